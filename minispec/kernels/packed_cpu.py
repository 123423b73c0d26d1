"""The C++ packed-weight op (packed_cpu.cpp), built once with torch.utils.cpp_extension and cached.

``ops()`` returns the built module, or None (after one warning) where it cannot be built, e.g. no
compiler: the callers then take the pure-torch reference path (layers/quant.py).
"""
from __future__ import annotations

import functools
import hashlib
import os
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name("packed_cpu.cpp")
# -ffp-contract=off: dequantisation rounds d * q and + m separately, as gguf's numpy code does.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]


@functools.cache
def ops():
    """The compiled module (packed_linear, packed_dequantize), or None where it cannot be built."""
    if os.environ.get("MINISPEC_NO_CPP_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load

        # The source hash in the name: each version builds once and checkouts do not rebuild each other's.
        digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:10]
        return load(name=f"minispec_packed_cpu_{digest}", sources=[str(SOURCE)], extra_cflags=CFLAGS,
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no headers, a failed build
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        warnings.warn(f"minispec: the C++ packed-weight kernel could not be built ({reason[:200]}); "
                      f"using the slower pure-torch path", RuntimeWarning, stacklevel=2)
        return None
