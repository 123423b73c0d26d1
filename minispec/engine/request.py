"""Requests as the engine sees them: each one's state (tokens, cache lengths, pending drafts, metrics), and the
scheduler that chooses each step's requests under a token budget, skips what does not fit and starves nobody."""
from __future__ import annotations

import time
from collections import deque
from itertools import islice
from dataclasses import dataclass, field

import numpy as np

from minispec.sample.random import RequestRandom
from minispec.sampling_params import SamplingParams

TokenLogprobs = tuple[float, list[tuple[int, float]]]  # a token's logprob, the top (id, logprob) pairs
# RequestMetrics' speculation counters, the ones summed over requests (tools/metrics.py, serve's updates)
COUNTERS = ("num_spec_verifications", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens",
            "num_stale_drafts")


@dataclass(slots=True)
class RequestMetrics:
    """Speculation and timing counters of one request."""

    num_spec_verifications: int = 0  # verifications that had at least one draft
    num_draft_tokens: int = 0  # drafts verified (placeholders excluded)
    num_accepted_tokens: int = 0  # accepted drafts that were emitted (a stop or max_tokens cuts a run)
    num_emitted_tokens: int = 0  # tokens emitted by verifications with drafts (accepted + drawn, as cut)
    num_stale_drafts: int = 0  # drafts rejected because their draft logits row was taken
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from another slot's prefix (Scheduler, prefix caching)
    accepted_per_position: list[int] = field(default_factory=list)  # [k]
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification with drafts (1 + accepted / drafts unless a stop cut a run)."""
        return self.num_emitted_tokens / self.num_spec_verifications if self.num_spec_verifications else 1.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (not the i.i.d. alpha: see tools/metrics.py)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def counters(self) -> dict:
        """The speculation counters (COUNTERS) and accepted_per_position (a copy)."""
        return {**{c: getattr(self, c) for c in COUNTERS}, "accepted_per_position": list(self.accepted_per_position)}

    def as_dict(self, num_generated: int) -> dict:
        elapsed = (self.finish_time or time.perf_counter()) - self.arrival_time
        return {
            **self.counters(),
            "num_cached_tokens": self.num_cached_tokens,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_rate": self.acceptance_rate,
            "time_to_first_token_s": (self.first_token_time - self.arrival_time) if self.first_token_time else None,
            "elapsed_s": elapsed,
            "tokens_per_s": num_generated / elapsed if elapsed > 0 else 0.0,
        }


@dataclass(slots=True)
class Request:
    """One prompt's generation. `slot` is its persistent index (KV caches, draft-logits cache)."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    random: RequestRandom
    arrival: int  # order of arrival, ties in scheduling go to the older request
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    slot: int = -1
    num_computed: int = 0  # tokens whose K/V are in the target cache
    num_draft_computed: int = 0  # tokens whose K/V are in the draft cache
    drafts: np.ndarray | None = None  # [k] drafts awaiting verification, -1 = placeholder
    last_scheduled_step: int = -1
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "error"
    error: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # Per output / prompt token (params.logprobs / prompt_logprobs; else None): (its logprob, [(id, logprob)] of
    # the most likely tokens, most likely first); the first prompt token's entry is None (nothing predicts it).
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        """Tokens the target has not yet seen (the prompt's rest, or the last sampled token)."""
        return len(self.token_ids) - self.num_computed

    @property
    def num_drafts(self) -> int:
        return 0 if self.drafts is None else len(self.drafts)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    # The target cache's length changes here only; the draft cache's (num_draft_computed) belongs to the proposer
    # (spec_decode/proposer.py's Drafting), which a verification can only shorten.
    def prefilled(self, n: int) -> None:
        """A step fed n more prompt tokens and sampled nothing: their K/V are in the target cache."""
        self.num_computed += n

    def verified(self, num_accepted: int) -> None:
        """A verification (before its tokens are appended) accepted num_accepted drafts: the target cache holds
        token_ids and those drafts, the draft cache no more than that, and the drafts are spent."""
        self.num_computed = len(self.token_ids) + num_accepted
        self.num_draft_computed = min(self.num_draft_computed, self.num_computed)
        self.drafts = None

@dataclass(slots=True)
class ScheduledRequest:
    """A request's share of one step: `num_tokens` prompt/output tokens, then its drafts if it `emits`."""

    req: Request
    num_tokens: int  # tokens from req.token_ids[req.num_computed:] fed this step
    emits: bool  # this step reaches the end of token_ids: its drafts are verified and a token sampled


# A newcomer waits for a running prompt's prefill when sharing that prompt's prefix saves it this many tokens or more.
DEFER_MIN_TOKENS = 16


@dataclass(slots=True)
class PrefixCopy:
    """A prefix reused at admission: positions < num_tokens of slot src's KV caches go to slot dst (equal: in place)."""

    src: int
    dst: int
    num_tokens: int


class Scheduler:
    """Admits requests into at most `max_num_seqs` slots and packs a step into a token budget.

    Running requests are taken least recently scheduled first. A prompt that does not fit is
    prefilled in chunks; a decode (1 token + its drafts) that does not fit is skipped this step and
    keeps its drafts. Since the request skipped longest goes first next step, nobody starves.

    Prefix caching (reuse_prefixes): a free slot keeps the K/V its last request computed until a newcomer takes it.
    A newcomer starts from the longest prefix of its prompt that a running request or a free slot holds, copied into
    its own slot (`copies`, applied by the engine before the step's forward); it takes the free slot that holds
    nothing, else the least recently freed one, and the source itself only when no other slot is free.
    The last shared token is fed again (an EAGLE head's entry at position p reads token p + 1), and so is the
    prompt's last token (its logits). A newcomer whose prompt shares DEFER_MIN_TOKENS more with a prompt still
    being prefilled waits for that prefill. A request that asks for prompt logprobs computes its whole prompt.
    """

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, reuse_prefixes: bool = False,
                 draft_kv: bool = False):
        """draft_kv: the proposer keeps a KV cache of its own, so a prefix is reused only as far as both hold it."""
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.reuse_prefixes = reuse_prefixes
        self.draft_kv = draft_kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots: list[int] = list(range(max_num_seqs - 1, -1, -1))
        # free slot -> (the token ids of its last request, how many of them its caches hold), least recently used first
        self.held: dict[int, tuple[list[int], int]] = {}
        self.copies: list[PrefixCopy] = []  # the last schedule()'s prefixes to copy, in admission order
        self.step_idx = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def free(self, req: Request) -> None:
        """Take a finished or aborted request out and give its slot back (which keeps its prefix, unless the
        request ended in an error). Call it before the proposer forgets the request's draft cache length."""
        if req in self.running:
            self.running.remove(req)
            self.free_slots.append(req.slot)
            if self.reuse_prefixes and req.error is None:
                self.held[req.slot] = (req.token_ids, self._valid(req))
        elif req in self.waiting:
            self.waiting.remove(req)

    def forget_prefixes(self) -> None:
        """Free slots keep nothing: the next newcomers compute their prompts (running requests stay sources)."""
        self.held.clear()

    def _valid(self, req: Request) -> int:
        """Leading token ids of req whose K/V both its target cache and (draft_kv) its draft cache hold."""
        return min(req.num_computed, req.num_draft_computed) if self.draft_kv else req.num_computed

    def _prefix_source(self, req: Request) -> tuple[int, int]:
        """(slot, tokens) of the longest reusable prefix of req's prompt in a free slot or a running request (a free
        slot first in a tie); (-1, 0): none."""
        prompt = req.prompt_token_ids
        most = len(prompt) - 1  # the prompt's last token is always fed
        best = (-1, 0)
        sources = [(s, *self.held[s]) for s in self.held] + [(r.slot, r.token_ids, self._valid(r)) for r in self.running]
        for slot, tokens, valid in sources:
            if min(valid, most) <= best[1]:  # cannot do better
                continue
            n = min(common_prefix(prompt, tokens) - 1, most, valid)
            if n > best[1]:
                best = (slot, n)
                if n == most:
                    break
        return best

    def _defer(self, req: Request, n: int) -> bool:
        """Whether req should wait: a running prompt still being prefilled shares DEFER_MIN_TOKENS more with it than
        the n tokens it can reuse now."""
        prompt = req.prompt_token_ids
        if len(prompt) - 1 - n < DEFER_MIN_TOKENS:  # nothing left that waiting could save
            return False
        return any(r.num_computed < r.num_prompt_tokens and
                   common_prefix(prompt, r.prompt_token_ids) - 1 - n >= DEFER_MIN_TOKENS for r in self.running)

    def _admit(self) -> None:
        """Give free slots to waiting requests, oldest first, each reusing the longest prefix it finds (the first
        2 max_num_seqs waiting are looked at: a burst of deferred ones costs a bounded scan a step)."""
        self.copies = []
        for req in list(islice(self.waiting, 2 * self.max_num_seqs)):
            if not self.free_slots:
                break
            src, n = (-1, 0)
            if self.reuse_prefixes and req.prompt_logprobs is None:
                src, n = self._prefix_source(req)
                if self._defer(req, n):
                    continue
            self.waiting.remove(req)
            # a slot that holds nothing, else the least recently freed prefix but the source's; else the source itself
            empty = [s for s in self.free_slots if s not in self.held]
            slot = empty[-1] if empty else next((s for s in self.held if s != src), src)
            self.free_slots.remove(slot)
            self.held.pop(slot, None)
            req.slot = slot
            self.running.append(req)
            if n:
                req.num_computed = req.num_draft_computed = n
                req.metrics.num_cached_tokens = n
                self.copies.append(PrefixCopy(src, slot, n))

    def schedule(self) -> list[ScheduledRequest]:
        """This step's batch, in batch-position order (admitting newcomers first: see `copies`)."""
        self._admit()
        budget = self.max_num_batched_tokens
        batch: list[ScheduledRequest] = []
        for req in sorted(self.running, key=lambda r: (r.last_scheduled_step, r.arrival)):
            if budget == 0:
                break
            full = req.num_uncomputed + req.num_drafts
            if full <= budget:
                batch.append(ScheduledRequest(req, req.num_uncomputed, emits=True))
                budget -= full
            elif req.num_drafts == 0 and req.num_uncomputed > 1:
                # A prompt: prefill the chunk that fits.
                batch.append(ScheduledRequest(req, budget, emits=False))
                budget = 0
            # else: a decode with drafts that does not fit: skipped, keeps its drafts.
        for s in batch:
            s.req.last_scheduled_step = self.step_idx
        self.step_idx += 1
        return batch


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case (a repeated prompt, a shared system prompt's source), without numpy
        return n
    return int(np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0])
