"""Runs one model over a step's queries: builds the padded batch, the forward, and the logits."""
from __future__ import annotations

import time

import numpy as np
import torch

from minispec.runner.kv_cache import KVCache
from minispec.layers.attention import ForwardBatch, fused_max_tokens


class ModelRunner:
    """A model and its KV cache. Target and draft each have one."""

    def __init__(self, model, num_slots: int, max_len: int, *, dtype: torch.dtype, device: torch.device,
                 kv: KVCache | None = None):
        self.model = model
        # on_hidden(slots, starts, lens, states): after each forward, when the model captures hidden states
        # (capture_layers), every fed token's captured states [sum(lens), C] in the order of slots
        self.on_hidden = None
        self.device = device
        self.max_len = max_len
        self.forward_s = 0.0  # wall seconds spent in forward so far (the device synchronised at the end of each)
        # kv: another runner's cache, for a model with the same layers (a self-draft reads the target's K/V)
        self.kv = kv if kv is not None else KVCache(
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

        Requests whose query lengths differ a lot (a prefill among decodes) run as separate padded
        forwards, so one long query does not pad every short one to its length. Each forward takes its
        requests in slot order, so requests on consecutive slots read their KV cache in place.
        Returns: [sum(num_logits), vocab] float32 ([.., vocab shard] when gather is False).
        """
        t0 = time.perf_counter()
        out = self._forward_groups(slots, starts, queries, num_logits, gather)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        self.forward_s += time.perf_counter() - t0
        return out

    def _forward_groups(self, slots, starts, queries, num_logits, gather: bool) -> torch.Tensor:
        """forward without the timing: one padded forward per group of similar query lengths."""
        unpadded_past = fused_max_tokens() if torch.device(self.device).type == "cpu" else 0
        groups = [sorted(g, key=slots.__getitem__) for g in length_groups([len(q) for q in queries],
                                                                          unpadded_past=unpadded_past)]
        if len(groups) <= 1:
            return self._forward(slots, starts, queries, num_logits, gather, groups[0] if groups else None)
        parts, at = [], []  # each group's logits, and where they go in the output
        offsets = np.cumsum([0] + list(num_logits))
        for g in groups:
            parts.append(self._forward([slots[i] for i in g], [starts[i] for i in g], [queries[i] for i in g],
                                       [num_logits[i] for i in g], gather))
            at += [np.arange(offsets[i], offsets[i + 1]) for i in g]
        out = torch.empty(int(offsets[-1]), parts[0].shape[-1], dtype=parts[0].dtype, device=parts[0].device)
        out[torch.from_numpy(np.concatenate(at)).to(out.device)] = torch.cat(parts)
        return out

    def _forward(self, slots, starts, queries, num_logits, gather: bool, order: list[int] | None = None
                 ) -> torch.Tensor:
        """One padded forward over all the given requests (see forward); batch index j holds request order[j]
        (default: request j), the logits come out in request order."""
        n = len(queries)
        order = list(range(n)) if order is None else order
        batch = ForwardBatch.build([slots[i] for i in order], [starts[i] for i in order], [queries[i] for i in order],
                                   self.kv.scratch_slot, self.device)
        if batch.max_ctx > self.max_len:
            raise ValueError(f"context of {batch.max_ctx} tokens exceeds the KV cache's {self.max_len}")
        lens = [len(q) for q in queries]
        hidden = self.model(batch, self.kv)  # [B, L, hidden]
        B, L, H = hidden.shape
        if self.on_hidden is not None and self.model.captured is not None:
            sel = [order[j] for j in range(n)]
            flat = np.concatenate([j * L + np.arange(len(queries[i])) for j, i in enumerate(sel)])
            states = self.model.captured.view(B * L, -1).index_select(0, torch.from_numpy(flat).to(self.device))
            self.on_hidden([slots[i] for i in sel], [starts[i] for i in sel], [len(queries[i]) for i in sel], states)
        if order == list(range(n)) and all(k == L for k in num_logits) and all(m == L for m in lens):
            states = hidden.view(B * L, H)  # every token's hidden state, already in request order
        else:  # the hidden states of each request's last num_logits tokens, in request order
            batch_idx = np.empty(n, dtype=np.int64)  # [n] batch index of each request
            batch_idx[order] = np.arange(n)
            b_idx = np.repeat(batch_idx, num_logits)
            t_idx = np.concatenate([np.arange(m - k, m) for m, k in zip(lens, num_logits)]) if b_idx.size else b_idx
            states = hidden.view(B * L, H).index_select(0, torch.from_numpy(b_idx * L + t_idx).to(self.device))
        return self.model.compute_logits(states, gather=gather)


def length_groups(lens: list[int], max_waste: int = 16, unpadded_past: int | None = None) -> list[list[int]]:
    """Request indices in groups of similar query length: padding a group to its longest query wastes
    at most max(max_waste, a quarter of its real tokens) token positions. One group when all are alike.
    A padded position costs about what a real one does, and a forward more about what 16 positions do on a
    2-core CPU: with 256, a prompt admitted beside 3 decoding requests padded them to its length (4x its own
    positions), and the head at batch 4 ran 0.72x target-only (docs/experiments.md, eighteenth session).
    Neighbouring groups both padded past unpadded_past positions then merge while the waste stays at most the real
    tokens: such a forward runs its layers on its real tokens alone (LlamaForCausalLM past fused_max_tokens()), so
    padding costs attention only, and each forward more dequantises every weight again (docs/experiments.md,
    thirty-fourth session)."""
    order = sorted(range(len(lens)), key=lens.__getitem__)
    groups: list[list[int]] = []
    cur: list[int] = []
    real = 0
    for i in order:
        waste = (len(cur) + 1) * lens[i] - (real + lens[i])  # sorted ascending: lens[i] is the longest
        if cur and waste > max(max_waste, (real + lens[i]) // 4):
            groups.append(cur)
            cur, real = [], 0
        cur.append(i)
        real += lens[i]
    if cur:
        groups.append(cur)
    if unpadded_past is None:
        return groups

    def padded(g: list[int]) -> int:
        return len(g) * max(lens[i] for i in g)

    merged = groups[:1]
    for g in groups[1:]:
        both = merged[-1] + g
        unfused = padded(merged[-1]) > unpadded_past and padded(g) > unpadded_past
        if unfused and padded(both) <= 2 * sum(lens[i] for i in both):  # waste at most the real tokens
            merged[-1] = both
        else:
            merged.append(g)
    return merged
