"""Playground settings: defaults, the TOML file, and command-line overrides."""
from __future__ import annotations

import copy
import tomllib

# Keys swept as a grid (a scalar in the file means a one-value list).
GRID_KEYS = ("draft", "k", "temperature", "top_p", "prompt_set", "batch_size", "policy")

DEFAULTS: dict = {
    "title": "speculative decoding playground",
    "target": "smollm2-135m-instruct",  # model spec, or "tiny:seed=0,layers=2,hidden=64" (random, built on the fly)
    "draft": ["ngram"],  # "ngram", "target" (the target drafting for itself), or model specs
    "k": [1, 2, 4],
    "temperature": [0.0],
    "top_p": [1.0],
    "prompt_set": ["builtin"],  # "builtin", "eval" / "train" / "all" (minispec.data; "eval:code+math"), or a .json file
    "batch_size": [4],  # max_num_seqs; every configuration runs all its prompts through one generate()
    "policy": ["fixed"],  # "fixed": one row per k; "adaptive": AdaptiveK with k_max = max(k)
    "num_prompts": 8,
    "max_tokens": 64,
    "chat": True,  # chat template (when the target's tokenizer has one)
    "ignore_eos": True,  # every run generates exactly max_tokens per prompt, so tokens/s compare
    "seed": 0,  # prompt i samples with seed + i in every configuration
    "dtype": "float32",
    "ngram_n": [1, 3],
    "threads": 0,  # torch intra-op threads; 0 keeps torch's default
    "record_beta": True,  # beta = sum_x min(p, q) per draft; builds p and q even for greedy batches
    "warmup": True,  # one short untimed generate per engine before its timed runs
    "cost_context": 128,  # context length of the cost-ratio measurements
    "cost_repeats": 5,  # timed samples per cost measurement (the fastest is taken)
    "adaptive": {"decay": 0.8, "prior_alpha": 0.5, "prior_weight": 2.0, "margin": 1.0, "probe_every": 8},
}

_TYPES = {
    "k": int, "batch_size": int, "temperature": float, "top_p": float, "draft": str, "prompt_set": str, "policy": str,
}


def _as_list(key: str, value) -> list:
    values = value if isinstance(value, list) else [value]
    if not values:
        raise ValueError(f"{key}: empty list")
    try:
        return [_TYPES[key](v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(f"{key}: expected {_TYPES[key].__name__} values, got {value!r}") from None


def parse_list(key: str, text: str) -> list:
    """A comma-separated command-line value of a grid key: "2,4" -> [2, 4]."""
    return _as_list(key, [t.strip() for t in text.split(",") if t.strip()])


def normalize(cfg: dict) -> dict:
    """Check keys and values; grid keys become lists. Raises ValueError naming the key."""
    unknown = set(cfg) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown setting(s) {sorted(unknown)}; known: {', '.join(DEFAULTS)}")
    for key in GRID_KEYS:
        cfg[key] = _as_list(key, cfg[key])
    for key in ("num_prompts", "max_tokens", "seed", "threads", "cost_context", "cost_repeats"):
        cfg[key] = int(cfg[key])
    for p in cfg["policy"]:
        if p not in ("fixed", "adaptive"):
            raise ValueError(f"policy: expected 'fixed' or 'adaptive', got {p!r}")
    if any(k < 1 for k in cfg["k"]):
        raise ValueError(f"k: every value must be >= 1, got {cfg['k']}")
    if any(t < 0 for t in cfg["temperature"]):
        raise ValueError(f"temperature: must be >= 0, got {cfg['temperature']}")
    if any(not 0 < p <= 1 for p in cfg["top_p"]):
        raise ValueError(f"top_p: must be in (0, 1], got {cfg['top_p']}")
    if any(b < 1 for b in cfg["batch_size"]):
        raise ValueError(f"batch_size: must be >= 1, got {cfg['batch_size']}")
    if cfg["num_prompts"] < 1 or cfg["max_tokens"] < 1 or cfg["cost_repeats"] < 1 or cfg["cost_context"] < 1:
        raise ValueError("num_prompts, max_tokens, cost_repeats and cost_context must be >= 1")
    if len(cfg["ngram_n"]) != 2:
        raise ValueError(f"ngram_n: expected [min_n, max_n], got {cfg['ngram_n']}")
    cfg["ngram_n"] = [int(n) for n in cfg["ngram_n"]]
    adaptive = dict(DEFAULTS["adaptive"])
    extra = set(cfg["adaptive"]) - set(adaptive)
    if extra:
        raise ValueError(f"adaptive: unknown setting(s) {sorted(extra)}; known: {', '.join(adaptive)}")
    adaptive.update(cfg["adaptive"])
    cfg["adaptive"] = adaptive
    return cfg


def load_config(path: str | None = None, overrides: dict | None = None) -> dict:
    """DEFAULTS, then the TOML file's top-level keys, then overrides (None values ignored)."""
    cfg = copy.deepcopy(DEFAULTS)
    if path is not None:
        with open(path, "rb") as f:
            cfg.update(tomllib.load(f))
    for key, value in (overrides or {}).items():
        if value is not None:
            cfg[key] = value
    return normalize(cfg)
