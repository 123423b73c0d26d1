"""Tensor-parallel linear layers and the vocab-parallel embedding (plain F.linear at tp=1)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minispec.distributed import TPGroup
from minispec.utils import cdiv


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
    ):
        super().__init__()
        tp = tp_group.world_size
        assert all(s % tp == 0 for s in part_sizes), (part_sizes, tp)
        self.rank = tp_group.rank_in_group
        self.local_sizes = [s // tp for s in part_sizes]
        self.local_offsets = [sum(self.local_sizes[:i]) for i in range(len(part_sizes))]
        out_local = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(out_local, in_features, dtype=dtype, device=device), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(out_local, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    def load_part(self, i: int, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's shard of part i from its full weight [part_size, in] (and bias [part_size])."""
        n, off = self.local_sizes[i], self.local_offsets[i]
        start = self.rank * n
        self.weight[off : off + n].copy_(weight[start : start + n])
        if self.bias is not None:
            self.bias[off : off + n].copy_(bias[start : start + n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


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
    ):
        super().__init__()
        tp = tp_group.world_size
        assert in_features % tp == 0, (in_features, tp)
        self.tp_group = tp_group
        self.in_local = in_features // tp
        self.weight = nn.Parameter(
            torch.empty(out_features, self.in_local, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's column shard of the full weight [out, in] (the bias is kept whole)."""
        start = self.tp_group.rank_in_group * self.in_local
        self.weight.copy_(weight[:, start : start + self.in_local])
        if self.bias is not None:
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_group.world_size == 1:
            return F.linear(x, self.weight, self.bias)
        y = self.tp_group.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary padded to a multiple of tp and split into row shards.

    Rank r owns token ids [r * shard, (r + 1) * shard); padded rows stay zero. The same weight
    serves as a tied LM head (see ``LlamaForCausalLM.compute_logits``).
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, tp_group: TPGroup, dtype: torch.dtype, device):
        super().__init__()
        tp = tp_group.world_size
        self.tp_group = tp_group
        self.vocab_size = vocab_size
        self.vocab_size_padded = cdiv(vocab_size, tp) * tp
        self.shard_size = self.vocab_size_padded // tp
        self.shard_start = tp_group.rank_in_group * self.shard_size
        # Real (unpadded) rows of this rank's shard.
        self.num_real = max(0, min(self.shard_size, vocab_size - self.shard_start))
        self.weight = nn.Parameter(
            torch.zeros(self.shard_size, hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def load(self, weight: torch.Tensor) -> None:
        """Copy this rank's rows of the full [vocab_size, hidden] weight."""
        self.weight[: self.num_real].copy_(weight[self.shard_start : self.shard_start + self.num_real])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.shard_start
        in_shard = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.masked_fill(~in_shard, 0), self.weight)  # [*ids.shape, hidden]
        out.mul_(in_shard.unsqueeze(-1).to(out.dtype))
        return self.tp_group.all_reduce(out)
