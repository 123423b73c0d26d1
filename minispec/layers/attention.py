"""The forward batch and attention over the per-slot KV cache."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from minispec.kernels import cpu
from minispec.layers.rotary import apply_rotary


@dataclass(slots=True)
class ForwardBatch:
    """One forward's tokens: B requests padded to the longest query L.

    Padded tokens write their K/V to the KV cache's scratch slot; their outputs are finite garbage.
    """

    input_ids: torch.Tensor  # [B, L] int64, padded per request
    positions: torch.Tensor  # [B, L] int64, position of each token within its request
    write_slots: torch.Tensor  # [B, L] int64, slot each token's K/V is written to (scratch slot for padding)
    read_slots: torch.Tensor  # [B] int64, slot each request attends over
    last: torch.Tensor  # [B] int64, index of each request's last token in the flattened [B * L]
    max_ctx: int  # keys read per request: max(positions) + 1 over real tokens
    first_slot: int = -1  # read_slots[0] if the requests hold consecutive slots in order (read in place), else -1

    @staticmethod
    def build(slots: list[int], starts: list[int], queries: list[list[int]], scratch_slot: int, device) -> "ForwardBatch":
        """Request i feeds tokens queries[i] at positions starts[i].. into KV slot slots[i]."""
        num_reqs = len(queries)
        lens = [len(q) for q in queries]
        max_q = max(lens)
        size = num_reqs * max_q
        # every field in one buffer, made a tensor at once: a decode step's forward is mostly such small calls
        buf = np.zeros(3 * size + 2 * num_reqs, dtype=np.int64)  # [3 * B * L + 2 * B]
        ids, pos, write = buf[: 3 * size].reshape(3, num_reqs, max_q)  # [B, L] each
        write.fill(scratch_slot)
        for i, q in enumerate(queries):
            n = lens[i]
            ids[i, :n] = q
            pos[i, :n] = range(starts[i], starts[i] + n)
            write[i, :n] = slots[i]
        buf[3 * size : 3 * size + num_reqs] = slots
        buf[3 * size + num_reqs :] = np.arange(0, size, max_q) + lens - 1
        t = torch.from_numpy(buf).to(device)
        grid = t[: 3 * size].view(3, num_reqs, max_q)
        return ForwardBatch(
            input_ids=grid[0],
            positions=grid[1],
            write_slots=grid[2],
            read_slots=t[3 * size : 3 * size + num_reqs],
            last=t[3 * size + num_reqs :],
            max_ctx=max(s + n for s, n in zip(starts, lens)),
            first_slot=slots[0] if list(slots) == list(range(slots[0], slots[0] + num_reqs)) else -1,
        )


def causal_mask(positions: torch.Tensor, max_ctx: int, groups: int = 1) -> torch.Tensor:
    """[B, 1, groups * L, max_ctx] bool: query at position p may see key j iff j <= p; the L rows
    repeated for each of the `groups` query heads that share a KV head (see ``attend``).

    Keys past a request's length are stale (earlier drafts, other requests' longer contexts) and
    the rule hides them. Key 0 is always visible so padded rows never softmax over nothing.
    """
    keys = torch.arange(max_ctx, device=positions.device)  # [max_ctx]
    mask = keys <= positions.unsqueeze(-1)  # [B, L, max_ctx]
    mask[..., 0] = True
    return mask.unsqueeze(1).repeat(1, 1, groups, 1)


# Forwards of up to this many tokens (B * L) take the fused C++ kernels on CPU (rope_cache_attend, and the whole
# forward in one call: decode_layers, head_layer), and at most the rows the packed kernels take before a long
# prefill goes to a GEMM (PACKED_MAX_ROWS: 256 with AVX-512, 96 with AVX2, 48 else); longer ones take SDPA's blocked
# matmuls op by op. Was 16: on the Intel AMX kind 4x5 / 16x2 / 4x16 steps ran 22 / 26 / 15 % faster at 256, a 44-token
# prompt's prefill 18 % (docs/experiments.md, nineteenth session).
FUSED_MAX_TOKENS = 256


def fused_max_tokens() -> int:
    """The most tokens a forward may have to take the fused kernels here (0 without the C++ module)."""
    ext = cpu.ops()
    return 0 if ext is None else min(FUSED_MAX_TOKENS, ext.PACKED_MAX_ROWS)


@dataclass(slots=True)
class AttentionMetadata:
    """What every layer's attention needs, built once per forward."""

    batch: ForwardBatch
    freqs_cis: torch.Tensor  # [B, L, 1, head_dim / 2] complex64 (layers/rotary.py)
    write_index: torch.Tensor  # [B * L] int64: cache row (slot * max_len + position) each token's K/V goes to
    mask: torch.Tensor | None  # [B, 1, groups * L, max_ctx] bool for the torch path; None on the fused one
    fused: bool  # the fused C++ kernel runs RoPE, the cache write and attention
    # [N] the real tokens' rows of the flattened [B * L] where the layers around attention run on those N rows alone
    # (attention's qkv [N, ...] then), else None: every row, padding included
    rows: torch.Tensor | None = None

    @staticmethod
    def build(batch: ForwardBatch, freqs_cis: torch.Tensor, k_cache: torch.Tensor, groups: int,
              unpadded: bool = False) -> "AttentionMetadata":
        """For a forward over batch, writing into caches shaped like k_cache; groups = n_heads / n_kv_heads.
        unpadded: the caller runs its layers on the real tokens alone (rows) where the torch path has padding."""
        write_index = batch.positions.add(batch.write_slots, alpha=k_cache.shape[1]).view(-1)  # [B * L]
        fused = batch.input_ids.numel() <= fused_max_tokens() and cpu.applies(k_cache)
        mask = None if fused else causal_mask(batch.positions, batch.max_ctx, groups)
        rows = real_rows(batch) if unpadded and not fused else None
        return AttentionMetadata(batch, freqs_cis, write_index, mask, fused, rows)


def real_rows(batch: ForwardBatch) -> torch.Tensor | None:
    """[N] the rows of the flattened [B * L] that hold real tokens (each request's first ones), or None where no row
    is padding."""
    B, L = batch.input_ids.shape
    lens = batch.last - torch.arange(0, B * L, L, device=batch.last.device) + 1  # [B]
    if bool((lens == L).all()):
        return None
    keep = torch.arange(L, device=lens.device) < lens.unsqueeze(1)  # [B, L]
    return keep.view(-1).nonzero().squeeze(1)


def attention(
    qkv: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int
) -> torch.Tensor:
    """RoPE on q and k, write this step's K/V into the cache, attend over each request's cached keys.

    qkv [B, L, (n_heads + 2 n_kv_heads) * head_dim] (interleaved rotary pairs, layers/rotary.py),
    caches [num_slots + 1, max_len, n_kv_heads, head_dim]. Returns [B, L, n_heads * head_dim].
    With meta.rows, qkv is the real tokens' [N, ...] and so is the result. The fused path rotates q in place in qkv.
    """
    if meta.rows is not None:  # padded back to [B, L] for attention alone (padded rows: zeros, written to scratch)
        B, L = meta.batch.input_ids.shape
        full = qkv.new_zeros(B * L, qkv.shape[-1]).index_copy_(0, meta.rows, qkv.reshape(-1, qkv.shape[-1]))
        out = attention(full.view(B, L, -1), replace(meta, rows=None), k_cache, v_cache, n_heads)
        return out.view(B * L, -1).index_select(0, meta.rows)
    B, L, _ = qkv.shape
    n_kv, hd = k_cache.shape[2], k_cache.shape[3]
    batch = meta.batch
    if meta.fused and qkv.is_contiguous():
        cos_sin = torch.view_as_real(meta.freqs_cis)  # [B, L, 1, head_dim / 2, 2]
        out = cpu.ops().rope_cache_attend(
            qkv, cos_sin, k_cache, v_cache, meta.write_index, batch.positions, batch.read_slots,
            n_heads, n_kv, hd ** -0.5,
        )  # [B * L, n_heads * head_dim]
        return out.view(B, L, n_heads * hd)
    qk = apply_rotary(qkv[..., : (n_heads + n_kv) * hd].view(B, L, n_heads + n_kv, hd), meta.freqs_cis)
    k = qk[:, :, n_heads:]  # [B, L, n_kv_heads, head_dim]
    v = qkv[..., (n_heads + n_kv) * hd :].view(B, L, n_kv, hd)
    k_cache.view(-1, n_kv, hd).index_copy_(0, meta.write_index, k.reshape(B * L, n_kv, hd))
    v_cache.view(-1, n_kv, hd).index_copy_(0, meta.write_index, v.reshape(B * L, n_kv, hd))
    return attend(qk[:, :, :n_heads], k_cache, v_cache, batch, meta.mask)


def attend(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, mask: torch.Tensor
) -> torch.Tensor:
    """SDPA of q [B, L, n_heads, head_dim] over each request's cached keys (already written).

    Caches [num_slots + 1, max_len, n_kv_heads, head_dim], mask from ``causal_mask`` with
    groups = n_heads / n_kv_heads. Returns [B, L, n_heads * head_dim].
    """
    B, L, n_heads, head_dim = q.shape
    n_kv = k_cache.shape[2]
    g = n_heads // n_kv  # query heads per KV head
    keys, values = k_cache[:, : batch.max_ctx], v_cache[:, : batch.max_ctx]
    if batch.first_slot >= 0:  # consecutive slots in order: read them in place
        keys = keys[batch.first_slot : batch.first_slot + B]  # [B, max_ctx, n_kv_heads, head_dim]
        values = values[batch.first_slot : batch.first_slot + B]
    else:  # index_select copies only the max_ctx rows of each slot
        keys = keys.index_select(0, batch.read_slots)  # [B, max_ctx, n_kv_heads, head_dim]
        values = values.index_select(0, batch.read_slots)
    # Grouped-query attention without repeating K/V: the g query heads of a KV head become g * L queries.
    qg = q.view(B, L, n_kv, g, head_dim).permute(0, 2, 3, 1, 4).reshape(B, n_kv, g * L, head_dim)
    out = F.scaled_dot_product_attention(
        qg, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask
    )  # [B, n_kv_heads, g * L, head_dim]
    return out.view(B, n_kv, g, L, head_dim).permute(0, 3, 1, 2, 4).reshape(B, L, n_heads * head_dim)
