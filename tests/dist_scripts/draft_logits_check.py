"""Multi-rank check of the sharded DraftLogitsCache against a pure-Python oracle.

Run: python -m torch.distributed.run --standalone --nproc-per-node N tests/dist_scripts/draft_logits_check.py
Every rank replays the same seeded schedule (skips, finished requests, slot reuse), checks its cache,
prints its values bytes against a replicated cache and exits non-zero on any mismatch. On CPU under
TRITON_INTERPRET=1 a second cache runs the Triton kernels in lockstep and must agree.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from minispec.engine.input_batch import InputBatch
from minispec.spec_decode.draft_logits import DraftLogitsCache
from minispec.utils import cdiv
from tests.dist_scripts.leave import leave

MAX_NUM_REQS = 7
NUM_STEPS = 3
VOCAB_SIZE = 5


@dataclass
class Step:
    """One engine step: the scheduled requests in batch-position order."""

    req_ids: list[int]  # unique per request, never reused
    slots: list[int]
    num_drafts: list[int]  # drafts to verify this step (0 if not drafted since taking its slot)
    num_logits: list[int]  # logits rows: num_drafts + 1, or 0 for a prefill chunk inside the prompt


def make_schedule(num_iters: int, seed: int, max_num_reqs: int = MAX_NUM_REQS) -> list[Step]:
    """A seeded schedule with skipped requests, finished requests and reused slots."""
    rng = np.random.default_rng(seed)
    free = list(range(max_num_reqs))
    running: dict[int, int] = {}  # req_id -> slot
    drafted: set[int] = set()
    next_id = 0
    steps = []
    for _ in range(num_iters):
        for req_id in list(running):
            if rng.random() < 0.15:
                free.append(running.pop(req_id))
                drafted.discard(req_id)
        while free and rng.random() < 0.6:
            slot = free.pop(int(rng.integers(len(free))))
            running[next_id] = slot
            next_id += 1
        scheduled = [r for r in running if rng.random() < 0.7]
        scheduled = [scheduled[i] for i in rng.permutation(len(scheduled))]
        num_drafts = [NUM_STEPS if r in drafted else 0 for r in scheduled]
        num_logits = [n + 1 if n > 0 or rng.random() < 0.8 else 0 for n in num_drafts]
        steps.append(Step(scheduled, [running[r] for r in scheduled], num_drafts, num_logits))
        drafted.update(scheduled)
    return steps


class Oracle:
    """Staleness and ownership from the history of draft steps, without row tables.

    A slot last drafted at batch position p of a draft step is owned by rank p % tp at row p // tp.
    Row p // tp of that rank is handed to another slot by any later draft step with more than p
    requests (the slot itself is in none of them), so its drafts are stale iff such a step exists.
    A slot never drafted is owned by rank slot % tp and is stale.
    """

    def __init__(self, tp: int):
        self.tp = tp
        self.last_draft: dict[int, tuple[int, int]] = {}  # slot -> (draft step index, position)
        self.batch_sizes: list[int] = []  # number of requests of each draft step

    def owner(self, slot: int) -> int:
        if slot not in self.last_draft:
            return slot % self.tp
        return self.last_draft[slot][1] % self.tp

    def stale(self, slot: int) -> bool:
        if slot not in self.last_draft:
            return True
        step, pos = self.last_draft[slot]
        return any(n > pos for n in self.batch_sizes[step + 1:])

    def draft(self, slots: list[int]) -> None:
        for pos, slot in enumerate(slots):
            self.last_draft[slot] = (len(self.batch_sizes), pos)
        self.batch_sizes.append(len(slots))


def run_rank(
    tp: int,
    rank: int,
    device: torch.device,
    steps: list[Step],
    all_gather=None,
    check_triton: bool = False,
) -> list[str]:
    """Replay steps on rank's sharded cache; returns the mismatches found (empty if none).

    The caller makes get_tp_group() report (tp, rank). all_gather(int32 tensor) -> [tp, n] compares
    shard_mapping across ranks when given. check_triton runs a Triton-path cache in lockstep.
    """
    errors: list[str] = []

    def check(ok, msg):
        if not ok:
            errors.append(f"rank {rank}: {msg}")

    kw = dict(dtype=torch.float32, fill=-1.0, device=device)
    cache = DraftLogitsCache(MAX_NUM_REQS, NUM_STEPS, VOCAB_SIZE, sharded=True, **kw)
    twin = DraftLogitsCache(MAX_NUM_REQS, NUM_STEPS, VOCAB_SIZE, sharded=True, **kw) if check_triton else None
    num_rows = cdiv(MAX_NUM_REQS, tp)
    check(tuple(cache.values.shape) == (num_rows, NUM_STEPS, VOCAB_SIZE), f"values shape {tuple(cache.values.shape)}")

    oracle = Oracle(tp)
    marker: dict[int, float] = {}  # req_id -> value its last draft step wrote
    for t, step in enumerate(steps):
        slots_np = np.array(step.slots, dtype=np.int32)
        num_logits = np.array(step.num_logits, dtype=np.int64)
        batch = InputBatch.build([str(r) for r in step.req_ids], slots_np, num_logits, device)

        # Verification: owners and stale drafts.
        owners = cache.owners_of(batch.slots_np)
        want_owners = [oracle.owner(s) for s in step.slots]
        check(owners.tolist() == want_owners, f"step {t}: owners {owners.tolist()} != {want_owners}")
        check(cache.shard_mapping.cpu().tolist() == cache.shard_mapping_np.tolist(), f"step {t}: device/host owners")
        stale = cache.stale_drafts(batch).cpu()
        if twin is not None:
            twin_stale = twin.stale_drafts(batch, use_triton=True).cpu()
            check(torch.equal(stale, twin_stale), f"step {t}: triton stale {twin_stale.tolist()} != {stale.tolist()}")
        rows = cache.rows_of(batch.slots).cpu().tolist()
        for i, (req_id, slot) in enumerate(zip(step.req_ids, step.slots)):
            if owners[i] != rank:
                continue
            first, last = batch.cu_num_logits_np[i], batch.cu_num_logits_np[i + 1]
            local = batch.expanded_local_pos[first:last].cpu()
            want = [oracle.stale(slot) and int(p) < NUM_STEPS for p in local]
            got = stale[first:last].tolist()
            check(got == want, f"step {t}: slot {slot} stale {got} != {want}")
            if step.num_drafts[i] > 0 and not oracle.stale(slot):
                # Fresh drafts: the row still holds what this request's draft step wrote.
                value = cache.values[rows[i], 0, 0].item() if rows[i] >= 0 else None
                check(value == marker.get(req_id), f"step {t}: slot {slot} row {rows[i]} holds {value}")

        # Draft step: give rows out by batch position, then write the draft logits.
        cache.assign(batch.slots, batch.slots_np)
        if twin is not None:
            twin.assign(batch.slots, batch.slots_np, use_triton=True)
            for name in ("row_mapping", "inverse_row_mapping", "shard_mapping"):
                a, b = getattr(cache, name).cpu(), getattr(twin, name).cpu()
                check(torch.equal(a, b), f"step {t}: triton {name} {b.tolist()} != {a.tolist()}")
            check(np.array_equal(cache.shard_mapping_np, twin.shard_mapping_np), f"step {t}: shard_mapping_np")
        oracle.draft(step.slots)
        owners = cache.owners_of(batch.slots_np)
        positions = np.arange(len(step.slots))
        check(np.array_equal(owners, positions % tp), f"step {t}: drafted owners {owners.tolist()}")
        rows = cache.rows_of(batch.slots).cpu().tolist()
        want_rows = [int(p // tp) if p % tp == rank else -1 for p in positions]
        check(rows == want_rows, f"step {t}: drafted rows {rows} != {want_rows}")
        for i, req_id in enumerate(step.req_ids):
            if rows[i] >= 0:
                marker[req_id] = float(1000 * t + req_id)
                cache.values[rows[i]] = marker[req_id]
        if all_gather is not None:
            host = torch.from_numpy(cache.shard_mapping_np.astype(np.int32)).to(device)
            gathered = all_gather(host).cpu()
            check(bool((gathered == gathered[0]).all()), f"step {t}: shard_mapping differs across ranks")
            check(torch.equal(gathered[rank], cache.shard_mapping.cpu()), f"step {t}: device shard_mapping")
    return errors


def main() -> int:
    from minispec.distributed import init_distributed

    group = init_distributed(timeout_s=60)
    tp, rank, device = group.world_size, group.rank_in_group, group.device
    steps = make_schedule(num_iters=40, seed=1234)
    check_triton = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"

    def gather(x):
        return group.all_gather(x.unsqueeze(0), dim=0)

    errors = run_rank(tp, rank, device, steps, all_gather=gather, check_triton=check_triton)
    sharded = DraftLogitsCache(MAX_NUM_REQS, NUM_STEPS, VOCAB_SIZE, dtype=torch.float32, fill=0.0,
                               device=device, sharded=True)
    replicated = DraftLogitsCache(MAX_NUM_REQS, NUM_STEPS, VOCAB_SIZE, dtype=torch.float32, fill=0.0,
                                  device=device)
    print(f"rank {rank}/{tp}: values bytes sharded {sharded.nbytes} vs replicated {replicated.nbytes}"
          f" (triton twin: {check_triton})", flush=True)
    # Every rank must finish its checks; then count errors over the group.
    num_errors = torch.tensor([len(errors)], dtype=torch.int64, device=device)
    group.all_reduce(num_errors)
    for e in errors[:20]:
        print(e, flush=True)
    if num_errors.item():
        print(f"rank {rank}: FAILED ({len(errors)} here, {num_errors.item()} in all)", flush=True)
        return 1
    print(f"rank {rank}: OK ({len(steps)} steps)", flush=True)
    return 0


if __name__ == "__main__":
    leave(main())
