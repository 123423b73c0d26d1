"""Per-request seeded random streams, so a request's draws never depend on the batch it runs in."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from minispec.kernels import cpu

DRAFT_STREAM = 0
SAMPLER_STREAM = 1
POSITION_STREAM = 2  # the position-keyed noise of coupled requests, one generator per token position


def _stream_seed(seed: int, stream: int, *key: int) -> int:
    """A well-mixed 63-bit seed for one stream of a request seed (SeedSequence hashing), optionally keyed further."""
    state = np.random.SeedSequence([seed & (2**64 - 1), stream, *key]).generate_state(1, dtype=np.uint64)
    return int(state[0]) & (2**63 - 1)


class RequestRandom:
    """Independent generators from one seed: `draft` (draft sampling), `sampler` (the rejection sampler), and the
    position-keyed noise of position_noise.

    numpy's PCG64 on the host; the rejection sampler's vocabulary of noise per request and step comes from one
    64-bit draw of it (exponentials)."""

    def __init__(self, seed: int):
        self.seed = int(seed)
        self.draft = np.random.Generator(np.random.PCG64(_stream_seed(self.seed, DRAFT_STREAM)))
        self.sampler = np.random.Generator(np.random.PCG64(_stream_seed(self.seed, SAMPLER_STREAM)))
        self._position_noise: dict[int, torch.Tensor] = {}  # token position -> its Exp(1) noise [V]

    def position_noise(self, start: int, count: int, vocab: int) -> list[torch.Tensor]:
        """Exp(1) noise rows [vocab] for the tokens at positions start .. start + count - 1 of token_ids (callers
        stack the rows of a batch once).

        Position n's noise comes from a generator keyed by (seed, n) alone, so the draft that guesses token n and
        the target that samples it see the same noise whichever step, k or batch asks (the coupled path of
        spec_decode/rejection_sampler.py). Each position's noise is drawn once and kept until a call starts
        past it.
        """
        for n in [n for n in self._position_noise if n < start]:
            del self._position_noise[n]
        rows = []
        for n in range(start, start + count):
            row = self._position_noise.get(n)
            if row is None or row.shape[0] != vocab:
                gen = np.random.Generator(np.random.PCG64(_stream_seed(self.seed, POSITION_STREAM, n)))
                row = self._position_noise[n] = exponentials([gen], vocab)[0]
            rows.append(row)
        return rows

    def __repr__(self) -> str:
        return f"RequestRandom(seed={self.seed})"


def uniforms(gens: Sequence[np.random.Generator], n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """U[0, 1) float32 [len(gens), n], entry i drawn from gens[i] alone, moved to device.

    Each generator advances by exactly n draws: keep n independent of the batch (e.g. the number of
    speculative tokens) for a request's later draws not to depend on who it was batched with.
    """
    out = np.empty((len(gens), n), dtype=np.float32)  # [num_reqs, n]
    for i, g in enumerate(gens):
        g.random(out=out[i], dtype=np.float32)
    t = torch.from_numpy(out)
    return t.to(device) if device is not None else t


def exponentials(gens: Sequence[np.random.Generator], vocab: int, device: torch.device | str | None = None
                 ) -> torch.Tensor:
    """Exp(1) float32 [len(gens), vocab], row i drawn from gens[i] alone, moved to device.

    Each generator gives one 64-bit draw, the state of a counter-based SplitMix64 whose first vocab outputs make the
    row (exp_noise_numpy; the C++ kernel exp_noise where built, a few times faster than drawing vocab doubles from
    PCG64): -log(u) of 53-bit uniforms u in (0, 1], so an Exp draw of 0 (which wins any exponential race) has
    probability 2^-53 per entry instead of float32 uniforms' 2^-24.
    """
    seeds = np.array([g.bit_generator.random_raw() for g in gens], dtype=np.uint64)  # [len(gens)]
    ops = cpu.ops()
    if ops is not None:
        t = ops.exp_noise(torch.from_numpy(seeds.view(np.int64)), vocab)
    else:
        t = torch.from_numpy(exp_noise_numpy(seeds, vocab))
    return t.to(device) if device is not None else t


def exp_noise_numpy(seeds: np.ndarray, vocab: int) -> np.ndarray:
    """Exp(1) float32 [len(seeds), vocab]: entry j of row n is -log(u), u = (k + 1) 2^-53 with k the top 53 bits of
    SplitMix64 output j from state seeds[n] (uint64). The C++ kernel exp_noise computes the same (its logarithm is
    within 1e-12 of numpy's, so the float32 values agree but for a rare last-bit rounding)."""
    j = np.arange(1, vocab + 1, dtype=np.uint64)  # [vocab]
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as SplitMix64 means it to
        z = seeds.astype(np.uint64)[:, None] + j * np.uint64(0x9E3779B97F4A7C15)  # [len(seeds), vocab]
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    u = ((z >> np.uint64(11)) + np.uint64(1)).astype(np.float64) * 2.0**-53  # (0, 1]
    return (-np.log(u)).astype(np.float32)


def verify_draws(gens: Sequence[np.random.Generator | None], k: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection sampler's randomness for a batch: uniforms [n, k] and Exp(1) noise [n, vocab].

    gens[i] is request i's sampler stream (RequestRandom.sampler), or None for a greedy or coupled request,
    which draws nothing (its entries stay 0 and 1: the sampler ignores them). Only the other streams advance.
    """
    sampled = [i for i, g in enumerate(gens) if g is not None]
    if sampled and len(sampled) == len(gens):  # every request samples: no placeholders to fill in
        return uniforms(gens, k), exponentials(gens, vocab)
    u = torch.zeros(len(gens), k)  # [n, k]
    noise = torch.ones(len(gens), 1).expand(len(gens), vocab)  # [n, vocab]
    if sampled:
        idx = torch.tensor(sampled)
        drawing = [gens[i] for i in sampled]
        if k:
            u[idx] = uniforms(drawing, k)
        noise = noise.contiguous()
        noise[idx] = exponentials(drawing, vocab)
    return u, noise
