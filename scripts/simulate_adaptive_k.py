"""AdaptiveK against the best fixed k, on simulated acceptance: no models, no timing, the same draws for every policy.

    .venv/bin/python scripts/simulate_adaptive_k.py [--settings "decay=0.8,probe_every=8" "decay=0.9,probe_every=4"]

Requests of 64 tokens run one after another at batch 1. Each drafted token is accepted with the request's own rate
(i.i.d., Leviathan et al.'s model, which AdaptiveK assumes), and a step with k drafts costs k c + v[k] plain steps,
with the verify ratios v and the draft cost c of two CPU kinds (docs/experiments.md: the Zen 4's measured 2-5 token
forwards, the Intel AMX kind's from ../shared/notes/cpu-measurements.md; c = 0.1, the shipped head's). Prints each
setting's tokens per unit cost over the best fixed k's (k = 0 included) for each workload: 1.0 is the oracle.
"""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import numpy as np

from minispec.spec_decode.adaptive import AdaptiveK

KINDS = {"zen4": [1.0, 1.29, 1.55, 1.80, 2.10], "intel-amx": [1.0, 1.02, 1.10, 1.17, 1.26]}  # v[k], k = 0..4
DRAFT_COST = 0.1


def workloads(num_requests: int) -> dict[str, list[float]]:
    """Each workload's per-request acceptance rates."""
    out = {f"alpha {a}": [a] * num_requests for a in (0.2, 0.4, 0.59, 0.75)}
    out["Beta(5.9, 4.1)"] = list(np.random.default_rng(1).beta(5.9, 4.1, num_requests))  # mean 0.59, per request
    out["0.15 / 0.7 alternating"] = [0.15 if i % 2 else 0.7 for i in range(num_requests)]
    return out


def tokens_per_cost(policy, alphas: list[float], costs: np.ndarray, fixed_k: int = 0, tokens: int = 64) -> float:
    """Emitted tokens over cost (in plain steps) of the requests run one by one under policy (None: fixed_k)."""
    rng = np.random.default_rng(0)
    emitted = spent = 0.0
    for n, alpha in enumerate(alphas):
        m = SimpleNamespace(num_spec_verifications=0, num_draft_tokens=0, num_accepted_tokens=0)
        req = SimpleNamespace(req_id=str(n), metrics=m)
        out = 0
        while out < tokens:
            k = policy([req])[0] if policy is not None else fixed_k
            accepted = 0
            while accepted < k and rng.random() < alpha:
                accepted += 1
            if k:
                m.num_spec_verifications += 1
                m.num_draft_tokens += k
                m.num_accepted_tokens += accepted
            out += accepted + 1
            emitted += accepted + 1
            spent += costs[k]
        if policy is not None:
            policy.free(req)
    return emitted / spent


def parse_setting(text: str) -> dict:
    """"decay=0.9,probe_every=4" -> AdaptiveK keyword arguments ("" -> its defaults)."""
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        out[key.strip()] = int(value) if key.strip() == "probe_every" else float(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", nargs="+", default=["decay=0.8,probe_every=8", ""],
                    help='AdaptiveK keyword arguments per row, e.g. "decay=0.9,probe_every=4" ("" = the defaults)')
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args()
    loads = workloads(args.requests)
    for kind, v in KINDS.items():
        costs = np.array([1.0] + [v[k] + k * DRAFT_COST for k in range(1, len(v))])
        k_max = len(v) - 1
        best = {name: max(tokens_per_cost(None, a, costs, k) for k in range(k_max + 1)) for name, a in loads.items()}
        print(f"{kind} (v = {v}, c = {DRAFT_COST}); best fixed k, tokens per unit cost: "
              + ", ".join(f"{n} {b:.3f}" for n, b in best.items()))
        for setting in args.settings:
            kw = parse_setting(setting)
            rel = [tokens_per_cost(AdaptiveK(k_max, draft_cost=DRAFT_COST, verify_costs=v, **kw), a, costs) / best[n]
                   for n, a in loads.items()]
            print(f"  {setting or 'defaults':24s} " + " ".join(f"{r:.3f}" for r in rel)
                  + f"   mean {np.mean(rel):.3f}, min {min(rel):.3f}")


if __name__ == "__main__":
    main()
