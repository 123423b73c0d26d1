"""Prompt-lookup (n-gram) proposer: matching rules, one-hot draft logits, greedy equality and a
chi-square check that sampling through it is lossless, on tiny random models."""
import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from minispec import LLM, SamplingParams
from minispec.distributed import TPGroup
from minispec.engine.engine import Engine
from minispec.runner.model_runner import ModelRunner
from minispec.engine.request import Request
from minispec.sample.random import RequestRandom
from minispec.sample.sampler import probs_from_logits
from minispec.spec_decode import draft_logits
from minispec.spec_decode.draft_logits import DraftLogitsCache
from minispec.spec_decode.ngram import NgramProposer, ngram_drafts
from tests.sampler_law import Request as LawRequest, exact_law, probe
from tests.utils import make_tiny_model_dir


def ngram_llm(target_dir: str, k: int, min_n: int = 1, max_n: int = 3, **llm_kwargs) -> LLM:
    """An LLM whose engine drafts with NgramProposer(k): a target-only LLM with its engine rebuilt
    around a KV cache with room for the k drafts."""
    llm = LLM(target=target_dir, **llm_kwargs)
    config = llm.engine.config  # the engine reads k from its proposer
    runner = ModelRunner(llm.target.model, config.max_num_seqs, config.max_model_len + k + 1,
                         dtype=torch.float32, device=llm.device)
    llm.engine = Engine(runner, NgramProposer(k, min_n, max_n), config, llm.target.eos_token_ids,
                        llm.target.vocab_size)
    return llm


# ---- matching ------------------------------------------------------------------------------

def brute_force(history: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Reference: for n from max_n down, scan earlier occurrences from the latest; pad with -1."""
    L = len(history)
    for n in range(max_n, min_n - 1, -1):
        for i in range(L - n - 1, -1, -1):
            if history[i : i + n] == history[L - n :]:
                follow = history[i + n : i + n + k]
                return follow + [-1] * (k - len(follow))
    return [-1] * k


def test_longest_n_wins():
    h = [1, 2, 3, 9, 9, 5, 3, 7, 7, 1, 2, 3]
    # [1, 2, 3] occurred at 0 (then 9 9 5); the latest lone 3 is at 6 (then 7 7 1).
    assert ngram_drafts([h], 3).tolist() == [[9, 9, 5]]
    assert ngram_drafts([h], 3, max_n=1).tolist() == [[7, 7, 1]]
    # [2, 3] occurs only at 1 as well, so n = 2 already finds the 3-gram's continuation.
    assert ngram_drafts([h], 3, min_n=2, max_n=2).tolist() == [[9, 9, 5]]


def test_most_recent_occurrence():
    h = [4, 5, 1, 4, 6, 2, 8, 4]
    assert ngram_drafts([h], 2).tolist() == [[6, 2]]
    h = [3, 4, 0, 3, 4, 1, 3, 4, 2, 9, 3, 4]
    assert ngram_drafts([h], 2, max_n=2).tolist() == [[2, 9]]


def test_no_match_is_all_placeholders():
    assert ngram_drafts([[1, 2, 3, 4]], 3).tolist() == [[-1, -1, -1]]
    assert ngram_drafts([[7]], 2).tolist() == [[-1, -1]]
    # Only a 1-gram repeats: min_n = 2 proposes nothing.
    h = [5, 1, 2, 5]
    assert ngram_drafts([h], 2, min_n=1).tolist() == [[1, 2]]
    assert ngram_drafts([h], 2, min_n=2).tolist() == [[-1, -1]]
    assert ngram_drafts([], 4).shape == (0, 4)


def test_partial_proposals_padded():
    assert ngram_drafts([[7, 8, 9, 7]], 4).tolist() == [[8, 9, 7, -1]]
    # A run of one token: the latest earlier match ends one before the last, one token follows it.
    assert ngram_drafts([[5, 5, 5, 5]], 3).tolist() == [[5, -1, -1]]


def test_batch_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(200):
        k = int(rng.integers(1, 6))
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 5))
        histories = [[int(t) for t in rng.integers(0, rng.integers(1, 6), rng.integers(1, 40))]
                     for _ in range(rng.integers(1, 6))]
        got = ngram_drafts(histories, k, min_n, max_n)
        assert got.dtype == np.int64 and got.shape == (len(histories), k)
        assert got.tolist() == [brute_force(h, k, min_n, max_n) for h in histories]


def test_long_history():
    rng = np.random.default_rng(1)
    h = [int(t) for t in rng.integers(0, 50_000, 2048)]
    h[1000:1004] = h[-3:] + [11]  # the only earlier occurrence of the last 3 tokens, followed by 11
    assert ngram_drafts([h, h[:1500]], 4)[0].tolist() == [11] + h[1004:1007]


def test_bad_settings():
    for kw in (dict(k=0), dict(k=2, min_n=0), dict(k=2, min_n=3, max_n=2)):
        with pytest.raises(ValueError):
            NgramProposer(**kw)


# ---- draft logits --------------------------------------------------------------------------

def make_reqs(histories, slots):
    reqs = []
    for i, (h, s) in enumerate(zip(histories, slots)):
        r = Request(f"r{i}", list(h), SamplingParams(), RequestRandom(i), i)
        r.slot = s
        reqs.append(r)
    return reqs


HISTORIES = [[1, 2, 3, 1, 2], [4, 4], [0, 1, 2], [3, 5, 3, 6, 3]]


def test_propose_writes_one_hot_logits():
    k, vocab = 3, 8
    cache = DraftLogitsCache(8, k, vocab, dtype=torch.float32, fill=0.0, device="cpu")
    reqs = make_reqs(HISTORIES, [5, 0, 2, 7])
    for r in reqs:
        r.num_draft_computed = 1
    drafts = NgramProposer(k).propose(reqs, cache, None)
    assert drafts.tolist() == [[3, 1, 2], [4, -1, -1], [-1, -1, -1], [6, 3, -1]]
    for r, d in zip(reqs, drafts):
        assert r.num_draft_computed == 1  # no draft model: left alone
        for j in range(k):
            row = cache.values[r.slot, j]
            if d[j] < 0:
                assert torch.isneginf(row).all()
            else:
                assert row[d[j]] == 0 and torch.isneginf(row).sum() == vocab - 1
    # q after any warping is one-hot at the draft.
    logits = cache.values[5]  # [k, V]
    for t, tk, tp in [(1.0, 0, 1.0), (0.3, 2, 0.5), (0.0, 0, 1.0), (2.0, 8, 0.99)]:
        q = probs_from_logits(logits, torch.full((k,), t), torch.full((k,), tk), torch.full((k,), tp))
        assert torch.equal(q, torch.nn.functional.one_hot(torch.tensor([3, 1, 2]), vocab).float())


@pytest.mark.parametrize("tp", [2, 3])
def test_sharded_cache_writes_only_own_rows(monkeypatch, tp):
    k, vocab = 3, 8
    slots = [6, 1, 3, 4]
    expected = ngram_drafts(HISTORIES, k)
    for rank in range(tp):
        monkeypatch.setattr(draft_logits, "get_tp_group", lambda: TPGroup(tp, rank))
        cache = DraftLogitsCache(8, k, vocab, dtype=torch.float32, fill=7.0, device="cpu", sharded=True)
        idx = np.array(slots, dtype=np.int32)
        cache.assign(torch.from_numpy(idx), idx)
        drafts = NgramProposer(k).propose(make_reqs(HISTORIES, slots), cache, None)
        assert np.array_equal(drafts, expected)  # every rank proposes the same drafts
        written = set()
        for i in range(len(slots)):
            if i % tp != rank:
                continue
            row = i // tp
            written.add(row)
            for j in range(k):
                want = torch.full((vocab,), float("-inf"))
                if expected[i, j] >= 0:
                    want[expected[i, j]] = 0.0
                assert torch.equal(cache.values[row, j], want)
        for row in set(range(cache.values.shape[0])) - written:
            assert (cache.values[row] == 7.0).all()


def test_one_hot_draft_is_lossless_exactly():
    """With one-hot q the sampler accepts d with probability p(d) and otherwise draws p without d:
    probed on rejection_sample (tests/sampler_law.py), every emitted token follows p."""
    g = torch.Generator().manual_seed(0)
    vocab = 6
    target = torch.randn(2, vocab, generator=g)
    draft = torch.full((2, vocab), float("-inf"))
    draft[:, 4] = 0.0  # row 0 verifies draft 4 (q one-hot at 4); row 1 is the bonus row
    req = LawRequest(target, draft, draft)
    assert req.threshold[0, 4].item() == pytest.approx(req.p[0, 4].item())
    assert not probe(req) and not probe(req, use_triton=True)
    for prefix, m in exact_law(req).items():
        torch.testing.assert_close(m / m.sum(), req.p[len(prefix)], atol=1e-6, rtol=0)


# ---- engine: greedy ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("target")), seed=0)


REPEATS = [
    [5, 17, 99, 3, 5, 17, 99, 3, 5, 17],
    [200, 1, 42, 42, 7, 8, 9, 42, 42, 7, 8, 9, 42, 42],
    [77],
    list(range(30, 52)) + list(range(30, 40)),
]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def target_greedy(target_dir):
    return [o.token_ids for o in LLM(target=target_dir, max_num_seqs=4).generate(REPEATS, GREEDY)]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_target_only(target_dir, target_greedy, k):
    llm = ngram_llm(target_dir, k, max_num_seqs=4)
    outs = llm.generate(REPEATS, GREEDY)
    assert [o.token_ids for o in outs] == target_greedy
    for o in outs:
        m = o.metrics
        assert len(m["accepted_per_position"]) == k
        assert m["num_accepted_tokens"] <= m["num_draft_tokens"] <= m["num_spec_verifications"] * k
    assert sum(o.metrics["num_spec_verifications"] for o in outs) > 0
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 0


def test_greedy_sharded_with_skips_equals_target_only(target_dir, target_greedy):
    # One decode per step: requests take turns and take each other's draft-logits rows.
    k = 3
    llm = ngram_llm(target_dir, k, max_num_seqs=2, max_num_batched_tokens=k + 1, shard_draft_logits=True)
    outs = llm.generate(REPEATS[:2], GREEDY)
    assert [o.token_ids for o in outs] == target_greedy[:2]
    assert sum(o.metrics["num_stale_drafts"] for o in outs) > 0
    for o in outs:  # a stale draft is never accepted
        m = o.metrics
        assert m["num_accepted_tokens"] <= m["num_draft_tokens"] - m["num_stale_drafts"]


def test_seeded_sampling_independent_of_batch(target_dir):
    llm = ngram_llm(target_dir, 3, max_num_seqs=4)
    sp = [SamplingParams(temperature=0.8, top_k=20, max_tokens=20, seed=50 + i, ignore_eos=True)
          for i in range(len(REPEATS))]
    together = [o.token_ids for o in llm.generate(REPEATS, sp)]
    alone = [llm.generate([p], s)[0].token_ids for p, s in zip(REPEATS, sp)]
    assert together == alone


# ---- engine: sampling is lossless ----------------------------------------------------------

VOCAB = 32


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A tiny model over 32 tokens with sharpened logits, its HF twin, and its greedy path as the
    prompt: repetitive, so the proposer drafts for nearly every request and often gets accepted."""
    path = make_tiny_model_dir(str(tmp_path_factory.mktemp("vocab32")), seed=0, vocab_size=VOCAB)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    model.save_pretrained(path)
    ids = torch.tensor([[1]])
    prompt = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=30,
                            pad_token_id=0)[0].tolist()
    return path, model, prompt


def exact_probs(model, prompt, temperature, top_k, top_p):
    """Exact target distributions: P(x1) [V], P(x1, x2) [V, V] and P(x3) [V], in float64."""

    def next_probs(seqs):
        with torch.no_grad():
            logits = model(torch.tensor(seqs)).logits[:, -1]  # [N, V]
        n = logits.shape[0]
        return probs_from_logits(logits, torch.full((n,), temperature), torch.full((n,), top_k),
                                 torch.full((n,), top_p)).double()

    p1 = next_probs([prompt])[0]  # [V]
    p2 = next_probs([prompt + [a] for a in range(VOCAB)])  # [V, V] row x1
    p3 = next_probs([prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)])  # [V * V, V]
    joint12 = p1[:, None] * p2  # [V, V]
    return p1, joint12, joint12.reshape(-1) @ p3


def chi2_ok(counts: np.ndarray, probs: torch.Tensor, min_expected: float = 5.0) -> bool:
    """Pearson test at p = 1e-4 (Wilson-Hilferty quantile); cells expecting fewer than min_expected
    counts are pooled into one; any count on a zero-probability cell fails."""
    counts = torch.from_numpy(counts.reshape(-1)).double()
    probs = probs.reshape(-1)
    if counts[probs == 0].sum() > 0:
        return False
    expected = probs * counts.sum()
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)])
    exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    df = obs.numel() - 1
    if df < 1:
        return True
    stat = (((obs - exp) ** 2) / exp).sum().item()
    c = 2.0 / (9.0 * df)
    return stat < df * (1.0 - c + 3.719 * math.sqrt(c)) ** 3


def sample_three(llm, prompt, n, temperature, top_k, top_p, coupled=False):
    """The first three tokens of n requests, and the batch's accepted and draft token counts. coupled: seeded
    requests (SamplingParams.coupled), else unseeded ones, whose seeds come from the LLM's generator."""
    sp = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=3,
                         seed=i if coupled else None, ignore_eos=True) for i in range(n)]
    outs = llm.generate([prompt] * n, sp)
    toks = np.array([o.token_ids for o in outs])  # [n, 3]
    accepted = sum(o.metrics["num_accepted_tokens"] for o in outs)
    drafted = sum(o.metrics["num_draft_tokens"] for o in outs)
    return toks, accepted, drafted


def counts_of(toks: np.ndarray):
    c1 = np.bincount(toks[:, 0], minlength=VOCAB)
    c12 = np.bincount(toks[:, 0] * VOCAB + toks[:, 1], minlength=VOCAB * VOCAB)
    c3 = np.bincount(toks[:, 2], minlength=VOCAB)
    return c1, c12, c3


@pytest.mark.parametrize("coupled", [False, True])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 10, 0.9)])
def test_sampled_tokens_follow_target(small_vocab, temperature, top_k, top_p, coupled):
    path, model, prompt = small_vocab
    p1, p12, p3 = exact_probs(model, prompt, temperature, top_k, top_p)
    llm = ngram_llm(path, 3, max_num_seqs=128, seed=0)
    toks, accepted, drafted = sample_three(llm, prompt, 4000, temperature, top_k, top_p, coupled)
    assert 0 < accepted < drafted  # both the accept and the residual paths ran
    c1, c12, c3 = counts_of(toks)
    assert chi2_ok(c1, p1)
    assert chi2_ok(c12, p12)
    assert chi2_ok(c3, p3)


class UniformLogitsNgram(NgramProposer):
    """Broken on purpose: proposes n-gram drafts but caches uniform draft logits (q != one-hot)."""

    def propose(self, reqs, cache, num_steps=None):
        drafts = super().propose(reqs, cache, num_steps)
        cache.values.zero_()
        return drafts


def test_chi_square_detects_wrong_draft_logits(small_vocab):
    """The check has power: drafts verified against the wrong q are accepted too often (the rejection sampler's
    path; the coupled one never reads q)."""
    path, model, prompt = small_vocab
    p1, p12, _ = exact_probs(model, prompt, 1.0, 0, 1.0)
    llm = ngram_llm(path, 3, max_num_seqs=128, seed=0)
    llm.engine.proposer = UniformLogitsNgram(3)
    toks, _, _ = sample_three(llm, prompt, 1500, 1.0, 0, 1.0)
    c1, c12, _ = counts_of(toks)
    assert chi2_ok(c1, p1)  # the first token never goes through verification of drafts
    assert not chi2_ok(c12, p12)
