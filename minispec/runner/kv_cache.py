"""The paged-free KV cache: one contiguous run of positions per request slot."""
from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every layer, indexed [slot, position].

    A request owns one slot for its lifetime; its length is bookkeeping kept by the engine, so
    dropping the last n positions (speculative rollback) is free: later writes overwrite them.
    Slot ``num_slots`` is a scratch slot that padded tokens write to and nobody reads.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.num_slots = num_slots
        self.max_len = max_len
        self.scratch_slot = num_slots
        shape = (num_slots + 1, max_len, num_kv_heads, head_dim)
        # num_layers x [num_slots + 1, max_len, num_kv_heads, head_dim]
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Positions < n of slot src, every layer, into slot dst (prefix caching)."""
        for t in self.k + self.v:
            t[dst, :n] = t[src, :n]
