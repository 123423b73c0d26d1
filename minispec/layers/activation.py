"""SiLU-gated MLP activation (one C++ op on CPU float32)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minispec.kernels import cpu


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[.., 2 I] (gate | up) -> silu(gate) * up [.., I]."""
    if cpu.applies(gate_up):
        return cpu.ops().silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
