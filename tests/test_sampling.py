"""Logit warping vs transformers' warpers, probabilities, exact sampling and seeded random streams."""
import math

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from minispec.sample.random import RequestRandom, exponentials, uniforms
from minispec.sample.sampler import probs_from_logits, sample, warp_logits


def hf_warp(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' warpers in generate()'s order, each added only when it is on."""
    x = row.unsqueeze(0).float()
    if temperature != 0:
        x = TemperatureLogitsWarper(temperature)(None, x)
    if top_k != 0:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(None, x)
    return x[0]


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper chi-square quantile (z = 3.719: p = 1e-4) by the Wilson-Hilferty approximation."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def chi2_stat(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic of counts against probs over the outcomes with positive probability."""
    n = counts.sum().item()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a zero-probability outcome"
    expected = probs[support].double() * n
    return (((counts[support].double() - expected) ** 2) / expected).sum().item(), int(support.sum()) - 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_warp_logits_matches_transformers(seed):
    g = torch.Generator().manual_seed(seed)
    num_rows, vocab = 96, 50
    logits = torch.randn(num_rows, vocab, generator=g) * 3
    temps = torch.tensor([0.0, 0.3, 0.7, 1.0, 1.5])
    ks = torch.tensor([0, 1, 2, 5, 20, 50, 60])
    ps = torch.tensor([1.0, 0.95, 0.9, 0.5, 0.1, 0.0])
    temperature = temps[torch.randint(len(temps), (num_rows,), generator=g)]
    top_k = ks[torch.randint(len(ks), (num_rows,), generator=g)]
    top_p = ps[torch.randint(len(ps), (num_rows,), generator=g)]
    out = warp_logits(logits, temperature, top_k, top_p)
    assert out.dtype == torch.float32 and out.shape == logits.shape
    for i in range(num_rows):
        ref = hf_warp(logits[i], float(temperature[i]), int(top_k[i]), float(top_p[i]))
        assert torch.equal(out[i], ref), (i, float(temperature[i]), int(top_k[i]), float(top_p[i]))


def test_warp_top_k_keeps_ties():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 0.0], [5.0, 5.0, 5.0, 1.0, 1.0, 1.0]])
    top_k = torch.tensor([2, 1])
    out = warp_logits(logits, torch.ones(2), top_k, torch.ones(2))
    for i in range(2):
        assert torch.equal(out[i], hf_warp(logits[i], 1.0, int(top_k[i]), 1.0))
    assert torch.isfinite(out[0]).tolist() == [False, True, False, True, False, False]
    assert torch.isfinite(out[1]).tolist() == [True, True, True, False, False, False]


def test_warp_logits_no_sort_rows_only_scaled():
    logits = torch.randn(4, 10)
    temperature = torch.tensor([0.0, 0.5, 1.0, 2.0])
    out = warp_logits(logits, temperature, torch.tensor([0, 0, 10, 99]), torch.ones(4))
    expected = logits / torch.tensor([1.0, 0.5, 1.0, 2.0]).unsqueeze(1)
    assert torch.equal(out, expected)


def test_warp_logits_bf16_input():
    # Seeded: bf16 logits tie often, and a tie at the top-k / top-p boundary may keep another of the tied tokens
    # than transformers does (33 of 2,400 rows over seeds 0..299); unseeded, the test failed by test order.
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = warp_logits(logits, torch.full((8,), 0.8), torch.full((8,), 7), torch.full((8,), 0.9))
    assert out.dtype == torch.float32
    for i in range(8):
        assert torch.equal(out[i], hf_warp(logits[i].float(), 0.8, 7, float(torch.tensor(0.9))))


def test_probs_from_logits_sampled_and_greedy():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 40, generator=g)
    temperature = torch.tensor([1.0, 0.0, 0.5, 0.0, 2.0, 1.0])
    top_k = torch.tensor([0, 5, 10, 0, 3, 0])
    top_p = torch.tensor([1.0, 0.5, 0.9, 1.0, 1.0, 0.3])
    probs = probs_from_logits(logits, temperature, top_k, top_p)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(6))
    for i in range(6):
        if temperature[i] == 0:
            expected = torch.zeros(40)
            expected[logits[i].argmax()] = 1.0
        else:
            expected = hf_warp(logits[i], float(temperature[i]), int(top_k[i]), float(top_p[i])).softmax(-1)
        assert torch.equal(probs[i], expected), i


def test_probs_from_logits_nan_inf_rows():
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([
        [nan, 1.0, 2.0, nan],      # NaN counts as -inf
        [nan, nan, nan, nan],      # nothing finite: token 0
        [-inf, -inf, -inf, -inf],  # nothing finite: token 0
        [1.0, inf, 0.0, inf],      # +inf entries share the mass
        [nan, -inf, inf, inf],     # no finite entry: token 0
        [nan, 3.0, nan, 5.0],      # greedy ignores NaN
        [-inf, -inf, 2.0, -inf],   # one finite entry
    ])
    temperature = torch.tensor([1.0, 1.0, 0.0, 0.7, 1.0, 0.0, 0.5])
    top_k = torch.tensor([0, 2, 0, 0, 0, 0, 1])
    top_p = torch.tensor([1.0, 0.5, 1.0, 0.9, 1.0, 1.0, 0.5])
    probs = probs_from_logits(logits, temperature, top_k, top_p)
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(7))
    e = torch.tensor(1.0).exp()
    torch.testing.assert_close(probs[0], torch.tensor([0.0, 1 / (1 + e), e / (1 + e), 0.0]))
    for i in (1, 2, 4):
        assert probs[i].tolist() == [1.0, 0.0, 0.0, 0.0], i
    # top-p 0.9 over two equal +inf entries keeps both
    assert probs[3].tolist() == [0.0, 0.5, 0.0, 0.5]
    assert probs[5].tolist() == [0.0, 0.0, 0.0, 1.0]
    assert probs[6].tolist() == [0.0, 0.0, 1.0, 0.0]
    tok = sample(probs, torch.empty(7, 4).exponential_())
    assert ((tok >= 0) & (tok < 4)).all()


def test_sample_matches_distribution():
    g = torch.Generator().manual_seed(7)
    vocab, n = 8, 40000
    logits = torch.randn(1, vocab, generator=g) * 1.5
    probs = probs_from_logits(logits, torch.tensor([0.8]), torch.tensor([6]), torch.tensor([0.95]))[0]
    assert (probs == 0).any()  # top-k / top-p removed something
    noise = torch.empty(n, vocab).exponential_(generator=g)
    tok = sample(probs.expand(n, vocab), noise)
    stat, df = chi2_stat(torch.bincount(tok, minlength=vocab), probs)
    assert stat < chi2_critical(df), stat


def test_sample_detects_wrong_distribution():
    """The chi-square check has power: counts from a different distribution fail it."""
    g = torch.Generator().manual_seed(8)
    vocab, n = 8, 40000
    probs = torch.softmax(torch.randn(vocab, generator=g), -1)
    other = torch.softmax(torch.log(probs) + 0.1 * torch.randn(vocab, generator=g), -1)
    tok = sample(other.expand(n, vocab), torch.empty(n, vocab).exponential_(generator=g))
    stat, df = chi2_stat(torch.bincount(tok, minlength=vocab), probs)
    assert stat > chi2_critical(df)


def test_sample_greedy_ignores_noise():
    logits = torch.randn(5, 30)
    probs = probs_from_logits(logits, torch.zeros(5), torch.zeros(5, dtype=torch.int64), torch.ones(5))
    for noise in (torch.empty(5, 30).exponential_(), torch.zeros(5, 30), torch.full((5, 30), float("inf"))):
        assert torch.equal(sample(probs, noise), logits.argmax(-1))


def test_request_random_reproducible_and_independent_streams():
    a, b = RequestRandom(1234), RequestRandom(1234)
    assert torch.equal(uniforms([a.draft], 16), uniforms([b.draft], 16))
    assert torch.equal(exponentials([a.sampler], 100), exponentials([b.sampler], 100))
    c = RequestRandom(1234)
    assert not torch.equal(uniforms([c.draft], 16), uniforms([c.sampler], 16))
    assert not torch.equal(uniforms([RequestRandom(1).sampler], 16), uniforms([RequestRandom(2).sampler], 16))
    # draws on the draft stream do not move the sampler stream
    d, e = RequestRandom(99), RequestRandom(99)
    uniforms([d.draft], 5)
    assert torch.equal(uniforms([d.sampler], 4), uniforms([e.sampler], 4))


def test_request_random_independent_of_batch():
    seeds = [5, 17, -3, 2**40]
    alone = []
    for s in seeds:
        r = RequestRandom(s)
        alone.append((uniforms([r.sampler], 3)[0], exponentials([r.sampler], 20)[0]))
    for order in ([0, 1, 2, 3], [3, 1], [2, 0, 3]):
        rs = [RequestRandom(seeds[i]) for i in order]
        u = uniforms([r.sampler for r in rs], 3)
        x = exponentials([r.sampler for r in rs], 20, device="cpu")
        assert u.shape == (len(order), 3) and x.shape == (len(order), 20)
        assert u.dtype == x.dtype == torch.float32
        for row, i in enumerate(order):
            assert torch.equal(u[row], alone[i][0]) and torch.equal(x[row], alone[i][1])
    assert (x > 0).all() and ((u >= 0) & (u < 1)).all()
    assert uniforms([], 4).shape == (0, 4) and uniforms([RequestRandom(0).sampler], 0).shape == (1, 0)


@pytest.mark.parametrize("vocab", [1, 7, 4096, 49157])
def test_exp_noise_kernel_equals_numpy_and_is_exponential(vocab):
    """The C++ noise equals its numpy twin exactly (float32; seeds across the uint64 range), and 2M draws pass a
    Kolmogorov-Smirnov test against Exp(1) at the 1 % level (D < 1.63 / sqrt(n)), the tails' counts within 4 sigma."""
    from minispec.kernels import cpu
    from minispec.sample.random import exp_noise_numpy

    if cpu.ops() is None:
        pytest.skip("the C++ kernels could not be built")
    seeds = np.array([0, 1, 2**63 - 1, 2**63, 2**64 - 1, 12345678901234567], dtype=np.uint64)
    got = cpu.ops().exp_noise(torch.from_numpy(seeds.view(np.int64)), vocab).numpy()
    np.testing.assert_array_equal(got, exp_noise_numpy(seeds, vocab))
    n_rows = -(-2_000_000 // vocab)
    x = cpu.ops().exp_noise(torch.arange(n_rows, dtype=torch.int64), vocab).numpy().ravel()[:2_000_000]
    assert (x > 0).all() and np.isfinite(x).all()
    xs = np.sort(x.astype(np.float64))
    n = len(xs)
    d = np.max(np.maximum(np.arange(1, n + 1) / n - (1 - np.exp(-xs)), (1 - np.exp(-xs)) - np.arange(n) / n))
    assert d < 1.63 / np.sqrt(n), d
    for count, p in (((x > 10).sum(), np.exp(-10)), ((x < 1e-3).sum(), -np.expm1(-1e-3))):  # 4 sigma
        assert abs(count - n * p) < 4 * np.sqrt(n * p), (count, n * p)


def test_finite_fast_path_equals_sanitising_path():
    """probs_from_logits takes a shortcut for finite rows; it must equal the general (sanitising) path."""
    from minispec.sample import sampler

    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        n, v = 6, 50
        logits = torch.randn(n, v, generator=g) * 3
        logits[0, :10] = float("-inf")  # masked entries are allowed on the fast path
        temp = torch.tensor([0.0, 1.0, 0.7, 0.0, 1.3, 1.0])
        top_k = torch.randint(0, 8, (n,), generator=g)
        top_p = torch.where(torch.rand(n, generator=g) < 0.5, torch.rand(n, generator=g) * 0.9 + 0.1,
                            torch.ones(n))
        fast = sampler.probs_from_logits(logits, temp, top_k, top_p)
        # The general path: force it by comparing against a row set that holds one NaN row.
        with_nan = torch.cat([logits, torch.full((1, v), float("nan"))])
        slow = sampler.probs_from_logits(with_nan, torch.cat([temp, torch.ones(1)]),
                                         torch.cat([top_k, torch.zeros(1, dtype=top_k.dtype)]),
                                         torch.cat([top_p, torch.ones(1)]))[:n]
        assert torch.allclose(fast, slow, atol=1e-6, rtol=0), trial
        greedy_only = sampler.probs_from_logits(logits, torch.zeros(n), top_k, top_p)
        assert torch.equal(greedy_only.argmax(-1), logits.argmax(-1)) and torch.all(greedy_only.sum(-1) == 1)


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-8])
def test_tiny_temperatures_keep_the_argmax(temperature):
    """logits / T overflowed at T = 1e-40 (every logit above 3.4e-2 became the largest float, so token 0 or, after
    top-k, every overflowing token won): rows below SHIFT_BELOW_T are divided after subtracting their maximum.
    The limit law: one-hot at the argmax, uniform over tied maxima, with or without top-k / top-p."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=g) * 3
    logits[5, [7, 30]] = logits[5].max() + 1.0  # a tie
    n = logits.shape[0]
    for top_k, top_p in ((0, 1.0), (5, 1.0), (0, 0.9), (5, 0.9)):
        probs = probs_from_logits(logits, torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p))
        want = torch.nn.functional.one_hot(logits.argmax(-1), 40).float()
        want[5] = 0.0
        want[5, [7, 30]] = 0.5
        assert torch.equal(probs, want), (top_k, top_p)
        assert torch.isfinite(warp_logits(logits, torch.full((n,), temperature), torch.full((n,), top_k),
                                          torch.full((n,), top_p)).amax(-1)).all()
