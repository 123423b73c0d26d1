"""RMSNorm, alone or fused with the residual add before it (one C++ op on CPU float32)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minispec.kernels import cpu


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim."""

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu.applies(x, self.weight):
            return cpu.ops().add_rms_norm(x, None, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); the fused path adds into residual in place."""
        if cpu.applies(x, residual, self.weight):
            return cpu.ops().add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = x + residual
        return F.rms_norm(residual, self.weight.shape, self.weight, self.eps), residual
