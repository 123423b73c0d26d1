"""Rejection sampler: exact output distributions, seeded Monte-Carlo, Triton kernel vs torch reference."""
import itertools
import math

import pytest
import torch

from minispec.sample.sampler import probs_from_logits, sample
from minispec.spec_decode.rejection_sampler import (
    rejection_sample,
    rejection_sample_ref,
    rejection_sample_triton,
    rejection_terms,
)
from tests.utils import DEVICES


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper chi-square quantile (z = 3.719: p = 1e-4) by the Wilson-Hilferty approximation."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def chi2_ok(tokens: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson test of sampled tokens against probs (zero-probability tokens must never appear)."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    support = probs > 0
    if counts[~support].sum() > 0:
        return False
    expected = probs[support].double() * counts.sum()
    stat = (((counts[support] - expected) ** 2) / expected).sum().item()
    df = int(support.sum()) - 1
    return df == 0 or stat < chi2_critical(df)


def request_params(temperature, top_k, top_p):
    return torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p])


def row_probs(logits, temperature, top_k, top_p):
    n = logits.shape[0]
    return probs_from_logits(logits, torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p))


# ----------------------------------------------------------------------------- exact enumeration

def emitted_distributions(target, draft, temperature, top_k, top_p, stale_pos=None, placeholder_pos=None):
    """Exact law of the sampler's output for one request with fixed per-position q rows.

    Returns {prefix: [V] probability mass of the next emitted token after that prefix} and the total mass.
    """
    k = target.shape[0] - 1
    vocab = target.shape[1]
    q = row_probs(draft, temperature, top_k, top_p)
    cu = torch.tensor([0, k + 1])
    stale = torch.zeros(k + 1, dtype=torch.bool)
    if stale_pos is not None:
        stale[stale_pos] = True
    choices = []
    for i in range(k):
        if i == placeholder_pos:
            choices.append([(-1, 1.0)])
        else:
            choices.append([(x, q[i, x].item()) for x in range(vocab) if q[i, x] > 0])
    mass = {}
    total = 0.0
    for combo in itertools.product(*choices):
        drafts = [d for d, _ in combo]
        p_drafts = math.prod(w for _, w in combo)
        draft_tokens = torch.tensor(drafts + [-1])
        accept, final = rejection_terms(target, draft, draft_tokens, stale, cu, *request_params(temperature, top_k, top_p))
        accept, final = accept.double(), final.double()
        reach = p_drafts
        for m in range(k + 1):
            stop = reach * (1 - accept[m].item())
            prefix = tuple(drafts[:m])
            mass.setdefault(prefix, torch.zeros(vocab, dtype=torch.float64))
            mass[prefix] += stop * final[m]
            total += stop
            for t in range(m):  # the accepted drafts are emitted too
                mass.setdefault(prefix[:t], torch.zeros(vocab, dtype=torch.float64))
                mass[prefix[:t]][prefix[t]] += stop
            reach *= accept[m].item()
        assert accept[k] == 0  # the bonus row never "accepts"
    return mass, total


CASES = {
    "plain": dict(temperature=1.0, top_k=0, top_p=1.0),
    "top_k": dict(temperature=1.0, top_k=3, top_p=1.0),
    "top_p": dict(temperature=1.0, top_k=0, top_p=0.7),
    "temperature_low": dict(temperature=0.6, top_k=0, top_p=1.0),
    "temperature_high_top_k_top_p": dict(temperature=1.7, top_k=4, top_p=0.85),
    "greedy": dict(temperature=0.0, top_k=0, top_p=1.0),
    "stale": dict(temperature=1.0, top_k=0, top_p=1.0, stale_pos=1),
    "stale_first_top_k": dict(temperature=0.8, top_k=2, top_p=1.0, stale_pos=0),
    "placeholder": dict(temperature=1.0, top_k=0, top_p=1.0, placeholder_pos=1),
    "placeholder_greedy": dict(temperature=0.0, top_k=0, top_p=1.0, placeholder_pos=0),
}


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_exact_output_distribution_is_target(case, k):
    cfg = dict(CASES[case])
    g = torch.Generator().manual_seed(sum(map(ord, case)) + k)
    vocab = 5
    target = torch.randn(k + 1, vocab, generator=g) * 1.5
    draft = target + torch.randn(k + 1, vocab, generator=g)  # close but different
    if case == "greedy":
        draft[0] = target[0]  # first draft agrees with the target's argmax, the others may not
    p = row_probs(target, cfg["temperature"], cfg["top_k"], cfg["top_p"]).double()
    mass, total = emitted_distributions(target, draft, **cfg)
    assert abs(total - 1.0) < 1e-6
    checked = 0
    for prefix, m in mass.items():
        emitted = m.sum().item()
        if emitted < 1e-12:
            continue
        torch.testing.assert_close(m / emitted, p[len(prefix)], atol=1e-6, rtol=0)
        checked += 1
    # the first position is always emitted; later ones only after accepted drafts
    assert abs(mass[()].sum().item() - 1.0) < 1e-6
    block = cfg.get("stale_pos", cfg.get("placeholder_pos"))
    if block is None and cfg["temperature"] > 0:
        assert any(len(prefix) == k for prefix, m in mass.items() if m.sum() > 1e-12)  # bonus reached
    elif block is not None:
        assert all(len(prefix) <= block for prefix, m in mass.items() if m.sum() > 1e-12)
    assert checked >= 1


def test_exact_check_detects_a_wrong_residual():
    """The enumeration has power: emitting from p (instead of the residual) on rejection is not lossless."""
    g = torch.Generator().manual_seed(11)
    target = torch.randn(3, 5, generator=g)
    draft = torch.randn(3, 5, generator=g)
    p = row_probs(target, 1.0, 0, 1.0).double()
    q = row_probs(draft, 1.0, 0, 1.0).double()
    a = torch.minimum(torch.ones(5, dtype=torch.float64), p[0] / q[0])
    first = q[0] * a + (1 - (q[0] * a).sum()) * p[0]  # naive: resample from p
    assert (first - p[0]).abs().max() > 1e-3
    accept, final = rejection_terms(target, draft, torch.tensor([0, 1, -1]), None, torch.tensor([0, 3]),
                                     *request_params(1.0, 0, 1.0))
    resid = (p[0] - q[0]).clamp_min(0)
    torch.testing.assert_close(final[0].double(), resid / resid.sum(), atol=1e-6, rtol=0)
    torch.testing.assert_close(accept[0].double(), a[0], atol=1e-6, rtol=0)


def test_terms_zero_q():
    """q[d] == 0: accept iff p[d] > 0 (drafts the draft model could not have produced, e.g. after its top-k)."""
    inf = float("inf")
    target = torch.tensor([[0.0, 0.0, -inf, 0.0], [0.0, 0.0, 0.0, 0.0]])
    draft = torch.tensor([[0.0, -inf, -inf, 0.0], [0.0, 0.0, 0.0, 0.0]])
    cu = torch.tensor([0, 2])
    params = request_params(1.0, 0, 1.0)
    accept, _ = rejection_terms(target, draft, torch.tensor([1, -1]), None, cu, *params)
    assert accept[0] == 1.0
    accept, _ = rejection_terms(target, draft, torch.tensor([2, -1]), None, cu, *params)
    assert accept[0] == 0.0
    u = torch.tensor([[0.999]])
    tokens, n = rejection_sample(target, draft, torch.tensor([1, -1]), None, cu, *params, u, torch.ones(1, 4))
    assert n.item() == 2 and tokens[0, 0] == 1
    tokens, n = rejection_sample(target, draft, torch.tensor([2, -1]), None, cu, *params, u, torch.ones(1, 4))
    assert n.item() == 1 and tokens[0, 0] != 2


# ----------------------------------------------------------------------------- Monte-Carlo

MC_CASES = {
    "plain": dict(temperature=1.0, top_k=0, top_p=1.0),
    "top_k_temperature": dict(temperature=0.7, top_k=4, top_p=1.0),
    "top_p_temperature": dict(temperature=1.4, top_k=0, top_p=0.8),
    "stale_second": dict(temperature=1.0, top_k=0, top_p=0.9, stale_pos=1),
}


def mc_run(target, draft, cfg, n, seed, device="cpu"):
    """n copies of one request with k drafts sampled from the fixed q rows; returns tokens, num_sampled (on CPU).

    The draws are made on CPU; the sampler runs on device (CPU: the torch reference, CUDA: the Triton kernel)."""
    g = torch.Generator().manual_seed(seed)
    k = target.shape[0] - 1
    vocab = target.shape[1]
    q = row_probs(draft, cfg["temperature"], cfg["top_k"], cfg["top_p"])
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(k)], 1)  # [n, k]
    draft_tokens = torch.cat([drafts, torch.full((n, 1), -1)], 1).reshape(-1)  # [n * (k + 1)]
    stale = None
    if cfg.get("stale_pos") is not None:
        stale = torch.zeros(n, k + 1, dtype=torch.bool)
        stale[:, cfg["stale_pos"]] = True
        stale = stale.reshape(-1)
    cu = torch.arange(n + 1) * (k + 1)
    temperature = torch.full((n,), cfg["temperature"])
    top_k = torch.full((n,), cfg["top_k"])
    top_p = torch.full((n,), cfg["top_p"])
    u = torch.rand(n, k, generator=g)
    noise = torch.empty(n, vocab).exponential_(generator=g)
    args = (target.repeat(n, 1), draft.repeat(n, 1), draft_tokens, stale, cu, temperature, top_k, top_p, u, noise)
    tokens, num_sampled = rejection_sample(*(a if a is None else a.to(device) for a in args))
    return tokens.cpu(), num_sampled.cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(MC_CASES))
def test_monte_carlo_first_and_second_token(case, device):
    cfg = MC_CASES[case]
    g = torch.Generator().manual_seed(sum(map(ord, case)))
    k, vocab, n = 2, 6, 30000
    target = torch.randn(k + 1, vocab, generator=g)
    draft = target + 0.7 * torch.randn(k + 1, vocab, generator=g)
    p = row_probs(target, cfg["temperature"], cfg["top_k"], cfg["top_p"])
    tokens, num_sampled = mc_run(target, draft, cfg, n, seed=1, device=device)
    assert ((num_sampled >= 1) & (num_sampled <= k + 1)).all()
    assert chi2_ok(tokens[:, 0], p[0])
    second = num_sampled >= 2
    assert second.sum() > 1000
    assert chi2_ok(tokens[second, 1], p[1])
    if cfg.get("stale_pos") == 1:
        assert (num_sampled <= 2).all()
    for i in range(k + 1):
        assert ((tokens[:, i] >= 0) == (num_sampled > i)).all()


def test_monte_carlo_detects_biased_sampling():
    """The chi-square check has power: the draft's own q (what an always-accept sampler emits) fails it."""
    g = torch.Generator().manual_seed(5)
    target = torch.randn(3, 6, generator=g)
    draft = target + 0.7 * torch.randn(3, 6, generator=g)
    p = row_probs(target, 1.0, 0, 1.0)
    q = row_probs(draft, 1.0, 0, 1.0)
    tok = torch.multinomial(q[0], 30000, replacement=True, generator=g)
    assert not chi2_ok(tok, p[0])


def test_greedy_accepts_iff_argmax():
    g = torch.Generator().manual_seed(2)
    k, vocab = 3, 30
    target = torch.randn(k + 1, vocab, generator=g)
    argmax = target.argmax(-1)
    draft_tokens = torch.tensor([argmax[0], argmax[1], (argmax[2] + 1) % vocab, -1])
    params = request_params(0.0, 0, 1.0)
    for use_triton in (False, True):
        for u, noise in ((torch.rand(1, k), torch.empty(1, vocab).exponential_()), (torch.zeros(1, k), torch.ones(1, vocab))):
            tokens, n = rejection_sample(target, torch.randn(k + 1, vocab), draft_tokens, None, torch.tensor([0, k + 1]),
                                         *params, u, noise, use_triton=use_triton)
            assert n.tolist() == [3]
            assert tokens[0].tolist() == argmax[:3].tolist() + [-1]


# ----------------------------------------------------------------------------- Triton vs reference

def random_batch(seed, vocab=200, rows=(1, 3, 4, 2, 4, 1, 3), nonfinite=False):
    g = torch.Generator().manual_seed(seed)
    num_reqs = len(rows)
    cu = torch.tensor([0, *itertools.accumulate(rows)])
    num_logits = int(cu[-1])
    max_drafts = max(rows) - 1 + seed % 2  # sometimes wider than needed
    draft = torch.randn(num_logits, vocab, generator=g) * 2
    target = draft + 0.3 * torch.randn(num_logits, vocab, generator=g)  # close, so drafts are often accepted
    temperature = torch.tensor([0.0, 1.0, 0.7, 0.0, 1.3, 1.0, 0.5])[:num_reqs]
    top_k = torch.tensor([0, 0, 5, 3, 50, 0, 0])[:num_reqs]
    top_p = torch.tensor([1.0, 0.9, 1.0, 1.0, 0.8, 1.0, 0.95])[:num_reqs]
    if nonfinite:
        target[1, ::7] = float("nan")
        target[2] = float("nan")
        target[4, :10] = float("inf")
        draft[5] = float("-inf")
        draft[6, 3] = float("nan")
        target[num_logits - 1] = float("-inf")
    t_rows = torch.repeat_interleave(temperature, torch.tensor(rows))
    q = probs_from_logits(draft, t_rows, torch.repeat_interleave(top_k, torch.tensor(rows)),
                          torch.repeat_interleave(top_p, torch.tensor(rows)))
    draft_tokens = torch.multinomial(q, 1, generator=g).squeeze(1)  # [num_logits]
    draft_tokens[cu[1:] - 1] = -1  # bonus rows
    draft_tokens[torch.rand(num_logits, generator=g) < 0.1] = -1  # placeholders
    draft_tokens[torch.rand(num_logits, generator=g) < 0.05] = vocab + 3  # out of range: never accepted
    stale = torch.rand(num_logits, generator=g) < 0.1
    u = torch.rand(num_reqs, max_drafts, generator=g)
    noise = torch.empty(num_reqs, vocab).exponential_(generator=g)
    return target, draft, draft_tokens, stale, cu, temperature, top_k, top_p, u, noise


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("nonfinite", [False, True])
def test_triton_matches_reference(seed, nonfinite, device):
    """Same p and q (computed on device) into the kernel (interpreted on CPU, compiled on CUDA) and the torch reference."""
    args = tuple(a.to(device) for a in random_batch(seed, nonfinite=nonfinite))
    ref = rejection_sample(*args, use_triton=False)
    tri = rejection_sample(*args, use_triton=True)
    assert torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1])
    tokens, num_sampled = ref
    vocab = args[0].shape[1]
    assert tokens.shape == (len(num_sampled), args[8].shape[1] + 1)
    assert tokens.dtype == torch.int64
    for r in range(len(num_sampled)):
        n = int(num_sampled[r])
        assert (tokens[r, :n] >= 0).all() and (tokens[r, :n] < vocab).all()
        assert (tokens[r, n:] == -1).all()
    no_stale = args[:3] + (None,) + args[4:]
    ref = rejection_sample(*no_stale, use_triton=False)
    tri = rejection_sample(*no_stale, use_triton=True)
    assert torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1])


@pytest.mark.parametrize("device", DEVICES)
def test_triton_matches_reference_on_probs_multi_block_and_ties(device):
    """Several V blocks, tied scores (uniform p, constant noise): both take the first maximal index."""
    g = torch.Generator().manual_seed(9)
    vocab = 150
    cu = torch.tensor([0, 1, 3, 6, 7])
    p = torch.softmax(torch.randn(7, vocab, generator=g), -1)
    q = torch.softmax(torch.randn(7, vocab, generator=g), -1)
    p[0] = 0.0
    p[0, [70, 20, 140]] = 1 / 3  # tie, across blocks
    p[6] = 0.0
    p[6, [130, 66]] = 0.5
    q[1, 5] = 0.0
    q[1] /= q[1].sum()
    p[1] = q[1]  # draft 5 has p = q = 0: rejected with a zero residual, so drawn from p
    draft_tokens = torch.tensor([-1, 5, -1, 7, 8, -1, -1])
    u = torch.tensor([[0.0, 0.0], [0.999, 0.0], [0.0, 0.0], [0.0, 0.0]])
    noise = torch.ones(4, vocab)
    noise[1] = torch.empty(vocab).exponential_(generator=g)
    p, q, draft_tokens, cu, u, noise = (t.to(device) for t in (p, q, draft_tokens, cu, u, noise))
    ref = rejection_sample_ref(p, q, draft_tokens, None, cu, u, noise)
    for block_v in (32, 64, 1024):
        tri = rejection_sample_triton(p, q, draft_tokens, None, cu, u, noise, block_v=block_v)
        assert torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1]), block_v
    assert ref[0][0, 0] == 20 and ref[0][3, 0] == 66
    assert ref[1].tolist() == [1, 1, 3, 1]
    assert ref[0][1, 0] == sample(p[1:2], noise[1:2])[0]  # request 1: the zero-residual fallback to p
    assert ref[0][2, :2].tolist() == [7, 8] and ref[0][2, 2] == p[5].argmax()  # request 2: u = 0 accepts all


@pytest.mark.parametrize("device", DEVICES)
def test_triton_matches_reference_on_residual_draws(device):
    """Many rejections of valid drafts (p and q far apart), including residual ties across V blocks."""
    g = torch.Generator().manual_seed(12)
    num_reqs, vocab = 64, 100
    cu = torch.arange(num_reqs + 1) * 2  # one draft + the bonus row each
    p = torch.softmax(2 * torch.randn(2 * num_reqs, vocab, generator=g), -1)
    q = torch.softmax(2 * torch.randn(2 * num_reqs, vocab, generator=g), -1)
    draft_tokens = torch.multinomial(q, 1, generator=g).squeeze(1)
    draft_tokens[1::2] = -1
    noise = torch.empty(num_reqs, vocab).exponential_(generator=g)
    for r in range(4):  # residual max(0, p - q) tied at 10, 45, 90, with constant noise
        p[2 * r], q[2 * r] = torch.full((vocab,), 0.5 / (vocab - 3)), torch.full((vocab,), 0.5 / (vocab - 3))
        p[2 * r, [10, 45, 90]], q[2 * r, [10, 45, 90]] = 0.5 / 3, 0.0
        draft_tokens[2 * r] = r
        p[2 * r, r] = 0.0  # rejected
        noise[r] = 1.0
    u = torch.rand(num_reqs, 1, generator=g)
    u[:4] = 0.9
    p, q, draft_tokens, cu, u, noise = (t.to(device) for t in (p, q, draft_tokens, cu, u, noise))
    ref = rejection_sample_ref(p, q, draft_tokens, None, cu, u, noise)
    assert (ref[1] == 1).sum() >= 12  # mostly rejections
    assert ref[0][:4, 0].tolist() == [10] * 4
    for block_v in (32, 128):
        tri = rejection_sample_triton(p, q, draft_tokens, None, cu, u, noise, block_v=block_v)
        assert torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1]), block_v


def test_single_row_request_is_plain_sampling():
    g = torch.Generator().manual_seed(4)
    vocab, num_reqs = 64, 5
    logits = torch.randn(num_reqs, vocab, generator=g)
    temperature = torch.tensor([1.0, 0.0, 0.5, 2.0, 1.0])
    top_k = torch.tensor([0, 0, 10, 0, 3])
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.7, 1.0])
    noise = torch.empty(num_reqs, vocab).exponential_(generator=g)
    expected = sample(probs_from_logits(logits, temperature, top_k, top_p), noise)
    for use_triton in (False, True):
        tokens, n = rejection_sample(logits, logits, torch.full((num_reqs,), -1), None, torch.arange(num_reqs + 1),
                                     temperature, top_k, top_p, torch.zeros(num_reqs, 0), noise, use_triton=use_triton)
        assert tokens.shape == (num_reqs, 1) and n.tolist() == [1] * num_reqs
        assert torch.equal(tokens[:, 0], expected)


def test_greedy_fast_path_equals_general_path():
    """rejection_sample's all-greedy shortcut gives the same tokens as the one-hot p/q computation."""
    from minispec.spec_decode.rejection_sampler import greedy_verify, rejection_sample

    g = torch.Generator().manual_seed(5)
    for trial in range(30):
        num_reqs, vocab = 4, 11
        rows = torch.randint(1, 5, (num_reqs,), generator=g)
        cu = torch.zeros(num_reqs + 1, dtype=torch.int64)
        cu[1:] = rows.cumsum(0)
        n = int(cu[-1])
        target = torch.randn(n, vocab, generator=g)
        target[torch.rand(n, generator=g) < 0.1] = float("nan")
        drafts = torch.where(torch.rand(n, generator=g) < 0.5, target.nan_to_num(-1e9).argmax(-1),
                             torch.randint(-1, vocab, (n,), generator=g))
        drafts[cu[1:] - 1] = -1
        stale = torch.rand(n, generator=g) < 0.2
        zeros = torch.zeros(num_reqs)
        k = int(rows.max()) - 1
        args = (target, torch.randn(n, vocab, generator=g), drafts, stale, cu, zeros,
                torch.zeros(num_reqs, dtype=torch.int64), torch.ones(num_reqs))
        u = torch.rand(num_reqs, k, generator=g)
        noise = torch.empty(num_reqs, vocab).exponential_(generator=g)
        fast = greedy_verify(target, drafts, stale, cu, k)
        general = rejection_sample(*args, u, noise, return_probs=True)[:2]
        assert torch.equal(fast[0], general[0]) and torch.equal(fast[1], general[1]), trial
