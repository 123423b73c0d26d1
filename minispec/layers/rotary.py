"""Rotary position embedding, applied as a complex multiply on (even, odd) pairs of each head.

Hugging Face checkpoints rotate dims (i, i + head_dim / 2) together; ``interleave_rope_rows``
permutes the q/k projection rows at load time so that pair i sits at dims (2i, 2i + 1). The
permutation is the same for q and k, so q . k (and the attention output) is unchanged, and the
rotation becomes one complex multiply. Keys in the KV cache are stored in this permuted order.
"""
from __future__ import annotations

import torch
from torch import nn


def rope_parameters(config) -> dict:
    """The config's RoPE parameters as one dict with rope_type and rope_theta (transformers 4 or 5)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def rope_inv_freq(config, head_dim: int, device=None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float32, attention_scaling) for the checkpoint's RoPE type.

    Non-default types come from transformers' own initialisers. Types that change with the
    sequence length ('dynamic', 'longrope') keep their initial frequencies: exact for contexts
    within original_max_position_embeddings.
    """
    params = rope_parameters(config)
    if params["rope_type"] == "default":
        theta = float(params["rope_theta"])
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq.to(device), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, device)
    return inv_freq.float(), float(attention_scaling)


def interleave_rope_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a q/k projection weight [n_heads * head_dim, ...] (or bias) from HF's half-split
    rotary layout to the interleaved one: new row 2i + j of a head = old row j * head_dim / 2 + i."""
    rest = w.shape[1:]
    return w.reshape(-1, 2, head_dim // 2, *rest).transpose(1, 2).reshape(w.shape)


class RotaryEmbedding(nn.Module):
    """Rotation of each position as unit complex numbers (times attention_scaling)."""

    def __init__(self, config, head_dim: int, device=None):
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(config, head_dim, device)
        if inv_freq.numel() * 2 != head_dim:
            raise ValueError(f"partial rotary embeddings are not supported (rotary dim {inv_freq.numel() * 2} "
                             f"!= head_dim {head_dim})")
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim / 2]
        # [num_positions, head_dim / 2] complex64: the rotation of every position below num_positions
        self.register_buffer("table", torch.empty(0, inv_freq.numel(), dtype=torch.complex64, device=device),
                             persistent=False)

    def forward(self, positions: torch.Tensor, max_ctx: int | None = None) -> torch.Tensor:
        """positions [B, L] (each below max_ctx; default positions.max() + 1) -> freqs_cis [B, L, 1, head_dim / 2]
        complex64 (broadcasts over heads): rows of the table, grown (at least doubled) when a context outgrows it."""
        n = int(positions.max()) + 1 if max_ctx is None else max_ctx
        if n > self.table.shape[0]:
            size = max(n, 2 * self.table.shape[0], 256)
            angles = torch.arange(size, dtype=torch.float32, device=self.inv_freq.device).unsqueeze(-1) * self.inv_freq
            self.table = torch.polar(torch.full_like(angles, self.attention_scaling), angles)  # [size, head_dim / 2]
        return self.table.index_select(0, positions.reshape(-1)).view(*positions.shape, 1, -1)


def apply_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, L, heads, head_dim] (interleaved pairs) by freqs_cis [B, L, 1, head_dim / 2]."""
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # [B, L, heads, head_dim / 2]
    return torch.view_as_real(xc * freqs_cis).flatten(-2).to(x.dtype)  # [B, L, heads, head_dim]
