"""The playground: a smoke sweep on tiny models (files, columns, plots, consistent numbers), AdaptiveK's
rule and its request tracking, settings parsing, prompt sets."""
import csv
import inspect
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from minispec import LLM, SamplingParams
from minispec.playground.__main__ import main
from minispec.playground.config import load_config, parse_list
from minispec.spec_decode.adaptive import AdaptiveK, expected_tokens
from minispec.spec_decode.costs import fit_verify_ratios
from minispec.tools.metrics import alpha_mle
from minispec.tools.prompts import load_prompt_set
from tests.utils import make_tiny_model_dir, requires_smollm2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, target_dir, draft_dir):
    out = tmp_path_factory.mktemp("playground")
    rc = main([
        "--config", os.path.join(ROOT, "configs", "playground-smoke.toml"), "--out", str(out),
        "--target", target_dir, "--draft", f"{draft_dir},{target_dir},ngram", "--k", "1,3",
        "--temperature", "0,0.8", "--num-prompts", "3", "--max-tokens", "16", "--cost-repeats", "2", "--no-progress",
    ])
    assert rc == 0
    with open(out / "results.json") as f:
        result = json.load(f)
    return out, result


def test_sweep_writes_every_file(sweep):
    out, result = sweep
    for name in ("results.csv", "results.json", "summary.md", "acceptance_by_position.png", "tau_vs_k.png",
                 "speedup_vs_k.png", "beta_hist.png"):
        assert (out / name).is_file(), name
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == PNG_MAGIC
    summary = (out / "summary.md").read_text()
    for png in ("acceptance_by_position.png", "tau_vs_k.png", "speedup_vs_k.png", "beta_hist.png"):
        assert f"]({png})" in summary
    # 2 temperatures x (target-only + 3 drafts x (k = 1, 3 fixed + adaptive at k = 3))
    assert len(result["rows"]) == 2 * (1 + 3 * 3)
    assert {"torch_version", "cpu", "threads"} <= set(result["env"])
    assert result["settings"]["k"] == [1, 3] and result["settings"]["temperature"] == [0.0, 0.8]
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(result["rows"])
    for col in ("draft", "policy", "k", "temperature", "top_p", "prompt_set", "batch_size", "alpha", "tau",
                "tau_theory", "beta_mean", "tokens_per_s", "speedup", "c", "verify_ratio", "predicted_speedup",
                "accept_pos_1", "accept_pos_3", "beta_hist", "torch_version", "cpu", "threads"):
        assert col in rows[0], col


def test_sweep_numbers_are_consistent(sweep):
    _, result = sweep
    rows = result["rows"]
    baselines = {(r["temperature"], r["top_p"]): r for r in rows if r["draft"] == "none"}
    assert len(baselines) == 2
    for r in baselines.values():  # target-only ran before and after the speculative runs
        assert r["tokens_per_s"] == pytest.approx((r["baseline_tokens_per_s_first"] + r["baseline_tokens_per_s_last"]) / 2)
        assert r["baseline_drift"] == pytest.approx(r["baseline_tokens_per_s_last"] / r["baseline_tokens_per_s_first"])
    for r in rows:
        assert r["num_generated"] == 3 * 16  # ignore_eos: every run generates the same number of tokens
        if r["draft"] == "none":
            continue
        rates = r["accept_rate_by_position"]
        assert len(rates) == r["k"]
        # tau counts emitted tokens: max_tokens may cut a request's last accepted run (at most 3 cuts).
        nd = r["num_spec_verifications"]
        assert r["tau"] == pytest.approx(r["num_emitted_tokens"] / nd if nd else 1.0, abs=1e-9)
        assert 1 + sum(rates) - (3 / nd if nd else 0) - 1e-9 <= r["tau"] <= 1 + sum(rates) + 1e-9
        assert all(a >= b for a, b in zip(rates, rates[1:]))  # accepting j + 1 means accepting j
        assert 0 <= r["num_accepted_tokens"] <= r["num_draft_tokens"] <= r["num_spec_verifications"] * r["k"]
        drafted = r["num_draft_tokens"]
        assert r["acceptance_rate"] == pytest.approx(r["num_accepted_tokens"] / drafted if drafted else 0.0)
        if r["policy"] == "fixed":  # the i.i.d. MLE from the run's counters (fixed k only)
            counts = {"num_accepted_tokens": r["num_accepted_tokens"], "num_spec_verifications": r["num_spec_verifications"],
                      "accepted_per_position": [round(a * r["num_spec_verifications"]) for a in rates],
                      "num_tokens": r["num_generated"], "num_requests": 3}
            assert r["alpha"] == pytest.approx(alpha_mle(counts))
        else:
            assert r["alpha"] is None
        assert r["beta_count"] == sum(r["beta_hist"])
        if drafted == 0:  # adaptive k found drafting not worth it on this machine, or n-gram lookup never matched
            assert r["policy"] == "adaptive" or r["draft_label"] == "ngram"
        else:
            assert r["beta_count"] > 0
            assert 0.0 <= r["beta_min"] <= r["beta_mean"] <= r["beta_max"] <= 1.0 + 1e-6
        assert sum(r["k_counts"]) + 3 == r["num_verifications"]
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / baselines[(r["temperature"], r["top_p"])]["tokens_per_s"])
        if r["policy"] == "fixed":
            assert r["k_counts"][r["k"]] == sum(r["k_counts"])
            assert r["tau_theory"] == pytest.approx(expected_tokens(r["alpha"], r["k"]))
            assert r["predicted_speedup"] == pytest.approx(r["tau_theory"] / (r["k"] * r["c"] + r["verify_ratio_fit"]))
        if r["draft_label"] == "target (self)" and drafted:  # adaptive k never drafts with it: c = 1 cannot pay
            # The target drafting for itself: p = q up to float rounding, every draft accepted (the metrics count
            # those emitted: max_tokens may cut the last run of each of the 3 requests).
            assert r["num_draft_tokens"] - r["num_accepted_tokens"] <= 3 * (r["k"] - 1)
            assert r["beta_min"] >= 1.0 - 1e-5
            if r["policy"] == "fixed":
                assert r["alpha"] == 1.0
                assert r["k"] + 1 - 3 * r["k"] / r["num_spec_verifications"] <= r["tau"] <= r["k"] + 1  # k + 1 but cut runs
        if r["draft"] == "ngram":
            assert r["c"] > 0  # how small a fraction of a forward a lookup costs is a speed figure (the bench's)


def test_fit_verify_ratios():
    fit = fit_verify_ratios([1.33, 1.62, 1.24, 1.34, 1.36, 1.44])
    assert all(b >= a for a, b in zip(fit, fit[1:])) and fit[0] >= 1.0
    assert np.mean(fit) == pytest.approx(np.mean([1.33, 1.62, 1.24, 1.34, 1.36, 1.44]))
    assert fit_verify_ratios([1.5, 1.2, 1.1]) == pytest.approx([1.2667] * 3, abs=1e-3)  # no negative slope
    assert fit_verify_ratios([0.8, 0.9]) == [1.0, 1.0]
    assert fit_verify_ratios([1.0, 2.0, 3.0]) == pytest.approx([1.0, 2.0, 3.0])
    assert fit_verify_ratios([1.2, 2.0], [1, 5], 5) == pytest.approx([1.2, 1.4, 1.6, 1.8, 2.0])  # two ends


def test_adaptive_choose_maximises_tokens_per_cost():
    v = [1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    pol = AdaptiveK(5, draft_cost=0.1, verify_costs=v)
    for alpha in np.linspace(0.0, 1.0, 21):
        rates = [1.0] + [expected_tokens(alpha, k) / (0.1 * k + v[k]) for k in range(1, 6)]
        best = int(np.argmax(rates[1:])) + 1
        assert pol.choose(alpha) == (best if rates[best] > 1.0 else 0)
    assert pol.choose(0.0) == 0
    assert pol.choose(1.0) == 5  # every draft accepted: k + 1 tokens for 1.1 k + 1 cost grows with k
    free = AdaptiveK(4)  # free drafts and verification: always the longest
    assert free.choose(0.05) == 4
    assert expected_tokens(1.0, 3) == 4.0 and expected_tokens(0.0, 3) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    with pytest.raises(ValueError, match="verify_costs"):
        AdaptiveK(3, verify_costs=[1.0, 1.0])


def _fake_request(req_id):
    metrics = SimpleNamespace(num_spec_verifications=0, num_draft_tokens=0, num_accepted_tokens=0)
    return SimpleNamespace(req_id=req_id, metrics=metrics, params=SimpleNamespace(seed=None))


def _verify(req, drafted, accepted):
    req.metrics.num_spec_verifications += 1
    req.metrics.num_draft_tokens += drafted
    req.metrics.num_accepted_tokens += accepted


def test_adaptive_tracks_each_request():
    pol = AdaptiveK(4, draft_cost=0.05, verify_costs=[1.0, 1.1, 1.2, 1.3, 1.4], decay=0.7, probe_every=3)
    good, bad = _fake_request("a"), _fake_request("b")
    k_good, k_bad = pol([good])[0], pol([bad])[0]
    assert k_good == k_bad > 0  # both start from the prior
    for _ in range(10):
        _verify(good, k_good, k_good)  # everything accepted
        (k_good,) = pol([good])
        if k_bad:
            _verify(bad, k_bad, 0)  # nothing accepted
        (k_bad,) = pol([bad])
    assert k_good == 4 and pol.alpha("a") > 0.9
    assert pol.alpha("b") < 0.2
    # Switched off, the policy probes with one draft every probe_every steps.
    ks = []
    for _ in range(6):
        if k_bad:
            _verify(bad, k_bad, 0)
        (k_bad,) = pol([bad])
        ks.append(k_bad)
    assert ks.count(1) >= 1 and ks.count(0) >= 4
    # Together they get one k: the good request's tokens pay for drafting for both.
    both = pol([good, bad])
    assert both[0] == both[1] > 0
    assert pol.choose([pol.alpha("a"), pol.alpha("b")]) == both[0]
    # A truncated run counts one failure: 2 of 4 accepted -> 2 successes in 3 trials.
    fresh = AdaptiveK(4, decay=1.0, prior_weight=1e-9)
    r = _fake_request("c")
    fresh([r])
    _verify(r, 4, 2)
    fresh([r])
    assert fresh.alpha("c") == pytest.approx(2 / 3)
    # A new request reusing an id starts afresh.
    r2 = _fake_request("c")
    fresh([r2])
    assert fresh.states["c"].req is r2 and fresh.alpha("c") == pytest.approx(fresh.prior()) == pytest.approx(2 / 3)
    # Off, it probes with one draft after probe_every steps, then waits twice as long after each failed probe.
    off = AdaptiveK(4, draft_cost=0.3, verify_costs=[1.0, 1.5, 2.0, 2.5, 3.0], probe_every=3, prior_alpha=0.0)
    x, ks = _fake_request("x"), []
    for _ in range(21):
        (k,) = off([x])
        ks.append(k)
        if k:
            _verify(x, k, 0)
    assert [i for i, k in enumerate(ks) if k] == [2, 8, 20]
    # Where even a draft always accepted could not pay (k + 1 tokens for k * 0.5 + v[k] = k + 1 steps), no probes.
    never = AdaptiveK(4, draft_cost=0.5, verify_costs=[1.0, 1.5, 2.0, 2.5, 3.0], probe_every=3, prior_alpha=0.0)
    y = _fake_request("y")
    assert not never.can_pay(never.forward_costs(1)) and off.can_pay(off.forward_costs(1))
    assert [never([y])[0] for _ in range(21)] == [0] * 21
    # Nor where only drafts accepted more often than probe_alpha could: 4 drafts pay at alpha 1 (5 tokens for
    # 4.8 steps), none at 0.9 (4.1 tokens at best for k = 4, 1.9 for 2.2 steps at k = 1).
    costly = [1.0, 2.2, 3.1, 3.9, 4.8]
    assert AdaptiveK(4, verify_costs=costly, probe_alpha=1.0).can_pay(np.array(costly))
    rare = AdaptiveK(4, verify_costs=costly, probe_every=3, prior_alpha=0.0)
    z = _fake_request("z")
    assert not rare.can_pay(rare.forward_costs(1)) and [rare([z])[0] for _ in range(21)] == [0] * 21
    # A new request starts from the pooled acceptance of the requests seen so far.
    assert off.prior() == pytest.approx(0.0) and off.alpha("new") == pytest.approx(0.0)
    assert pol.prior() == pytest.approx(pol.pool[0] / pol.pool[1]) and 0.0 < pol.prior() < 1.0
    # Asked for drafts but verified none (an n-gram miss): one failed run.
    miss = AdaptiveK(4, decay=1.0, prior_weight=1e-9)
    r3 = _fake_request("m")
    assert miss([r3]) == [4]
    miss([r3])
    assert miss.alpha("m") == pytest.approx(0.0, abs=1e-6)
    assert pol.counts.sum() == 2 * 11 + 6 + 2
    assert 0 < pol.mean_k() < 4


def test_adaptive_prices_the_drafts_catch_up_into_its_probes():
    """A probe makes the draft read every position it skipped (num_computed - num_draft_computed): with catch_up_cost
    that reading, spread over probe_every steps, must be payable too. At acceptance 0.9 drafting pays alone (k = 4:
    4.1 tokens for 3 steps); 300 pending positions at 0.02 steps each add 6 / 3 = 2 steps to every k (4.1 tokens for
    5): no probe, and once the draft has caught up (9 pending: 0.06 steps) the probes come back."""
    costs = [1.0, 1.5, 2.0, 2.5, 3.0]
    plain = AdaptiveK(4, verify_costs=costs, probe_every=3, prior_alpha=0.0)
    priced = AdaptiveK(4, verify_costs=costs, probe_every=3, prior_alpha=0.0, catch_up_cost=lambda b: 0.02)
    reqs = [_fake_request(i) for i in range(3)]
    for r in reqs:
        r.num_computed, r.num_draft_computed = 120, 20  # 100 positions each the draft has not read
    assert plain.catch_up(reqs) == 0.0 and priced.catch_up(reqs) == pytest.approx(2.0)
    assert [plain(reqs)[0] for _ in range(9)].count(1) >= 1
    assert [priced(reqs)[0] for _ in range(9)] == [0] * 9
    for r in reqs:
        r.num_draft_computed = 117  # caught up but for 3 positions each
    assert [priced(reqs)[0] for _ in range(9)].count(1) >= 1


def test_gated_policy_gives_a_lone_request_k_max_and_a_batch_its_estimate():
    """gated (the head cuts its own drafts): a lone request drafts k_max whatever its running acceptance, wherever
    drafting can pay at all (at probe_alpha 0.9), and never where it cannot; two requests get the estimate's k."""
    cheap, dear = [1.0, 1.2, 1.4, 1.6, 1.8], [1.0, 3.0, 5.0, 7.0, 9.0]  # k = 4 at 0.9 pays: 4.1 tokens; dear: not
    gated = AdaptiveK(4, verify_costs=cheap, prior_alpha=0.05, gated=True)
    plain = AdaptiveK(4, verify_costs=cheap, prior_alpha=0.05)
    one, two = [_fake_request(0)], [_fake_request(1), _fake_request(2)]
    assert [gated(one)[0] for _ in range(6)] == [4] * 6
    assert [plain(one)[0] for _ in range(2)] == [0, 0]  # acceptance 0.05: the estimate turns drafting off
    assert gated(two) == [0, 0]
    assert [AdaptiveK(4, verify_costs=dear, gated=True)(one)[0] for _ in range(3)] == [0] * 3


def test_adaptive_batch_choice_and_measured_overhead():
    """One k for the batch maximises summed expected tokens per step cost; the step overhead measured in
    the engine's steps (speculative over plain) scales the cost of drafting and can turn it off."""
    v = [1.0, 1.1, 1.2, 1.3, 1.4]
    pol = AdaptiveK(4, draft_cost=0.1, verify_costs=v)
    alphas = [0.9, 0.1, 0.1]
    tokens = [sum(expected_tokens(a, k) for a in alphas) for k in range(5)]
    rates = [tokens[0]] + [tokens[k] / (0.1 * k + v[k]) for k in range(1, 5)]
    best = int(np.argmax(rates[1:])) + 1
    assert pol.choose(alphas) == (best if rates[best] > rates[0] else 0) > 0
    assert pol.overhead(3) == 1.0  # nothing measured yet
    # Speculative steps spend 50% of their time outside the forwards, plain ones 10%.
    for _ in range(20):
        pol.observe_step(3, True, 1.5, 1.0)
        pol.observe_step(3, False, 1.1, 1.0)
    assert pol.overhead(3) == pytest.approx(1.5 / 1.1)
    assert pol.overhead(4) == pytest.approx(1.5 / 1.1)  # same power-of-two bucket
    assert pol.overhead(1) == 1.0  # another bucket: its own measurements
    assert list(pol.costs(3)) == pytest.approx([1.0] + [(0.1 * k + v[k]) * 1.5 / 1.1 for k in range(1, 5)])
    assert pol.choose([0.4, 0.4, 0.4]) == 0  # paid before, not with this overhead
    assert AdaptiveK(4, draft_cost=0.1, verify_costs=v).choose([0.4, 0.4, 0.4]) > 0
    # Only speculative steps measured: plain steps count as overhead-free (the cautious side).
    spec_only = AdaptiveK(4)
    spec_only.observe_step(2, True, 1.2, 1.0)
    assert spec_only.overhead(2) == pytest.approx(1.2)
    spec_only.observe_step(2, False, 2.0, 1.0)  # plain steps costlier than speculative ones: no discount
    assert spec_only.overhead(2) == 1.0


def test_adaptive_in_engine_is_lossless(target_dir, draft_dir):
    prompts = [[5, 17, 99, 3], [200, 1, 42, 42, 7, 8, 9, 10], list(range(30, 52))]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = [o.token_ids for o in LLM(target=target_dir, max_num_seqs=3).generate(prompts, params)]
    llm = LLM(target=target_dir, draft=draft_dir, num_speculative_tokens=3, max_num_seqs=3)
    pol = AdaptiveK(3, draft_cost=0.2, verify_costs=[1.0, 1.05, 1.1, 1.15], prior_alpha=0.9)
    llm.engine.k_policy = pol
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
    assert pol.counts.sum() > 0 and not pol.states  # each finished request's state was freed
    for o in outs:
        m = o.metrics
        assert m["num_accepted_tokens"] <= m["num_draft_tokens"] <= 3 * m["num_spec_verifications"]


def test_measured_costs_drive_adaptive_k(target_dir):
    """LLM(adaptive_k=True): costs measured per power-of-two batch bucket on the engine's own models. The
    target as its own draft costs as much as the target (c ~ 1), so speculation never pays: k = 0 except
    for the periodic one-token probes, and the output is still target-only greedy."""
    from minispec.spec_decode.costs import MeasuredCosts

    prompts = [[5, 17, 99, 3], [200, 1, 42, 42, 7, 8, 9, 10], list(range(30, 52))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = [o.token_ids for o in LLM(target=target_dir, max_num_seqs=4).generate(prompts, params)]
    llm = LLM(target=target_dir, draft=target_dir, num_speculative_tokens=3, max_num_seqs=4, adaptive_k=True)
    pol = llm.engine.k_policy
    costs = pol.cost_model
    assert isinstance(costs, MeasuredCosts)
    assert [costs.bucket(b) for b in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, 4]
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    assert set(costs.table) <= {1, 2, 4} and 4 in costs.table
    c, verify = costs.table[4]
    assert c > 0.5 and len(verify) == 4 and verify[0] == 1.0 and min(verify) >= 1.0
    assert pol.overhead(4) >= 1.0  # measured in the engine's own steps
    assert list(pol.costs(4)) == pytest.approx([1.0] + [(k * c + verify[k]) * pol.overhead(4) for k in (1, 2, 3)])
    assert pol.counts[0] > pol.counts[1:].sum()  # off but for the probes
    assert costs.catch_up(4) == 0.0  # a draft model: its catch-up counts as free


def test_costs_are_measured_before_serving(target_dir, draft_dir, monkeypatch):
    """LLM(adaptive_k=True) measures every batch-size bucket when it is built; no step measures: with
    CostBench.measure failing once the LLM exists, batches of every size up to max_num_seqs still run."""
    from minispec.spec_decode import costs as costs_module

    llm = LLM(target=target_dir, draft=draft_dir, num_speculative_tokens=2, max_num_seqs=5, adaptive_k=True)
    costs = llm.engine.k_policy.cost_model
    assert set(costs.table) == {1, 2, 4, 5} and costs.measure_s > 0

    def measure_in_a_step(*args, **kwargs):
        raise AssertionError("a step measured costs")

    monkeypatch.setattr(costs_module.CostBench, "measure", measure_in_a_step)
    prompts = [[5, 17, 99, 3], [200, 1, 42], list(range(30, 40)), [7, 7, 7], [1, 2, 3, 4, 5]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for n in (1, 2, 3, 5):
        assert all(len(o.token_ids) == 6 for o in llm.generate(prompts[:n], params))


def test_cost_bench_makes_rank0s_number_of_calls(target_dir, monkeypatch):
    """Under TP every forward is collective, so how many calls a timer batches must not come from this rank's own
    (noisy) warm-up: it comes from rank 0's, broadcast. A fake two-rank group whose broadcast says each warm-up took
    a second (one call per sample) meets a fast local model: each timer still runs exactly 1 + repeats calls."""
    from minispec import distributed
    from minispec.models.loader import load_model
    from minispec.spec_decode import costs as costs_module

    class TwoRanks(distributed.TPGroup):
        def broadcast(self, x, src=0):
            return x.fill_(1.0)  # rank 0's warm-up times: one second each

    model = load_model(target_dir, dtype=torch.float32, device="cpu").model
    bench = costs_module.CostBench(model, {"draft": "ngram"}, 2, 2, 16, model.vocab_size, torch.float32, "cpu")
    steps = []
    monkeypatch.setattr(bench.target, "step", lambda b, n: steps.append(n))
    monkeypatch.setattr(costs_module, "get_tp_group", lambda: TwoRanks(world_size=2))
    bench.measure(2, repeats=3)
    # target, verify1, verify2: 1 + 3 calls each, and a 1-token forward before each of the draft's 1 + 3 samples
    assert sorted(steps) == sorted([1] * 4 + [2] * 4 + [3] * 4 + [1] * 4)


def test_cost_bench_ratios_are_medians_of_each_rounds_ratio(target_dir, monkeypatch):
    """A ratio pairs the samples of one round (a slow phase of the host slows both): the median of the rounds'
    ratios past the warm-up, not the ratio of the fastest samples; the times stay the fastest."""
    from minispec.models.loader import load_model
    from minispec.spec_decode import costs as costs_module

    model = load_model(target_dir, dtype=torch.float32, device="cpu").model
    bench = costs_module.CostBench(model, {}, 1, 1, 16, model.vocab_size, torch.float32, "cpu")
    fed = []
    monkeypatch.setattr(bench.target, "step", lambda b, n: fed.append(n))
    samples = {1: iter([50.0, 10.0, 20.0, 11.0]), 2: iter([50.0, 12.0, 26.0, 14.3])}  # warm-up, then 3 rounds

    def fake_time(fn, n):
        fn()
        return samples[fed[-1]].__next__()

    monkeypatch.setattr(costs_module, "_time", fake_time)
    out = bench.measure(1, repeats=3)
    assert out["verify_ratio"][1] == pytest.approx(1.3)  # rounds 1.2, 1.3, 1.3; the fastest samples give 1.2
    assert out["target_step_ms"] == pytest.approx(1e4) and out["verify_ms"][1] == pytest.approx(1.2e4)


def test_cost_bench_times_drafts_after_a_target_forward(target_dir, monkeypatch):
    """In generation a draft step follows the target's forward, which streams the target's weights through the caches:
    every draft sample (the warm-up and each repeat) is timed after an untimed 1-token target forward."""
    from minispec.models.loader import load_model
    from minispec.spec_decode import costs as costs_module

    model = load_model(target_dir, dtype=torch.float32, device="cpu").model
    bench = costs_module.CostBench(model, {"draft": "ngram"}, 2, 2, 16, model.vocab_size, torch.float32, "cpu")
    calls = []
    real_step = bench.target.step
    monkeypatch.setattr(bench.target, "step", lambda b, n: (calls.append(("target", n)), real_step(b, n))[1])
    real = costs_module._time_after

    def spy(fn, n, before):
        calls.append(("draft", n))
        return real(fn, n, before)

    monkeypatch.setattr(costs_module, "_time_after", spy)
    out = bench.measure(2, repeats=3)
    drafts = [i for i, c in enumerate(calls) if c[0] == "draft"]
    assert len(drafts) == 4 and all(calls[i + 1] == ("target", 1) for i in drafts) and out["c"]["draft"] > 0


def test_config_and_overrides(tmp_path):
    smoke = os.path.join(ROOT, "configs", "playground-smoke.toml")
    cfg = load_config(smoke, {"k": parse_list("k", "2,4"), "temperature": parse_list("temperature", "0,0.8"),
                              "max_tokens": 5, "seed": None})
    assert cfg.k == [2, 4] and cfg.temperature == [0.0, 0.8] and cfg.max_tokens == 5
    assert cfg.seed == 0  # None overrides leave the file's value
    assert isinstance(cfg.draft, list) and cfg.adaptive["decay"] == inspect.signature(AdaptiveK).parameters["decay"].default
    for path in ("playground-smoke.toml", "playground-smollm2.toml"):
        load_config(os.path.join(ROOT, "configs", path))
    bad = tmp_path / "bad.toml"
    bad.write_text('kk = [1]\n')
    with pytest.raises(ValueError, match="unknown key"):
        load_config(str(bad))
    with pytest.raises(ValueError, match="k"):
        load_config(None, {"k": [0]})
    with pytest.raises(ValueError, match="policy"):
        load_config(None, {"policy": "sometimes"})


def test_prompt_sets(tmp_path):
    with pytest.raises(ValueError, match="eval"):  # no list but prompts.json's
        load_prompt_set("builtin", 3)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(["one", {"prompt": "two"}]))
    assert load_prompt_set(str(path), 10)[0] == ["one", "two"]
    with pytest.raises(ValueError):
        load_prompt_set("nonsense", 3)
    prompts, desc = load_prompt_set("eval", 10)
    assert len(prompts) == 10 and len(set(prompts)) == 10 and "round-robin" in desc


@requires_smollm2
def test_sweep_with_tokenizer_and_chat_template(tmp_path):
    # String prompts through a real tokenizer and chat template (tiny weights, SmolLM2 tokenizer).
    target = make_tiny_model_dir(str(tmp_path / "target"), seed=0, with_tokenizer=True)
    out = tmp_path / "out"
    rc = main(["--out", str(out), "--target", target, "--draft", "ngram", "--k", "2", "--temperature", "0",
               "--batch-size", "2", "--num-prompts", "2", "--max-tokens", "8", "--cost-repeats", "1",
               "--cost-context", "16", "--chat", "--no-progress"])
    assert rc == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["draft"] for r in rows] == ["none", "ngram"]
    assert all(r["chat"] and r["num_generated"] == 16 for r in rows)


def test_tiny_specs(tmp_path):
    """"tiny:..." specs become seeded random checkpoints, built once per spec."""
    from minispec.tools.tiny import parse_tiny, tiny_model_dir

    spec = "tiny:seed=1,layers=1,hidden=32,heads=2,kv_heads=1,mlp=64"
    path = tiny_model_dir(spec, tmp_path)
    config = json.loads((tmp_path / os.path.basename(path) / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["max_position_embeddings"]) == (1, 32, 512)
    assert tiny_model_dir(spec, tmp_path) == path and len(os.listdir(tmp_path)) == 1
    assert parse_tiny("tiny:")["max_position_embeddings"] == 512
    with pytest.raises(ValueError, match="layers"):
        parse_tiny("tiny:layer=1")
