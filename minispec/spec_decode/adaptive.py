"""Adaptive speculation length: each request picks its k from its own running acceptance.

The rule (AdaptiveK). Model drafts as accepted independently with a per-token rate alpha
(Leviathan et al., 2023). A step with k drafts then emits on average

    E[tokens | k] = (1 - alpha^(k + 1)) / (1 - alpha)        (k + 1 when alpha = 1)

tokens and costs, in units of one plain target decode step,

    cost(k) = k * c + v[k]        (v[0] = 1: a plain decode)

where c is the draft's cost per drafted token relative to a target decode step (~0 for n-gram
lookup) and v[k] the cost of a (k + 1)-token target forward relative to a 1-token one. Both depend
on the batch size (a CPU or a big batch turns verification compute-bound), so a cost_model measured
at each batch size (spec_decode/costs.MeasuredCosts, what LLM(adaptive_k=True) uses) replaces the
fixed draft_cost / verify_costs. It times the forwards only, not the rest of a speculative step
(proposer sampling, draft-logits writes, the rejection sampler), so where that overhead is large it
can still keep a small k that does not pay. The
policy picks the k in [0, k_max] with the most tokens per unit cost, E[tokens | k] / cost(k), and
k = 0 (speculation off) unless some k beats plain decoding (1 token per unit) by the factor
`margin`.

alpha is estimated per request from its own verifications, forgetting old ones exponentially.
A verification of n drafts that accepted a of them is a geometric run truncated at n: it saw
a successes and, when a < n, one failure. The estimate is the ratio of decayed counts

    successes <- decay * successes + a
    trials    <- decay * trials    + a + (1 if a < n else 0)
    alpha      = successes / trials

which is the maximum-likelihood alpha of the recent runs. A request starts from prior_weight
pseudo-trials at rate prior_alpha (successes = prior_alpha * prior_weight, trials = prior_weight),
forgotten like any observation. A request with speculation off makes no observations, so every
`probe_every` steps off it drafts one token to let its estimate recover.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def expected_tokens(alpha: float | np.ndarray, k: int | np.ndarray) -> float | np.ndarray:
    """Mean tokens per verification with k drafts at per-token acceptance alpha: (1 - alpha^(k+1)) / (1 - alpha)."""
    alpha = np.asarray(alpha, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    near_one = np.abs(1.0 - alpha) < 1e-12
    safe = np.where(near_one, 0.5, alpha)
    out = np.where(near_one, k + 1.0, (1.0 - safe ** (k + 1.0)) / (1.0 - safe))
    return float(out) if out.ndim == 0 else out


@dataclass(slots=True)
class _RequestState:
    req: object  # the Request this state belongs to (a new request reusing the id starts afresh)
    seen_draft_tokens: int = 0  # the request's counters at the previous call
    seen_accepted: int = 0
    seen_drafts: int = 0
    successes: float = 0.0
    trials: float = 0.0
    steps_off: int = 0


class AdaptiveK:
    """Per-request k policy for Engine.k_policy: the k maximising expected tokens per unit cost.

    k_max: the engine's num_speculative_tokens. draft_cost: c, draft cost per drafted token over a
    target decode step. verify_costs: v[0..k_max] (v[0] = 1), or None for free verification
    (v[k] = 1). cost_model: batch_size -> (draft_cost, verify_costs), used instead of the fixed pair when
    given. draft_steps_fixed: charge k_max * c whenever k > 0 (for a proposer that always drafts
    k_max tokens and truncates; the engine's proposers draft only the batch's largest chosen k).
    See the module docstring.
    """

    def __init__(
        self,
        k_max: int,
        draft_cost: float = 0.0,
        verify_costs: Sequence[float] | None = None,
        decay: float = 0.8,
        prior_alpha: float = 0.5,
        prior_weight: float = 2.0,
        margin: float = 1.0,
        probe_every: int = 8,
        draft_steps_fixed: bool = False,
        cost_model=None,
    ):
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}")
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {decay}")
        if not 0.0 <= prior_alpha <= 1.0:
            raise ValueError(f"prior_alpha must be in [0, 1], got {prior_alpha}")
        if prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight}")
        self.k_max = k_max
        self.draft_steps_fixed = draft_steps_fixed
        self.cost_model = cost_model
        self.costs = self.step_costs(draft_cost, verify_costs)  # [k_max + 1] cost of a step with k drafts
        self._costs_by_batch: dict[int, np.ndarray] = {}
        self.decay = decay
        self.prior_alpha = prior_alpha
        self.prior_weight = prior_weight
        self.margin = margin
        self.probe_every = probe_every
        self.states: dict[str, _RequestState] = {}
        self.counts = np.zeros(k_max + 1, dtype=np.int64)  # [k_max + 1] how often each k was chosen

    def step_costs(self, draft_cost: float, verify_costs: Sequence[float] | None) -> np.ndarray:
        """[k_max + 1] cost of a step with k drafts, in plain decode steps (entry 0 is 1)."""
        v = np.ones(self.k_max + 1) if verify_costs is None else np.asarray(verify_costs, dtype=np.float64)
        if v.shape != (self.k_max + 1,):
            raise ValueError(f"verify_costs needs k_max + 1 = {self.k_max + 1} entries (v[0] = 1), got {v.shape[0]}")
        ks = np.arange(self.k_max + 1)
        drafting = np.where(ks > 0, self.k_max if self.draft_steps_fixed else ks, 0)
        costs = drafting * float(draft_cost) + v
        costs[0] = 1.0
        return costs

    def use_batch_size(self, batch_size: int) -> None:
        """Switch self.costs to the cost model's at batch_size (no-op without a cost model)."""
        if self.cost_model is None:
            return
        if batch_size not in self._costs_by_batch:
            self._costs_by_batch[batch_size] = self.step_costs(*self.cost_model(batch_size))
        self.costs = self._costs_by_batch[batch_size]

    def choose(self, alpha: float) -> int:
        """The k in [0, k_max] with the most expected tokens per unit cost at acceptance alpha."""
        ks = np.arange(self.k_max + 1)
        rate = expected_tokens(alpha, ks) / self.costs  # [k_max + 1]; rate[0] = 1
        k = int(np.argmax(rate[1:])) + 1
        return k if rate[k] > self.margin else 0

    def alpha(self, req_id: str) -> float:
        """The current acceptance estimate of a request (prior_alpha for one never seen)."""
        s = self.states.get(req_id)
        if s is None or s.trials <= 0:
            return self.prior_alpha
        return s.successes / s.trials

    def observe(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        """Fold one verification (num_drafted drafts, num_accepted of them accepted) into the estimate."""
        s = self.states[req_id]
        s.successes = self.decay * s.successes + num_accepted
        s.trials = self.decay * s.trials + num_accepted + (1 if num_accepted < num_drafted else 0)

    def __call__(self, req, batch_size: int = 1) -> int:
        """Engine hook: called once per verified request per step (batch_size of them), after its counters
        were updated."""
        self.use_batch_size(batch_size)
        m = req.metrics
        s = self.states.get(req.req_id)
        if s is None or s.req is not req:
            s = self.states[req.req_id] = _RequestState(req, successes=self.prior_alpha * self.prior_weight,
                                                         trials=self.prior_weight)
        if m.num_drafts > s.seen_drafts:  # the last step verified drafts of ours: one observation
            self.observe(req.req_id, m.num_draft_tokens - s.seen_draft_tokens, m.num_accepted_tokens - s.seen_accepted)
        s.seen_drafts, s.seen_draft_tokens, s.seen_accepted = m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens
        k = self.choose(self.alpha(req.req_id))
        if k == 0:
            s.steps_off += 1
            if self.probe_every > 0 and s.steps_off >= self.probe_every:
                s.steps_off = 0
                k = 1
        else:
            s.steps_off = 0
        self.counts[k] += 1
        return k

    def mean_k(self) -> float:
        """Mean chosen k over every call so far (nan before the first)."""
        n = self.counts.sum()
        return float((self.counts * np.arange(self.k_max + 1)).sum() / n) if n else float("nan")

    def reset(self) -> None:
        """Forget every request and the k counts."""
        self.states.clear()
        self.counts[:] = 0
