"""Acceptance metrics: the per-request counters summed over a run, and the named estimators read off them.

The model behind alpha and tau: each draft is accepted independently with probability alpha
(Leviathan et al., 2023), so a verification of k drafts is a run of Bernoulli trials that stops at the
first rejection, and emits on average expected_tokens(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha) tokens.

- acceptance_rate: accepted / drafted tokens. Not alpha: drafts after a rejection are never tried, so
  fed into expected_tokens it predicts too little (i.i.d. alpha = 0.5, k = 4: 0.23, tau 1.31, not 1.94).
- first_position_rate: verifications whose first draft was accepted / verifications with drafts.
  alpha under the model; on real drafts below per_token_agreement, since a verification starts right
  after a rejection and misses come in runs.
- alpha_mle: the maximum-likelihood alpha of the model from the accept counts of fixed-k runs.
- tau (mean_accepted_length): tokens emitted per verification with drafts, 1 + accepted / verifications
  unless a stop or max_tokens cut a run (RequestMetrics.mean_accepted_length); expected_tokens(alpha, k)
  under the model. The counters count what was emitted: a run cut by a stop or max_tokens (at most one
  per request, its last) counts only its emitted drafts as accepted, which alpha_mle reads as a rejection.
- per_token_agreement: along a text, the fraction of positions where the draft's greedy token is the
  target's (teacher-forced); alpha under the model. tau_from_agreement: its capped runs as tau.
- predicted_speedup(alpha, k, c, verify_ratio): expected tokens over the cost of a step in target
  forwards (spec_decode/adaptive.py, which AdaptiveK's rule shares).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from minispec.engine.request import COUNTERS, RequestMetrics
from minispec.spec_decode.adaptive import expected_tokens, predicted_speedup

__all__ = ["acceptance_by_position", "aggregate", "alpha_mle", "expected_tokens", "first_position_rate", "per_token_agreement",
           "predicted_speedup", "tau_from_acceptance", "tau_from_agreement"]

def aggregate(outputs) -> dict:
    """The speculation counters of RequestOutputs summed, with every estimator of this module.

    Keys: COUNTERS, accepted_per_position, num_tokens (generated), num_requests, mean_accepted_length
    (tau), acceptance_rate, first_position_rate, alpha (alpha_mle; fixed k = len(accepted_per_position)).
    """
    ms = [o.metrics for o in outputs]
    k = max((len(m["accepted_per_position"]) for m in ms), default=0)
    total = RequestMetrics(**{c: sum(m[c] for m in ms) for c in COUNTERS},
                           accepted_per_position=[sum(m["accepted_per_position"][j] for m in ms) for j in range(k)])
    out = {c: getattr(total, c) for c in COUNTERS}
    out.update(accepted_per_position=total.accepted_per_position, num_tokens=sum(len(o.token_ids) for o in outputs),
               num_requests=len(outputs), mean_accepted_length=total.mean_accepted_length,
               acceptance_rate=total.acceptance_rate)
    out.update(first_position_rate=first_position_rate(out), alpha=alpha_mle(out))
    return out


def first_position_rate(m: dict) -> float:
    """Verifications whose first draft was accepted / verifications with drafts (0 without any)."""
    n = m["num_spec_verifications"]
    return m["accepted_per_position"][0] / n if n and m["accepted_per_position"] else 0.0


def decode_verifications(m: dict) -> int:
    """Verifications after the prefill in summed counters: generated tokens - one per request (the prefill) -
    accepted drafts (each verification emits one token beyond its accepted drafts), at least those with drafts
    (max_tokens may cut a verification's own token)."""
    return max(m["num_spec_verifications"], m["num_tokens"] - m["num_requests"] - m["num_accepted_tokens"])


def alpha_mle(m: dict) -> float:
    """Maximum-likelihood i.i.d. alpha from the summed counters of a fixed-k run (k = len(accepted_per_position)).

    Each decode verification is a run of Bernoulli trials that stops at the first rejection or after k
    acceptances; a verification without any draft (an n-gram miss) counts as a rejection at draft 1.
    """
    k = len(m["accepted_per_position"])
    accepted = m["num_accepted_tokens"]
    all_k = m["accepted_per_position"][k - 1] if k else 0
    steps = decode_verifications(m)
    trials = accepted + steps - all_k
    return accepted / trials if trials > 0 else 0.0


def per_token_agreement(agree: Sequence[np.ndarray]) -> float:
    """Fraction of positions where the draft agreed with the target, over texts of 0/1 agreements."""
    return float(np.concatenate(agree).mean())


def tau_from_agreement(agree: Sequence[np.ndarray], k: int) -> float:
    """1 + the mean run of agreements starting at each position, capped at k: tau of greedy k-draft steps."""
    runs = []
    for a in agree:  # run[t] = consecutive agreements from t on, capped at k
        run = np.zeros(len(a) + 1, dtype=np.int64)
        for t in range(len(a) - 1, -1, -1):
            run[t] = min(run[t + 1] + 1, k) if a[t] else 0
        runs.append(run[:-1])
    return float(1 + np.concatenate(runs).mean())


def acceptance_by_position(m: dict) -> list[float]:
    """Conditional acceptance at each draft position of summed counters (aggregate's): accepted at j / accepted at
    j - 1, position 1 over the verifications with drafts (fixed-k runs)."""
    counts = [m["num_spec_verifications"]] + list(m["accepted_per_position"])
    return [counts[j + 1] / counts[j] if counts[j] else 0.0 for j in range(len(counts) - 1)]


def tau_from_acceptance(acc: list[float], k: int) -> float:
    """Tokens per verification at k drafts from conditional acceptances a_1, a_2, ..: 1 + a_1 + a_1 a_2 + ..."""
    tau, run = 1.0, 1.0
    for a in acc[:k]:
        run *= a
        tau += run
    return tau
