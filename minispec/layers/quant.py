"""Packed weights as GGUF ships them, and exact float32 math on them.

A ``PackedWeight`` holds a [N, K] weight as N rows of bytes in one GGML format (kernels/ggml.py): blocks of 32
values (Q4_0, Q4_1, Q8_0: a float16 scale d, for Q4_1 a float16 minimum m, and 32 codes q) or plain
F16 / BF16 values. The value of code q is d * (q - 8) (Q4_0), d * q + m (Q4_1) or d * q (Q8_0).

In memory, Q4_0 / Q4_1 rows may be split (kernels/ggml.py: codes, then scales, then minima) where the AVX-512
one-row kernel reads them, or tiled in groups of 16 rows where the AMX kernel does: ``kernel_layout(w)``, which the
layers apply as they load. The values are the file's.

``linear(x, w)`` equals ``F.linear(x.float(), w.dequantize())``, the float32 layer over the
dequantised weight, up to float32 summation order (it computes d * sum(q * x) + m * sum(x) per
block): the C++ op on CPU (kernels/packed_cpu.cpp, built by kernels/cpu.py), the Triton kernel on GPU
(kernels/packed_triton.py), and that reference itself where neither is available.

``quantize(w, qtype)`` makes a PackedWeight from a dense weight (Q8_0 or Q4_1, rounded as ggml's reference
quantiser rounds), for weight-only quantisation of float checkpoints (QUANTIZATIONS: LLM(quantization=...)
and the self-drafts).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minispec.kernels.cpu import applies
from minispec.kernels.ggml import (BF16, BLOCK_TYPES, F16, F32, GROUP, PACKED_TYPES, Q4_0, Q4_1, Q8_0, SPLIT_OF, TILE_ROWS,
                                   TILES_OF, file_type)

# Weight-only quantisation of a float checkpoint: name -> (linear layers' type, embedding / LM head type). The
# embedding stays 8-bit under int4, as llama.cpp's Q4_1 files keep it (it is also the tied LM head).
QUANTIZATIONS: dict[str, tuple[int, int]] = {"int8": (Q8_0, Q8_0), "int4": (Q4_1, Q8_0)}


def type_name(qtype: int) -> str:
    return "F32" if qtype == F32 else PACKED_TYPES[qtype].name


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one packed row of k values."""
    fmt = PACKED_TYPES[qtype]
    return k // fmt.block_values * fmt.block_bytes


@dataclass(slots=True)
class PackedWeight:
    """A [N, K] weight stored as N packed rows: data [N, row_bytes(qtype, K)] uint8."""

    data: torch.Tensor
    qtype: int
    in_features: int

    def __post_init__(self):
        name = PACKED_TYPES[self.qtype].name
        if self.qtype in BLOCK_TYPES and self.in_features % GROUP:
            raise ValueError(f"{name} rows hold whole blocks of {GROUP}; got {self.in_features} values per row")
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or \
                self.data.shape[1] != row_bytes(self.qtype, self.in_features):
            raise ValueError(f"{name} data for rows of {self.in_features} values must be uint8 "
                             f"[N, {row_bytes(self.qtype, self.in_features)}], got {self.data.dtype} {list(self.data.shape)}")
        if self.tiled and self.data.shape[0] % TILE_ROWS:
            raise ValueError(f"{name} holds whole groups of {TILE_ROWS} rows; got {self.data.shape[0]} rows")

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.in_features

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def tiled(self) -> bool:
        """Whether the rows are in groups of TILE_ROWS (the AMX kernel's layout), where a row is no slice of data."""
        return self.qtype in TILES_OF.values()

    def as_type(self, qtype: int) -> PackedWeight:
        """This weight in layout qtype, its file's format or a split or tiled one (itself when it is already)."""
        return self if qtype == self.qtype else PackedWeight(relayout(self.data, self.qtype, qtype), qtype,
                                                              self.in_features)

    def split(self) -> PackedWeight:
        """This Q4_0 / Q4_1 weight in its split layout."""
        return self.as_type(SPLIT_OF[file_type(self.qtype)])

    def joined(self) -> PackedWeight:
        """This weight in its file's layout."""
        return self.as_type(file_type(self.qtype))

    def rows(self, start: int, n: int) -> PackedWeight:
        """Rows [start, start + n) (a view; from a tiled layout, rows off its groups of 16 come as a copy in the
        file's)."""
        if self.tiled and (start % TILE_ROWS or n % TILE_ROWS):
            return self.joined().rows(start, n)
        return PackedWeight(self.data[start : start + n], self.qtype, self.in_features)

    def cols(self, start: int, k: int) -> PackedWeight:
        """Columns [start, start + k) of every row (a copy); a block format needs start and k on block bounds."""
        if file_type(self.qtype) != self.qtype:
            return self.joined().cols(start, k).as_type(self.qtype)
        fmt = PACKED_TYPES[self.qtype]
        if start % fmt.block_values or k % fmt.block_values:
            raise ValueError(f"a {fmt.name} weight splits its columns on blocks of {fmt.block_values}; "
                             f"columns [{start}, {start + k}) are not block-aligned")
        a, b = row_bytes(self.qtype, start), row_bytes(self.qtype, start + k)
        return PackedWeight(self.data[:, a:b].contiguous(), self.qtype, k)

    def permute_rows(self, fn) -> PackedWeight:
        """Rows reordered by fn, a function of a [N, ...] tensor that permutes its rows (a copy)."""
        if self.tiled:
            return self.joined().permute_rows(fn).as_type(self.qtype)
        return PackedWeight(fn(self.data).contiguous(), self.qtype, self.in_features)

    def to(self, device) -> PackedWeight:
        """On another device; a split layout joins off the CPU (only the CPU kernels read it)."""
        w = self if torch.device(device).type == "cpu" else self.joined()
        return PackedWeight(w.data.to(device), w.qtype, w.in_features)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K], rounded as gguf's dequantisation rounds it."""
        if self.data.device.type == "cpu" and (ext := _cpu_ops()) is not None:
            return ext.packed_dequantize(self.data, self.qtype, self.in_features)
        return dequantize_ref(self.data, self.qtype, self.in_features)


def packed_weights_of(model: torch.nn.Module) -> list[PackedWeight]:
    """The PackedWeights a module tree holds, each once: they are plain attributes (not Parameters), so
    model.parameters() and state_dict() do not see them."""
    found = {id(w): w for m in model.modules() for w in vars(m).values() if isinstance(w, PackedWeight)}
    return list(found.values())


def split_rows(data: torch.Tensor, qtype: int) -> torch.Tensor:
    """Q4_0 / Q4_1 rows [N, G * block bytes] in their split layout: every block's 16 code bytes, then the G float16
    scales, then (Q4_1) the G minima."""
    n, head = data.shape[0], 4 if qtype == Q4_1 else 2
    blocks = data.reshape(n, -1, PACKED_TYPES[qtype].block_bytes)  # [N, G, block bytes]
    parts = [blocks[..., head:], blocks[..., 0:2]] + ([blocks[..., 2:4]] if qtype == Q4_1 else [])
    return torch.cat([q.reshape(n, -1) for q in parts], dim=1)


def join_rows(data: torch.Tensor, qtype: int) -> torch.Tensor:
    """Split rows of type qtype back in their file's layout (split_rows' inverse)."""
    ft = file_type(qtype)
    n, G = data.shape[0], data.shape[1] // PACKED_TYPES[qtype].block_bytes
    codes, d = data[:, : 16 * G].reshape(n, G, 16), data[:, 16 * G : 18 * G].reshape(n, G, 2)
    parts = [d] + ([data[:, 18 * G :].reshape(n, G, 2)] if ft == Q4_1 else []) + [codes]
    return torch.cat(parts, dim=-1).reshape(n, -1)


def tile_rows(data: torch.Tensor, qtype: int) -> torch.Tensor:
    """Q4_0 / Q4_1 rows [N, G * block bytes] (N a multiple of 16) in their tiled layout (kernels/ggml.py): group t's
    block g at bytes (t G + g) 16 * block bytes, its 256 code bytes (code k = 8 c + 2 s + h of the group's row j in
    nibble s of little-endian word 2 j + h of 64-byte chunk c), then the 16 rows' float16 scales, then (Q4_1) minima."""
    n, bb, head = data.shape[0], PACKED_TYPES[qtype].block_bytes, 4 if qtype == Q4_1 else 2
    blocks = data.reshape(n // TILE_ROWS, TILE_ROWS, -1, bb)  # [T, 16 rows j, G, block bytes]
    t, _, g, _ = blocks.shape
    qs = blocks[..., head:]  # [T, j, G, 16]: code k in byte k % 16, low nibble for k < 16
    codes = torch.cat([qs & 15, qs >> 4], -1).view(t, TILE_ROWS, g, 4, 4, 2)  # [T, j, G, chunk c, nibble s, h]
    word_bytes = codes[..., 0::2, :] | codes[..., 1::2, :] << 4  # [T, j, G, c, byte s // 2, h]
    code_bytes = word_bytes.permute(0, 2, 3, 1, 5, 4).reshape(t, g, 256)  # [T, G, c, word 2 j + h, byte]
    per_row = [blocks[..., 0:2]] + ([blocks[..., 2:4]] if qtype == Q4_1 else [])  # scales, minima: [T, j, G, 2]
    parts = [code_bytes] + [p.permute(0, 2, 1, 3).reshape(t, g, 2 * TILE_ROWS) for p in per_row]
    return torch.cat(parts, -1).reshape(n, -1)


def untile_rows(data: torch.Tensor, qtype: int) -> torch.Tensor:
    """Tiled rows of type qtype back in their file's layout (tile_rows' inverse)."""
    ft = file_type(qtype)
    n, bb = data.shape[0], PACKED_TYPES[ft].block_bytes
    t, g = n // TILE_ROWS, data.shape[1] // bb
    b = data.reshape(t, g, TILE_ROWS * bb)  # [T, G, bytes of a group's block]
    w = b[..., :256].reshape(t, g, 4, TILE_ROWS, 2, 2)  # [T, G, c, j, h, byte]
    codes = torch.stack([w & 15, w >> 4], -1).view(t, g, 4, TILE_ROWS, 2, 4)  # [T, G, c, j, h, nibble s]
    codes = codes.permute(0, 3, 1, 2, 5, 4).reshape(t, TILE_ROWS, g, 32)  # [T, j, G, k = 8 c + 2 s + h]
    qs = (codes[..., :16] | codes[..., 16:] << 4).to(torch.uint8)  # [T, j, G, 16]
    per_row = [b[..., 256:288]] + ([b[..., 288:320]] if ft == Q4_1 else [])  # [T, G, 32] each
    parts = [p.reshape(t, g, TILE_ROWS, 2).permute(0, 2, 1, 3) for p in per_row] + [qs]
    return torch.cat(parts, -1).reshape(n, -1)


def relayout(data: torch.Tensor, qtype: int, to: int) -> torch.Tensor:
    """Packed rows of layout qtype in layout `to`, the same format's file layout or a split or tiled one (the same
    values)."""
    if qtype == to:
        return data
    ft = file_type(qtype)
    if qtype in SPLIT_OF.values():
        data = join_rows(data, qtype)
    elif qtype in TILES_OF.values():
        data = untile_rows(data, qtype)
    if to == ft:
        return data
    return split_rows(data, ft) if to in SPLIT_OF.values() else tile_rows(data, ft)


def kernel_qtype(qtype: int, device, rows: int) -> int:
    """The layout the CPU kernels read qtype's rows in fastest: a Q4_0 / Q4_1 weight of `rows` rows on CPU tiled
    where the AMX kernel runs it and rows is a multiple of 16 (an embedding too: its lookups read the tiles), else
    split where the AVX-512 or AVX2 kernels run it; anything else as it is. MINISPEC_FILE_LAYOUT=1 keeps the file's,
    MINISPEC_NO_TILES=1 the split one (to measure one against another)."""
    if qtype not in SPLIT_OF or torch.device(device).type != "cpu" or os.environ.get("MINISPEC_FILE_LAYOUT") or \
            (ext := _cpu_ops()) is None:
        return qtype
    if rows % TILE_ROWS == 0 and ext.packed_amx() and not os.environ.get("MINISPEC_NO_TILES"):
        return TILES_OF[qtype]
    return SPLIT_OF[qtype] if ext.PACKED_SPLIT else qtype


def kernel_layout(w):
    """A PackedWeight in kernel_qtype's layout; anything else as it is."""
    return w.as_type(kernel_qtype(w.qtype, w.device, w.shape[0])) if isinstance(w, PackedWeight) else w


def dequantize_ref(data: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """Pure-torch dequantisation of packed rows data [N, row_bytes] -> float32 [N, k]."""
    data, qtype = relayout(data, qtype, file_type(qtype)), file_type(qtype)
    n = data.shape[0]
    if qtype == F16:
        return data.contiguous().view(torch.float16).float().view(n, k)
    if qtype == BF16:
        return data.contiguous().view(torch.bfloat16).float().view(n, k)
    blocks = data.reshape(n, k // GROUP, PACKED_TYPES[qtype].block_bytes)  # [N, G, block bytes]
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [N, G, 1]
    if qtype == Q8_0:
        q = blocks[..., 2:].contiguous().view(torch.int8).float()  # [N, G, 32]
        return (d * q).view(n, k)
    qs = blocks[..., -16:]  # [N, G, 16]: value j in the low nibble of byte j, value j + 16 in the high one
    q = torch.cat([qs & 15, qs >> 4], dim=-1).float()  # [N, G, 32]
    if qtype == Q4_0:
        return (d * (q - 8)).view(n, k)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()  # [N, G, 1]
    return (d * q + m).view(n, k)


def quantize(w: torch.Tensor, qtype: int) -> PackedWeight:
    """A dense weight [N, K] (K a multiple of 32) as packed Q8_0 or Q4_1 rows, byte for byte what ggml's reference
    quantiser (gguf.quants.quantize) makes of its float32 values."""
    if qtype not in (Q4_1, Q8_0):
        raise ValueError(f"quantize makes Q8_0 or Q4_1 rows, not {type_name(qtype)}")
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"{type_name(qtype)} rows hold whole blocks of {GROUP}; got {k} values per row")
    x = w.detach().float().reshape(n, k // GROUP, GROUP)  # [N, G, 32]
    if qtype == Q8_0:
        d = x.abs().amax(-1, keepdim=True) / 127  # [N, G, 1]
        v = x * torch.where(d == 0, 0.0, 1 / d)
        a = v.abs()
        q = (v.sign() * (a.floor() + (2 * (a - a.floor())).floor())).to(torch.int8)  # roundf: halves away from 0
        parts = [d.half().view(torch.uint8), q.view(torch.uint8)]
    else:
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)  # [N, G, 1]
        d = (hi - lo) / 15
        q = ((x - lo) * torch.where(d == 0, 0.0, 1 / d) + 0.5).trunc().clamp(0, 15).to(torch.uint8)  # [N, G, 32]
        parts = [d.half().view(torch.uint8), lo.half().view(torch.uint8), q[..., :16] | (q[..., 16:] << 4)]
    return PackedWeight(torch.cat(parts, -1).reshape(n, -1).contiguous(), qtype, k)


def linear_ref(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: the float32 layer over the dequantised weight, in x's dtype."""
    y = F.linear(x.float(), dequantize_ref(w.data, w.qtype, w.in_features), None if bias is None else bias.float())
    return y.to(x.dtype)


def gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T in float32 on CPU: oneDNN's GEMM on AVX-512 CPUs where torch ships it (F.linear's MKL
    takes no AVX-512 path on AMD CPUs), else F.linear (MKL: faster under AVX2); both accumulate in float32
    (docs/experiments.md, "The prefill GEMM")."""
    if _ONEDNN_LINEAR is not None and x.is_contiguous() and w.is_contiguous():
        return _ONEDNN_LINEAR(x, w, None, "none", [], "")
    return F.linear(x, w)


def linear(x: torch.Tensor, w: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: F.linear for a dense weight (on CPU in float32, the C++
    dense_linear: each weight row read once for up to 16 rows), exact float32 math for a packed one."""
    if not isinstance(w, PackedWeight):
        if applies(x, w, *([] if bias is None else [bias])):  # up to 16 rows: each weight row read once
            return _cpu_ops().dense_linear(x.reshape(-1, x.shape[-1]), w, bias).view(*x.shape[:-1], w.shape[0])
        return F.linear(x, w, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if x.is_cuda:
        from minispec.kernels.packed_triton import packed_linear_triton

        y = packed_linear_triton(x2, w.data, w.qtype, w.in_features)  # [M, N] float32
    elif (ext := _cpu_ops()) is None:
        return linear_ref(x, w, bias)
    elif x2.shape[0] > ext.PACKED_MAX_ROWS and not w.tiled:
        # a long prefill: one float32 GEMM on the weight dequantised for it (a tiled weight's AMX kernel beats that at
        # every count of rows: docs/experiments.md, twenty-third session)
        y = gemm(x2.float(), ext.packed_dequantize(w.data, w.qtype, w.in_features))
    else:
        y = ext.packed_linear(x2.float().contiguous(), w.data, w.qtype, w.in_features)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*lead, y.shape[-1])


def embedding(ids: torch.Tensor, w: torch.Tensor | PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    """Rows of w for ids [...] -> [..., K]; a packed weight dequantises only the rows looked up."""
    if not isinstance(w, PackedWeight):
        return F.embedding(ids, w)
    flat = ids.reshape(-1)
    if w.data.device.type == "cpu" and (ext := _cpu_ops()) is not None:  # a tiled layout's rows are no slices
        rows = ext.packed_rows(w.data, w.qtype, w.in_features, flat.long())
    else:
        rows = dequantize_ref((w.joined() if w.tiled else w).data[flat], file_type(w.qtype), w.in_features)
    return rows.to(dtype).view(*ids.shape, w.in_features)


def onednn_linear():
    """torch's oneDNN linear op (the one inductor calls on CPU), or None where this torch lacks it."""
    try:
        op = torch.ops.mkldnn._linear_pointwise
        return op if torch.backends.mkldnn.is_available() else None
    except (AttributeError, RuntimeError):
        return None


# gemm's oneDNN op where the CPU has AVX-512, else None (F.linear): on a Zen 3 (AVX2) MKL's sgemm ran the bench's
# 16-prompt prefill in 0.80-0.97x oneDNN's time (docs/experiments.md, thirty-third session)
_ONEDNN_LINEAR = onednn_linear() if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else None


def _cpu_ops():
    from minispec.kernels.cpu import ops

    return ops()
