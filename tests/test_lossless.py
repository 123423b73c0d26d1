"""Lossless end to end: engine samples follow the target's exact token laws (chi-square tests).

A tiny random target over a 32-token vocabulary and a different tiny random draft. For each
sampling setting the engine runs N unseeded requests of one prompt (an LLM seed fixes their seeds); the counts of the
1st, 2nd and 3rd generated tokens are tested against the exact marginals, enumerated with
transformers' model: P(t1) = p(. | prompt), P(t2) = sum_x P(t1=x) p(. | prompt x), and so on.
With a draft, t1 comes from the prefill (no drafts) while t2 and t3 go through the rejection
sampler (drafts d1 and d2 of the first verification). The same counts tested against the laws of
two broken engines (every draft accepted; rejected drafts resampled from p instead of the residual)
must fail, so the tests can fail. Acceptance counts are tested against the exact acceptance
probabilities E[sum min(p, q)]. With k = 1, t3 is the bonus token whenever d1 was accepted.
Two more runs keep the laws: a token budget that skips decodes so that (sharded cache) drafts go
stale, and tp = 2 under torchrun (gloo), with skips as well. Seeded requests go through coupled
verification instead (SamplingParams.coupled): their laws, and their exact acceptance rate.
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from minispec import LLM, SamplingParams
from minispec.sample.sampler import probs_from_logits
from tests.utils import DEVICES, chi2_sf, chi2_test, make_tiny_model_dir

VOCAB = 32
PROMPT = [5, 17, 9, 3, 30, 1]
N = 6000  # requests per setting
ALPHA = 1e-3  # reject the law when p < ALPHA
NUM_TOKENS = 3
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, sampling settings, k)
SETTINGS = [
    ("T=1", dict(temperature=1.0), 3),
    ("T=1,k=1", dict(temperature=1.0), 1),  # t3 is the bonus token whenever d1 is accepted
    ("T=0.7", dict(temperature=0.7), 2),
    ("T=1.3", dict(temperature=1.3), 3),
    ("top_k=5", dict(top_k=5), 2),
    ("top_p=0.8", dict(top_p=0.8), 3),
    ("T=0.8,top_k=20,top_p=0.9", dict(temperature=0.8, top_k=20, top_p=0.9), 2),
]
TARGET_ONLY_SETTINGS = [SETTINGS[0], SETTINGS[5]]


# ---- statistics --------------------------------------------------------------------------------

def binomial_test(successes: int, n: int, prob: float) -> tuple[float, float]:
    """Two-sided normal-approximation test of successes ~ Binomial(n, prob): (z, p)."""
    z = (successes - n * prob) / math.sqrt(n * prob * (1 - prob))
    return z, math.erfc(abs(z) / math.sqrt(2))


# ---- exact laws --------------------------------------------------------------------------------

@torch.no_grad()
def next_token_probs(model, contexts: list[list[int]], params: SamplingParams) -> torch.Tensor:
    """The warped next-token distribution after each context (all of one length), float64 [num_contexts, V]."""
    logits = model(torch.tensor(contexts)).logits[:, -1].float()  # [C, V]
    c = len(contexts)
    return probs_from_logits(logits, torch.full((c,), params.temperature), torch.full((c,), params.top_k),
                             torch.full((c,), params.top_p)).double()


class ExactLaws:
    """Exact laws of the first three tokens under one setting, from target p and draft q conditionals."""

    def __init__(self, target, draft, params: SamplingParams):
        ctx2 = [PROMPT + [x] for x in range(VOCAB)]
        ctx3 = [PROMPT + [x, y] for x in range(VOCAB) for y in range(VOCAB)]
        self.p1 = next_token_probs(target, [PROMPT], params)[0]  # [V]
        self.p2 = next_token_probs(target, ctx2, params)  # [V (t1), V]
        self.q2 = next_token_probs(draft, ctx2, params)  # [V (t1), V]
        self.p3 = next_token_probs(target, ctx3, params).view(VOCAB, VOCAB, VOCAB)  # [V (t1), V (t2), V]
        self.q3 = next_token_probs(draft, ctx3, params).view(VOCAB, VOCAB, VOCAB)

    def target(self) -> list[torch.Tensor]:
        """Marginals of t1, t2, t3 under the target alone: what a lossless engine must produce."""
        return [self.p1, self.p1 @ self.p2, torch.einsum("x,xy,xyz->z", self.p1, self.p2, self.p3)]

    def accept_all_t2(self) -> torch.Tensor:
        """Law of t2 if every draft were accepted: sum_x P(t1=x) q(. | x)."""
        return self.p1 @ self.q2

    def resample_from_p_t2(self) -> torch.Tensor:
        """Law of t2 if a rejected d1 were replaced by a draw from p instead of norm(max(0, p - q))."""
        both = torch.minimum(self.p2, self.q2)  # [V, V] P(d1 = y and accepted | t1)
        return self.p1 @ (both + (1 - both.sum(-1, keepdim=True)) * self.p2)

    def coupled_acceptance(self) -> float:
        """P(d1 accepted) under coupled verification: d1 = argmax(q / E) and t2 = argmax(p / E) with one noise E,
        so P(both are y) = 1 / sum_z max(p_z / p_y, q_z / q_y) = p_y q_y / sum_z max(p_z q_y, q_z p_y)."""
        p, q = self.p2.unsqueeze(1), self.q2.unsqueeze(1)  # [V (t1), 1, V (z)]
        py, qy = self.p2.unsqueeze(2), self.q2.unsqueeze(2)  # [V (t1), V (y), 1]
        denom = torch.maximum(p * qy, q * py).sum(-1)  # [V (t1), V (y)]
        both = torch.where(denom > 0, self.p2 * self.q2 / denom.clamp_min(1e-300), 0.0)  # [V (t1), V (y)]
        return float(self.p1 @ both.sum(-1))

    def acceptance(self) -> tuple[float, float]:
        """P(d1 accepted) and P(d1 and d2 accepted) in the first verification."""
        a2 = torch.minimum(self.p2, self.q2)  # [V, V]
        a3 = torch.minimum(self.p3, self.q3).sum(-1)  # [V, V]
        return float(self.p1 @ a2.sum(-1)), float(torch.einsum("x,xy,xy->", self.p1, a2, a3))


# ---- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("target")), seed=3, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    # Another random model over the same vocabulary: its laws differ from the target's everywhere.
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("draft")), seed=4, vocab_size=VOCAB, num_hidden_layers=1)


@pytest.fixture(scope="module")
def hf_models(target_dir, draft_dir):
    load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()  # noqa: E731
    return load(target_dir), load(draft_dir)


@pytest.fixture(scope="module")
def engines(target_dir, draft_dir):
    """One LLM per k (with the draft; 0: target only) and LLM settings (device=...), built on first use."""
    cache = {}

    def get(k: int, **kwargs) -> LLM:
        key = (k, tuple(sorted(kwargs.items())))
        if key not in cache:
            draft = dict(draft=draft_dir, num_speculative_tokens=k) if k else {}
            cache[key] = LLM(target=target_dir, **dict(dict(max_num_seqs=256, max_num_batched_tokens=4096), **kwargs),
                             **draft)
        return cache[key]

    return get


def sample_counts(llm: LLM, settings: dict, seed0: int | None = None):
    """Run N requests of PROMPT for NUM_TOKENS tokens; counts [NUM_TOKENS, V] and the outputs. seed0: seeded requests
    (SamplingParams.coupled), else unseeded ones (the rejection sampler), whose seeds the LLM's seed fixes."""
    params = [SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, seed=None if seed0 is None else seed0 + i,
                             **settings) for i in range(N)]
    outs = llm.generate([PROMPT] * N, params)
    return counts_of([o.token_ids for o in outs]), outs


def counts_of(token_ids: list[list[int]]) -> torch.Tensor:
    """Counts [NUM_TOKENS, V] of each generated position over the requests."""
    tokens = torch.tensor(token_ids)  # [num_requests, NUM_TOKENS]
    assert tokens.shape == (len(token_ids), NUM_TOKENS)
    return torch.stack([torch.bincount(tokens[:, j], minlength=VOCAB) for j in range(NUM_TOKENS)])  # [3, V]


def check_marginals(label: str, counts: torch.Tensor, laws: list[torch.Tensor]) -> None:
    for j, (c, law) in enumerate(zip(counts, laws)):
        stat, dof, p, impossible = chi2_test(c, law)
        print(f"\n[lossless] {label} t{j + 1}: chi2={stat:.2f} dof={dof} p={p:.4f}", end="")
        assert impossible == 0, f"{label} t{j + 1}: {impossible} samples of zero-probability tokens"
        assert p >= ALPHA, f"{label} t{j + 1}: chi2={stat:.2f} dof={dof} p={p:.2e} < {ALPHA}"


# ---- tests -------------------------------------------------------------------------------------

def test_chi2_sf_matches_closed_forms():
    for x in (0.5, 3.0, 12.0, 40.0):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-9)
        assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, settings, k", SETTINGS, ids=[s[0] for s in SETTINGS])
def test_speculative_sampling_matches_target_law(engines, hf_models, name, settings, k, device):
    idx = [s[0] for s in SETTINGS].index(name)
    exact = ExactLaws(*hf_models, SamplingParams(**settings))
    counts, outs = sample_counts(engines(k, device=device, seed=1_000_000 * (idx + 1)), settings)
    check_marginals(f"draft k={k} {name} {device}", counts, exact.target())

    # The same t2 counts reject the laws of two broken engines: the test above can fail.
    for key, law in (("accept-all", exact.accept_all_t2()), ("resample-from-p", exact.resample_from_p_t2())):
        stat, dof, p, _ = chi2_test(counts[1], law)
        print(f"\n[lossless] draft k={k} {name} t2 vs {key} law: chi2={stat:.2f} dof={dof} p={p:.2e}", end="")
        assert p < ALPHA, f"{name}: the {key} engine's t2 law is not rejected (p={p:.3g})"

    # Acceptance in the first verification. A request that accepts d1 there has all 3 tokens and
    # finishes after one verification; one that rejects d1 needs a second.
    a1, a12 = exact.acceptance()
    first = [o for o in outs if o.metrics["num_spec_verifications"] == 1]
    accepted_two = sum(o.metrics["accepted_per_position"][1] for o in first) if k > 1 else 0
    assert all(o.metrics["num_spec_verifications"] in (1, 2) and o.metrics["num_stale_drafts"] == 0 for o in outs)
    for what, got, prob in (("d1", len(first), a1), ("d1,d2", accepted_two, a12))[:k]:
        z, p = binomial_test(got, N, prob)
        print(f"\n[lossless] draft k={k} {name} P({what} accepted): exact={prob:.4f} "
              f"observed={got / N:.4f} z={z:+.2f} p={p:.4f}", end="")
        assert p >= ALPHA, f"{name}: P({what} accepted) exact {prob:.4f}, observed {got / N:.4f} (z={z:.2f})"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, settings, k", TARGET_ONLY_SETTINGS, ids=[s[0] for s in TARGET_ONLY_SETTINGS])
def test_target_only_sampling_matches_target_law(engines, hf_models, name, settings, k, device):
    exact = ExactLaws(*hf_models, SamplingParams(**settings))
    idx = [s[0] for s in TARGET_ONLY_SETTINGS].index(name)
    counts, _ = sample_counts(engines(0, device=device, seed=100_000_000 + 1_000_000 * idx), settings)
    check_marginals(f"target-only {name} {device}", counts, exact.target())
    # And not the draft's law: sanity of the statistic on t1, which the prefill samples from p.
    stat, dof, p, _ = chi2_test(counts[0], next_token_probs(hf_models[1], [PROMPT], SamplingParams(**settings))[0])
    print(f"\n[lossless] target-only {name} t1 vs draft law: chi2={stat:.2f} dof={dof} p={p:.2e}", end="")
    assert p < ALPHA


COUPLED_SETTINGS = [SETTINGS[0], SETTINGS[6]]


@pytest.mark.parametrize("name, settings, k", COUPLED_SETTINGS, ids=[s[0] for s in COUPLED_SETTINGS])
def test_coupled_sampling_matches_target_law(engines, hf_models, name, settings, k):
    """Seeded requests (coupled verification): the target's laws, and d1 accepted at the coupled rate, which the
    rejection sampler's rate sum_x min(p, q) would fail (the draft draws with the target's noise)."""
    exact = ExactLaws(*hf_models, SamplingParams(**settings))
    idx = [s[0] for s in COUPLED_SETTINGS].index(name)
    counts, outs = sample_counts(engines(k), settings, seed0=300_000_000 + 1_000_000 * idx)
    check_marginals(f"coupled k={k} {name}", counts, exact.target())
    got = sum(o.metrics["num_spec_verifications"] == 1 for o in outs)
    for what, prob, holds in (("coupled", exact.coupled_acceptance(), True), ("rejection", exact.acceptance()[0], False)):
        z, p = binomial_test(got, N, prob)
        print(f"\n[lossless] coupled k={k} {name} P(d1 accepted) vs {what} rate {prob:.4f}: observed={got / N:.4f} "
              f"z={z:+.2f} p={p:.2e}", end="")
        assert (p >= ALPHA) == holds, f"{name}: P(d1 accepted) {got / N:.4f} against the {what} rate {prob:.4f}"


def test_skips_and_stale_drafts_keep_the_target_law(engines, hf_models):
    """A token budget of 200 for 64 running requests (prefills of 6 tokens, decodes of 3): skipped requests
    keep their drafts, and with a sharded cache their rows go to the requests drafting in their place, so
    many drafts go stale (drawn from the request's own q, while the row now holds another request's). Stale drafts are rejected and
    their tokens drawn from p: the laws stay the target's."""
    settings = dict(temperature=1.0)
    exact = ExactLaws(*hf_models, SamplingParams(**settings))
    # without prefix caching: the requests share one prompt, and its reuse would leave 1-token prefills, no pressure
    llm = engines(2, max_num_seqs=64, max_num_batched_tokens=200, shard_draft_logits=True, seed=500_000_000,
                  enable_prefix_caching=False)
    counts, outs = sample_counts(llm, settings)
    check_marginals("draft k=2 skips + stale", counts, exact.target())
    stale = sum(o.metrics["num_stale_drafts"] for o in outs)
    drafted = sum(o.metrics["num_draft_tokens"] for o in outs)
    accepted = sum(o.metrics["num_accepted_tokens"] for o in outs)
    print(f"\n[lossless] skips + stale: {stale} of {drafted} drafts stale, {accepted} accepted", end="")
    assert 0.2 * drafted < stale < 0.8 * drafted and accepted > 0.1 * drafted


# (name, settings, k, fused): T = 1 drafts through HeadRunner.sampled's one C++ call and through the Python loop
HEAD_SETTINGS = [(*SETTINGS[0], True), (*SETTINGS[6], True), (*SETTINGS[0], False)]
HEAD_IDS = ["T=1", SETTINGS[6][0], "T=1,loop"]


@pytest.mark.parametrize("name, settings, k, fused", HEAD_SETTINGS, ids=HEAD_IDS)
def test_head_sampling_matches_target_law(target_dir, hf_models, name, settings, k, fused):
    """An EAGLE-3 head drafting over 20 of the 32 tokens (q = 0 on the others) keeps the target's laws; at T = 1 it
    stops drafting where its probability of the drafts falls below 0.1 (HeadProposer.min_confidence), through
    HeadRunner.sampled's one C++ call (16 requests x 6 prompt positions fit the fused forward) where the build has one,
    and through the Python loop (fused off)."""
    from minispec.layers.attention import fused_max_tokens
    from minispec.models.loader import load_model
    from minispec.tools.tiny import make_tiny_head

    target = load_model(target_dir, dtype=torch.float32, device=torch.device("cpu"))
    head = make_tiny_head(target.config, version=3, draft_vocab_size=20, seed=7)
    idx = HEAD_SETTINGS.index((name, settings, k, fused))
    llm = LLM(target, draft=head, num_speculative_tokens=k, max_num_seqs=16, max_num_batched_tokens=4096,
              seed=700_000_000 + 1_000_000 * idx)
    gated = name == "T=1"
    if gated:
        llm.engine.proposer.min_confidence = 0.1
    llm.engine.proposer.fused_sampled = fused
    runner, ran = llm.engine.proposer.runner, []  # per HeadRunner.sampled call: whether it drafted

    def sampled(*args, run=runner.sampled):
        out = run(*args)
        ran.append(out is not None)
        return out

    runner.sampled = sampled
    exact = ExactLaws(*hf_models, SamplingParams(**settings))
    counts, outs = sample_counts(llm, settings)
    label = f"head k={k} {name}" + (" gated" if gated else "") + ("" if fused else " loop")
    check_marginals(label, counts, exact.target())
    if gated and fused and fused_max_tokens() >= 16 * len(PROMPT):  # T = 1: a plain softmax, HeadRunner.sampled's
        assert sum(ran) > 0.9 * len(ran) > 0
    accepted = sum(o.metrics["num_accepted_tokens"] for o in outs)
    drafted = sum(o.metrics["num_draft_tokens"] for o in outs)
    verifications = sum(o.metrics["num_spec_verifications"] for o in outs)
    assert drafted >= N and 0 < accepted < drafted
    if gated:  # the gate cut some proposals short
        assert drafted < k * verifications


def test_tp2_sampling_matches_target_law(target_dir, draft_dir, hf_models, tmp_path):
    """tp = 2 under torchrun (gloo): vocabulary-sharded logits, batch-sharded verification and a sharded draft-logits
    cache; a budget that skips decodes, so drafts also go stale across ranks. N / 2 requests (two processes on
    a 2-core machine are slow)."""
    settings = dict(temperature=0.9, top_k=20)
    cfg = dict(target=target_dir, draft=draft_dir, k=2, prompt=PROMPT, n=N // 2, seed=700_000_000, settings=settings,
               max_tokens=NUM_TOKENS, llm=dict(max_num_seqs=64, max_num_batched_tokens=200),
               out=str(tmp_path / "tp2.json"))
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", MINISPEC_DIST_TIMEOUT="120")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(ROOT, "tests", "dist_scripts", "lossless_tp.py"), str(tmp_path / "cfg.json")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads((tmp_path / "tp2.json").read_text())
    check_marginals("tp=2 draft k=2 T=0.9,top_k=20", counts_of(result["tokens"]),
                    ExactLaws(*hf_models, SamplingParams(**settings)).target())
    stale = sum(m["num_stale_drafts"] for m in result["metrics"])
    print(f"\n[lossless] tp=2: {stale} stale drafts", end="")
