"""Rejection sampler: the law of what the sampler the engine calls (rejection_sample) emits, and Triton vs torch.

Exact: tests/sampler_law.py probes rejection_sample on every draft sequence of one request (vocabulary
4, k = 1..4, temperature / top-k / top-p, stale and -1 drafts at every position, stale drafts drawn
from a q other than the cached one) and composes the probed terms into the exact law of every
emitted token, the bonus token included: it must be the target's p (the probes
hold the sampler to the specification within a relative EPS = 1e-3; float32 probabilities, so the law
holds to atol 1e-6). The C++ kernel (what runs on CPU) and the torch reference run every
case; the Triton kernel (TRITON_INTERPRET=1, about 20 ms per request on a CPU) a subset.
Monte-Carlo: MC_N seeded requests per case through rejection_sample on each device (CPU: the
C++ kernel; CUDA, where present: the Triton kernel); the token at every position
(given that the drafts before it were accepted) is chi-square tested against p at MC_ALPHA, and the
bonus tokens must reject the laws of two wrong samplers (draws from the residual, or from q).
"""
import itertools

import pytest
import torch

from minispec.kernels import cpu
from minispec.sample.sampler import probs_from_logits, sample
from minispec.spec_decode import rejection_sampler
from minispec.spec_decode.rejection_sampler import (
    rejection_sample,
    rejection_sample_ref,
    rejection_sample_triton,
)
from tests.sampler_law import Request, exact_law, probe, row_probs
from tests.utils import DEVICES, chi2_test


def request_params(temperature, top_k, top_p):
    return torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p])


# ----------------------------------------------------------------------------- exact: probes + enumeration

SETTINGS = {
    "plain": dict(temperature=1.0, top_k=0, top_p=1.0),
    "T0.6-topk3": dict(temperature=0.6, top_k=3, top_p=1.0),
    "T1.7-topp0.7": dict(temperature=1.7, top_k=0, top_p=0.7),
    "T0.8-topk3-topp0.8": dict(temperature=0.8, top_k=3, top_p=0.8),
    "greedy": dict(temperature=0.0, top_k=0, top_p=1.0),
}


def exact_cases() -> dict[str, dict]:
    """k = 1..4: each setting, and a stale and a -1 draft at every position (rotating through the settings)."""
    cases = {}
    names = list(SETTINGS)[:4]
    for k in range(1, 5):
        for name, settings in SETTINGS.items():
            cases[f"k{k}-{name}"] = dict(settings, k=k)
        for m in range(k):
            cases[f"k{k}-stale{m}"] = dict(SETTINGS[names[m % 4]], k=k, stale=(m,))
            cases[f"k{k}-placeholder{m}"] = dict(SETTINGS[names[(m + 1) % 4]], k=k, placeholder=(m,))
    cases["k4-stale0-placeholder2"] = dict(SETTINGS["plain"], k=4, stale=(0,), placeholder=(2,))
    cases["k3-stale-all"] = dict(SETTINGS["T0.6-topk3"], k=3, stale=(0, 1, 2))
    return cases


EXACT_CASES = exact_cases()


def make_request(name: str, vocab: int = 4) -> Request:
    """Target logits, a draft close to them, and on stale rows another request's draft in the cache."""
    cfg = dict(EXACT_CASES[name])
    k = cfg.pop("k")
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    target = torch.randn(k + 1, vocab, generator=g) * 1.5
    own = target + torch.randn(k + 1, vocab, generator=g)  # close but different
    if cfg["temperature"] == 0:
        own[0] = target[0]  # the first draft agrees with the target's argmax, the others may not
    cached = own.clone()
    for m in cfg.get("stale", ()):
        cached[m] = torch.randn(vocab, generator=g) * 2  # the row's new owner drafted from these
    return Request(target, cached, own, **cfg)


@pytest.mark.parametrize("kernel", ["cpp", "torch"])
@pytest.mark.parametrize("name", list(EXACT_CASES))
def test_exact_law_of_every_emitted_token(name, kernel, monkeypatch):
    """kernel: what rejection_sample runs on CPU, the C++ kernel where it is built or the torch reference."""
    if kernel == "torch":
        monkeypatch.setattr(rejection_sampler, "rejection_sample_cpu", rejection_sample_ref)
    elif cpu.ops() is None:
        pytest.skip("the C++ kernels could not be built")
    req = make_request(name)
    failures = probe(req)
    assert not failures, f"{len(failures)} probes failed, e.g. " + "; ".join(failures[:3])
    mass = exact_law(req)
    assert abs(mass[()].sum().item() - 1.0) < 1e-6  # the first token is always emitted
    for prefix, m in mass.items():
        emitted = m.sum().item()
        if emitted > 1e-12:
            torch.testing.assert_close(m / emitted, req.p[len(prefix)], atol=1e-6, rtol=0, msg=f"after {prefix}")
    reached = {len(prefix) for prefix, m in mass.items() if m.sum() > 1e-12}
    blocked = min(req.stale | req.placeholder, default=None)
    if blocked is not None:
        assert max(reached) == blocked  # nothing is accepted at a stale or -1 draft
    elif req.settings[0] > 0:
        assert req.k in reached  # the bonus token is among the checked ones


TRITON_CASES = ["k1-stale0", "k1-placeholder0", "k2-T0.6-topk3", "k3-T1.7-topp0.7", "k4-T0.8-topk3-topp0.8",
                "k4-stale2", "k2-placeholder1"]


def triton_combos(req: Request) -> list[tuple[int, ...]]:
    """Two draft sequences: the most likely to reach the bonus token, and the one most often rejected."""
    combos = req.combos()

    def reach(c):
        return torch.tensor([req.terms(c, m)[0] for m in range(req.k)]).prod().item()

    def rejections(c):
        return sum(1 - req.terms(c, m)[0] for m in range(req.k) if req.terms(c, m)[0] > 0)

    return sorted({max(combos, key=reach), max(combos, key=rejections)})


@pytest.mark.parametrize("name", TRITON_CASES)
def test_exact_probes_triton(name):
    req = make_request(name)
    combos = triton_combos(req)
    failures = probe(req, combos, use_triton=True)
    assert not failures, f"{len(failures)} probes failed, e.g. " + "; ".join(failures[:3])


def test_probes_catch_a_sampler_that_ignores_stale_flags(monkeypatch):
    """The probes have power: the same stale request verified without its stale flags fails them."""
    import tests.sampler_law as law

    real = law.rejection_sample
    monkeypatch.setattr(law, "rejection_sample", lambda t, d, dt, stale, *a, **kw: real(t, d, dt, None, *a, **kw))
    assert probe(make_request("k2-stale0"))


def test_zero_q_draft():
    """q[d] == 0: accept iff p[d] > 0 (drafts the draft model could not have produced, e.g. after its top-k)."""
    inf = float("inf")
    target = torch.tensor([[0.0, 0.0, -inf, 0.0], [0.0, 0.0, 0.0, 0.0]])
    draft = torch.tensor([[0.0, -inf, -inf, 0.0], [0.0, 0.0, 0.0, 0.0]])
    cu = torch.tensor([0, 2])
    params = request_params(1.0, 0, 1.0)
    u = torch.tensor([[0.999]])
    tokens, n = rejection_sample(target, draft, torch.tensor([1, -1]), None, cu, *params, u, torch.ones(1, 4))
    assert n.item() == 2 and tokens[0, 0] == 1
    tokens, n = rejection_sample(target, draft, torch.tensor([2, -1]), None, cu, *params, u, torch.ones(1, 4))
    assert n.item() == 1 and tokens[0, 0] != 2


# ----------------------------------------------------------------------------- Monte-Carlo

MC_N = 40_000  # requests per case
MC_ALPHA = 1e-3  # a law is rejected when its chi-square p-value is below this
MC_CASES = {
    "k1-plain": dict(k=1, temperature=1.0, top_k=0, top_p=1.0),
    "k2-T0.7-topk4": dict(k=2, temperature=0.7, top_k=4, top_p=1.0),
    "k3-T1.4-topp0.8": dict(k=3, temperature=1.4, top_k=0, top_p=0.8),
    "k4-T0.9-topk5-topp0.9": dict(k=4, temperature=0.9, top_k=5, top_p=0.9),
    "k4-plain": dict(k=4, temperature=1.0, top_k=0, top_p=1.0),
    "k3-stale1": dict(k=3, temperature=1.0, top_k=0, top_p=0.9, stale=(1,)),
    "k2-stale0": dict(k=2, temperature=0.8, top_k=4, top_p=1.0, stale=(0,)),
    "k4-placeholder3": dict(k=4, temperature=1.2, top_k=0, top_p=1.0, placeholder=(3,)),
    "k2-placeholder0": dict(k=2, temperature=1.0, top_k=0, top_p=0.85, placeholder=(0,)),
}


def mc_run(name: str, vocab: int = 6, n: int = MC_N, seed: int = 1, device: str = "cpu"):
    """n copies of one request, drafts drawn from its own q (another q in the cache on stale rows); the draws are
    made on CPU, the sampler runs on device (CPU: the C++ kernel, CUDA: the Triton kernel)."""
    cfg = dict(MC_CASES[name])
    k = cfg.pop("k")
    stale_pos, placeholder = cfg.pop("stale", ()), cfg.pop("placeholder", ())
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    target = torch.randn(k + 1, vocab, generator=g)
    own = target + 0.5 * torch.randn(k + 1, vocab, generator=g)  # close: drafts are often accepted
    cached = own.clone()
    for m in stale_pos:
        cached[m] = torch.randn(vocab, generator=g) * 2
    settings = (cfg["temperature"], cfg["top_k"], cfg["top_p"])
    p, q, q_own = (row_probs(x, *settings) for x in (target, cached, own))
    g = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(q_own[m], n, replacement=True, generator=g) for m in range(k)], 1)
    drafts[:, list(placeholder)] = -1
    draft_tokens = torch.cat([drafts, torch.full((n, 1), -1)], 1).reshape(-1)  # [n * (k + 1)]
    stale = None
    if stale_pos:
        stale = torch.zeros(n, k + 1, dtype=torch.bool)
        stale[:, list(stale_pos)] = True
        stale = stale.reshape(-1)
    u = torch.rand(n, k, generator=g)
    noise = torch.empty(n, vocab).exponential_(generator=g)
    args = (target.repeat(n, 1), cached.repeat(n, 1), draft_tokens, stale, torch.arange(n + 1) * (k + 1),
            torch.full((n,), settings[0]), torch.full((n,), settings[1]), torch.full((n,), settings[2]), u, noise)
    tokens, num_sampled = rejection_sample(*(a if a is None else a.to(device) for a in args))
    return tokens.cpu(), num_sampled.cpu(), p, q, k, min(stale_pos + placeholder, default=None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(MC_CASES))
def test_monte_carlo_every_position(name, device):
    tokens, num_sampled, p, q, k, blocked = mc_run(name, device=device)
    assert ((num_sampled >= 1) & (num_sampled <= k + 1)).all()
    for i in range(k + 1):
        assert ((tokens[:, i] >= 0) == (num_sampled > i)).all()
    last = k if blocked is None else blocked
    assert (num_sampled <= last + 1).all()  # nothing accepted at a stale or -1 draft
    for m in range(last + 1):
        reached = num_sampled > m  # the drafts before m were accepted: token m must follow p[m]
        stat, dof, pval, impossible = chi2_test(torch.bincount(tokens[reached, m], minlength=p.shape[1]), p[m])
        print(f"\n[mc] {name} position {m}{' (bonus)' if m == k else ''}: n={int(reached.sum())} "
              f"chi2={stat:.2f} dof={dof} p={pval:.4f}", end="")
        assert reached.sum() >= 1000
        assert impossible == 0 and pval >= MC_ALPHA, (m, stat, dof, pval)
    if blocked is None:  # power: the bonus tokens reject the laws of the residual and of q
        bonus = tokens[num_sampled == k + 1, k]
        counts = torch.bincount(bonus, minlength=p.shape[1])
        resid = (p[k] - q[k]).clamp_min(0)
        for what, law in (("residual", resid / resid.sum()), ("q", q[k])):
            pval = chi2_test(counts, law)[2]
            print(f"\n[mc] {name} bonus vs the {what} law: p={pval:.2e}", end="")
            assert pval < MC_ALPHA


def test_monte_carlo_detects_biased_sampling():
    """The chi-square check has power: the draft's own q (what an always-accept sampler emits) fails it."""
    g = torch.Generator().manual_seed(5)
    target = torch.randn(3, 6, generator=g)
    draft = target + 0.7 * torch.randn(3, 6, generator=g)
    p, q = row_probs(target, 1.0, 0, 1.0), row_probs(draft, 1.0, 0, 1.0)
    tok = torch.multinomial(q[0], 30000, replacement=True, generator=g)
    assert chi2_test(torch.bincount(tok, minlength=6), p[0])[2] < MC_ALPHA


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


# ----------------------------------------------------------------------------- vocabularies, batch sizes, greedy edges

def shaped_batch(seed, vocab, rows, zero_tail: int = 0):
    """random_batch's kind of batch with any vocabulary and rows; zero_tail: the last zero_tail tokens get no mass in
    p or q (-inf logits: the kernel's last vocabulary tile holds nothing)."""
    g = torch.Generator().manual_seed(seed)
    num_reqs = len(rows)
    cu = torch.tensor([0, *itertools.accumulate(rows)])
    n = int(cu[-1])
    draft = torch.randn(n, vocab, generator=g) * 2
    target = draft + 0.3 * torch.randn(n, vocab, generator=g)
    if zero_tail:
        draft[:, vocab - zero_tail :] = float("-inf")
        target[:, vocab - zero_tail :] = float("-inf")
    temperature = torch.tensor([(0.0, 1.0, 0.7, 1.3)[i % 4] for i in range(num_reqs)])
    top_k = torch.tensor([(0, 0, 5, 50)[i % 4] for i in range(num_reqs)])
    top_p = torch.tensor([(1.0, 0.9, 1.0, 0.8)[i % 4] for i in range(num_reqs)])
    rep = torch.tensor(rows)
    q = probs_from_logits(draft, torch.repeat_interleave(temperature, rep), torch.repeat_interleave(top_k, rep),
                          torch.repeat_interleave(top_p, rep))
    drafts = torch.multinomial(q, 1, generator=g).squeeze(1)
    drafts[cu[1:] - 1] = -1
    stale = torch.rand(n, generator=g) < 0.1
    u = torch.rand(num_reqs, max(rows) - 1, generator=g)
    noise = torch.empty(num_reqs, vocab).exponential_(generator=g)
    return target, draft, drafts, stale, cu, temperature, top_k, top_p, u, noise


@pytest.mark.parametrize("vocab", [8193, 10000, 151936])
def test_triton_matches_reference_on_large_vocabularies_with_an_empty_last_tile(vocab):
    """Vocabularies past the kernel's 1024-wide tiles, whose last tile (and more) has zero mass in p and q."""
    tail = vocab % 1024 or 1024
    args = shaped_batch(vocab, vocab, (3, 1, 2), zero_tail=tail + 7)
    ref = rejection_sample(*args, use_triton=False)
    tri = rejection_sample(*args, use_triton=True)
    assert torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1])
    emitted = ref[0][ref[0] >= 0]
    assert emitted.numel() >= 3 and (emitted < vocab - tail - 7).all()  # no token of zero mass


def test_triton_matches_reference_on_a_batch_of_100():
    rows = [1 + (7 * i) % 5 for i in range(100)]  # 0 to 4 drafts each
    args = shaped_batch(11, 64, rows)
    ref = rejection_sample(*args, use_triton=False)
    tri = rejection_sample(*args, use_triton=True)
    assert ref[0].shape == (100, 5)
    assert torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1])


def test_greedy_batch_with_empty_draft_lists_and_masked_target_logits():
    """A greedy batch where some requests have no drafts and the target masks most tokens with -inf: the argmax of
    the unmasked ones, on the shortcut, the general path and the kernel alike."""
    from minispec.spec_decode.rejection_sampler import greedy_verify

    g = torch.Generator().manual_seed(9)
    vocab, rows = 50, (1, 3, 1, 4, 1)
    cu = torch.tensor([0, *itertools.accumulate(rows)])
    n = int(cu[-1])
    target = torch.randn(n, vocab, generator=g)
    allowed = torch.rand(n, vocab, generator=g) < 0.1
    allowed[:, 0] = True
    target = target.masked_fill(~allowed, float("-inf"))
    argmax = target.argmax(-1)
    drafts = argmax.clone()
    drafts[6] = (argmax[6] + 1) % vocab  # request 3 (logits positions 5 .. 8): its 2nd draft is rejected
    drafts[cu[1:] - 1] = -1
    num_reqs = len(rows)
    zeros = torch.zeros(num_reqs)
    params = (zeros, torch.zeros(num_reqs, dtype=torch.int64), torch.ones(num_reqs))
    u = torch.rand(num_reqs, max(rows) - 1, generator=g)
    noise = torch.empty(num_reqs, vocab).exponential_(generator=g)
    fast = greedy_verify(target, drafts, None, cu, max(rows) - 1)
    for use_triton in (False, True):
        general = rejection_sample(target, torch.randn(n, vocab, generator=g), drafts, None, cu, *params, u, noise,
                                   use_triton=use_triton)
        assert torch.equal(fast[0], general[0]) and torch.equal(fast[1], general[1])
    tokens, num_sampled, finite = fast
    assert finite.all()  # -inf masks most tokens, not all
    for r in range(num_reqs):
        k = int(num_sampled[r])
        got = tokens[r, :k]
        assert allowed[cu[r] + torch.arange(k), got].all()  # never a masked token
        assert got.tolist() == argmax[cu[r] : cu[r] + k].tolist()
    assert num_sampled.tolist() == [1, 3, 1, 2, 1]


@pytest.mark.parametrize("use_triton", [False, True])
def test_batch_without_drafts_takes_the_general_paths_tokens(use_triton):
    """No request verifies drafts (one logits position each, as in target-only steps or adaptive k = 0): the
    shortcut's draw is the token the general path (forced by return_probs) gives with the same noise; greedy,
    top-k, top-p and NaN rows mixed in."""
    g = torch.Generator().manual_seed(11)
    num_reqs, vocab = 7, 300
    target = torch.randn(num_reqs, vocab, generator=g) * 3
    target[5, 7] = float("nan")
    temperature = torch.tensor([0.8, 0.0, 1.0, 1.3, 0.5, 1.0, 0.0])
    top_k = torch.tensor([0, 0, 20, 0, 5, 0, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.9, 0.7, 1.0, 1.0])
    cu = torch.arange(num_reqs + 1)
    drafts = torch.full((num_reqs,), -1)
    for trial in range(20):
        noise = torch.empty(num_reqs, vocab).exponential_(generator=g)
        u = torch.rand(num_reqs, 3, generator=g)
        args = (target, torch.randn(num_reqs, vocab, generator=g), drafts, None, cu, temperature, top_k, top_p, u,
                noise)
        fast = rejection_sample(*args, use_triton=use_triton)
        general = rejection_sample(*args, use_triton=use_triton, return_probs=True)[:2]
        assert torch.equal(fast[0], general[0]) and torch.equal(fast[1], general[1]), trial
        assert fast[0][1, 0] == target[1].argmax() and fast[0][6, 0] == target[6].argmax()


def test_coupled_verify_accepts_drafts_equal_to_the_targets_draws():
    """coupled_verify against a loop on its definition: the token at every position is the target's race
    argmax(p / E) with that position's noise, drafts are accepted while they equal it, a -1 never; the
    drafts here are drawn with the same noise from a nearby q (so some are accepted, some not), greedy rows
    included."""
    from minispec.spec_decode.rejection_sampler import coupled_verify

    g = torch.Generator().manual_seed(5)
    vocab, max_drafts = 50, 3
    num_drafts = [3, 0, 2, 1, 3]
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.2, 0.9])
    top_k = torch.tensor([0, 10, 0, 0, 5])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.8, 1.0])
    cu = torch.tensor([0] + list(itertools.accumulate(n + 1 for n in num_drafts)))
    rep = lambda x: torch.repeat_interleave(x, torch.tensor(num_drafts) + 1)  # noqa: E731
    accepted = rejected = 0
    for trial in range(30):
        target = torch.randn(int(cu[-1]), vocab, generator=g) * 2
        draft = target + torch.randn(target.shape, generator=g)
        noise = torch.empty(target.shape).exponential_(generator=g)
        p = probs_from_logits(target, rep(temperature), rep(top_k), rep(top_p))
        drawn = sample(p, noise)  # [num_logits] the target's draw at every position
        drafts = sample(probs_from_logits(draft, rep(temperature), rep(top_k), rep(top_p)), noise)
        drafts[cu[1:] - 1] = -1  # bonus positions verify nothing
        drafts[torch.rand(drafts.shape, generator=g) < 0.1] = -1  # placeholders
        tokens, num_sampled = coupled_verify(target, drafts, cu, temperature, top_k, top_p, noise, max_drafts)
        for r, n in enumerate(num_drafts):
            start = int(cu[r])
            a = 0
            while a < n and drafts[start + a] >= 0 and drafts[start + a] == drawn[start + a]:
                a += 1
            accepted += a
            rejected += a < n
            assert int(num_sampled[r]) == a + 1, (trial, r)
            assert tokens[r, : a + 1].tolist() == drawn[start : start + a + 1].tolist(), (trial, r)
            assert (tokens[r, a + 1 :] == -1).all()
        assert tokens[2, 0] == target[int(cu[2])].argmax()  # greedy: the argmax
    assert accepted > 0 and rejected > 0
