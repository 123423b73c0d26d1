"""The fused C++ CPU kernels (kernels/fused_cpu.cpp) against their torch references.

Tolerances: float32 with a different rounding order, rtol 1e-5 / atol 1e-6 (attention atol 1e-5).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from minispec.kernels import cpu
from minispec.layers.activation import silu_mul
from minispec.layers.attention import AttentionMetadata, ForwardBatch, attention, causal_mask
from minispec.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(cpu.ops() is None, reason="the fused C++ kernels could not be built")


@pytest.mark.parametrize("shape", [(1, 576), (3, 5, 64), (2, 37)])
def test_add_rms_norm(shape):
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(shape, generator=g), torch.randn(shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    ops = cpu.ops()
    torch.testing.assert_close(ops.add_rms_norm(x, None, w, 1e-5), F.rms_norm(x, w.shape, w, 1e-5),
                               rtol=1e-5, atol=1e-6)
    ref_res = x + r
    ref = F.rms_norm(ref_res, w.shape, w, 1e-5)
    out = ops.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(r, ref_res), "the residual is updated in place with one rounding, as x + r"
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("vocab", [1, 7, 8, 49152, 49157])
def test_greedy_argmax_equals_torch(vocab):
    """greedy_argmax == (argmax of the sanitised logits, isfinite(amax)) exactly: ties go to the first index, NaN
    counts as -inf, +inf as the largest float32; rows with NaN, +inf, only -inf, ties across lanes and the tail."""
    from minispec.sample.sampler import _sanitize

    g = torch.Generator().manual_seed(vocab)
    rows = [torch.randn(vocab, generator=g) for _ in range(4)]
    rows.append(torch.full((vocab,), float("-inf")))
    rows.append(torch.full((vocab,), float("nan")))
    for special in (float("nan"), float("inf"), float("-inf"), 3.0e38):
        r = torch.randn(vocab, generator=g)
        r[torch.randint(0, vocab, (max(1, vocab // 3),), generator=g)] = special
        rows.append(r)
    r = torch.randint(0, 3, (vocab,), generator=g).float()  # many ties of the maximum, in every lane
    rows.append(r)
    r = torch.zeros(vocab)
    r[-1] = 1.0  # the maximum in the tail
    rows.append(r)
    logits = torch.stack(rows)
    tokens, finite = cpu.ops().greedy_argmax(logits)
    assert torch.equal(tokens, _sanitize(logits).argmax(dim=-1))
    assert torch.equal(finite, torch.isfinite(logits.amax(dim=-1)))


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 49152, 49157])
def test_exp_race_equals_torch(vocab):
    """exp_race == sampler.sample's torch form, argmax(probs / clamp(noise)), exactly: ties in and across lanes and in
    the tail go to the first index; noise at 0 and inf is clamped; zero rows."""
    from minispec.sample.sampler import NOISE_MAX, NOISE_MIN

    g = torch.Generator().manual_seed(vocab)
    probs = torch.softmax(3 * torch.randn(8, vocab, generator=g), -1)
    noise = torch.empty(8, vocab).exponential_(generator=g)
    probs[1] = (probs[1] * 4).round() / 4  # ties of the score with constant noise
    noise[1] = 1.0
    probs[2] = 0.0  # all scores 0: token 0
    noise[3, : vocab // 2] = 0.0  # clamped to NOISE_MIN: ties at p / 1e-30
    noise[4, ::3] = float("inf")
    probs[5] = 1.0 / vocab  # uniform, noise tied too
    noise[5] = 2.0
    probs[6] = 0.0
    probs[6, -1] = 1.0  # the maximum in the tail
    want = (probs / noise.clamp(NOISE_MIN, NOISE_MAX)).argmax(dim=-1)
    assert torch.equal(cpu.ops().exp_race(probs, noise, NOISE_MIN, NOISE_MAX), want)


@pytest.mark.parametrize("vocab", [1, 17, 1000, 49152])
def test_temperature_softmax_against_torch(vocab):
    """softmax(logits / t) within 4 float32 ulps (relative 5e-7 on entries above 1e-30) of the float64 softmax of the
    float32 differences l / t - max(l / t) that torch's softmax and the kernel both form; -inf logits get exactly 0;
    rows with NaN, +inf or only -inf come back not ok."""
    g = torch.Generator().manual_seed(vocab)
    logits = 4 * torch.randn(7, vocab, generator=g)
    logits[1, ::2] = float("-inf")  # a draft row over a subset of the vocabulary
    logits[1, -1] = 2.0
    t = torch.tensor([1.0, 0.8, 0.05, 1.7, 1.0, 1.0, 1.0])
    logits[4, 0] = float("nan")
    logits[5, -1] = float("inf")
    logits[6] = float("-inf")
    probs, ok = cpu.ops().temperature_softmax(logits, t)
    assert ok.tolist() == [True] * 4 + [False] * 3
    q = logits[:4] / t[:4, None]  # [4, V] float32, as torch's softmax and the kernel divide
    want = torch.softmax((q - q.amax(-1, keepdim=True)).double(), dim=-1)  # [4, V] float64 of the float32 differences
    got = probs[:4].double()
    big = want > 1e-30
    assert ((got[big] - want[big]).abs() <= 5e-7 * want[big]).all()
    assert (got[~big] <= 1e-30).all()
    assert (got[1][logits[1] == float("-inf")] == 0).all()
    torch.testing.assert_close(got.sum(-1), want.sum(-1), rtol=0, atol=1e-6)  # rows sum to 1 (float32 rounding aside)


def test_rejection_sample_probs_equals_the_reference():
    """The C++ kernel == rejection_sample_ref on the same p, q exactly: 300 random batches over 1..6 logits positions
    a request and vocabularies 5 .. 49,152 (stale, out-of-range and -1 drafts, q zero on half the vocabulary, tied
    probabilities and constant noise), and the zero-residual fallback to p."""
    import itertools

    from minispec.spec_decode.rejection_sampler import rejection_sample_cpu, rejection_sample_ref

    for seed in range(300):
        g = torch.Generator().manual_seed(seed)
        vocab = [5, 17, 200, 1000, 49152][seed % 5] if seed % 10 else 49152
        rows = torch.randint(1, 7, (1 + seed % 7,), generator=g).tolist()
        cu = torch.tensor([0, *itertools.accumulate(rows)])
        n, num_logits = len(rows), int(cu[-1])
        p = torch.softmax(3 * torch.randn(num_logits, vocab, generator=g), -1)
        q = torch.softmax(3 * torch.randn(num_logits, vocab, generator=g), -1)
        if seed % 3 == 0:
            q[:, ::2] = 0.0
        if seed % 4 == 0:
            p, q = (p * 8).round() / 8, (q * 8).round() / 8
        if seed % 9 == 0:
            p = q.clone()  # every residual is zero: a rejected draft is redrawn from p
        drafts = torch.multinomial(q + 1e-9, 1, generator=g).squeeze(1)
        drafts[cu[1:] - 1] = -1
        drafts[torch.rand(num_logits, generator=g) < 0.1] = vocab + 2
        drafts[torch.rand(num_logits, generator=g) < 0.05] = -1
        stale = (torch.rand(num_logits, generator=g) < 0.1) if seed % 2 else None
        u = torch.rand(n, max(rows) + seed % 2, generator=g)
        noise = torch.empty(n, vocab).exponential_(generator=g)
        if seed % 6 == 0:
            noise[:] = 1.0
        want = rejection_sample_ref(p, q, drafts, stale, cu, u, noise)
        got = rejection_sample_cpu(p, q, drafts, stale, cu, u, noise)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), seed


@pytest.mark.parametrize("shape", [(1, 3072), (4, 3, 34)])
def test_silu_mul(shape):
    gate_up = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 8
    gate_up[..., 0] = 100.0  # saturated ends of the exp
    gate_up[..., 1] = -100.0
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_heads,n_kv,head_dim", [(9, 3, 64), (4, 4, 16), (4, 1, 24), (2, 1, 96)])
@pytest.mark.parametrize("slots,starts,lens", [
    ([0], [40], [1]),  # batch-1 decode
    ([1], [7], [3]),  # a verify of 2 drafts
    ([2, 0], [13, 0], [2, 4]),  # slots out of order, a fresh request, padding (8 tokens)
    ([1, 2], [0, 5], [24, 17]),  # a prompt beside a prefill chunk: 48 tokens, the most the fused path takes on AVX2
])
def test_rope_cache_attend(n_heads, n_kv, head_dim, slots, starts, lens):
    """RoPE + cache write + attention: the fused kernel against the torch path (rope, index_copy_, SDPA)."""
    g = torch.Generator().manual_seed(2)
    cfg = LlamaConfig(hidden_size=n_heads * head_dim, num_attention_heads=n_heads, num_key_value_heads=n_kv)
    rotary = RotaryEmbedding(cfg, head_dim)
    queries = [torch.randint(0, 9, (n,), generator=g).tolist() for n in lens]
    batch = ForwardBatch.build(slots, starts, queries, 3, "cpu")
    B, L = batch.input_ids.shape
    caches = torch.randn(2, 4, 64, n_kv, head_dim, generator=g)  # k and v, 3 slots + scratch
    qkv = torch.randn(B, L, (n_heads + 2 * n_kv) * head_dim, generator=g)
    freqs_cis = rotary(batch.positions)
    meta = AttentionMetadata.build(batch, freqs_cis, caches[0], n_heads // n_kv)
    assert meta.fused
    ref_meta = AttentionMetadata(batch, freqs_cis, meta.write_index, causal_mask(batch.positions, batch.max_ctx,
                                                                                 n_heads // n_kv), fused=False)
    ref_caches = caches.clone()
    out = attention(qkv.clone(), meta, caches[0], caches[1], n_heads)
    ref = attention(qkv.clone(), ref_meta, ref_caches[0], ref_caches[1], n_heads)
    real = torch.tensor([[j < n for j in range(L)] for n in lens])  # padded rows are garbage in both
    torch.testing.assert_close(out[real], ref[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[:, :3], ref_caches[:, :3], rtol=1e-6, atol=1e-6)
