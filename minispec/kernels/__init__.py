"""Compiled kernels, built on first use, each with a pure-torch fallback: cpu (one C++ extension: the
packed-weight linear, the decode step's small ops, every decoder layer in one call) and packed_triton
(the packed-weight linear on GPU)."""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import time
import warnings
from pathlib import Path

from minispec.utils import one_line


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    return frozenset(w for ln in lines if ln.startswith("flags") for w in ln.split(":", 1)[1].split())


def native_bf16() -> bool:
    """Whether the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX); elsewhere torch emulates it, slower than
    float32."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def _cpu_identity() -> bytes:
    """The CPU's model and feature flags: a -march=native build is only reused on the same kind of CPU."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))})).encode()
    except OSError:
        return platform.processor().encode()


def _build_dir(full_name: str) -> Path:
    """torch's extension cache directory of this build."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(full_name, verbose=False))


def _is_built(full_name: str) -> bool:
    """Whether torch's extension cache already holds this build (then loading it takes no compile)."""
    try:
        return (_build_dir(full_name) / f"{full_name}.so").is_file()
    except Exception:  # a torch without the helper: say nothing
        return True


STALE_LOCK_S = 600  # a build takes about a minute; a lock this old was left by a build that was killed


def clear_stale_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove torch's build lock in build_dir if it is older than max_age_s (an interrupted build leaves it, and
    every later build would wait on it for ever); whether it did."""
    lock = Path(build_dir) / "lock"
    try:
        if time.time() - lock.stat().st_mtime <= max_age_s:
            return False
        lock.unlink()
    except OSError:  # no lock, or another process removed it first
        return False
    print(f"minispec: removed a stale build lock {lock} (left by an interrupted build)", file=sys.stderr, flush=True)
    return True


def build_cpp(name: str, sources: list[Path], cflags: list[str], what: str):
    """Build (once, cached) the C++ extension of `sources` (.h files: hashed, not compiled) as minispec_<name>;
    None after one warning where it cannot be."""
    if os.environ.get("MINISPEC_NO_CPP_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load

        # Source, flags, CPU and the sources' directory in the name: each version builds once, and checkouts do
        # not rebuild each other's (torch's ninja file names the source paths: another checkout's build of the
        # same name is rebuilt from scratch).
        text = b"".join(s.read_bytes() for s in sources)
        where = str(Path(sources[0]).resolve().parent).encode()
        digest = hashlib.sha256(text + " ".join(cflags).encode() + _cpu_identity() + where).hexdigest()[:10]
        full_name = f"minispec_{name}_{digest}"
        if not _is_built(full_name):
            clear_stale_lock(_build_dir(full_name))
            print(f"minispec: building {what}, once for this CPU and checkout (about a minute)", file=sys.stderr,
                  flush=True)
        return load(name=full_name, sources=[str(s) for s in sources if s.suffix == ".cpp"],
                    extra_cflags=cflags,
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no headers, a failed build
        warnings.warn(f"minispec: {what} could not be built ({one_line(e, limit=None)[:200]}); using the slower pure-torch path",
                      RuntimeWarning, stacklevel=3)
        return None
