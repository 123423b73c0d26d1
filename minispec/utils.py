"""Small helpers shared across minispec."""
from __future__ import annotations

from types import SimpleNamespace

import torch


def one_line(e: BaseException, limit: int | None = 300) -> str:
    """An exception's message as one line: its first non-empty line (its type's name without one), cut to limit."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    text = lines[0] if lines else type(e).__name__
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def use_triton(t: torch.Tensor) -> bool:
    """Run the Triton kernel (CUDA tensors) or its torch reference (CPU tensors)."""
    return t.is_cuda


def load_triton():
    """(triton, triton.language) for the modules that define kernels.

    Triton ships for Linux only (pyproject): without it this returns a stand-in whose jit leaves each
    kernel a plain, never-launched function, and None for triton.language (kernel bodies and their
    string annotations are read only when a CUDA tensor launches them).
    """
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return SimpleNamespace(jit=lambda fn: fn), None
    return triton, tl


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'float32' / 'bf16' / torch.float16 -> torch dtype; ValueError naming the choices otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}") from None

