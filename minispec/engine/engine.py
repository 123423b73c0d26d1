"""The engine and its step: schedule -> verify (Verifier: the target's forward, rejection sampling) -> accept -> draft."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from minispec.distributed import get_tp_group, share_from_owners, to_owners
from minispec.engine.input_batch import InputBatch, logits_offsets
from minispec.engine.observer import Observer, StepRecord
from minispec.engine.request import Request, ScheduledRequest, Scheduler, TokenLogprobs
from minispec.runner.model_runner import ModelRunner
from minispec.sample.random import RequestRandom, verify_draws
from minispec.sample.sampler import BatchSampling
from minispec.sampling_params import SamplingParams
from minispec.spec_decode.adaptive import KPolicy, as_k_policy
from minispec.spec_decode.draft_logits import DraftLogitsCache, shard_owners
from minispec.spec_decode.proposer import Proposer
from minispec.spec_decode.rejection_sampler import coupled_verify, greedy_verify, rejection_sample


@dataclass(slots=True)
class EngineConfig:
    """Sizes and switches of one engine."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    shard_draft_logits: bool | None = None  # None: sharded iff tp > 1
    enable_prefix_caching: bool = True  # a newcomer reuses the K/V of a prompt prefix another slot holds (Scheduler)


@dataclass(slots=True)
class StepOutput:
    """What one step added to one request."""

    req: Request
    new_token_ids: list[int]


# ---- verification ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Verdict:
    """What verification decided for each verified request, in batch order (host tensors)."""

    tokens: torch.Tensor  # [num_reqs, k + 1] accepted drafts then one sampled token, -1 padded
    num_sampled: torch.Tensor  # [num_reqs] tokens to append: accepted drafts + 1
    num_stale: torch.Tensor  # [num_reqs] drafts whose cached logits another request overwrote
    bad: torch.Tensor  # [num_reqs] bool: the target gave NaN or inf logits
    # per request: its sampled tokens' logprobs (num_sampled of them) if its params ask (tp = 1 only), else None
    logprobs: list[list[TokenLogprobs] | None] | None = None


class Verifier:
    """Runs the target over a step's batch and samples each verified request's next tokens."""

    def __init__(self, target: ModelRunner, draft_logits: DraftLogitsCache | None, k: int, vocab_size: int,
                 observer: Observer):
        self.tp = get_tp_group()
        self.target = target
        self.draft_logits = draft_logits
        self.k = k
        self.vocab_size = vocab_size
        self.observer = observer  # record_beta: hand sum_x min(p, q) of every verified draft to on_verify
        self.device = target.device

    def __call__(self, scheduled: list[ScheduledRequest]) -> Verdict | None:
        """One target forward over every scheduled request's new tokens (+ drafts); sample the verified.

        A request still prefilling only advances num_computed. Under TP each verified request has an owner
        rank: its logits reach the owner with one all-to-all, the owner runs the rejection sampler, and one
        all-gather shares the verdicts. None when no request was verified.
        """
        queries, num_logits, num_prompt = [], [], []
        for s in scheduled:
            r = s.req
            q = r.token_ids[r.num_computed : r.num_computed + s.num_tokens]
            n = 0
            if s.emits:
                n = 1 + r.num_drafts
                if r.num_drafts:
                    q = q + [max(int(d), 0) for d in r.drafts]  # a -1 placeholder feeds token 0; never accepted
            queries.append(q)
            # prompt_logprobs: the fed prompt positions before the verified one predict prompt tokens
            p = s.num_tokens - s.emits if r.prompt_logprobs is not None and r.num_computed < r.num_prompt_tokens else 0
            num_prompt.append(p)
            num_logits.append(p + n)
        logits = self.target.forward(
            [s.req.slot for s in scheduled], [s.req.num_computed for s in scheduled], queries, num_logits,
            gather=False,
        )  # [num_logits, V] ([num_logits, V_padded / tp] under TP)
        if any(num_prompt):
            logits = self._score_prompts(scheduled, num_prompt, num_logits, logits)
        for s in scheduled:
            if not s.emits:
                s.req.prefilled(s.num_tokens)
        reqs = [s.req for s in scheduled if s.emits]
        if not reqs:
            return None
        slots = np.array([r.slot for r in reqs], dtype=np.int32)
        owners = self._owners(slots)  # [num_reqs]
        num_logits_v = np.array([1 + r.num_drafts for r in reqs], dtype=np.int64)
        logits = to_owners(self.tp, logits, np.repeat(owners, num_logits_v))[:, : self.vocab_size]
        # Every rank draws every request's stream randomness (streams stay in step), owners use theirs; a coupled
        # request's position-keyed noise is its owner's alone (_verify_coupled).
        u, noise = verify_draws([None if r.params.greedy or r.params.coupled else r.random.sampler for r in reqs], self.k,
                                self.vocab_size)
        mine = owners == self.tp.rank_in_group
        if not mine.all():
            u, noise = u[torch.from_numpy(mine)], noise[torch.from_numpy(mine)]
        my_reqs = [r for r, m in zip(reqs, mine) if m]
        verdict = self._sample_mine(my_reqs, slots[mine], num_logits_v[mine], logits, u, noise)
        logprobs = None
        if any(r.logprobs is not None for r in my_reqs):  # tp = 1 (Engine.add_request): every request is mine
            logprobs = self._sampled_logprobs(my_reqs, num_logits_v[mine], logits, verdict)
        verdict = Verdict(*share_from_owners(
            self.tp, [verdict.tokens, verdict.num_sampled, verdict.num_stale, verdict.bad], owners,
        ), logprobs=logprobs)
        for r, n_stale in zip(reqs, verdict.num_stale.tolist()):
            r.metrics.num_stale_drafts += n_stale
        return verdict

    def _sample_mine(self, reqs: list[Request], slots: np.ndarray, num_logits: np.ndarray, logits: torch.Tensor,
                     u: torch.Tensor, noise: torch.Tensor) -> Verdict:
        """Verify the requests this rank owns (logits [num_logits, V], u [num_reqs, k], noise [num_reqs, V]): the
        rejection sampler, and coupled_verify for the coupled ones (SamplingParams.coupled)."""
        k, n = self.k, len(reqs)
        if not reqs:
            empty = torch.zeros(0, dtype=torch.int64)
            return Verdict(torch.zeros(0, k + 1, dtype=torch.int64), empty, empty, empty.bool())
        record_beta = self.observer.record_beta and self.draft_logits is not None
        coupled = np.array([r.params.coupled for r in reqs], dtype=bool)  # [num_reqs]
        drawn = any(not (r.params.greedy or c) for r, c in zip(reqs, coupled))  # the rejection sampler draws tokens
        cu_np = logits_offsets(num_logits)  # [num_reqs + 1]
        draft_tokens = np.full(int(cu_np[-1]), -1, dtype=np.int64)  # [num_logits]
        for r, start in zip(reqs, cu_np[:-1]):
            if r.num_drafts:
                draft_tokens[start : start + r.num_drafts] = r.drafts
        if not (drawn or coupled.any() or record_beta) and (self.draft_logits is None or not self.draft_logits.sharded):
            return self._greedy(logits, draft_tokens, cu_np)
        batch = InputBatch.build([r.req_id for r in reqs], slots, num_logits, self.device, cu_np)
        draft_tokens_t = torch.from_numpy(draft_tokens).to(self.device)
        draft_logits, stale = logits, None  # without a cache or drafts every logits position is a bonus
        if self.draft_logits is not None and int(cu_np[-1]) > n:
            cache = self.draft_logits
            if drawn or record_beta:  # greedy and coupled verification compare tokens only
                steps = batch.expanded_local_pos.long().clamp(max=k - 1)  # [num_logits]
                draft_logits = cache.read(batch.expanded_slots.long(), steps)  # [num_logits, V]
            stale = cache.stale_drafts(batch)
            if stale is not None:
                stale = stale & (draft_tokens_t >= 0)
        sampling = BatchSampling([r.params for r in reqs], self.device)
        tokens = torch.full((n, k + 1), -1, dtype=torch.int64)  # [num_reqs, k + 1]
        num_sampled = torch.zeros(n, dtype=torch.int64)  # [num_reqs]
        if not coupled.all() or record_beta:
            cu = torch.from_numpy(batch.cu_num_logits_np).to(self.device)
            out = rejection_sample(
                logits, draft_logits, draft_tokens_t, stale, cu, sampling.temperature, sampling.top_k,
                sampling.top_p, u[:, : int(num_logits.max()) - 1].to(self.device), noise.to(self.device),
                return_probs=record_beta,
            )
            tokens[:, : out[0].shape[1]] = out[0].cpu()
            num_sampled[:] = out[1].cpu()
            if record_beta:
                self._record_beta(reqs, batch, draft_tokens, stale, *out[2:])
        if coupled.any():
            self._verify_coupled(reqs, coupled, cu_np, logits, draft_tokens_t, stale, sampling, tokens, num_sampled)
        # A target that emits NaN or +inf logits cannot be sampled from: the request ends with an error.
        bad_pos = ~torch.isfinite(logits.amax(dim=-1)).cpu()  # [num_logits]; NaN, +inf or nothing finite
        req_of_pos = torch.repeat_interleave(torch.arange(n), torch.from_numpy(num_logits))  # [num_logits]
        bad = torch.zeros(n, dtype=torch.int64).index_add_(0, req_of_pos, bad_pos.long()) > 0  # [num_reqs]
        num_stale = torch.zeros(n, dtype=torch.int64)  # [num_reqs]
        if stale is not None:
            num_stale.index_add_(0, req_of_pos, stale.cpu().long())
        return Verdict(tokens, num_sampled, num_stale, bad)

    def _verify_coupled(self, reqs: list[Request], coupled: np.ndarray, cu_np: np.ndarray, logits: torch.Tensor,
                        draft_tokens: torch.Tensor, stale: torch.Tensor | None, sampling: BatchSampling,
                        tokens: torch.Tensor, num_sampled: torch.Tensor) -> None:
        """Write coupled_verify's verdict into tokens [num_reqs, k + 1] and num_sampled [num_reqs] for the requests
        with coupled [num_reqs] set. Logits position j of a request draws the token at position len(token_ids) + j."""
        idx = np.flatnonzero(coupled)
        num_logits = np.diff(cu_np)[idx]  # [num_coupled]
        drafts = draft_tokens if stale is None else torch.where(stale, -1, draft_tokens)  # [num_logits]; stale: rejected
        if len(idx) < len(reqs):
            pos = torch.from_numpy(np.concatenate([np.arange(cu_np[i], cu_np[i + 1]) for i in idx])).to(self.device)
            logits, drafts = logits[pos], drafts[pos]
        noise = torch.stack([row for i, m in zip(idx, num_logits) for row in
                             reqs[i].random.position_noise(len(reqs[i].token_ids), int(m), self.vocab_size)])  # [.., V]
        at = torch.from_numpy(idx).to(self.device)
        got, got_n = coupled_verify(logits, drafts, torch.from_numpy(logits_offsets(num_logits)).to(self.device),
                                    sampling.temperature[at], sampling.top_k[at], sampling.top_p[at], noise, self.k)
        tokens[idx] = got
        num_sampled[idx] = got_n

    def _greedy(self, logits: torch.Tensor, draft_tokens: np.ndarray, cu_num_logits: np.ndarray) -> Verdict:
        """An all-greedy batch whose drafts cannot be stale (logits [num_logits, V]): one argmax pass, then
        greedy_accept on the host. What rejection_sample gives it, without its batch bookkeeping."""
        tokens, num_sampled, finite = greedy_verify(logits, torch.from_numpy(draft_tokens), None,
                                                    torch.from_numpy(cu_num_logits), self.k)
        bad = np.logical_or.reduceat(~finite.cpu().numpy(), cu_num_logits[:-1])  # [num_reqs]
        n = len(cu_num_logits) - 1
        return Verdict(tokens.cpu(), num_sampled.cpu(), torch.zeros(n, dtype=torch.int64), torch.from_numpy(bad))

    def _record_beta(self, reqs, batch, draft_tokens, stale, p, q) -> None:
        """Analytic acceptance beta = sum_x min(p, q) at every verified draft (Leviathan et al., Thm 3.5)."""
        valid = draft_tokens >= 0
        if stale is not None:
            valid &= ~stale.cpu().numpy()
        beta = torch.minimum(p, q).sum(dim=-1).cpu().numpy()  # [num_logits]
        cu = batch.cu_num_logits_np
        self.observer.on_verify(reqs, [[float(b) for b, v in zip(beta[start:end], valid[start:end]) if v]
                                       for start, end in zip(cu[:-1], cu[1:])])

    def _score_prompts(self, scheduled: list[ScheduledRequest], num_prompt: list[int], num_logits: list[int],
                       logits: torch.Tensor) -> torch.Tensor:
        """Append each scored prompt chunk's logprobs to its request (tp = 1); returns the other logits rows.

        logits [num_logits, V]: request i's num_prompt[i] prompt rows come first among its num_logits[i]."""
        starts = np.cumsum([0] + num_logits[:-1])
        for s, p, start in zip(scheduled, num_prompt, starts):
            if p:
                r = s.req
                # row j (position num_computed + j) predicts the prompt token after it
                predicted = r.token_ids[r.num_computed + 1 : r.num_computed + 1 + p]
                r.prompt_logprobs += token_logprobs(logits[start : start + p, : self.vocab_size], predicted,
                                                    r.params.prompt_logprobs)
        keep = np.concatenate([np.arange(start + p, start + n) for start, p, n in zip(starts, num_prompt, num_logits)])
        return logits[torch.from_numpy(keep).to(logits.device)]  # [num_logits - sum(num_prompt), V]

    def _sampled_logprobs(self, reqs: list[Request], num_logits: np.ndarray, logits: torch.Tensor,
                          verdict: Verdict) -> list[list[TokenLogprobs] | None]:
        """The logprobs of each asking request's sampled tokens (accepted drafts, then the drawn one): each read
        at the logits position that token was verified or drawn at (logits [num_logits, V])."""
        out = []
        for r, start, n, toks in zip(reqs, np.cumsum(num_logits) - num_logits, verdict.num_sampled.tolist(),
                                     verdict.tokens.tolist()):
            rows = logits[start : start + n]  # [n, V]
            out.append(None if r.logprobs is None else token_logprobs(rows, [max(t, 0) for t in toks[:n]],
                                                                      r.params.logprobs))
        return out

    def _owners(self, slots: np.ndarray) -> np.ndarray:
        """The TP rank that verifies each request (the rank that caches its draft logits)."""
        if self.draft_logits is not None:
            return self.draft_logits.owners_of(slots)
        return shard_owners(len(slots), self.tp.world_size)


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """Each row's log-probability of its token and its num_top most likely tokens (most likely first).

    The raw log-softmax of the target's logits (logits [n, V]), before temperature, top-k and top-p: the
    target's own distribution, the same whichever way the token was sampled, with or without drafts."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    chosen = lp.gather(1, torch.tensor(token_ids, device=lp.device).view(-1, 1)).view(-1).tolist()  # [n]
    top_lp, top_ids = lp.topk(min(num_top, lp.shape[1]), dim=-1)  # [n, num_top] each
    return [(c, list(zip(ids, lps))) for c, ids, lps in zip(chosen, top_ids.tolist(), top_lp.tolist())]


# ---- the engine --------------------------------------------------------------------------------------------
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
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, config.enable_prefix_caching,
                                   draft_kv=proposer is not None and proposer.has_kv_cache)
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
        self.scheduler.free(req)  # first: the slot keeps the prefix both caches hold
        if self.proposer is not None:
            self.proposer.free(req)
        self.k_policy.free(req)
        req.slot = -1
        del self.requests[req.req_id]

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One engine step: verify the scheduled requests' drafts, accept, then draft anew."""
        scheduled = self.scheduler.schedule()
        for c in self.scheduler.copies:  # newcomers' reused prefixes, before the forward reads them
            if c.src != c.dst:
                self.target.kv.copy_prefix(c.src, c.dst, c.num_tokens)
                if self.proposer is not None:
                    self.proposer.copy_prefix(c.src, c.dst, c.num_tokens)
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
        cache.greedy_rows_read = self.observer.record_beta
        drafts = self.proposer.propose(reqs, cache, max(ks))  # [num_reqs, max(ks)]
        for r, d, k in zip(reqs, drafts, ks):
            drafted = np.flatnonzero(d[:k] >= 0)  # trailing -1s cost rows and give nothing
            r.drafts = d[: drafted[-1] + 1] if len(drafted) else None
        return asked
