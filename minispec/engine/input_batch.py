"""One step's batch as tensors: batch positions, slots and logits positions."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def logits_offsets(num_logits: np.ndarray) -> np.ndarray:
    """[num_reqs + 1] int64: the first logits position of each request, then the total (a cumulative sum)."""
    cu = np.zeros(len(num_logits) + 1, dtype=np.int64)
    np.cumsum(num_logits, out=cu[1:])
    return cu


@dataclass(slots=True)
class InputBatch:
    """The requests scheduled this step, in batch-position order.

    A request with n drafts to verify has n + 1 logits positions (its drafts and the bonus); a
    request whose prefill chunk ends inside the prompt has none.
    """

    req_ids: list[str]
    slots_np: np.ndarray  # [num_reqs] batch position -> slot
    slots: torch.Tensor  # [num_reqs]
    cu_num_logits_np: np.ndarray  # [num_reqs + 1] first logits position of each request
    expanded_slots: torch.Tensor  # [num_logits] slot of each logits position
    expanded_local_pos: torch.Tensor  # [num_logits] its index within its request, 0..num_drafts

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def num_logits(self) -> int:
        return int(self.cu_num_logits_np[-1])

    @staticmethod
    def build(req_ids: list[str], slots: np.ndarray, num_logits: np.ndarray, device,
              cu_num_logits: np.ndarray | None = None) -> "InputBatch":
        """From each request's slot and number of logits positions (and their offsets, where already known)."""
        cu = logits_offsets(num_logits) if cu_num_logits is None else cu_num_logits
        expanded_slots = np.repeat(slots, num_logits)
        local_pos = np.arange(cu[-1], dtype=np.int64) - np.repeat(cu[:-1], num_logits)
        return InputBatch(
            req_ids=req_ids,
            slots_np=slots.astype(np.int32),
            slots=torch.from_numpy(slots.astype(np.int32)).to(device),
            cu_num_logits_np=cu,
            expanded_slots=torch.from_numpy(expanded_slots.astype(np.int32)).to(device),
            expanded_local_pos=torch.from_numpy(local_pos.astype(np.int32)).to(device),
        )
