"""Verification: one target forward over the scheduled requests, then rejection sampling of the drafts."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minispec.distributed import get_tp_group, to_owners, share_from_owners
from minispec.engine.input_batch import InputBatch
from minispec.engine.observer import Observer
from minispec.engine.request import Request, TokenLogprobs
from minispec.engine.scheduler import ScheduledRequest
from minispec.runner.model_runner import ModelRunner
from minispec.sample.random import verify_draws
from minispec.sample.sampler import BatchSampling, greedy_tokens
from minispec.spec_decode.draft_logits import DraftLogitsCache, shard_owners
from minispec.spec_decode.rejection_sampler import greedy_accept, rejection_sample


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
        # Every rank draws every request's randomness (streams stay in step), owners use theirs.
        u, noise = verify_draws([None if r.params.greedy else r.random.sampler for r in reqs], self.k, self.vocab_size)
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
        """Rejection-sample the requests this rank owns (logits [num_logits, V], u [num_reqs, k], noise [num_reqs, V])."""
        k, n = self.k, len(reqs)
        if not reqs:
            empty = torch.zeros(0, dtype=torch.int64)
            return Verdict(torch.zeros(0, k + 1, dtype=torch.int64), empty, empty, empty.bool())
        record_beta = self.observer.record_beta and self.draft_logits is not None
        sampled = any(not r.params.greedy for r in reqs)
        cu_np = np.zeros(n + 1, dtype=np.int64)  # [num_reqs + 1]
        np.cumsum(num_logits, out=cu_np[1:])
        draft_tokens = np.full(int(cu_np[-1]), -1, dtype=np.int64)  # [num_logits]
        for r, start in zip(reqs, cu_np[:-1]):
            if r.num_drafts:
                draft_tokens[start : start + r.num_drafts] = r.drafts
        if not sampled and not record_beta and (self.draft_logits is None or not self.draft_logits.sharded):
            return self._greedy(logits, draft_tokens, cu_np)
        batch = InputBatch.build([r.req_id for r in reqs], slots, num_logits, self.device)
        draft_tokens_t = torch.from_numpy(draft_tokens).to(self.device)
        draft_logits, stale = logits, None  # without a cache every logits position is a bonus
        if self.draft_logits is not None:
            cache = self.draft_logits
            if sampled or record_beta:  # all-greedy verification compares tokens only
                steps = batch.expanded_local_pos.long().clamp(max=k - 1)  # [num_logits]
                draft_logits = cache.read(batch.expanded_slots.long(), steps)  # [num_logits, V]
            stale = cache.stale_drafts(batch)
            if stale is not None:
                stale = stale & (draft_tokens_t >= 0)
        sampling = BatchSampling([r.params for r in reqs], self.device)
        cu = torch.from_numpy(batch.cu_num_logits_np).to(self.device)
        out = rejection_sample(
            logits, draft_logits, draft_tokens_t, stale, cu, sampling.temperature, sampling.top_k,
            sampling.top_p, u[:, : int(num_logits.max()) - 1].to(self.device), noise.to(self.device),
            return_probs=record_beta,
        )
        tokens = torch.full((n, k + 1), -1, dtype=torch.int64)  # [num_reqs, k + 1]
        tokens[:, : out[0].shape[1]] = out[0].cpu()
        # A target that emits NaN or +inf logits cannot be sampled from: the request ends with an error.
        bad_pos = ~torch.isfinite(logits.amax(dim=-1)).cpu()  # [num_logits]; NaN, +inf or nothing finite
        req_of_pos = torch.repeat_interleave(torch.arange(n), torch.from_numpy(num_logits))  # [num_logits]
        bad = torch.zeros(n, dtype=torch.int64).index_add_(0, req_of_pos, bad_pos.long()) > 0  # [num_reqs]
        num_stale = torch.zeros(n, dtype=torch.int64)  # [num_reqs]
        if stale is not None:
            num_stale.index_add_(0, req_of_pos, stale.cpu().long())
        if record_beta:
            self._record_beta(reqs, batch, draft_tokens, stale, *out[2:])
        return Verdict(tokens, out[1].cpu().to(torch.int64), num_stale, bad)

    def _greedy(self, logits: torch.Tensor, draft_tokens: np.ndarray, cu_num_logits: np.ndarray) -> Verdict:
        """An all-greedy batch whose drafts cannot be stale (logits [num_logits, V]): one argmax pass, then
        greedy_accept on the host. What rejection_sample gives it, without its batch bookkeeping."""
        argmax, finite = greedy_tokens(logits)  # [num_logits] each; not finite: NaN, +inf or nothing above -inf
        tokens, num_sampled = greedy_accept(argmax.cpu().numpy(), draft_tokens, cu_num_logits, self.k)
        bad = np.logical_or.reduceat(~finite.cpu().numpy(), cu_num_logits[:-1])  # [num_reqs]
        n = len(cu_num_logits) - 1
        return Verdict(torch.from_numpy(tokens), torch.from_numpy(num_sampled), torch.zeros(n, dtype=torch.int64),
                       torch.from_numpy(bad))

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
