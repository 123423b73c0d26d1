"""Small helpers shared across minispec."""
from __future__ import annotations

import torch


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def use_triton(t: torch.Tensor) -> bool:
    """Run the Triton kernel (CUDA tensors) or its torch reference (CPU tensors)."""
    return t.is_cuda


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


def read_toml(path: str, known: set[str]) -> dict:
    """A TOML settings file as a dict; ValueError naming any key outside `known`."""
    import tomllib

    with open(path, "rb") as f:
        raw = tomllib.load(f)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return raw
