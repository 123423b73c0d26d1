"""The fused C++ kernels of a decode step (fused_cpu.cpp), built once with torch.utils.cpp_extension and cached.

``ops()`` returns the built module, or None (after one warning) where it cannot be built, e.g. no
compiler, or when MINISPEC_NO_CPP_KERNELS is set: the callers then take their pure-torch path.
"""
from __future__ import annotations

import functools
import hashlib
import os
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("fused_cpu.cpp")
# -fno-math-errno -fno-trapping-math (as torch builds with): lets the exp and clamp loops vectorise.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]


@functools.cache
def ops():
    """The compiled module (add_rms_norm, silu_mul, rope_cache_attend), or None where it cannot be built."""
    if os.environ.get("MINISPEC_NO_CPP_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load

        # The source hash in the name: each version builds once and checkouts do not rebuild each other's.
        digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:10]
        return load(name=f"minispec_fused_cpu_{digest}", sources=[str(SOURCE)], extra_cflags=CFLAGS,
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no headers, a failed build
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        warnings.warn(f"minispec: the fused C++ CPU kernels could not be built ({reason[:200]}); "
                      f"using the slower pure-torch path", RuntimeWarning, stacklevel=2)
        return None


def applies(*tensors) -> bool:
    """Whether the kernels take these tensors: contiguous float32 on CPU, and the module built."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors) \
        and ops() is not None
