"""The C++ packed-weight op (packed_cpu.cpp), built once with torch.utils.cpp_extension and cached.

``ops()`` returns the built module, or None (after one warning) where it cannot be built, e.g. no
compiler: the callers then take the pure-torch reference path (layers/quant.py).
"""
from __future__ import annotations

import functools
from pathlib import Path

from minispec.kernels import build_cpp

SOURCE = Path(__file__).with_name("packed_cpu.cpp")
# -ffp-contract=off: dequantisation rounds d * q and + m separately, as gguf's numpy code does.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]


@functools.cache
def ops():
    """The compiled module (packed_linear, packed_dequantize), or None where it cannot be built."""
    return build_cpp("packed_cpu", SOURCE, CFLAGS, "the C++ packed-weight kernel")
