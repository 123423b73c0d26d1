"""Chooses each step's requests under a token budget; skips what does not fit, starves nobody."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from minispec.engine.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """A request's share of one step: `num_tokens` prompt/output tokens, then its drafts if it `emits`."""

    req: Request
    num_tokens: int  # tokens from req.token_ids[req.num_computed:] fed this step
    emits: bool  # this step reaches the end of token_ids: its drafts are verified and a token sampled


class Scheduler:
    """Admits requests into at most `max_num_seqs` slots and packs a step into a token budget.

    Running requests are taken least recently scheduled first. A prompt that does not fit is
    prefilled in chunks; a decode (1 token + its drafts) that does not fit is skipped this step and
    keeps its drafts. Since the request skipped longest goes first next step, nobody starves.
    """

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots: list[int] = list(range(max_num_seqs - 1, -1, -1))
        self.step_idx = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def free(self, req: Request) -> None:
        """Take a finished or aborted request out and give its slot back."""
        if req in self.running:
            self.running.remove(req)
            self.free_slots.append(req.slot)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.slot = -1

    def schedule(self) -> list[ScheduledRequest]:
        """This step's batch, in batch-position order."""
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            req.slot = self.free_slots.pop()
            self.running.append(req)
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
