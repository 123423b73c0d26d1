"""The CPU kernels (packed_cpu.cpp, fused_cpu.cpp, cpu_ops.cpp), built once as one extension with
torch.utils.cpp_extension and cached.

``ops()`` returns the built module, or None (after one warning) where it cannot be built, e.g. no
compiler, or when MINISPEC_NO_CPP_KERNELS is set: the callers then take their pure-torch paths
(layers/quant.py's reference, the torch ops beside each fused call).
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from minispec.kernels import build_cpp

HERE = Path(__file__).parent
SOURCES = [HERE / "packed_cpu.cpp", HERE / "fused_cpu.cpp", HERE / "cpu_ops.cpp", HERE / "cpu_ops.h"]
# -ffp-contract=off: dequantisation rounds d * q and + m separately, as gguf's numpy code does.
# -fno-math-errno -fno-trapping-math (as torch builds with): lets the exp and clamp loops vectorise.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]


@functools.cache
def ops():
    """The compiled module (packed_linear, packed_dequantize, add_rms_norm, silu_mul, rope_cache_attend,
    decode_layers), or None where it cannot be built."""
    return build_cpp("cpu", SOURCES, CFLAGS, "the C++ CPU kernels")


def applies(*tensors) -> bool:
    """Whether the kernels take these tensors: contiguous float32 on CPU, no gradient wanted (the kernels
    have no backward), and the module built."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors) \
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)) and ops() is not None
