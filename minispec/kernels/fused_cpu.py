"""The fused C++ kernels of a decode step (fused_cpu.cpp), built once with torch.utils.cpp_extension and cached.

``ops()`` returns the built module, or None (after one warning) where it cannot be built, e.g. no
compiler, or when MINISPEC_NO_CPP_KERNELS is set: the callers then take their pure-torch path.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from minispec.kernels import build_cpp

SOURCE = Path(__file__).with_name("fused_cpu.cpp")
# -fno-math-errno -fno-trapping-math (as torch builds with): lets the exp and clamp loops vectorise.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]


@functools.cache
def ops():
    """The compiled module (add_rms_norm, silu_mul, rope_cache_attend), or None where it cannot be built."""
    return build_cpp("fused_cpu", SOURCE, CFLAGS, "the fused C++ CPU kernels")


def applies(*tensors) -> bool:
    """Whether the kernels take these tensors: contiguous float32 on CPU, and the module built."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors) \
        and ops() is not None
