"""Playground settings: one dataclass, filled from its defaults, a TOML file and command-line overrides."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from minispec.llm import DEFAULT_TARGET
from minispec.spec_decode.adaptive import AdaptiveK
from minispec.tools.config import load_settings

# Keys swept as a grid (a scalar in the file means a one-value list), and their element types.
GRID_TYPES = {"draft": str, "k": int, "temperature": float, "top_p": float, "prompt_set": str, "batch_size": int,
              "policy": str}
GRID_KEYS = tuple(GRID_TYPES)
# AdaptiveK settings a file may give, and their defaults (AdaptiveK's own)
ADAPTIVE = {name: inspect.signature(AdaptiveK).parameters[name].default
            for name in ("decay", "prior_alpha", "prior_weight", "margin", "probe_every")}


@dataclass
class PlaygroundConfig:
    """What a sweep runs; see configs/playground-*.toml."""

    title: str = "speculative decoding playground"
    target: str = DEFAULT_TARGET  # model spec, or "tiny:seed=0,layers=2,hidden=64" (random, built on the fly)
    # "ngram", "target" (the target drafting for itself), self-drafts ("self-int4", "self-int8", "self:20"), model specs
    draft: list = field(default_factory=lambda: ["ngram"])
    k: list = field(default_factory=lambda: [1, 2, 4])
    temperature: list = field(default_factory=lambda: [0.0])
    top_p: list = field(default_factory=lambda: [1.0])
    prompt_set: list = field(default_factory=lambda: ["eval"])  # "eval" / "train" / "all" ("eval:code+math"), or a .json file
    batch_size: list = field(default_factory=lambda: [4])  # max_num_seqs; a configuration runs all its prompts in one generate()
    policy: list = field(default_factory=lambda: ["fixed"])  # "fixed": one row per k; "adaptive": AdaptiveK, k_max = max(k)
    num_prompts: int = 8
    max_tokens: int = 64
    chat: bool = True  # chat template (when the target's tokenizer has one)
    ignore_eos: bool = True  # every run generates exactly max_tokens per prompt, so tokens/s compare
    seed: int = 0  # every configuration's LLM: its requests draw their seeds from it in the same order
    dtype: str = "float32"
    ngram_n: list = field(default_factory=lambda: [1, 3])
    threads: int = 0  # torch intra-op threads; 0 keeps torch's default
    record_beta: bool = True  # beta = sum_x min(p, q) per draft; builds p and q even for greedy batches
    warmup: bool = True  # one short untimed generate per engine before its timed runs
    cost_context: int = 128  # context length of the cost-ratio measurements
    cost_repeats: int = 5  # timed samples per cost measurement (the fastest is taken)
    adaptive: dict = field(default_factory=lambda: dict(ADAPTIVE))  # AdaptiveK's settings

    def validate(self) -> None:
        """Check values (ValueError naming the key); grid keys become typed lists."""
        for key, kind in GRID_TYPES.items():
            setattr(self, key, _as_list(key, getattr(self, key), kind))
        for key in ("num_prompts", "max_tokens", "seed", "threads", "cost_context", "cost_repeats"):
            setattr(self, key, int(getattr(self, key)))
        for p in self.policy:
            if p not in ("fixed", "adaptive"):
                raise ValueError(f"policy: expected 'fixed' or 'adaptive', got {p!r}")
        if any(k < 1 for k in self.k):
            raise ValueError(f"k: every value must be >= 1, got {self.k}")
        if any(t < 0 for t in self.temperature):
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if any(not 0 < p <= 1 for p in self.top_p):
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if any(b < 1 for b in self.batch_size):
            raise ValueError(f"batch_size: must be >= 1, got {self.batch_size}")
        if min(self.num_prompts, self.max_tokens, self.cost_repeats, self.cost_context) < 1:
            raise ValueError("num_prompts, max_tokens, cost_repeats and cost_context must be >= 1")
        if len(self.ngram_n) != 2:
            raise ValueError(f"ngram_n: expected [min_n, max_n], got {self.ngram_n}")
        self.ngram_n = [int(n) for n in self.ngram_n]
        extra = set(self.adaptive) - set(ADAPTIVE)
        if extra:
            raise ValueError(f"adaptive: unknown key(s) {sorted(extra)}; known: {', '.join(ADAPTIVE)}")
        self.adaptive = {**ADAPTIVE, **self.adaptive}


def _as_list(key: str, value, kind) -> list:
    values = value if isinstance(value, list) else [value]
    if not values:
        raise ValueError(f"{key}: empty list")
    try:
        return [kind(v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(f"{key}: expected {kind.__name__} values, got {value!r}") from None


def parse_list(key: str, text: str) -> list:
    """A comma-separated command-line value of a grid key: "2,4" -> [2, 4]."""
    return _as_list(key, [t.strip() for t in text.split(",") if t.strip()], GRID_TYPES[key])


def load_config(path: str | None = None, overrides: dict | None = None) -> PlaygroundConfig:
    """Defaults < the TOML file < overrides (None values ignored); unknown keys are a ValueError."""
    return load_settings(PlaygroundConfig, path, overrides)
