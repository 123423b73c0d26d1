"""Adaptive speculation length: one k per step for the whole batch, from each request's running acceptance.

The rule (AdaptiveK). Model drafts as accepted independently with a per-token rate alpha
(Leviathan et al., 2023). A request with k drafts then emits on average

    E[tokens | k] = (1 - alpha^(k + 1)) / (1 - alpha)        (k + 1 when alpha = 1)

tokens per step. A step of batch size b with k drafts costs, in units of one plain decode step,

    cost_b(k) = (k * c + v[k]) * overhead        (cost_b(0) = 1)

where c is the draft's cost per drafted token relative to a target decode step (~0 for n-gram
lookup) and v[k] the cost of a (k + 1)-token target forward relative to a 1-token one. Both depend
on the batch size (a CPU or a big batch turns verification compute-bound), so a cost_model measured
at each batch-size bucket before serving (spec_decode/costs.MeasuredCosts, what LLM(adaptive_k=True) uses) replaces the
fixed draft_cost / verify_costs. Those time the forwards only; `overhead` is the rest of a
speculative step (proposer sampling, draft-logits writes, the rejection sampler), measured in the
engine's own steps: the ratio of step time to forward time in speculative steps over the same
ratio in plain steps (1 until a plain step of that batch bucket was seen), fed by observe_step.

The k is chosen for the whole batch: every request's verify forward is padded to the longest
query and the draft forward runs for the batch's largest k, so the step costs cost_b(max k) whatever
each request drafts. The policy picks the k in [1, k_max] with the most expected batch tokens per
unit cost, sum_i E[tokens_i | k] / cost_b(k), and k = 0 (speculation off) unless that beats plain
decoding (b tokens per unit) by the factor `margin`. While off, the batch drafts one token after
`probe_every` steps so the acceptance estimates can recover; each probe that leaves it off doubles
the wait (up to 8 * probe_every), so a workload where drafting never pays spends little on probes. Where
the forward costs alone rule drafting out even at acceptance probe_alpha (a large batch on a CPU, whose
verification is compute-bound), there is no probe: it could only find that drafting does not pay. At
probe_alpha 1 the 2-core Intel AMX kind probed at batch 16 (a 4-draft step there costs 4.8 plain steps, 5
tokens if all were accepted) and the shipped head ran 0.90x target-only; at 0.9 it does not probe there. A draft
with a KV cache of its own (an EAGLE head) must first read every position it skipped, the prompt included for a
request that never drafted: with catch_up_cost, that reading, spread over probe_every steps, is added to the costs
the probe must be able to pay (a full batch of 16 whose head never drafted would read ~1,600 positions, several
plain steps, for one probe).

With a proposer that cuts its own drafts where it is unsure (gated: an EAGLE head's confidence gate), a lone
request asks for k_max wherever drafting can pay at all and the gate sets each step's length: at batch 1 a cut
draft costs only its head step (no verification row), while a running estimate turns drafting off after a few
rejections and then skips confident drafts too (on the Intel AMX kind, batch 1, three runs: 1.20-1.24x target-only
with the estimate alone, 1.22-1.38x with k_max and the gate; docs/experiments.md). In a batch the verify forward is
padded to the longest query, so a cut saves little there and the estimate still chooses.

alpha is estimated per request from its own verifications, forgetting old ones exponentially.
A verification of n drafts that accepted a of them is a geometric run truncated at n: it saw
a successes and, when a < n, one failure. The estimate is the ratio of decayed counts

    successes <- decay * successes + a
    trials    <- decay * trials    + a + (1 if a < n else 0)
    alpha      = successes / trials

which is the maximum-likelihood alpha of the recent runs. A request starts from prior_weight
pseudo-trials at the prior rate (successes = prior * prior_weight, trials = prior_weight), forgotten
like any observation. The prior is the pooled rate of the policy's recent observations over all
requests (pool_decay per observation), prior_alpha before it has seen one: a new request in a
workload where drafts are rarely accepted does not start out speculating. A request that was asked
for drafts and verified none (the proposer had nothing, as an n-gram lookup without a match) counts
one failure.

Every request shares the batch's k, seeded or not: a greedy request's tokens are the target's argmax and a seeded
sampled one's the target's position-keyed draws (SamplingParams.coupled), whatever is drafted, so neither
depends on the k chosen.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class KPolicy:
    """Engine.k_policy: each drafting request's k per step; the hooks are no-ops, override what you need."""

    # Whether the engine calls observe_step after every step (under TP with rank 0's timings, broadcast first:
    # every rank must choose the same k). Read once per step.
    observes_steps: bool = False

    def __call__(self, reqs: Sequence) -> list[int]:
        """Each request's k in [0, k_max] (0: no drafts this step)."""
        raise NotImplementedError

    def observe_step(self, batch_size: int, speculative: bool, step_s: float, forward_s: float) -> None:
        """With observes_steps, after every step: requests verified, any drafts, wall and forward seconds."""

    def free(self, req) -> None:
        """The request finished: forget what is kept of it."""


class FixedK(KPolicy):
    """Every request drafts k (the engine's policy when it is given none)."""

    def __init__(self, k: int):
        self.k = k

    def __call__(self, reqs: Sequence) -> list[int]:
        return [self.k] * len(reqs)


class _CallableK(KPolicy):
    """A plain function reqs -> ks as a KPolicy."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, reqs: Sequence) -> list[int]:
        return self.fn(reqs)


def as_k_policy(policy, k: int) -> KPolicy:
    """A KPolicy as it is, a plain callable reqs -> ks wrapped, None as FixedK(k)."""
    if policy is None:
        return FixedK(k)
    return policy if isinstance(policy, KPolicy) else _CallableK(policy)


def expected_tokens(alpha: float | np.ndarray, k: int | np.ndarray) -> float | np.ndarray:
    """Mean tokens per verification with k drafts at per-token acceptance alpha: (1 - alpha^(k+1)) / (1 - alpha)."""
    alpha = np.asarray(alpha, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    near_one = np.abs(1.0 - alpha) < 1e-12
    safe = np.where(near_one, 0.5, alpha)
    out = np.where(near_one, k + 1.0, (1.0 - safe ** (k + 1.0)) / (1.0 - safe))
    return float(out) if out.ndim == 0 else out


def predicted_speedup(alpha: float, k: int, c: float, verify_ratio: float) -> float:
    """Tokens per step over target-only at per-token acceptance alpha: expected_tokens / (k * c + verify_ratio).

    c: draft cost per drafted token, verify_ratio: a (k + 1)-token target forward, both in target decode steps.
    """
    return expected_tokens(alpha, k) / (k * c + verify_ratio)


@dataclass(slots=True)
class _RequestState:
    req: object  # the Request this state belongs to (a new request reusing the id starts afresh)
    seen_draft_tokens: int = 0  # the request's counters at the previous call
    seen_accepted: int = 0
    seen_verifications: int = 0
    asked: int = 0  # the k this policy gave it last time
    successes: float = 0.0
    trials: float = 0.0


def batch_bucket(batch_size: int) -> int:
    """The power of two at or above batch_size: costs are measured and kept per bucket."""
    return 1 << max(0, int(batch_size) - 1).bit_length()


class AdaptiveK(KPolicy):
    """Engine.k_policy: one k per step for the batch, the one with the most expected tokens per unit cost.

    k_max: the engine's num_speculative_tokens. draft_cost: c, draft cost per drafted token over a
    target decode step. verify_costs: v[0..k_max] (v[0] = 1), or None for free verification
    (v[k] = 1). cost_model: batch_size -> (draft_cost, verify_costs), used instead of the fixed pair when
    given. overhead_decay: how fast the measured step overhead forgets old steps. probe_alpha: no probes where
    drafting could not pay even at this acceptance. catch_up_cost: batch_size -> what the draft's reading of one
    position it has not seen costs, in plain decode steps at that batch size (MeasuredCosts.catch_up), or None
    (free). gated: the proposer cuts each request's drafts where it is unsure (HeadProposer.min_confidence); a lone
    request then drafts k_max wherever drafting can pay at all. See the module docstring.
    """

    observes_steps = True

    def __init__(
        self,
        k_max: int,
        draft_cost: float = 0.0,
        verify_costs: Sequence[float] | None = None,
        decay: float = 0.9,  # 0.9 and 4 (were 0.8 and 8): nearer the best fixed k in simulation, docs/experiments.md
        prior_alpha: float = 0.5,
        prior_weight: float = 2.0,
        margin: float = 1.0,
        probe_every: int = 4,
        cost_model=None,
        overhead_decay: float = 0.9,
        pool_decay: float = 0.95,
        probe_alpha: float = 0.9,
        catch_up_cost=None,
        gated: bool = False,
    ):
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}")
        for name, value in (("decay", decay), ("overhead_decay", overhead_decay), ("pool_decay", pool_decay),
                            ("prior_alpha", prior_alpha), ("probe_alpha", probe_alpha)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight}")
        self.k_max = k_max
        self.cost_model = cost_model
        self.fixed_costs = self.step_costs(draft_cost, verify_costs)  # [k_max + 1] forward cost of k drafts
        self._costs_by_batch: dict[int, np.ndarray] = {}
        self.decay = decay
        self.prior_alpha = prior_alpha
        self.prior_weight = prior_weight
        self.margin = margin
        self.probe_every = probe_every
        self.probe_alpha = probe_alpha  # the acceptance at which drafting must be able to pay for a probe
        self.catch_up_cost = catch_up_cost
        self.gated = gated
        self.probe_gap = probe_every  # steps off before the next probe (doubles after each probe that stays off)
        self.pool_decay = pool_decay
        self.pool = np.zeros(2)  # decayed (successes, trials) of every request's observations
        self.overhead_decay = overhead_decay
        # bucket -> [decayed step seconds, decayed forward seconds] of speculative (index 1) / plain (0) steps
        self.step_times: dict[int, np.ndarray] = {}
        self.steps_off = 0
        self.states: dict[str, _RequestState] = {}
        self.counts = np.zeros(k_max + 1, dtype=np.int64)  # [k_max + 1] how often each k was chosen (per request)

    def step_costs(self, draft_cost: float, verify_costs: Sequence[float] | None) -> np.ndarray:
        """[k_max + 1] forward cost of a step with k drafts, in plain decode steps (entry 0 is 1)."""
        v = np.ones(self.k_max + 1) if verify_costs is None else np.asarray(verify_costs, dtype=np.float64)
        if v.shape != (self.k_max + 1,):
            raise ValueError(f"verify_costs needs k_max + 1 = {self.k_max + 1} entries (v[0] = 1), got {v.shape[0]}")
        costs = np.arange(self.k_max + 1) * float(draft_cost) + v
        costs[0] = 1.0
        return costs

    def overhead(self, batch_size: int) -> float:
        """Measured (step / forward time) of speculative steps over that of plain steps at this batch bucket;
        1 before a speculative step was seen, and plain steps count as overhead-free until one is seen."""
        t = self.step_times.get(batch_bucket(batch_size))
        if t is None or t[1, 1] <= 0:
            return 1.0
        spec = t[1, 0] / t[1, 1]
        plain = t[0, 0] / t[0, 1] if t[0, 1] > 0 else 1.0
        return max(1.0, spec / plain)

    def forward_costs(self, batch_size: int) -> np.ndarray:
        """[k_max + 1] the forwards' cost of a step with k drafts at this batch size (no step overhead)."""
        if self.cost_model is None:
            return self.fixed_costs
        if batch_size not in self._costs_by_batch:
            self._costs_by_batch[batch_size] = self.step_costs(*self.cost_model(batch_size))
        return self._costs_by_batch[batch_size]

    def costs(self, batch_size: int) -> np.ndarray:
        """[k_max + 1] cost of a step with k drafts at this batch size, in plain decode steps."""
        costs = self.forward_costs(batch_size) * self.overhead(batch_size)
        costs[0] = 1.0
        return costs

    def can_pay(self, forward_costs: np.ndarray, catch_up: float = 0.0) -> bool:
        """Whether drafting could beat plain decoding at these forward costs [k_max + 1] plus catch_up (plain steps
        added to every k > 0) at acceptance probe_alpha; where it cannot, a probe finds nothing worth its step."""
        costs = np.array(forward_costs, dtype=np.float64)
        costs[1:] += catch_up
        return self._best_k(np.full(1, self.probe_alpha), costs) > 0

    def catch_up(self, reqs: Sequence) -> float:
        """A probe's catch-up, in plain steps a step: the positions the draft has not read of these requests
        (num_computed - num_draft_computed: the prompt and every token since it last drafted) at catch_up_cost, spread
        over probe_every steps of drafting. 0 without catch_up_cost."""
        if self.catch_up_cost is None or not reqs:
            return 0.0
        pending = sum(max(0, r.num_computed - r.num_draft_computed) for r in reqs)
        return pending * self.catch_up_cost(len(reqs)) / max(1, self.probe_every)

    def observe_step(self, batch_size: int, speculative: bool, step_s: float, forward_s: float) -> None:
        """Engine hook, once per step: its wall time and the part of it spent in model forwards."""
        if batch_size <= 0 or forward_s <= 0:
            return
        t = self.step_times.setdefault(batch_bucket(batch_size), np.zeros((2, 2)))
        row = t[int(bool(speculative))]
        row *= self.overhead_decay
        row += (step_s, forward_s)

    def choose(self, alphas: float | Sequence[float], batch_size: int | None = None) -> int:
        """The k in [0, k_max] with the most expected tokens per unit cost for a batch at these acceptances."""
        alphas = np.atleast_1d(np.asarray(alphas, dtype=np.float64))  # [num_reqs]
        return self._best_k(alphas, self.costs(len(alphas) if batch_size is None else batch_size))

    def _best_k(self, alphas: np.ndarray, costs: np.ndarray) -> int:
        """The k with the most expected tokens per unit of costs [k_max + 1] (0 unless it beats margin)."""
        ks = np.arange(self.k_max + 1)
        tokens = expected_tokens(alphas[:, None], ks[None, :]).sum(axis=0)  # [k_max + 1]; tokens[0] = num_reqs
        rate = tokens / costs
        k = int(np.argmax(rate[1:])) + 1
        return k if rate[k] > self.margin * rate[0] else 0

    def _probe(self, k: int, forward_costs: np.ndarray, reqs: Sequence = ()) -> int:
        """k, or 1 when speculation has been off for probe_gap steps (a probe) and drafting can pay at all at these
        forward costs [k_max + 1] with the draft's catch-up on reqs; advances the probe clock."""
        if k == 0:
            if not self.can_pay(forward_costs, self.catch_up(reqs)):
                return 0
            self.steps_off += 1
            if self.probe_every > 0 and self.steps_off >= self.probe_gap:
                self.steps_off = 0
                self.probe_gap = min(2 * self.probe_gap, 8 * self.probe_every)
                return 1
            return 0
        self.steps_off = 0
        self.probe_gap = self.probe_every
        return k

    def prior(self) -> float:
        """A new request's starting acceptance: the pooled rate of recent observations (prior_alpha before any)."""
        return self.pool[0] / self.pool[1] if self.pool[1] >= 1.0 else self.prior_alpha

    def alpha(self, req_id: str) -> float:
        """The current acceptance estimate of a request (the prior for one never seen)."""
        s = self.states.get(req_id)
        if s is None or s.trials <= 0:
            return self.prior()
        return s.successes / s.trials

    def observe(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        """Fold one verification (num_drafted drafts, num_accepted of them accepted) into the estimate."""
        s = self.states[req_id]
        trials = num_accepted + (1 if num_accepted < num_drafted else 0)
        s.successes = self.decay * s.successes + num_accepted
        s.trials = self.decay * s.trials + trials
        self.pool = self.pool_decay * self.pool + (num_accepted, trials)

    def _update(self, req) -> None:
        """Fold the request's latest verification (read off its counters) into its estimate."""
        m = req.metrics
        s = self.states.get(req.req_id)
        if s is None or s.req is not req:
            s = self.states[req.req_id] = _RequestState(req, successes=self.prior() * self.prior_weight,
                                                         trials=self.prior_weight)
        if m.num_spec_verifications > s.seen_verifications:  # the last step verified drafts of ours: one observation
            self.observe(req.req_id, m.num_draft_tokens - s.seen_draft_tokens, m.num_accepted_tokens - s.seen_accepted)
        elif s.asked:  # asked for drafts, got none (an n-gram miss): nothing to accept, a failed run
            self.observe(req.req_id, s.asked, 0)
        s.seen_verifications, s.seen_draft_tokens = m.num_spec_verifications, m.num_draft_tokens
        s.seen_accepted = m.num_accepted_tokens

    def free(self, req) -> None:
        """Engine hook: the request finished; forget its state."""
        s = self.states.get(req.req_id)
        if s is not None and s.req is req:
            del self.states[req.req_id]

    def __call__(self, reqs: Sequence) -> list[int]:
        """Engine hook: the batch's k for every request about to draft, after their counters were updated."""
        for r in reqs:
            self._update(r)
        if not reqs:
            return []
        costs = self.forward_costs(len(reqs))
        if self.gated and len(reqs) == 1:  # the proposer's gate sets the length, step by step
            k = self.k_max if self.can_pay(costs, self.catch_up(reqs)) else 0
        else:
            k = self._probe(self.choose([self.alpha(r.req_id) for r in reqs]), costs, reqs)
        for r in reqs:
            self.states[r.req_id].asked = k
        self.counts[k] += len(reqs)
        return [k] * len(reqs)

    def mean_k(self) -> float:
        """Mean chosen k over every request drafted so far (nan before the first)."""
        n = self.counts.sum()
        return float((self.counts * np.arange(self.k_max + 1)).sum() / n) if n else float("nan")
