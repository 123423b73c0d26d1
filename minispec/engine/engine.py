"""The engine and its step: schedule -> verify (engine/verify.py) -> accept -> draft."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from minispec.distributed import get_tp_group
from minispec.engine.observer import Observer, StepRecord
from minispec.engine.request import Request
from minispec.engine.scheduler import Scheduler, ScheduledRequest
from minispec.engine.verify import Verdict, Verifier
from minispec.runner.model_runner import ModelRunner
from minispec.sample.random import RequestRandom
from minispec.sampling_params import SamplingParams
from minispec.spec_decode.adaptive import KPolicy, as_k_policy
from minispec.spec_decode.draft_logits import DraftLogitsCache
from minispec.spec_decode.proposer import Proposer


@dataclass(slots=True)
class EngineConfig:
    """Sizes and switches of one engine."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    shard_draft_logits: bool | None = None  # None: sharded iff tp > 1


@dataclass(slots=True)
class StepOutput:
    """What one step added to one request."""

    req: Request
    new_token_ids: list[int]


class Engine:
    """Continuous batching over one target (and optionally one proposer)."""

    def __init__(self, target: ModelRunner, proposer: Proposer | None, config: EngineConfig,
                 eos_token_ids: set[int], vocab_size: int, k_policy=None, observer: Observer | None = None):
        self.tp = get_tp_group()
        self.target = target
        self.observer = observer if observer is not None else Observer()  # instrumentation (engine/observer.py)
        self.proposer = proposer
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.device = target.device
        self.k = proposer.k if proposer is not None else 0
        self.k_policy = k_policy
        if config.max_num_batched_tokens < self.k + 1:
            raise ValueError(
                f"max_num_batched_tokens={config.max_num_batched_tokens} cannot fit one decode of "
                f"1 + {self.k} draft tokens"
            )
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self.draft_logits: DraftLogitsCache | None = None
        if proposer is not None:
            sharded = config.shard_draft_logits
            if sharded is None:
                sharded = self.tp.world_size > 1
            self.draft_logits = DraftLogitsCache(
                config.max_num_seqs, self.k, vocab_size, dtype=torch.float32, fill=0.0,
                device=self.device, sharded=sharded,
            )
        self.verifier = Verifier(target, self.draft_logits, self.k, vocab_size, self.observer)
        self._num_arrived = 0

    # ---- requests -------------------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int) -> None:
        """ValueError unless a prompt of this many tokens leaves the context room for one generated token."""
        if num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt of {num_prompt_tokens} tokens does not fit the model's context "
                f"({self.config.max_model_len} tokens, including at least one generated)"
            )

    def add_request(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int) -> Request:
        """Queue a request. `seed` drives all its randomness (params.seed if the caller set one)."""
        if req_id in self.requests:
            raise ValueError(f"request id {req_id!r} is already running")
        if not prompt_token_ids:
            raise ValueError("empty prompt: give at least one token")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        self.check_fits(len(prompt_token_ids))
        if self.tp.world_size > 1 and (params.logprobs is not None or params.prompt_logprobs is not None):
            raise ValueError("logprobs and prompt_logprobs need tensor_parallel_size 1 (under TP the logits are "
                             "split over the ranks)")
        req = Request(req_id, list(prompt_token_ids), params, RequestRandom(seed), self._num_arrived)
        req.metrics.accepted_per_position = [0] * self.k
        req.metrics.arrival_time = time.perf_counter()
        self._num_arrived += 1
        self.requests[req_id] = req
        self.scheduler.add(req)
        return req

    def abort(self, req_id: str) -> None:
        """Stop a request now and free its slot (KV caches and draft-logits row)."""
        req = self.requests.get(req_id)
        if req is not None and not req.finished:
            self._finish(req, "abort")

    @property
    def k_policy(self) -> KPolicy:
        """Each drafting request's k in [0, proposer.k] (spec_decode/adaptive.py KPolicy)."""
        return self._k_policy

    @k_policy.setter
    def k_policy(self, policy) -> None:
        """A KPolicy, a plain function reqs -> ks, or None: every request drafts proposer.k."""
        self._k_policy = as_k_policy(policy, self.k)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.metrics.finish_time = time.perf_counter()
        req.drafts = None
        if self.proposer is not None:
            self.proposer.free(req)
        self.k_policy.free(req)
        self.scheduler.free(req)
        del self.requests[req.req_id]

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One engine step: verify the scheduled requests' drafts, accept, then draft anew."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        t0, forward_s0 = time.perf_counter(), self._forward_s()
        verified = [s for s in scheduled if s.emits]
        speculative = any(s.req.num_drafts for s in verified)
        verdict = self.verifier(scheduled)
        outputs = self._accept(verified, verdict) if verdict is not None else []
        to_draft = [s.req for s in verified if not s.req.finished] if self.proposer is not None else []
        ks = self._draft(to_draft) if to_draft else []
        speculative |= any(ks)
        times = [time.perf_counter() - t0, self._forward_s() - forward_s0]
        if self.k_policy.observes_steps:
            if self.tp.world_size > 1:  # every rank must choose the same k: rank 0's timings
                times = self.tp.broadcast(torch.tensor(times, dtype=torch.float64, device=self.device)).tolist()
            self.k_policy.observe_step(len(verified), speculative, *times)
        self.observer.on_step(StepRecord(len(verified), speculative, *times, ks))
        return outputs

    def _forward_s(self) -> float:
        """Seconds the target and draft models have spent in forwards so far."""
        return self.target.forward_s + (self.proposer.forward_s if self.proposer is not None else 0.0)

    def _accept(self, verified: list[ScheduledRequest], verdict: Verdict) -> list[StepOutput]:
        """Append each verified request's accepted drafts and sampled token; roll caches back; finish."""
        outputs = []
        now = time.perf_counter()
        tokens, num_sampled, bad = verdict.tokens.tolist(), verdict.num_sampled.tolist(), verdict.bad.tolist()
        for i, s in enumerate(verified):
            r = s.req
            if bad[i]:
                r.error = "the target model produced NaN or inf logits"
                outputs.append(StepOutput(r, []))
                self._finish(r, "error")
                continue
            if r.params.max_tokens == 0:  # a scored prompt (prompt_logprobs) that generates nothing
                outputs.append(StepOutput(r, []))
                self._finish(r, "length")
                continue
            n = num_sampled[i]
            num_accepted = n - 1
            m = r.metrics
            nd = int((r.drafts >= 0).sum()) if r.num_drafts else 0
            r.verified(num_accepted)  # valid K/V: every token fed before the drafts, and the accepted drafts
            new, reason = self._append(r, tokens[i][:n])
            if r.logprobs is not None:
                r.logprobs += verdict.logprobs[i][: len(new)]
            if nd:  # count what was emitted: a stop token or max_tokens may cut the accepted run
                m.num_spec_verifications += 1
                m.num_draft_tokens += nd
                m.num_accepted_tokens += min(num_accepted, len(new))
                m.num_emitted_tokens += len(new)
                for j in range(min(num_accepted, len(new))):
                    m.accepted_per_position[j] += 1
            if m.first_token_time is None and new:
                m.first_token_time = now
            outputs.append(StepOutput(r, new))
            if reason is not None:
                self._finish(r, reason)
        return outputs

    def _append(self, r: Request, toks: list[int]) -> tuple[list[int], str | None]:
        """Append tokens up to the first stop condition; return those appended and the finish reason."""
        p = r.params
        stops = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            stops |= self.eos_token_ids
        new = []
        for t in toks:
            r.token_ids.append(t)
            new.append(t)
            if t in stops:
                return new, "stop"
            if len(r.token_ids) - r.num_prompt_tokens >= p.max_tokens or len(r.token_ids) >= self.config.max_model_len:
                return new, "length"
        return new, None

    def _draft(self, reqs: list[Request]) -> list[int]:
        """Give out draft-logits rows by batch position, then draft each request's k tokens; returns each k."""
        asked = list(self.k_policy(reqs))
        reqs = [r for r, k in zip(reqs, asked) if k > 0]
        ks = [k for k in asked if k > 0]
        if not reqs:
            return asked
        cache = self.draft_logits
        slots = np.array([r.slot for r in reqs], dtype=np.int32)
        cache.assign(torch.from_numpy(slots).to(self.device), slots)
        drafts = self.proposer.propose(reqs, cache, max(ks))  # [num_reqs, max(ks)]
        for r, d, k in zip(reqs, drafts, ks):
            r.drafts = d[:k]
        return asked
