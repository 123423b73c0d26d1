"""The engine and its step: schedule -> verify -> accept -> draft. The whole speculative loop lives here."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from minispec.distributed import get_tp_group, rows_from_owners, rows_to_owners
from minispec.engine.input_batch import InputBatch
from minispec.engine.model_runner import ModelRunner
from minispec.engine.request import Request
from minispec.engine.scheduler import Scheduler, ScheduledRequest
from minispec.sample.random import RequestRandom, exponentials, uniforms
from minispec.sampling_params import SamplingParams
from minispec.spec_decode.draft_logits import DraftLogitsCache, shard_owners
from minispec.spec_decode.proposer import BatchSampling, Proposer
from minispec.spec_decode.rejection_sampler import rejection_sample


@dataclass(slots=True)
class EngineConfig:
    """Sizes and switches of one engine."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    num_speculative_tokens: int = 4
    shard_draft_logits: bool | None = None  # None: sharded iff tp > 1
    record_beta: bool = False  # keep sum_x min(p, q) of every verified draft in metrics.betas


@dataclass(slots=True)
class StepOutput:
    """What one step added to one request."""

    req: Request
    new_token_ids: list[int]


class Engine:
    """Continuous batching over one target (and optionally one proposer)."""

    def __init__(self, target: ModelRunner, proposer: Proposer | None, config: EngineConfig,
                 eos_token_ids: set[int], vocab_size: int, k_policy=None):
        self.tp = get_tp_group()
        self.target = target
        # Optional speculation length: k_policy(reqs) -> each request's k in [0, proposer.k]; a policy with an
        # observe_step(batch_size, speculative, step_s, forward_s) method also gets every step's timing.
        self.k_policy = k_policy
        self.proposer = proposer
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.device = target.device
        self.k = proposer.k if proposer is not None else 0
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
        self._num_arrived = 0

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int) -> Request:
        """Queue a request. `seed` drives all its randomness (params.seed if the caller set one)."""
        if req_id in self.requests:
            raise ValueError(f"request id {req_id!r} is already running")
        if not prompt_token_ids:
            raise ValueError("empty prompt: give at least one token")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_token_ids) >= self.config.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_token_ids)} tokens does not fit the model's context "
                f"({self.config.max_model_len} tokens, including at least one generated)"
            )
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

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.metrics.finish_time = time.perf_counter()
        req.drafts = None
        if self.proposer is not None:
            self.proposer.free(req)
        self.scheduler.free(req)
        del self.requests[req.req_id]

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One engine step: verify the scheduled requests' drafts, accept, then draft anew."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        t0, forward_s0 = time.perf_counter(), self._forward_s()
        verified = [s for s in scheduled if s.verify]
        speculative = any(s.req.num_drafts for s in verified)
        sampled = self._verify(scheduled, verified)  # tokens [num_verified, k + 1], counts, bad logits
        outputs = self._accept(verified, *sampled)
        if self.proposer is not None:
            to_draft = [s.req for s in verified if not s.req.finished]
            if to_draft:
                speculative |= self._draft(to_draft)
        if hasattr(self.k_policy, "observe_step"):
            times = [time.perf_counter() - t0, self._forward_s() - forward_s0]
            if self.tp.world_size > 1:  # every rank must choose the same k: rank 0's timings
                times = self.tp.broadcast(torch.tensor(times, dtype=torch.float64, device=self.device)).tolist()
            self.k_policy.observe_step(len(verified), speculative, *times)
        return outputs

    def _forward_s(self) -> float:
        """Seconds the target and draft models have spent in forwards so far."""
        draft = getattr(self.proposer, "runner", None)
        return self.target.forward_s + (draft.forward_s if draft is not None else 0.0)

    def _verify(self, scheduled: list[ScheduledRequest], verified: list[ScheduledRequest]):
        """One target forward over every scheduled request's new tokens (+ drafts); sample the verified.

        Under TP each verified request has an owner rank: its logits reach the owner with one
        all-to-all, the owner runs the rejection sampler, and one all-gather shares the results.
        """
        tp = self.tp
        queries, num_logits = [], []
        for s in scheduled:
            r = s.req
            q = r.token_ids[r.num_computed : r.num_computed + s.num_tokens]
            n = 0
            if s.verify:
                n = 1 + r.num_drafts
                if r.num_drafts:
                    q = q + [max(int(d), 0) for d in r.drafts]  # a -1 placeholder feeds token 0; never accepted
            queries.append(q)
            num_logits.append(n)
        logits = self.target.forward(
            [s.req.slot for s in scheduled], [s.req.num_computed for s in scheduled], queries, num_logits,
            gather=False,
        )  # [num_logits, V] ([num_logits, V_padded / tp] under TP)
        for s in scheduled:
            if not s.verify:
                s.req.num_computed += s.num_tokens
        if not verified:
            return None, None, None
        reqs = [s.req for s in verified]
        slots = np.array([r.slot for r in reqs], dtype=np.int32)
        owners = self._owners(slots)  # [num_reqs]
        num_logits_v = np.array([1 + r.num_drafts for r in reqs], dtype=np.int64)
        logits = rows_to_owners(tp, logits, np.repeat(owners, num_logits_v))[:, : self.vocab_size]
        # Every rank draws every request's randomness (streams stay in step), owners use theirs.
        sampled = [r for r in reqs if not r.params.greedy]
        draws_u = uniforms([r.random.verify for r in sampled], self.k) if sampled and self.k else None
        draws_e = exponentials([r.random.verify for r in sampled], self.vocab_size) if sampled else None
        mine = owners == tp.rank_in_group
        my_reqs = [r for r, m in zip(reqs, mine) if m]
        # [num_mine, k + 4]: tokens (k + 1, -1 padded), num_sampled, num_stale, bad logits (0/1)
        result = torch.zeros(len(my_reqs), self.k + 4, dtype=torch.int64)
        if my_reqs:
            result = self._sample_mine(my_reqs, slots[mine], num_logits_v[mine], logits, sampled, draws_u, draws_e)
        result = rows_from_owners(tp, result.to(self.device), owners).cpu().numpy()
        k = self.k
        for r, n_stale in zip(reqs, result[:, k + 2]):
            r.metrics.num_stale_drafts += int(n_stale)
        return result[:, : k + 1], result[:, k + 1], result[:, k + 3].astype(bool)

    def _sample_mine(self, reqs, slots, num_logits, logits, sampled, draws_u, draws_e) -> torch.Tensor:
        """Rejection-sample the requests this rank owns; returns [num_reqs, k + 4]: tokens, count, stale, bad."""
        batch = InputBatch.build([r.req_id for r in reqs], slots, num_logits, self.device)
        draft_tokens = np.full(batch.num_logits, -1, dtype=np.int64)  # [num_logits]
        for r, start in zip(reqs, batch.cu_num_logits_np[:-1]):
            if r.num_drafts:
                draft_tokens[start : start + r.num_drafts] = r.drafts
        draft_tokens_t = torch.from_numpy(draft_tokens).to(self.device)
        draft_logits, stale = logits, None  # without a cache every row is a bonus row
        if self.draft_logits is not None:
            cache = self.draft_logits
            if sampled or self.config.record_beta:  # all-greedy verification compares tokens only
                rows = cache.rows_of(batch.expanded_idx_mapping.long())  # [num_logits]
                steps = batch.expanded_local_pos.long().clamp(max=self.k - 1)
                draft_logits = cache.values[rows.clamp(min=0), steps]  # [num_logits, V]
            stale = cache.stale_drafts(batch)
            if stale is not None:
                stale = stale & (draft_tokens_t >= 0)
        sampling = BatchSampling(reqs, self.device)
        u = torch.zeros(len(reqs), self.k)  # [num_reqs, k]
        noise = torch.ones(len(reqs), 1).expand(len(reqs), self.vocab_size)  # [num_reqs, V]; greedy rows ignore it
        if sampled:
            noise = noise.contiguous()
        index = {id(r): i for i, r in enumerate(sampled)}
        for i, r in enumerate(reqs):
            j = index.get(id(r))
            if j is not None:
                noise[i] = draws_e[j]
                if draws_u is not None:
                    u[i] = draws_u[j]
        cu = torch.from_numpy(batch.cu_num_logits_np).to(self.device)
        verdict = rejection_sample(
            logits, draft_logits, draft_tokens_t, stale, cu, sampling.temperature, sampling.top_k,
            sampling.top_p, u[:, : int(num_logits.max()) - 1].to(self.device), noise.to(self.device),
            return_probs=self.config.record_beta,
        )
        tokens, num_sampled = verdict[:2]
        out = torch.full((len(reqs), self.k + 4), -1, dtype=torch.int64)
        out[:, : tokens.shape[1]] = tokens.cpu()
        out[:, self.k + 1] = num_sampled.cpu()
        out[:, self.k + 2] = 0
        # A target that emits NaN or +inf logits cannot be sampled from: the request ends with an error.
        bad_row = ~torch.isfinite(logits.amax(dim=-1)).cpu()  # [num_logits]; NaN, +inf or nothing finite
        req_of_row = torch.repeat_interleave(torch.arange(len(reqs)), torch.from_numpy(num_logits))
        out[:, self.k + 3] = torch.zeros(len(reqs), dtype=torch.int64).index_add_(0, req_of_row, bad_row.long()) > 0
        if stale is not None:
            per_req = torch.zeros(len(reqs), dtype=torch.int64)
            per_req.index_add_(0, req_of_row, stale.cpu().long())
            out[:, self.k + 2] = per_req
        if self.config.record_beta:
            self._record_beta(reqs, batch, draft_tokens, stale, *verdict[2:])
        return out

    def _record_beta(self, reqs, batch, draft_tokens, stale, p, q) -> None:
        """Analytic acceptance beta = sum_x min(p, q) at every verified draft (Leviathan et al., Thm 3.5)."""
        valid = draft_tokens >= 0
        if stale is not None:
            valid &= ~stale.cpu().numpy()
        beta = torch.minimum(p, q).sum(dim=-1).cpu().numpy()  # [num_logits]
        for r, start, end in zip(reqs, batch.cu_num_logits_np[:-1], batch.cu_num_logits_np[1:]):
            r.metrics.betas.extend(float(b) for b, v in zip(beta[start:end], valid[start:end]) if v)

    def _owners(self, slots: np.ndarray) -> np.ndarray:
        """The TP rank that verifies each request (the rank that caches its draft logits)."""
        if self.draft_logits is not None:
            return self.draft_logits.owners_of(slots)[0]
        return shard_owners(len(slots), self.tp.world_size)

    def _accept(self, verified: list[ScheduledRequest], tokens, num_sampled, bad) -> list[StepOutput]:
        """Append each verified request's accepted drafts and sampled token; roll caches back; finish."""
        outputs = []
        now = time.perf_counter()
        for i, s in enumerate(verified):
            r = s.req
            if bad[i]:
                r.error = "the target model produced NaN or inf logits"
                outputs.append(StepOutput(r, []))
                self._finish(r, "error")
                continue
            n = int(num_sampled[i])
            num_accepted = n - 1
            m = r.metrics
            nd = int((r.drafts >= 0).sum()) if r.num_drafts else 0
            # Valid K/V: everything up to the last token fed before the drafts, plus accepted drafts.
            r.num_computed = len(r.token_ids) + num_accepted
            r.num_draft_computed = min(r.num_draft_computed, r.num_computed)
            r.drafts = None
            new, reason = self._append(r, [int(t) for t in tokens[i, :n]])
            if nd:  # count what was emitted: a stop token or max_tokens may cut the accepted run
                m.num_drafts += 1
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

    def _draft(self, reqs: list[Request]) -> bool:
        """Give out draft-logits rows by batch position, then draft each request's k tokens; whether any drafted."""
        ks = list(self.k_policy(reqs)) if self.k_policy is not None else [self.k] * len(reqs)
        reqs = [r for r, k in zip(reqs, ks) if k > 0]
        ks = [k for k in ks if k > 0]
        if not reqs:
            return False
        cache = self.draft_logits
        slots = np.array([r.slot for r in reqs], dtype=np.int32)
        cache.assign(torch.from_numpy(slots).to(self.device), slots)
        drafts = self.proposer.propose(reqs, cache, max(ks))  # [num_reqs, max(ks)]
        for r, d, k in zip(reqs, drafts, ks):
            r.drafts = d[:k]
        return True
