"""Instrumentation: what the engine tells an observer (LLM(observer=...)) about its steps."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepRecord:
    """One engine step as an observer sees it."""

    batch_size: int  # requests verified this step
    speculative: bool  # some verified request had drafts, or some request drafted
    step_s: float  # wall seconds of the step (this rank's; rank 0's under TP when the k policy observes steps)
    forward_s: float  # seconds of it spent in target and draft forwards
    ks: list[int]  # the k given to each request asked to draft, in batch order (0: none); [] without a proposer


class Observer:
    """Hooks the engine calls; each is a no-op here, so a tool overrides only what it needs.

    record_beta: verification also computes beta = sum_x min(p, q) of every verified draft (Leviathan et al.,
    Thm 3.5) for on_verify; that builds p and q even for greedy batches. Read at every verification.
    """

    record_beta: bool = False

    def on_verify(self, reqs: list, betas: list[list[float]]) -> None:
        """After a verification with record_beta: the requests this rank verified (owned, under TP) and each
        one's betas (one per verified draft that was neither a placeholder nor stale)."""

    def on_step(self, step: StepRecord) -> None:
        """After every step that scheduled something."""
