"""Packed weights (layers/quant.py): dequantisation equals gguf's, and the packed linear layer equals
the float32 layer over the dequantised weight (F.linear), relative tolerance 1e-5."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf import quants

from minispec.kernels.cpu import ops
from minispec.layers.quant import DENSE_ROWS, PackedWeight, dequantize_ref, linear, linear_ref

TYPES = {"Q4_0": T.Q4_0, "Q4_1": T.Q4_1, "Q8_0": T.Q8_0, "F16": T.F16, "BF16": T.BF16}


def packed(name: str, n: int, k: int, seed: int = 0) -> tuple[PackedWeight, np.ndarray]:
    """A random [n, k] weight quantised by gguf, and gguf's own dequantisation of it."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.02).astype(np.float32)
    raw = quants.quantize(w, TYPES[name])  # [n, row bytes] uint8 (F16: float16, BF16: uint16 values)
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1)
    ref = quants.dequantize(raw, TYPES[name]).astype(np.float32).reshape(n, k)
    return PackedWeight(torch.from_numpy(raw.copy()), int(TYPES[name]), k), ref


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", list(TYPES))
def test_dequantize_matches_gguf(name):
    w, ref = packed(name, 7, 96)
    assert torch.equal(dequantize_ref(w.data, w.qtype, 96), torch.from_numpy(ref))
    assert torch.equal(w.dequantize(), torch.from_numpy(ref))  # the C++ op where built


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("n,k", [(37, 96), (5, 160)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 16, DENSE_ROWS + 2])  # each C++ tile shape
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


@pytest.mark.parametrize("name", list(TYPES))
def test_tp_shards_split_on_blocks(name):
    """Row shards (column-parallel) and block-aligned column shards (row-parallel) are the dequantised slices."""
    w, ref = packed(name, 8, 128)
    assert torch.equal(w.rows(2, 4).dequantize(), torch.from_numpy(ref[2:6]))
    assert torch.equal(w.cols(64, 64).dequantize(), torch.from_numpy(ref[:, 64:128]))
    x = torch.randn(2, 64)
    assert rel_err(linear(x, w.cols(32, 64)), F.linear(x, torch.from_numpy(ref[:, 32:96]))) < 1e-5


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
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


@pytest.mark.parametrize("name", list(TYPES))
def test_triton_kernel_matches_reference(name):
    """The Triton kernel (TRITON_INTERPRET=1 on CPU tensors) against the torch reference, tiny shapes."""
    from minispec.kernels.packed_triton import packed_linear_triton

    w, ref = packed(name, 5, 64 if name[0] == "Q" else 40)
    x = torch.randn(2, w.in_features)
    got = packed_linear_triton(x, w.data, w.qtype, w.in_features, block_n=4, block_b=32)
    assert rel_err(got, F.linear(x, torch.from_numpy(ref))) < 1e-5
