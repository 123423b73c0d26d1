"""CLI: python -m minispec.playground --config FILE.toml --out DIR [overrides]."""
from __future__ import annotations

import argparse
import os
import sys

from minispec.playground.config import GRID_KEYS, load_config, parse_list


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minispec.playground",
        description="Sweep drafts, k, sampling, prompt sets and batch sizes; measure acceptance (alpha, tau, "
                    "beta), cost ratios and speedups over target-only; write results.csv/json, plots, summary.md.",
    )
    p.add_argument("--config", default=None, help="TOML file of settings (see configs/playground-*.toml)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--target", default=None, help="target model spec, or tiny:seed=0,layers=2 (random, built here)")
    grid_help = {
        "draft": "drafts: ngram, target (the target itself), model specs, tiny:... (comma-separated)",
        "k": "speculation lengths, e.g. 1,2,4",
        "temperature": "temperatures, e.g. 0,0.7",
        "top_p": "top-p values, e.g. 1.0,0.9",
        "prompt_set": "prompt sets: eval, train, all, eval:code+math, or a .json file",
        "batch_size": "batch sizes (max_num_seqs), e.g. 1,4",
        "policy": "fixed and/or adaptive (AdaptiveK with k_max = max k)",
    }
    for key in GRID_KEYS:
        p.add_argument("--" + key.replace("_", "-"), default=None, help=grid_help[key] + " (comma-separated)")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (0: torch's default)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--cost-repeats", type=int, default=None)
    p.add_argument("--cost-context", type=int, default=None)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None, help="chat template on/off")
    p.add_argument("--record-beta", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config is not None and not os.path.isfile(args.config):
        parser.error(f"config file not found: {args.config}")
    overrides = {key: getattr(args, key) for key in ("target", "num_prompts", "max_tokens", "seed", "threads",
                                                      "dtype", "cost_repeats", "cost_context", "chat", "record_beta")}
    try:
        for key in GRID_KEYS:
            text = getattr(args, key)
            if text is not None:
                overrides[key] = parse_list(key, text)
        cfg = load_config(args.config, overrides)
    except (ValueError, OSError) as e:
        parser.error(str(e))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from minispec.models.errors import ModelLoadError
    from minispec.playground.report import write_results
    from minispec.playground.sweep import run_sweep

    try:
        result = run_sweep(cfg, args.out, progress=not args.no_progress)
    except (ModelLoadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    paths = write_results(result, args.out)
    print(f"{len(result['rows'])} configurations -> {paths['csv']}, {paths['json']}, {paths['summary']}")
    return 0


if __name__ == "__main__":
    from minispec.distributed import exit_process

    exit_process(main())
