"""The acceptance-rate playground: sweep drafts, k, sampling, prompts and batch sizes; measure alpha,
tau, beta, cost ratios and speedups; write results.csv/json, plots and summary.md.

    python -m minispec.playground --config configs/playground-smoke.toml --out DIR [--k 2,4 ...]
"""
from minispec.playground.config import PlaygroundConfig, load_config
from minispec.playground.sweep import run_sweep

__all__ = ["PlaygroundConfig", "load_config", "run_sweep"]
