"""Tensor-parallel process group: init from torchrun's environment and the few collectives used."""
from __future__ import annotations

import atexit
import datetime
import math
import os
import pickle
import re
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from minispec.utils import one_line


DEFAULT_TIMEOUT_S = 300.0


class CollectiveError(RuntimeError):
    """A collective of the TP group failed or timed out: another rank died, stalled or left.

    The message is one line naming the operation, this rank, the cause and the timeout.
    """


def _collective_failed(op: str, e: BaseException) -> CollectiveError:
    """A CollectiveError describing a backend's exception from collective `op` in one line."""
    cause = re.sub(r"^\[[^\]]*\]\s*", "", one_line(e, limit=None))  # gloo's "[path/to/file.cc:123] " prefix
    cause = cause.split(". This is typically")[0].rstrip(". ")
    if len(cause) > 200:
        cause = cause[:197] + "..."
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    return CollectiveError(
        f"rank {rank}/{world}: {op} failed ({cause}); another rank may have died or stalled "
        f"(collective timeout {_TIMEOUT_S:g} s, set by MINISPEC_DIST_TIMEOUT)"
    )


@dataclass(slots=True)
class TPGroup:
    """The tensor-parallel group: every rank of the job (a single-rank no-op group outside torchrun)."""

    world_size: int = 1
    rank_in_group: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    # Every collective raises CollectiveError (one line) when a peer dies or the timeout passes.
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over ranks in place; returns x."""
        if self.world_size > 1:
            try:
                dist.all_reduce(x)
            except RuntimeError as e:
                raise _collective_failed("all_reduce", e) from e
        return x

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's x (same shape on each rank) along dim, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        try:
            dist.all_gather(parts, x.contiguous())
        except RuntimeError as e:
            raise _collective_failed("all_gather", e) from e
        return torch.cat(parts, dim=dim)

    def all_to_all(
        self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        """Send x[sum(send_counts[:r]) : ...] to rank r; return what was received, by source rank."""
        if self.world_size == 1:
            return x
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        try:
            dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts)
        except RuntimeError as e:
            raise _collective_failed("all_to_all", e) from e
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copy rank src's x to every rank, in place; returns x."""
        if self.world_size > 1:
            try:
                dist.broadcast(x, src)
            except RuntimeError as e:
                raise _collective_failed("broadcast", e) from e
        return x

    def broadcast_object(self, obj=None, src: int = 0):
        """Rank src's picklable obj on every rank (others pass None): one size, then one byte broadcast."""
        if self.world_size == 1:
            return obj
        data = pickle.dumps(obj) if self.rank_in_group == src else b""
        size = self.broadcast(torch.tensor([len(data)], dtype=torch.int64, device=self.device), src)
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)  # [num_bytes]
        if self.rank_in_group == src:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return pickle.loads(self.broadcast(buf, src).cpu().numpy().tobytes())


_TP_GROUP = TPGroup()
_TIMEOUT_S = DEFAULT_TIMEOUT_S


def job_world_size() -> int:
    """How many ranks torchrun started (1 outside torchrun), known before any rank connects."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(timeout_s: float | None = None) -> TPGroup:
    """Join torchrun's job (gloo on CPU, nccl on CUDA), or set up a single-rank group outside torchrun.

    Idempotent. ``timeout_s`` (default: $MINISPEC_DIST_TIMEOUT or 300) bounds every collective, so a
    dead or stalled rank ends the job with a CollectiveError instead of a hang. (gloo raises it on
    the surviving ranks; NCCL's watchdog aborts the process after the timeout instead.)
    """
    global _TP_GROUP, _TIMEOUT_S
    world_size = job_world_size()
    if world_size == 1:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        _TP_GROUP = TPGroup(1, 0, device)
        return _TP_GROUP
    if not dist.is_initialized():
        if timeout_s is None:
            env = os.environ.get("MINISPEC_DIST_TIMEOUT", str(DEFAULT_TIMEOUT_S))
            try:
                timeout_s = float(env)
            except ValueError:
                raise ValueError(f"MINISPEC_DIST_TIMEOUT must be a number of seconds, got {env!r}") from None
        if not timeout_s > 0:
            raise ValueError(f"the collective timeout must be > 0 seconds, got {timeout_s}")
        _TIMEOUT_S = timeout_s
        use_cuda = torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        atexit.register(shutdown)
    rank = dist.get_rank()
    device = (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    )
    _TP_GROUP = TPGroup(dist.get_world_size(), rank, device)
    return _TP_GROUP


def get_tp_group() -> TPGroup:
    """The current TP group (single-rank until init_distributed joins a torchrun job)."""
    return _TP_GROUP


def to_owners(tp: TPGroup, x_shard: torch.Tensor, owner: np.ndarray) -> torch.Tensor:
    """Batch-sharded routing: every rank holds a column shard of every item x[i]; each item's owner gets it whole.

    x_shard: [n, W] this rank's columns (e.g. a vocab shard of logits); owner: [n] each item's owner rank.
    Returns [num_mine, tp * W]: the items this rank owns, in item order, columns in rank order. One
    all-to-all.
    """
    if tp.world_size == 1:
        return x_shard
    order = np.argsort(owner, kind="stable")
    counts = np.bincount(owner, minlength=tp.world_size).tolist()
    mine = counts[tp.rank_in_group]
    send = x_shard[torch.from_numpy(order).to(x_shard.device)]  # [n, W] grouped by owner
    recv = tp.all_to_all(send, counts, [mine] * tp.world_size)  # [tp * mine, W] grouped by source rank
    width = x_shard.shape[1]
    return recv.view(tp.world_size, mine, width).permute(1, 0, 2).reshape(mine, tp.world_size * width)


def from_owners(tp: TPGroup, x_mine: torch.Tensor, owner: np.ndarray) -> torch.Tensor:
    """The inverse share: each owner holds its items [num_mine, C]; every rank gets all n of them [n, C].

    One all-gather (each rank's items padded to the largest owner's count).
    """
    if tp.world_size == 1:
        return x_mine
    counts = np.bincount(owner, minlength=tp.world_size)
    pad = x_mine.new_zeros((int(counts.max()), *x_mine.shape[1:]))
    pad[: x_mine.shape[0]] = x_mine
    gathered = tp.all_gather(pad.unsqueeze(0), dim=0)  # [tp, max_count, C]
    out = x_mine.new_empty((len(owner), *x_mine.shape[1:]))
    for r in range(tp.world_size):
        idx = torch.from_numpy(np.flatnonzero(owner == r)).to(out.device)
        out[idx] = gathered[r, : int(counts[r])]
    return out


def share_from_owners(tp: TPGroup, parts: list[torch.Tensor], owner: np.ndarray) -> list[torch.Tensor]:
    """from_owners for several integer or bool tensors at once ([num_mine, ...] each): packed side by side
    as int64 for one all-gather, unpacked after. Returns each part for all n items, on the host."""
    if tp.world_size == 1:
        return [p.cpu() for p in parts]
    cols = [p.reshape(p.shape[0], math.prod(p.shape[1:])).to(torch.int64) for p in parts]
    packed = torch.cat(cols, dim=1).to(tp.device)  # [num_mine, sum of widths]
    shared = from_owners(tp, packed, owner).cpu()  # [n, sum of widths]
    out, start = [], 0
    for p, c in zip(parts, cols):
        out.append(shared[:, start : start + c.shape[1]].reshape(len(owner), *p.shape[1:]).to(p.dtype))
        start += c.shape[1]
    return out


def shutdown() -> None:
    """Leave the process group (avoids gloo's abort at interpreter exit)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> None:
    """End a command-line run with code. Under torchrun: leave the process group, flush and os._exit, skipping the
    interpreter's teardown, where C++ static destructors abort about one exit in ten on CPU ("terminate called
    without an active exception", SIGABRT) after a clean run, group destroyed or not. Else sys.exit."""
    if not dist.is_initialized():
        sys.exit(code)
    shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
