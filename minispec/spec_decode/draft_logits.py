"""Draft logits cached by a draft step for the next verification, replicated or sharded by batch position.

Layout of a sharded cache on a TP group of ``tp`` ranks:

* owner: the request at batch position i of a draft step is cached, and later verified, by rank
  ``i % tp`` (:func:`shard_owners`), at row ``i // tp`` of that rank's ``values``.
* ``shard_mapping[slot]``: the owner of each slot, the same on every rank.
* ``row_mapping[slot]``: the slot's row on this rank, -1 if another rank owns it.
* ``inverse_row_mapping[row]``: the slot last drafted into each row of this rank, -1 if none.

A slot skipped by the scheduler keeps its ``row_mapping`` entry while its row may be handed to
another slot; ``inverse_row_mapping`` then names the other slot and the skipped slot's drafts are
stale. Drafts belong to the slot: the engine must not verify drafts for a request that has not
been drafted since it took its slot (it has none).
"""
from __future__ import annotations

import numpy as np
import torch

from minispec.distributed import get_tp_group
from minispec.utils import cdiv, load_triton
from minispec.utils import use_triton as _use_triton

triton, tl = load_triton()

_BLOCK_SIZE = 1024


def shard_owners(num_reqs: int, tp: int) -> np.ndarray:
    """The owner rank of each batch position: position i -> rank i % tp."""
    return np.arange(num_reqs, dtype=np.int32) % tp  # [num_reqs]


def shard_rows(n: int, tp: int) -> np.ndarray:
    """The row of each of n slots (or batch positions) on its owner rank: s -> s // tp."""
    return np.arange(n, dtype=np.int32) // tp  # [n]


@triton.jit
def draft_logits_row(slot, row_mapping_ptr):
    """Row of a request in this rank's draft logits cache, or -1 if no row.

    ``row_mapping_ptr`` is None for a replicated cache, whose row is the slot;
    otherwise it is ``DraftLogitsCache.row_mapping``.
    """
    row = slot
    if row_mapping_ptr is not None:
        row = tl.load(row_mapping_ptr + slot, mask=slot >= 0, other=-1)
    return row.to(tl.int64)


@triton.jit
def _assign_rows_kernel(
    slots_ptr,  # [num_reqs] batch position -> slot
    shard_mapping_ptr,  # [max_num_reqs] slot -> owner rank
    row_mapping_ptr,  # [max_num_reqs] slot -> row on this rank, -1 if none
    inverse_row_mapping_ptr,  # [num_rows] row -> slot, -1 if none
    num_reqs,
    NUM_SHARDS: tl.constexpr,
    SHARD_IDX: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    pos = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = pos < num_reqs
    slot = tl.load(slots_ptr + pos, mask=mask, other=0)
    owner = pos % NUM_SHARDS
    row = pos // NUM_SHARDS
    mine = owner == SHARD_IDX
    tl.store(shard_mapping_ptr + slot, owner.to(tl.int32), mask=mask)
    tl.store(row_mapping_ptr + slot, tl.where(mine, row, -1).to(tl.int32), mask=mask)
    tl.store(inverse_row_mapping_ptr + row, slot.to(tl.int32), mask=mask & mine)


def _assign_rows_torch(
    slots: torch.Tensor,
    shard_mapping: torch.Tensor,
    row_mapping: torch.Tensor,
    inverse_row_mapping: torch.Tensor,
    num_shards: int,
    shard_idx: int,
) -> None:
    """Torch reference of _assign_rows_kernel: updates the three tables in place."""
    slots = slots.long()  # [num_reqs]
    pos = torch.arange(slots.shape[0], device=slots.device)  # [num_reqs]
    owner = pos % num_shards
    row = pos // num_shards
    mine = owner == shard_idx
    shard_mapping[slots] = owner.to(shard_mapping.dtype)
    row_mapping[slots] = torch.where(mine, row, -1).to(row_mapping.dtype)
    inverse_row_mapping[row[mine]] = slots[mine].to(inverse_row_mapping.dtype)


@triton.jit
def _stale_drafts_kernel(
    stale_ptr,  # [num_logits] bool out
    expanded_slots_ptr,  # [num_logits] logits position -> slot
    expanded_local_pos_ptr,  # [num_logits] logits position -> its index within its request
    row_mapping_ptr,  # [max_num_reqs]
    inverse_row_mapping_ptr,  # [num_rows]
    num_logits,
    NUM_STEPS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    idx = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = idx < num_logits
    slot = tl.load(expanded_slots_ptr + idx, mask=mask, other=-1)
    local_pos = tl.load(expanded_local_pos_ptr + idx, mask=mask, other=0)
    row = draft_logits_row(slot, row_mapping_ptr)
    last_slot = tl.load(inverse_row_mapping_ptr + row, mask=mask & (row >= 0), other=-1)
    reads_cache = (local_pos >= 0) & (local_pos < NUM_STEPS)
    stale = reads_cache & ((row < 0) | (last_slot != slot))
    tl.store(stale_ptr + idx, stale, mask=mask)


def _stale_drafts_torch(
    expanded_slots: torch.Tensor,
    expanded_local_pos: torch.Tensor,
    row_mapping: torch.Tensor,
    inverse_row_mapping: torch.Tensor,
    num_steps: int,
) -> torch.Tensor:
    """Torch reference of _stale_drafts_kernel: [num_logits] True for each stale draft."""
    slot = expanded_slots.long()  # [num_logits]
    row = torch.where(slot >= 0, row_mapping[slot.clamp(min=0)].long(), -1)  # [num_logits]
    last_slot = torch.where(row >= 0, inverse_row_mapping[row.clamp(min=0)].long(), -1)
    reads_cache = (expanded_local_pos >= 0) & (expanded_local_pos < num_steps)
    return reads_cache & ((row < 0) | (last_slot != slot))


class DraftLogitsCache:
    """Pre-temperature draft logits, cached by a draft step for the next verification.

    A replicated cache holds every request on every TP rank, at row = slot.

    A sharded cache (batch-sharded sampling) holds on each TP rank only the requests that rank
    verifies: every draft step gives the request at batch position i to rank i % tp, at row
    i // tp, so no rank holds more than cdiv(max_num_reqs, tp) rows however the slots are spread.

    Rows are reused every step. A request the scheduler skips for a step keeps its drafts, but
    its row may since have been given to another request; ``inverse_row_mapping`` detects this
    and ``stale_drafts`` marks those drafts invalid, so verification rejects them and samples
    from the target.
    """

    def __init__(
        self,
        max_num_reqs: int,
        num_steps: int,
        vocab_size: int,
        *,
        dtype: torch.dtype,
        fill: float,
        device: torch.device | str,
        sharded: bool = False,
    ):
        self.num_steps = num_steps
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        num_rows = max_num_reqs
        # [max_num_reqs] slot -> row in values, -1 if another rank caches it; None when replicated.
        self.row_mapping: torch.Tensor | None = None
        self.inverse_row_mapping: torch.Tensor | None = None
        self.shard_mapping: torch.Tensor | None = None
        self.shard_mapping_np: np.ndarray | None = None
        self._num_shards = 1
        self._shard_idx = 0
        if sharded:
            tp_group = get_tp_group()
            self._num_shards = tp_group.world_size
            self._shard_idx = tp_group.rank_in_group
            num_rows = cdiv(max_num_reqs, self._num_shards)
            # Slots never drafted keep a slot-based owner (slot % tp) and row (slot // tp). They have
            # no drafts, so any owner works as long as every rank agrees; inverse_row_mapping starts
            # at -1, so they read as stale until drafted.
            slots = np.arange(max_num_reqs, dtype=np.int32)
            self.shard_mapping_np = slots % self._num_shards  # [max_num_reqs]
            self.shard_mapping = torch.from_numpy(self.shard_mapping_np.copy()).to(device)
            rows_np = np.where(
                self.shard_mapping_np == self._shard_idx, shard_rows(max_num_reqs, self._num_shards), -1
            ).astype(np.int32)
            self.row_mapping = torch.from_numpy(rows_np).to(device)  # [max_num_reqs]
            # [num_rows] the slot last drafted into each row of this rank, -1 if none.
            self.inverse_row_mapping = torch.full((num_rows,), -1, dtype=torch.int32, device=device)
        self.num_rows = num_rows
        # Whether the next verification reads greedy requests' rows (only to record beta: greedy verification
        # compares tokens); the engine sets it before each draft step, and a proposer may skip writing them when not.
        self.greedy_rows_read = True
        # [num_rows, num_steps, vocab_size]; read and written through read / write / write_one_hot only
        self.values = torch.full((num_rows, num_steps, vocab_size), fill, dtype=dtype, device=device)

    @property
    def sharded(self) -> bool:
        return self.row_mapping is not None

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's cached draft logits (values)."""
        return self.values.numel() * self.values.element_size()

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row (one request's num_steps draft logits)."""
        return self.nbytes // self.num_rows

    def write(self, rows: torch.Tensor, step: int, logits: torch.Tensor) -> None:
        """Cache draft logits at this rank's rows [num_mine] (each >= 0): one step's [num_mine, V], or [num_mine, S,
        V] for steps step .. step + S - 1."""
        logits = logits if logits.dim() == 3 else logits.unsqueeze(1)  # [num_mine, S, V]
        self.values[rows, step : step + logits.shape[1]] = logits.to(self.values.dtype)

    def write_subset(self, rows: torch.Tensor, step: int, logits: torch.Tensor, ids: torch.Tensor) -> None:
        """Cache draft logits over the vocabulary ids [num_ids] at this rank's rows [num_mine] (each >= 0), -inf at
        every other id: one step's [num_mine, num_ids], or [num_mine, S, num_ids] for steps step .. step + S - 1."""
        logits = (logits if logits.dim() == 3 else logits.unsqueeze(1)).to(self.values.dtype)  # [num_mine, S, num_ids]
        index = ids.expand(logits.shape[1], -1)  # [S, num_ids]
        for i, row in enumerate(rows.tolist()):  # a fill and a scatter per row: a third of one advanced-index write's time
            out = self.values[row, step : step + logits.shape[1]]  # [S, V]
            out.fill_(float("-inf"))
            out.scatter_(1, index, logits[i])

    def write_one_hot(self, rows: torch.Tensor, drafts: torch.Tensor) -> None:
        """Cache one-hot draft logits (0 at the draft, -inf elsewhere) in the rows this rank owns.

        rows: [num_reqs] each request's row (-1: another rank's); drafts: [num_reqs, k] (-1: none, its
        logits are all -inf and never read, since the rejection sampler rejects placeholders).
        """
        mine = rows >= 0  # [num_reqs]
        self.values[rows[mine]] = float("-inf")
        sel = mine.unsqueeze(1) & (drafts >= 0)  # [num_reqs, k]
        row_idx = rows.unsqueeze(1).expand_as(drafts)[sel]
        step_idx = torch.arange(drafts.shape[1], device=drafts.device).expand_as(drafts)[sel]
        self.values[row_idx, step_idx, drafts[sel]] = 0.0

    def read(self, slots: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """The cached logits [N, V] at (slots[i], steps[i]); a slot with no row here reads row 0 (stale_drafts
        flags it)."""
        return self.values[self.rows_of(slots).clamp(min=0).long(), steps]

    def assign(self, slots: torch.Tensor, slots_np: np.ndarray, use_triton: bool | None = None) -> None:
        """Give a sharded cache's rows out by batch position; call after verification and before
        the draft step writes the draft logits.

        For batch position i with slot s = slots[i]: owner = i % tp and shard_mapping[s] =
        owner (host copy here in numpy, device copy by the kernel); if the owner is this rank,
        row_mapping[s] = i // tp and inverse_row_mapping[i // tp] = s, else row_mapping[s] = -1.
        Slots not in the batch keep their entries, which is how stale_drafts finds them later.
        A no-op for a replicated cache. use_triton: the kernel (None: on CUDA tensors; tests force it on CPU
        tensors under TRITON_INTERPRET=1), as rejection_sample's.
        """
        num_reqs = slots_np.shape[0]
        if self.row_mapping is None or num_reqs == 0:
            return
        self.shard_mapping_np[slots_np] = shard_owners(num_reqs, self._num_shards)
        if _use_triton(slots) if use_triton is None else use_triton:
            _assign_rows_kernel[(triton.cdiv(num_reqs, _BLOCK_SIZE),)](
                slots,
                self.shard_mapping,
                self.row_mapping,
                self.inverse_row_mapping,
                num_reqs,
                NUM_SHARDS=self._num_shards,
                SHARD_IDX=self._shard_idx,
                BLOCK_SIZE=_BLOCK_SIZE,
            )
        else:
            _assign_rows_torch(
                slots, self.shard_mapping, self.row_mapping, self.inverse_row_mapping,
                self._num_shards, self._shard_idx,
            )

    def owners_of(self, slots_np: np.ndarray) -> np.ndarray:
        """[num_reqs] the TP rank that verifies each of a batch's requests: the rank that cached its draft
        logits, or for a replicated cache, round-robin over batch positions."""
        if self.row_mapping is None:
            return shard_owners(slots_np.shape[0], get_tp_group().world_size)
        return self.shard_mapping_np[slots_np]

    def stale_drafts(self, input_batch, use_triton: bool | None = None) -> torch.Tensor | None:
        """Mark the drafts whose draft logits were overwritten since drafting; only valid for
        requests this rank owns.

        Logits position j belongs to slot expanded_slots[j] at local position
        expanded_local_pos[j]. It is stale iff it reads cached logits (0 <= local_pos < num_steps;
        positions past the drafted steps read none and are never stale) and the slot has no row here
        (row_mapping == -1) or inverse_row_mapping[row] != slot (another request took the row
        since). A request's bonus position may be flagged too; it verifies no draft, so the flag is moot.

        ``input_batch`` needs int32 tensors ``expanded_slots`` and ``expanded_local_pos``.
        Returns [num_logits] bool, or None for a replicated cache, whose rows are never reused. use_triton: as
        assign's.
        """
        if self.row_mapping is None:
            return None
        expanded_slots = input_batch.expanded_slots
        expanded_local_pos = input_batch.expanded_local_pos
        num_logits = expanded_slots.shape[0]
        if not (_use_triton(expanded_slots) if use_triton is None else use_triton):
            return _stale_drafts_torch(
                expanded_slots, expanded_local_pos, self.row_mapping, self.inverse_row_mapping,
                self.num_steps,
            )
        stale = expanded_slots.new_empty(num_logits, dtype=torch.bool)  # [num_logits]
        if num_logits == 0:
            return stale
        _stale_drafts_kernel[(triton.cdiv(num_logits, _BLOCK_SIZE),)](
            stale,
            expanded_slots,
            expanded_local_pos,
            self.row_mapping,
            self.inverse_row_mapping,
            num_logits,
            NUM_STEPS=self.num_steps,
            BLOCK_SIZE=_BLOCK_SIZE,
        )
        return stale

    def rows_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Torch twin of draft_logits_row: each slot's row in values, -1 if none (slot < 0 or
        cached by another rank); the slot itself for a replicated cache."""
        if self.row_mapping is None:
            return slots
        return torch.where(slots >= 0, self.row_mapping[slots.clamp(min=0).long()], -1).to(slots.dtype)
