"""Tensor-parallel linear layers and the vocab-parallel embedding (plain F.linear at tp=1).

Built with packed=True, a layer allocates nothing until it loads: a PackedWeight (layers/quant.py)
is kept packed, on the device, and runs the exact packed kernels; a dense tensor becomes a Parameter
in the layer's dtype. Column shards are whole rows; row-parallel shards split each row's columns
on quantisation-block bounds (ValueError where tp puts a shard boundary inside a block).
"""
from __future__ import annotations

import torch
from torch import nn

from minispec.distributed import TPGroup
from minispec.kernels.ggml import TILE_ROWS, file_type
from minispec.layers.quant import PackedWeight, embedding, kernel_qtype, linear, relayout, row_bytes, type_name
from minispec.utils import cdiv


def _dense(rows: int, cols: int, dtype, device, fill_zero: bool = False) -> nn.Parameter:
    new = torch.zeros if fill_zero else torch.empty
    return nn.Parameter(new(rows, cols, dtype=dtype, device=device), requires_grad=False)


def _rows_like(src: torch.Tensor | PackedWeight, rows: int, cols: int, dtype, device, fill_zero: bool = False):
    """An empty weight of `rows` rows for src's kind: PackedWeight of src's format in the kernels' layout
    (quant.kernel_qtype; zero bytes are zero values), or a dense Parameter."""
    if isinstance(src, PackedWeight):
        new = torch.zeros if fill_zero else torch.empty
        data = new(rows, row_bytes(src.qtype, cols), dtype=torch.uint8, device=device)
        return PackedWeight(data, kernel_qtype(file_type(src.qtype), device, rows), cols)
    return _dense(rows, cols, dtype, device, fill_zero)


def _check_kind(dst, src) -> None:
    """ValueError unless src (a loaded part) is stored like dst: both dense, or packed of one type."""
    if isinstance(dst, PackedWeight) != isinstance(src, PackedWeight) or \
            isinstance(dst, PackedWeight) and file_type(dst.qtype) != file_type(src.qtype):
        kinds = [f"packed {type_name(w.qtype)}" if isinstance(w, PackedWeight) else "dense" for w in (dst, src)]
        raise ValueError(f"the fused parts of one layer are stored differently ({kinds[0]} and {kinds[1]})")


def _rows_of(w: torch.Tensor | PackedWeight, start: int, n: int) -> torch.Tensor:
    """Rows [start, start + n) of a weight's storage (a view)."""
    return (w.data if isinstance(w, PackedWeight) else w)[start : start + n]


def _copy_rows(dst: torch.Tensor | PackedWeight, at: int, src: torch.Tensor | PackedWeight, start: int, n: int) -> None:
    """dst's rows [at, at + n) = src's rows [start, start + n), in dst's layout (a file's, split or tiled one)."""
    if isinstance(dst, PackedWeight) and dst.tiled and (at % TILE_ROWS or n % TILE_ROWS):
        lo, hi = at // TILE_ROWS * TILE_ROWS, cdiv(at + n, TILE_ROWS) * TILE_ROWS  # the groups rows [at, at + n) touch
        groups = PackedWeight(dst.data[lo:hi], dst.qtype, dst.in_features).joined()
        _copy_rows(groups, at - lo, src, start, n)
        dst.data[lo:hi].copy_(relayout(groups.data, groups.qtype, dst.qtype))
        return
    rows = _rows_of(src, start, n)
    _rows_of(dst, at, n).copy_(relayout(rows, src.qtype, dst.qtype) if isinstance(dst, PackedWeight) else rows)


def replace_weight(layer: nn.Module, weight: torch.Tensor | PackedWeight) -> None:
    """Swap a layer's dense weight (a Parameter) for a packed one, which nn.Module holds as a plain attribute."""
    layer._parameters.pop("weight", None)  # nn.Module refuses a non-Parameter under a parameter's name
    layer.weight = weight


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with the output features split across ranks.

    Several layers can be fused into one matmul (q|k|v, gate|up): each part is split evenly, and
    this rank's weight holds its shard of every part, in part order.
    """

    def __init__(
        self,
        in_features: int,
        part_sizes: list[int],
        bias: bool,
        *,
        tp_group: TPGroup,
        dtype: torch.dtype,
        device,
        packed: bool = False,
    ):
        super().__init__()
        tp = tp_group.world_size
        assert all(s % tp == 0 for s in part_sizes), (part_sizes, tp)
        self.rank = tp_group.rank_in_group
        self.local_sizes = [s // tp for s in part_sizes]
        self.local_offsets = [sum(self.local_sizes[:i]) for i in range(len(part_sizes))]
        out_local = sum(self.local_sizes)
        self.in_features, self.dtype, self.device = in_features, dtype, device
        self.weight = None if packed else _dense(out_local, in_features, dtype, device)
        self.bias = (
            nn.Parameter(torch.zeros(out_local, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    def load_part(self, i: int, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's shard of part i from its full weight [part_size, in] (and bias [part_size])."""
        n, off = self.local_sizes[i], self.local_offsets[i]
        start = self.rank * n
        if self.weight is None:
            self.weight = _rows_like(weight, sum(self.local_sizes), self.in_features, self.dtype, self.device)
        _check_kind(self.weight, weight)
        _copy_rows(self.weight, off, weight, start, n)
        if self.bias is not None:
            self.bias[off : off + n].copy_(bias[start : start + n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with the input features split across ranks: one all_reduce of the partial sums."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        *,
        tp_group: TPGroup,
        dtype: torch.dtype,
        device,
        packed: bool = False,
    ):
        super().__init__()
        tp = tp_group.world_size
        assert in_features % tp == 0, (in_features, tp)
        self.tp_group = tp_group
        self.in_local = in_features // tp
        self.out_features, self.dtype, self.device = out_features, dtype, device
        self.weight = None if packed else _dense(out_features, self.in_local, dtype, device)
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's column shard of the full weight [out, in] (the bias is kept whole)."""
        start = self.tp_group.rank_in_group * self.in_local
        if isinstance(weight, PackedWeight):  # a copy of each row's block-aligned columns
            shard = weight.cols(start, self.in_local) if self.tp_group.world_size > 1 else weight
        else:
            shard = weight[:, start : start + self.in_local]
        if self.weight is None:
            self.weight = _rows_like(shard, self.out_features, self.in_local, self.dtype, self.device)
        _check_kind(self.weight, shard)
        _copy_rows(self.weight, 0, shard, 0, self.out_features)
        if self.bias is not None:
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_group.world_size == 1:
            return linear(x, self.weight, self.bias)
        y = self.tp_group.all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary padded to a multiple of tp and split into row shards.

    Rank r owns token ids [r * shard, (r + 1) * shard); padded rows stay zero. The same weight
    serves as a tied LM head (see ``LlamaForCausalLM.compute_logits``).
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, tp_group: TPGroup, dtype: torch.dtype, device,
                 packed: bool = False):
        super().__init__()
        tp = tp_group.world_size
        self.tp_group = tp_group
        self.vocab_size = vocab_size
        self.vocab_size_padded = cdiv(vocab_size, tp) * tp
        self.shard_size = self.vocab_size_padded // tp
        self.shard_start = tp_group.rank_in_group * self.shard_size
        # Real (unpadded) rows of this rank's shard.
        self.num_real = max(0, min(self.shard_size, vocab_size - self.shard_start))
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.weight = None if packed else _dense(self.shard_size, hidden_size, dtype, device, fill_zero=True)

    def load(self, weight: torch.Tensor | PackedWeight) -> None:
        """Copy this rank's rows of the full [vocab_size, hidden] weight (padded rows stay zero)."""
        if self.weight is None:
            self.weight = _rows_like(weight, self.shard_size, self.hidden_size, self.dtype, self.device, fill_zero=True)
        _check_kind(self.weight, weight)
        _copy_rows(self.weight, 0, weight, self.shard_start, self.num_real)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group.world_size == 1:
            return embedding(ids, self.weight, self.dtype)
        local = ids - self.shard_start
        in_shard = (local >= 0) & (local < self.shard_size)
        out = embedding(local.masked_fill(~in_shard, 0), self.weight, self.dtype)  # [*ids.shape, hidden]
        out.mul_(in_shard.unsqueeze(-1).to(out.dtype))
        return self.tp_group.all_reduce(out)
