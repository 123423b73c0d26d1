"""The acceptance estimators of tools/metrics.py: hand-counted cases, and a synthetic i.i.d. draft of known alpha
whose verifications are simulated run by run, so each estimator is checked against what it should recover."""
import math
from types import SimpleNamespace

import numpy as np
import pytest

from minispec.tools.metrics import (aggregate, alpha_mle, expected_tokens, first_position_rate, per_token_agreement,
                                    predicted_speedup, tau_from_agreement)


def simulate(alpha: float, k: int, num_requests: int, steps: int, seed: int = 0) -> list:
    """RequestOutput stand-ins of an i.i.d. draft: every step drafts k tokens, each accepted with probability
    alpha until the first rejection; a step emits its accepted drafts and one more token."""
    rng = np.random.default_rng(seed)
    outs = []
    for _ in range(num_requests):
        accepted = np.argmin(np.concatenate([rng.random((steps, k)) < alpha, np.zeros((steps, 1), bool)], axis=1),
                             axis=1)  # [steps] drafts accepted before the first rejection (k if none)
        metrics = {"num_spec_verifications": steps, "num_draft_tokens": steps * k, "num_accepted_tokens": int(accepted.sum()),
                   "num_emitted_tokens": int((accepted + 1).sum()), "num_stale_drafts": 0, "accepted_per_position": [int((accepted > j).sum()) for j in range(k)]}
        num_tokens = 1 + int((accepted + 1).sum())  # the prefill's token, then accepted + 1 per step
        outs.append(SimpleNamespace(metrics=metrics, token_ids=[0] * num_tokens))
    return outs


@pytest.mark.parametrize("alpha,k", [(0.5, 4), (0.8, 3), (0.2, 2)])
def test_estimators_recover_an_iid_draft(alpha, k):
    m = aggregate(simulate(alpha, k, num_requests=20, steps=1000))
    tol = 0.02  # 20,000 verifications: a few standard errors of each rate
    assert m["alpha"] == pytest.approx(alpha, abs=tol)
    assert m["first_position_rate"] == pytest.approx(alpha, abs=tol)
    assert m["mean_accepted_length"] == pytest.approx(expected_tokens(alpha, k), abs=3 * tol)
    assert expected_tokens(m["alpha"], k) == pytest.approx(m["mean_accepted_length"], abs=3 * tol)
    # accepted / drafted is not alpha: the drafts after a rejection are never tried.
    rate = sum(alpha**j for j in range(1, k + 1)) / k
    assert m["acceptance_rate"] == pytest.approx(rate, abs=tol)
    # Per-token agreement along a text of i.i.d. agreements, and tau from its runs capped at k.
    agree = [np.random.default_rng(s).random(5000) < alpha for s in range(4)]
    assert per_token_agreement(agree) == pytest.approx(alpha, abs=tol)
    assert tau_from_agreement(agree, k) == pytest.approx(expected_tokens(alpha, k), abs=3 * tol)


def test_acceptance_rate_as_alpha_is_biased():
    """The issue's example: an i.i.d. alpha = 0.5 draft at k = 4 emits 1.94 tokens per step; accepted / drafted
    (0.23) fed into the i.i.d. formula predicts 1.31, the MLE alpha predicts the 1.94."""
    m = aggregate(simulate(0.5, 4, num_requests=20, steps=1000, seed=1))
    assert m["mean_accepted_length"] == pytest.approx(1.94, abs=0.03)
    assert expected_tokens(m["acceptance_rate"], 4) == pytest.approx(1.31, abs=0.03)
    assert expected_tokens(m["alpha"], 4) == pytest.approx(1.94, abs=0.03)


def test_alpha_and_prediction():
    k = 4
    # Two verifications: one accepted all 4, one accepted 1 then rejected -> 5 successes, 1 failure.
    m = {"num_accepted_tokens": 5, "num_spec_verifications": 2, "accepted_per_position": [2, 1, 1, 1], "num_requests": 1}
    # 1 request: prefill token + (1 + 4) + (1 + 1) = 8 tokens.
    assert alpha_mle({**m, "num_tokens": 8}) == pytest.approx(5 / 6)
    # An n-gram miss (a verification without drafts) adds a rejection: 9 tokens, 3 verifications.
    assert alpha_mle({**m, "num_tokens": 9}) == pytest.approx(5 / 7)
    assert first_position_rate(m) == 1.0
    none = {"num_accepted_tokens": 0, "num_spec_verifications": 3, "accepted_per_position": [0] * k, "num_tokens": 4,
            "num_requests": 1}
    assert alpha_mle(none) == 0.0 and first_position_rate(none) == 0.0
    assert predicted_speedup(0.0, k, 0.1, 1.2) == pytest.approx(1 / (0.4 + 1.2))
    assert predicted_speedup(1.0, k, 0.0, 1.0) == pytest.approx(k + 1)
    a = 0.7
    assert predicted_speedup(a, k, 0.05, 1.1) == pytest.approx(sum(a**i for i in range(k + 1)) / (k * 0.05 + 1.1))
    assert math.isfinite(predicted_speedup(0.999999, k, 0.0, 1.0))
