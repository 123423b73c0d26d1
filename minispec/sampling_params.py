"""Per-request sampling settings and their validation."""
from __future__ import annotations

import numbers
from dataclasses import dataclass


def _is_int(x) -> bool:
    """An integer of any kind (int, numpy integer), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclass(slots=True)
class SamplingParams:
    """How one request samples: temperature, then top-k, then top-p (transformers' warpers).

    temperature 0 means greedy (and any T below 1e-4 is computed without overflow: T = 1e-40 is the argmax).
    A seed makes the request's tokens the same run to run, in any batch, at any k (adaptive or not), with any draft or
    none, and whichever TP rank verifies it, given the same target and LLM settings: a seeded sampled request is
    `coupled` -- the token at each position is the target's own draw with that position's keyed noise, and a draft
    is accepted iff it equals it (spec_decode/rejection_sampler.coupled_verify). The exception is batched forwards
    that round differently from the request's alone (not on the CPU; possible with GPU kernels). DESIGN.md,
    Randomness, says exactly what holds.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # Log-probabilities: the raw log-softmax of the target's logits (before temperature, top-k and top-p), the
    # same with and without speculation. logprobs: each output token's and its N most likely alternatives';
    # prompt_logprobs: each prompt token's (the first's is None) and N alternatives'. None: not computed.
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError (one line, naming the field) on settings that make no sense."""
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if not self.temperature >= 0.0 or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature == float("inf"):
            raise ValueError("temperature must be finite")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"{name} must be an integer >= 0 or None, got {value!r}")
            setattr(self, name, None if value is None else int(value))
        least = 0 if self.prompt_logprobs is not None else 1  # max_tokens 0: score the prompt, generate nothing
        if not _is_int(self.max_tokens) or self.max_tokens < least:
            raise ValueError(f"max_tokens must be an integer >= {least}, got {self.max_tokens!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        self.top_k, self.max_tokens = int(self.top_k), int(self.max_tokens)
        self.seed = None if self.seed is None else int(self.seed)
        if self.stop_token_ids is not None:
            ids = list(self.stop_token_ids)
            if not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError(f"stop_token_ids must be integers >= 0, got {ids!r}")
            self.stop_token_ids = [int(t) for t in ids]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def coupled(self) -> bool:
        """Sampled with a seed: its tokens are the target's position-keyed draws whatever is drafted."""
        return self.seed is not None and not self.greedy
