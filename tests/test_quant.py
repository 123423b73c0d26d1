"""Packed weights (layers/quant.py): dequantisation equals gguf's, and the packed linear layer equals
the float32 layer over the dequantised weight (F.linear), relative tolerance 1e-5."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES, quants

from minispec.kernels import build_cpp
from minispec.kernels.cpu import CFLAGS, SOURCES, ops
from minispec.kernels.ggml import PACKED_TYPES, SPLIT_OF, TILES_OF, file_type
from minispec.layers.quant import (PackedWeight, dequantize_ref, embedding, join_rows, kernel_layout, kernel_qtype,
                                  linear, linear_ref, untile_rows)
from minispec.models.loader import load_model
from tests.utils import decode_layers_both_ways, make_tiny_gguf

TYPES = {"Q4_0": T.Q4_0, "Q4_1": T.Q4_1, "Q8_0": T.Q8_0, "F16": T.F16, "BF16": T.BF16}
SPLIT = {"Q4_0 split": "Q4_0", "Q4_1 split": "Q4_1"}  # the memory-only layouts, made from gguf's rows
TILES = {"Q4_0 tiles": "Q4_0", "Q4_1 tiles": "Q4_1"}  # ... in groups of 16 rows (n a multiple of 16)
LAYOUTS = list(TYPES) + list(SPLIT)
# Activation rows that reach each path of the C++ op: one row; AVX-512 tiles of 4 weight rows (2-5 rows of x),
# of 2 (6-8), 8 and a remainder (9, 17), chunks of 64 rows of x (70); AVX2 tiles of 4-8, its dequantised panels
# (9, 16, 17: pairs of rows of x and an odd one); and, past the packed op's limit (PACKED_MAX_ROWS: 48, 96 or 256), the
# dequantised weight's GEMM.
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 70, 258]


def packed(name: str, n: int, k: int, seed: int = 0) -> tuple[PackedWeight, np.ndarray]:
    """A random [n, k] weight quantised by gguf (split for a SPLIT name, tiled for a TILES one), and gguf's own
    dequantisation of it."""
    if name in SPLIT:
        w, ref = packed(SPLIT[name], n, k, seed)
        return w.split(), ref
    if name in TILES:
        w, ref = packed(TILES[name], n, k, seed)
        return w.as_type(TILES_OF[w.qtype]), ref
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.02).astype(np.float32)
    raw = quants.quantize(w, TYPES[name])  # [n, row bytes] uint8 (F16: float16, BF16: uint16 values)
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1)
    ref = quants.dequantize(raw, TYPES[name]).astype(np.float32).reshape(n, k)
    return PackedWeight(torch.from_numpy(raw.copy()), int(TYPES[name]), k), ref


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", LAYOUTS)
def test_dequantize_matches_gguf(name):
    w, ref = packed(name, 7, 96)
    assert torch.equal(dequantize_ref(w.data, w.qtype, 96), torch.from_numpy(ref))
    assert torch.equal(w.dequantize(), torch.from_numpy(ref))  # the C++ op where built


@pytest.mark.parametrize("name", LAYOUTS)
# 32: whole groups of 16 rows (AMX); 1056: the AVX2 panels' k in parts of 512, the last 32 (PANEL_K)
@pytest.mark.parametrize("n,k", [(37, 96), (5, 160), (9, 576), (32, 96), (7, 1056)])
@pytest.mark.parametrize("rows", ROWS)
def test_packed_linear_equals_float32_layer(name, n, k, rows):
    """Packed layer == F.linear over the dequantised weight, rel tol 1e-5 (summation order only)."""
    w, ref = packed(name, n, k, seed=rows)
    x = torch.randn(rows, k)
    expected = F.linear(x, torch.from_numpy(ref))
    assert rel_err(linear(x, w), expected) < 1e-5
    assert rel_err(linear_ref(x, w), expected) < 1e-5


@pytest.mark.parametrize("name", ["F16", "BF16"])
def test_packed_linear_odd_width(name):
    """F16 / BF16 rows need not be whole blocks."""
    w, ref = packed(name, 9, 37)
    x = torch.randn(3, 1, 37)
    assert rel_err(linear(x, w), F.linear(x, torch.from_numpy(ref))) < 1e-5


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17])
@pytest.mark.parametrize("k", [64, 100, 576])
def test_dense_linear_equals_float64_layer(rows, k):
    """A dense float32 layer on CPU (linear -> the C++ dense_linear): each weight row read once for up to 16
    rows, against the float64 layer (rel tol 1e-5); with a bias, and through linear's [..., K] shapes."""
    if ops() is None:
        pytest.skip("no C++ compiler: linear is F.linear")
    torch.manual_seed(rows * 1000 + k)
    x, w, b = torch.randn(rows, 1, k), torch.randn(37, k), torch.randn(37)
    ref = F.linear(x.double(), w.double(), b.double())
    assert rel_err(linear(x, w, b).double(), ref) < 1e-5
    assert rel_err(linear(x, w).double(), ref - b.double()) < 1e-5
    if rows > 16:  # more rows: at::linear's GEMM, as F.linear
        assert torch.equal(linear(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("onednn", [True, False])
def test_prefill_gemm_equals_float64_layer(onednn, monkeypatch):
    """The prefill's GEMM, oneDNN's (AVX-512 CPUs; here whatever the CPU, where torch has it) and F.linear, against
    the float64 layer, rel tol 1e-5."""
    import minispec.layers.quant as quant

    op = quant.onednn_linear() if onednn else None
    if onednn and op is None:
        pytest.skip("this torch has no oneDNN linear")
    monkeypatch.setattr(quant, "_ONEDNN_LINEAR", op)
    torch.manual_seed(0)
    x, w = torch.randn(300, 576), torch.randn(200, 576)
    assert rel_err(quant.gemm(x, w).double(), x.double() @ w.double().T) < 1e-5


def test_dense_linear_leaves_gradients_to_torch():
    """The kernels have no backward: a layer whose weight wants a gradient stays F.linear (distillation)."""
    w = torch.randn(8, 64, requires_grad=True)
    y = linear(torch.randn(2, 64), w)
    y.sum().backward()
    assert w.grad is not None and w.grad.shape == w.shape


def test_packed_linear_bias_and_bf16_activations():
    w, ref = packed("Q4_1", 11, 64)
    bias = torch.randn(11)
    x = torch.randn(2, 64)
    assert rel_err(linear(x, w, bias), F.linear(x, torch.from_numpy(ref), bias)) < 1e-5
    y = linear(x.bfloat16(), w, bias.bfloat16())
    assert y.dtype == torch.bfloat16 and y.shape == (2, 11)


@pytest.mark.parametrize("name", LAYOUTS)
def test_tp_shards_split_on_blocks(name):
    """Row shards (column-parallel) and block-aligned column shards (row-parallel) are the dequantised slices."""
    w, ref = packed(name, 8, 128)
    assert torch.equal(w.rows(2, 4).dequantize(), torch.from_numpy(ref[2:6]))
    assert torch.equal(w.cols(64, 64).dequantize(), torch.from_numpy(ref[:, 64:128]))
    x = torch.randn(2, 64)
    assert rel_err(linear(x, w.cols(32, 64)), F.linear(x, torch.from_numpy(ref[:, 32:96]))) < 1e-5


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q4_1 split"])
def test_misaligned_column_shard_is_an_error(name):
    w, _ = packed(name, 4, 96)
    with pytest.raises(ValueError, match="not block-aligned"):
        w.cols(48, 48)


def test_block_type_needs_whole_blocks():
    with pytest.raises(ValueError, match="whole blocks of 32"):
        PackedWeight(torch.zeros(2, 20, dtype=torch.uint8), int(T.Q4_1), 40)


def test_cpp_kernel_built():
    """The C++ op builds on this machine (gcc and Python headers are present in CI)."""
    assert ops() is not None
    assert ops().PACKED_ISA in ("avx512", "avx2", "portable")


def test_one_block_table():
    """kernels/ggml.py's formats are gguf's (names, values and bytes per block) and the C++ kernels' own table."""
    files = {t: f for t, f in PACKED_TYPES.items() if file_type(t) == t}
    assert {t: (f.name, f.block_values, f.block_bytes) for t, f in files.items()} == \
        {int(t): (T(t).name, *GGML_QUANT_SIZES[T(t)]) for t in files}
    assert all(PACKED_TYPES[s][1:] == PACKED_TYPES[t][1:] for t, s in SPLIT_OF.items())  # same bytes per block
    assert {t: (b, v) for t, b, v in ops().block_formats()} == \
        {t: (f.block_bytes, f.block_values) for t, f in PACKED_TYPES.items()}


NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]


@pytest.mark.parametrize("isa,flags", [("avx512", NO_AMX), ("avx2", ["-mno-avx512f"]),
                                       ("portable", ["-mno-avx512f", "-mno-avx2", "-mno-fma"])])
def test_narrower_builds_equal_float32_layer(isa, flags, tmp_path, monkeypatch):
    """The paths this CPU does not take by default, built without its wider instructions (a second build, cached):
    every block type and tile shape against F.linear over the dequantised weight, rel tol 1e-5. avx512: the AVX-512
    paths an AMX machine leaves for 9+ rows of x. The build's decode_layers in one parallel region equals its op-by-op
    path (torch.equal)."""
    if ops() is None or ops().PACKED_ISA == "portable" or (isa == "avx2" and ops().PACKED_ISA == "avx2") or \
            (isa == "avx512" and not ops().packed_amx()):
        pytest.skip(f"this CPU's own build is the {isa} one (or none): the other tests run it")
    ext = build_cpp(f"cpu_{isa}", SOURCES, CFLAGS + flags, f"the {isa} C++ kernels")
    assert ext is not None and ext.PACKED_ISA == isa and not ext.packed_amx()
    for name in LAYOUTS:
        w, ref = packed(name, 32, 96, seed=1)
        for rows in ROWS[:-1]:
            x = torch.randn(rows, 96)
            assert rel_err(ext.packed_linear(x, w.data, w.qtype, 96), F.linear(x, torch.from_numpy(ref))) < 1e-5, \
                (name, rows)
        assert torch.equal(ext.packed_dequantize(w.data, w.qtype, 96), torch.from_numpy(ref))
    logits = torch.randn(3, 1001)
    logits[1, ::7], logits[2, 500] = float("nan"), float("inf")
    tokens, finite = ext.greedy_argmax(logits)  # fused_cpu.cpp's, built the same way
    assert torch.equal(tokens, torch.nan_to_num(logits, nan=float("-inf")).argmax(dim=-1))
    assert finite.tolist() == [True, False, False]
    narrower_sampling_and_attention(ext)
    model = load_model(make_tiny_gguf(tmp_path / "tiny.gguf", qtype="Q4_1", seed=4), dtype=torch.float32,
                       device="cpu").model
    for one, op_by_op in decode_layers_both_ways(ext, model, monkeypatch):
        assert all(torch.equal(a, b) for a, b in zip(one, op_by_op))


def narrower_sampling_and_attention(ext):
    """fused_cpu.cpp's sampling kernels and attention in a narrower build: the noise and the rejection sampler equal
    their references exactly, the softmax within 5e-7 relative, the attention within 1e-5 of this CPU's build."""
    import numpy as np

    from minispec.sample.random import exp_noise_numpy
    from minispec.sample.sampler import NOISE_MAX, NOISE_MIN
    from minispec.spec_decode.rejection_sampler import rejection_sample_ref

    g = torch.Generator().manual_seed(5)
    seeds = np.array([3, 2**64 - 5], dtype=np.uint64)
    noise = ext.exp_noise(torch.from_numpy(seeds.view(np.int64)), 1001)
    assert torch.equal(noise, torch.from_numpy(exp_noise_numpy(seeds, 1001)))
    p, q = (torch.softmax(2 * torch.randn(5, 1001, generator=g), -1) for _ in range(2))
    assert torch.equal(ext.exp_race(p[:2].contiguous(), noise, NOISE_MIN, NOISE_MAX),
                       (p[:2] / noise.clamp(NOISE_MIN, NOISE_MAX)).argmax(-1))
    cu, drafts = torch.tensor([0, 3, 5]), torch.tensor([int(q[0].argmax()), 7, -1, 1500, -1])
    u = torch.rand(2, 2, generator=g)
    want = rejection_sample_ref(p, q, drafts, None, cu, u, noise)
    got = ext.rejection_sample_probs(p, q, drafts, torch.empty(0, dtype=torch.bool), cu, u, noise, NOISE_MIN,
                                     NOISE_MAX)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    logits, t = 3 * torch.randn(2, 1001, generator=g), torch.tensor([0.7, 1.3])
    probs, ok = ext.temperature_softmax(logits, t)
    want = torch.softmax(logits / t[:, None], -1)
    assert ok.all() and ((probs - want).abs() <= 5e-7 * want + 1e-30).all()
    n_heads, n_kv, hd, ctx = 9, 3, 64, 20
    args = (torch.randn(2, (n_heads + 2 * n_kv) * hd, generator=g), torch.randn(2, hd // 2, 2, generator=g))
    caches = [torch.randn(3, 32, n_kv, hd, generator=g) for _ in range(2)]
    idx = (torch.tensor([ctx, 32 + ctx]), torch.tensor([ctx, ctx]), torch.tensor([0, 1]))
    mine = ops().rope_cache_attend(args[0].clone(), args[1], *[c.clone() for c in caches], *idx, n_heads, n_kv, 0.125)
    theirs = ext.rope_cache_attend(args[0].clone(), args[1], *[c.clone() for c in caches], *idx, n_heads, n_kv, 0.125)
    torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(TYPES))
def test_triton_kernel_matches_reference(name):
    """The Triton kernel (TRITON_INTERPRET=1 on CPU tensors) against the torch reference, tiny shapes."""
    from minispec.kernels.packed_triton import packed_linear_triton

    w, ref = packed(name, 5, 64 if name[0] == "Q" else 40)
    x = torch.randn(2, w.in_features)
    got = packed_linear_triton(x, w.data, w.qtype, w.in_features, block_n=4, block_b=32)
    assert rel_err(got, F.linear(x, torch.from_numpy(ref))) < 1e-5


def test_a_stale_build_lock_is_cleared(tmp_path, capsys):
    """An interrupted build leaves torch's lock file, on which every later build would wait for ever: one older than
    STALE_LOCK_S goes (with a line saying so), a fresh one (a build running now) stays."""
    import os
    import time

    from minispec.kernels import STALE_LOCK_S, clear_stale_lock

    lock = tmp_path / "lock"
    lock.touch()
    assert not clear_stale_lock(tmp_path) and lock.exists()
    old = time.time() - STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path) and not lock.exists()
    assert "removed a stale build lock" in capsys.readouterr().err
    assert not clear_stale_lock(tmp_path)  # no lock: nothing to do


@pytest.mark.parametrize("name", list(SPLIT))
def test_split_rows_hold_the_files_bytes(name):
    """split_rows only reorders a row's bytes: join_rows gives the file's rows back, and kernel_layout splits
    exactly where the one-row kernel reads split rows (the AVX-512 build)."""
    w, _ = packed(SPLIT[name], 6, 320)
    s = w.split()
    assert s.qtype == SPLIT_OF[w.qtype] and s.data.shape == w.data.shape
    assert torch.equal(join_rows(s.data, s.qtype), w.data) and torch.equal(s.joined().data, w.data)
    assert torch.equal(torch.sort(s.data.flatten()).values, torch.sort(w.data.flatten()).values)
    assert kernel_layout(w).qtype == (s.qtype if ops() is not None and ops().PACKED_SPLIT else w.qtype)
    assert s.to("cpu").qtype == s.qtype


@pytest.mark.parametrize("name", list(TILES))
def test_tiled_rows_hold_the_files_bytes(name):
    """tile_rows only reorders a group's bytes: untile_rows gives the file's rows back, the values dequantise as gguf's,
    kernel_layout tiles exactly where the AMX kernel runs and the rows are whole groups of 16, a tiled weight refuses
    other row counts, its rows / columns / permuted rows come out as the file's would, and rows looked up by id
    (embedding) dequantise to the file's rows exactly."""
    w, ref = packed(TILES[name], 48, 320)
    t = w.as_type(TILES_OF[w.qtype])
    assert t.tiled and t.data.shape == w.data.shape and not torch.equal(t.data, w.data)
    assert torch.equal(untile_rows(t.data, t.qtype), w.data) and torch.equal(t.joined().data, w.data)
    assert torch.equal(t.split().joined().data, w.data)
    assert torch.equal(dequantize_ref(t.data, t.qtype, 320), torch.from_numpy(ref))
    assert torch.equal(t.dequantize(), torch.from_numpy(ref))  # the C++ op's tiled unpacking where built
    amx = ops() is not None and ops().packed_amx()
    assert kernel_layout(w).qtype == (t.qtype if amx else kernel_qtype(w.qtype, "cpu", 40))
    assert kernel_layout(w.rows(0, 40)).qtype != t.qtype and kernel_qtype(w.qtype, "cpu", 40) != t.qtype
    with pytest.raises(ValueError, match="whole groups of 16 rows; got 40"):
        PackedWeight(w.data[:40].clone(), t.qtype, 320)
    assert torch.equal(t.rows(16, 32).data, t.data[16:48]) and t.rows(16, 32).tiled  # whole groups: a view
    assert torch.equal(t.rows(3, 21).joined().data, w.data[3:24])  # else the file's rows
    assert torch.equal(t.cols(64, 96).joined().data, w.cols(64, 96).data) and t.cols(64, 96).tiled
    flip = t.permute_rows(lambda d: d.flip(0))
    assert flip.tiled and torch.equal(flip.joined().data, w.data.flip(0))
    x = torch.randn(300, 320, generator=torch.Generator().manual_seed(0))  # past PACKED_MAX_ROWS: still the packed op
    assert rel_err(linear(x, t), x @ torch.from_numpy(ref).T) < 1e-5
    ids = torch.tensor([[47, 0, 16], [15, 31, 47]])
    assert torch.equal(embedding(ids, t, torch.float32), torch.from_numpy(ref)[ids])
    if ops() is not None:
        with pytest.raises(RuntimeError, match="row 48 outside the weight's 48 rows"):
            ops().packed_rows(t.data, t.qtype, 320, torch.tensor([48]))


@pytest.mark.parametrize("name", list(SPLIT))
@pytest.mark.parametrize("blocks", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 18, 48])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
def test_split_kernel_every_run_and_tail(name, blocks, rows):
    """The split rows' kernels (runs of 4 blocks under AVX-512, 2 under AVX2, then the rest one at a time, the minima
    16 or 8 blocks per step; 1-8 rows of x) against the float64 layer over gguf's dequantisation, activations from 1e-6 to 1e6. It computes
    d (q . x) + m sum(x) per block, so its rounding is relative to sum (|d q| + |m|) |x| (Q4_0: m = -8 d): rel tol
    1e-5 of that."""
    w, ref = packed(name, 13, 32 * blocks, seed=blocks)
    g = torch.Generator().manual_seed(blocks)
    x = torch.randn(rows, 32 * blocks, generator=g) * torch.logspace(-6, 6, 32 * blocks)[torch.randperm(32 * blocks, generator=g)]
    raw = w.joined().data.view(13, blocks, -1)  # [N, G, block bytes] in the file's layout
    d = raw[..., 0:2].contiguous().view(torch.float16).double().abs()  # [N, G, 1]
    m = 8 * d if SPLIT[name] == "Q4_0" else raw[..., 2:4].contiguous().view(torch.float16).double().abs()
    q = torch.cat([raw[..., -16:] & 15, raw[..., -16:] >> 4], -1).double()  # [N, G, 32]
    scale = (d * q + m).view(13, -1)  # [N, K]
    err = (linear(x, w).double() - x.double() @ torch.from_numpy(ref).double().T).abs() / (x.double().abs() @ scale.T)
    assert float(err.max()) < 1e-5


def amx_or_skip():
    if ops() is None or not ops().packed_amx():
        pytest.skip("no AMX tiles on this CPU (or MINISPEC_NO_AMX is set): the AVX-512 / AVX2 tests cover its layers")


def layer64(w: PackedWeight, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 dequantised weight [n, k] and the scale of the kernels' rounding [n, k]: |d q| + |m| per value
    (Q4_0: m = -8 d), since they compute d (q . x) + m sum(x) per block (Q8_0: |d q|)."""
    raw = w.joined().data.view(n, k // 32, -1)
    d = raw[..., 0:2].contiguous().view(torch.float16).double()  # [N, G, 1]
    if file_type(w.qtype) == int(T.Q8_0):
        q = raw[..., 2:].contiguous().view(torch.int8).double()  # [N, G, 32]
        return (d * q).view(n, k), (d * q).abs().view(n, k)
    m = -8 * d if file_type(w.qtype) == int(T.Q4_0) else raw[..., 2:4].contiguous().view(torch.float16).double()
    q = torch.cat([raw[..., -16:] & 15, raw[..., -16:] >> 4], -1).double()  # [N, G, 32]
    return (d * q + m).view(n, k), ((d * q).abs() + m.abs()).view(n, k)


@pytest.mark.parametrize("name,rows", [(n, r) for n in TILES for r in [1, 2, 3, 5, 6, 9, 16, 17, 33, 70, 258]] +
                         [(n, r) for n in ["Q4_0", "Q4_1", "Q8_0", *SPLIT] for r in [9, 16, 17, 33, 70, 258]])
@pytest.mark.parametrize("k", [32, 96, 576])
def test_amx_tiles_equal_float64_layer(name, rows, k):
    """The AMX paths (whole groups of 16 weight rows): the tiled layout at every rows of x (one A tile a block up to 5,
    three from 6), the others from 9; each x as three bf16 limbs against the bf16 codes, accumulated in float32,
    against the float64 layer over gguf's dequantisation (a tiled layout off AMX takes the portable path, exact float32
    too). Activations from 2^-99 to 1e6 with exact zeros of both signs: rel tol 1e-5 of sum (|d q| + |m|) |x|. The first
    min(8, rows // 2) rows hold one value each, whose last limb carries about 2^-16 of it: one product and one sum,
    rel tol 1e-6 (a limb dropped is off by 2^-17 or more)."""
    if name not in TILES:
        amx_or_skip()
    elif ops() is None:
        pytest.skip("no C++ kernels")
    n = 48
    w, _ = packed(name, n, k, seed=rows + k)
    g = torch.Generator().manual_seed(rows)
    mags = torch.cat([torch.logspace(-29.5, 6, k - 2), torch.ones(2)])  # from 2^-98 (below 2^-100 the tiles refuse x)
    signs = torch.randint(0, 2, (rows, k), generator=g) * 2 - 1
    x = signs * (0.5 + torch.rand(rows, k, generator=g)) * mags[torch.randperm(k, generator=g)]
    x[:, 0], x[rows // 2, 1] = 0.0, -0.0
    single = min(8, rows // 2)
    x[:single] = 0.0
    for r in range(single):  # every significand bit set: limbs of 8 bits each, the last about 2^-16 of x
        x[r, (7 * r + 3) % k] = (-1) ** r * (2 - 2.0 ** -23) * 2.0 ** (5 * r - 20)
    ref, scale = layer64(w, n, k)
    got = ops().packed_linear(x, w.data, w.qtype, k).double()
    err = (got - x.double() @ ref.T).abs() / (x.double().abs() @ scale.T).clamp_min(1e-300)
    assert float(err[single:].max()) < 1e-5 and (single == 0 or float(err[:single].max()) < 1e-6)


@pytest.mark.parametrize("name,rows", [("Q4_1 split", 12), ("Q4_1 tiles", 4), ("Q4_0 tiles", 12)])
@pytest.mark.parametrize("case", ["tiny", "subnormal", "inf", "nan"])
def test_amx_refuses_x_its_limbs_cannot_hold(case, name, rows):
    """x below 2^-100 (a limb would be subnormal, which the tiles read as 0), or not finite, goes to the AVX-512 path
    (a tiled layout: the portable one): the float64 layer within rel tol 1e-5 for tiny and subnormal x (the tiles
    would be off by about 2^-16 for x near 2^-120), and the same inf / nan as F.linear (not inf for the portable
    path, whose d (q . x) + m sum(x) is nan where a zero code meets an infinite x)."""
    amx_or_skip()
    if case == "inf" and name in TILES:
        pytest.skip("the portable path's d (q . x) is nan where a zero code meets an infinite x")
    w, _ = packed(name, 32, 96, seed=3)
    ref, scale = layer64(w, 32, 96)
    x = torch.randn(rows, 96, dtype=torch.float64) * 2.0 ** -120
    if case == "subnormal":
        x[3, 5] = 2.0 ** -140
    elif case in ("inf", "nan"):
        x = torch.randn(rows, 96, dtype=torch.float64)
        x[3, 5] = float(case)
    got = ops().packed_linear(x.float(), w.data, w.qtype, 96).double()
    expected = x.float().double() @ ref.T
    if case in ("inf", "nan"):
        assert torch.equal(got.isnan(), F.linear(x.float(), ref.float()).isnan()) and bool(got[3].isnan().any() or got[3].isinf().any())
        return
    assert float(((got - expected).abs() / (x.float().double().abs() @ scale.T)).max()) < 1e-5
