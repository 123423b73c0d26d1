"""Runs one model over a step's queries: builds the padded batch, the forward, and the logits rows."""
from __future__ import annotations

import numpy as np
import torch

from minispec.engine.kv_cache import KVCache
from minispec.layers.attention import ForwardBatch


class ModelRunner:
    """A model and its KV cache. Target and draft each have one."""

    def __init__(self, model, num_slots: int, max_len: int, *, dtype: torch.dtype, device: torch.device):
        self.model = model
        self.device = device
        self.max_len = max_len
        self.kv = KVCache(
            model.num_layers, num_slots, max_len, model.num_kv_heads, model.head_dim, dtype=dtype, device=device
        )

    @torch.inference_mode()
    def forward(
        self,
        slots: list[int],
        starts: list[int],
        queries: list[list[int]],
        num_logits: list[int],
        gather: bool = True,
    ) -> torch.Tensor:
        """Feed request i's tokens `queries[i]` at positions starts[i].., writing its K/V into slot
        slots[i]; return the logits of each request's last num_logits[i] tokens, concatenated.

        Returns: [sum(num_logits), vocab] float32 ([.., vocab shard] when gather is False).
        """
        batch = ForwardBatch.build(slots, starts, queries, self.kv.scratch_slot, self.device)
        if batch.max_ctx > self.max_len:
            raise ValueError(f"context of {batch.max_ctx} tokens exceeds the KV cache's {self.max_len}")
        lens = [len(q) for q in queries]
        hidden = self.model(batch, self.kv)  # [B, L, hidden]
        # Rows of each request's last num_logits tokens, in request order.
        b_idx = np.repeat(np.arange(len(queries)), num_logits)
        t_idx = np.concatenate([np.arange(n - k, n) for n, k in zip(lens, num_logits)]) if b_idx.size else b_idx
        rows = hidden[torch.from_numpy(b_idx).to(self.device), torch.from_numpy(t_idx).to(self.device)]
        return self.model.compute_logits(rows, gather=gather)
