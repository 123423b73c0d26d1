"""Proposers: anything that drafts k tokens per request and caches the draft logits it drew them from."""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from minispec.distributed import get_tp_group, from_owners, to_owners
from minispec.runner.model_runner import ModelRunner
from minispec.sample.random import RequestRandom, uniforms
from minispec.sample.sampler import BatchSampling, greedy_tokens, probs_from_logits, sample, sample_inverse_cdf
from minispec.sampling_params import SamplingParams
from minispec.spec_decode.draft_logits import DraftLogitsCache


class Drafting(Protocol):
    """What a proposer reads and writes of a request (engine/request.py's Request is one)."""

    slot: int  # the request's persistent index (KV caches, draft-logits cache)
    token_ids: list[int]  # prompt + output
    params: SamplingParams
    random: RequestRandom
    num_computed: int  # tokens whose K/V are in the target cache
    num_draft_computed: int  # tokens whose K/V are in the draft cache


class Proposer(Protocol):
    """Drafts for a batch: returns [num_reqs, k] draft tokens (-1 = no draft) and writes each
    draft's pre-temperature logits to the cache rows of the requests this rank owns."""

    k: int
    forward_s: float  # seconds spent in model forwards so far (the engine's step timings)
    has_kv_cache: bool  # it keeps a KV cache of its own, which num_draft_computed measures

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Prefix caching: positions < n of slot src's own KV cache into slot dst (nothing without one)."""

    def propose(self, reqs: list[Drafting], cache: DraftLogitsCache, num_steps: int | None = None) -> np.ndarray:
        """[num_reqs, num_steps] drafts (num_steps defaults to k)."""

    def free(self, req: Drafting) -> None: ...


class DraftModelProposer:
    """A smaller causal LM drafts k tokens autoregressively, one batched forward per position.

    shares_target_kv: the draft runs on the target's KV cache (a self-draft with every layer). It starts
    at the target's num_computed, so it never prefills and never writes a position the target has
    computed: its K/V for the drafts lie past that, where the target's verification overwrites them
    before reading them.
    """

    def __init__(self, runner: ModelRunner, k: int, shares_target_kv: bool = False):
        self.runner = runner
        self.k = k
        self.shares_target_kv = shares_target_kv
        self.has_kv_cache = not shares_target_kv

    @property
    def forward_s(self) -> float:
        """Seconds spent in the draft's forwards so far."""
        return self.runner.forward_s

    def propose(self, reqs: list[Drafting], cache: DraftLogitsCache, num_steps: int | None = None) -> np.ndarray:
        """num_steps (default k) batched draft forwards. Under TP each draft step's logits go to the request's owner
        (all-to-all), which caches them and samples the draft token; the tokens are then shared."""
        tp = get_tp_group()
        device = self.runner.device
        vocab = cache.vocab_size
        sharded = cache.row_mapping is not None
        owners, mine, rows = owned(reqs, cache)
        my_reqs = [r for r, m in zip(reqs, mine) if m]
        sampling = BatchSampling([r.params for r in my_reqs], device)
        u_mine = proposal_uniforms(reqs, self.k)[torch.from_numpy(mine)].to(device)  # [num_mine, k]
        num_steps = self.k if num_steps is None else num_steps
        coupled = coupled_noise(my_reqs, num_steps, vocab)  # the owner draws its coupled requests' drafts
        drafts = np.empty((len(reqs), num_steps), dtype=np.int64)  # [num_reqs, num_steps]
        # Step 0 catches the draft cache up on everything it has not seen (prompt, accepted tokens, bonus).
        if self.shares_target_kv:
            for r in reqs:
                r.num_draft_computed = r.num_computed
        starts = [r.num_draft_computed for r in reqs]
        queries = [r.token_ids[r.num_draft_computed :] for r in reqs]
        for j in range(num_steps):
            logits = self.runner.forward([r.slot for r in reqs], starts, queries, [1] * len(reqs), gather=not sharded)
            logits = to_owners(tp, logits, owners)[:, :vocab] if sharded else logits  # [num_mine, V]
            cache.write(rows, j, logits)
            tok = draw_drafts(logits, sampling, u_mine[:, j], coupled[j])
            if sharded:
                tok = from_owners(tp, tok, owners)
            drafts[:, j] = tok.cpu().numpy()
            starts = [s + len(q) for s, q in zip(starts, queries)]
            queries = [[int(t)] for t in drafts[:, j]]
        for r in reqs:
            # The draft cache now holds token_ids and the drafts but the last, which was never fed.
            r.num_draft_computed = len(r.token_ids) + num_steps - 1
        return drafts

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        if self.has_kv_cache:
            self.runner.kv.copy_prefix(src, dst, n)

    def free(self, req: Drafting) -> None:
        req.num_draft_computed = 0


def owned(reqs: list[Drafting], cache: DraftLogitsCache) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """(owner rank of each request [num_reqs], whether this rank owns it [num_reqs] bool, this rank's cache rows of
    the requests it owns [num_mine]). A replicated cache keeps every request on every rank."""
    tp = get_tp_group()
    slots = np.array([r.slot for r in reqs], dtype=np.int32)
    sharded = cache.row_mapping is not None
    owners = cache.owners_of(slots) if sharded else np.full(len(reqs), tp.rank_in_group)
    mine = owners == tp.rank_in_group
    rows = cache.rows_of(torch.from_numpy(slots[mine]).long().to(cache.device)).long()
    return owners, mine, rows


def proposal_uniforms(reqs: list[Drafting], k: int) -> torch.Tensor:
    """[num_reqs, k] host uniforms: k from each sampled request's draft stream per proposal, whatever the batch or the
    k it drafts; zeros for greedy and coupled requests, which draw none."""
    u = torch.zeros(len(reqs), k)
    sampled = [i for i, r in enumerate(reqs) if not (r.params.greedy or r.params.coupled)]
    if sampled:
        u[sampled] = uniforms([reqs[i].random.draft for i in sampled], k)
    return u


def coupled_noise(reqs: list[Drafting], num_steps: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Per draft step j: (indices [m] into reqs, Exp(1) noise [m, V]) of the coupled requests (SamplingParams.coupled),
    the noise of the token draft j guesses, at position len(token_ids) + j; None at every step if none is coupled."""
    idx = [i for i, r in enumerate(reqs) if r.params.coupled]
    if not idx:
        return [None] * num_steps
    rows = [reqs[i].random.position_noise(len(reqs[i].token_ids), num_steps, vocab) for i in idx]  # [m][num_steps]
    at = torch.tensor(idx)  # [m], one tensor shared by the steps
    return [(at, torch.stack([r[j] for r in rows])) for j in range(num_steps)]


def draw_drafts(logits: torch.Tensor, sampling: BatchSampling, u: torch.Tensor,
                coupled: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """[n] draft tokens from pre-temperature logits [n, V]: the argmax (all greedy) or one exact draw from each
    request's warped distribution q, the one the rejection sampler recomputes from the cache: by inverse CDF with
    its uniform u [n], or for the coupled rows (indices [m], noise [m, V]) by exponential race with their noise."""
    if sampling.greedy:
        return greedy_tokens(logits)[0]
    q = probs_from_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)  # [n, V]
    if coupled is None:
        return sample_inverse_cdf(q, u)
    rows, noise = coupled
    tokens = torch.empty(q.shape[0], dtype=torch.int64, device=q.device)  # [n]
    rest = torch.ones(q.shape[0], dtype=torch.bool)
    rest[rows] = False
    if bool(rest.any()):  # the inverse CDF's cumulative sum only over the rows that use it
        rest = rest.to(q.device)
        tokens[rest] = sample_inverse_cdf(q[rest], u[rest])
    rows = rows.to(q.device)
    tokens[rows] = sample(q[rows], noise.to(q.device))
    return tokens
