"""DraftLogitsCache: Triton kernels vs torch references, skip/staleness semantics, multi-rank runs."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from minispec.distributed import TPGroup
from minispec.engine.input_batch import InputBatch
from minispec.spec_decode import draft_logits
from minispec.spec_decode.draft_logits import (
    DraftLogitsCache,
    draft_logits_row,
    shard_owners,
    shard_rows,
)
from tests.utils import DEVICES

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "dist_scripts" / "draft_logits_check.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("draft_logits_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fake_tp(monkeypatch):
    """Make the cache see a TP group of (tp, rank) without torch.distributed."""

    def set_group(tp: int, rank: int):
        monkeypatch.setattr(draft_logits, "get_tp_group", lambda: TPGroup(tp, rank))

    return set_group


def make_cache(max_num_reqs=8, num_steps=2, vocab_size=3, sharded=True, device="cpu"):
    return DraftLogitsCache(max_num_reqs, num_steps, vocab_size, dtype=torch.float32, fill=0.0,
                            device=device, sharded=sharded)


def build(slots, num_logits, device="cpu"):
    return InputBatch.build([f"r{s}" for s in slots], np.array(slots, dtype=np.int32),
                            np.array(num_logits, dtype=np.int64), device)


def test_shard_helpers():
    assert shard_owners(7, 3).tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert shard_rows(7, 3).tolist() == [0, 0, 0, 1, 1, 1, 2]
    assert shard_owners(0, 2).dtype == np.int32 and shard_rows(4, 1).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_initial_tables(fake_tp, tp):
    fake_tp(tp, tp - 1)
    cache = make_cache(max_num_reqs=8)
    assert cache.values.shape == (-(-8 // tp), 2, 3)
    assert cache.shard_mapping_np.tolist() == [s % tp for s in range(8)]
    assert cache.shard_mapping.tolist() == cache.shard_mapping_np.tolist()
    assert cache.row_mapping.tolist() == [s // tp if s % tp == tp - 1 else -1 for s in range(8)]
    assert cache.inverse_row_mapping.tolist() == [-1] * (-(-8 // tp))
    assert cache.nbytes == cache.values.numel() * 4
    # Never drafted: stale on its slot-based owner.
    stale = cache.stale_drafts(build([tp - 1], [2]))
    assert stale.tolist() == [True, True]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tp", [1, 2, 3])
def test_kernels_match_torch(fake_tp, tp, device):
    """Random batches: Triton (on device: interpreted on CPU, compiled on CUDA) and torch (CPU) paths give
    identical tables and stale flags."""
    rng = np.random.default_rng(tp)
    max_num_reqs, num_steps = 11, 3
    for rank in range(tp):
        fake_tp(tp, rank)
        ref = make_cache(max_num_reqs, num_steps)
        tri = make_cache(max_num_reqs, num_steps, device=device)
        for _ in range(12):
            n = int(rng.integers(0, max_num_reqs + 1))
            slots = rng.permutation(max_num_reqs)[:n].astype(np.int32)
            # Some batches verify first (stale_drafts), all then draft (assign).
            num_logits = rng.integers(0, num_steps + 3, size=n)
            batch = build(slots.tolist(), num_logits)
            tri_batch = build(slots.tolist(), num_logits, device)
            want = ref.stale_drafts(batch)
            got = tri.stale_drafts(tri_batch, use_triton=True).cpu()
            assert got.dtype == torch.bool and torch.equal(got, want), (got, want)
            ref.assign(batch.slots, batch.slots_np)
            tri.assign(tri_batch.slots, tri_batch.slots_np, use_triton=True)
            for name in ("row_mapping", "inverse_row_mapping", "shard_mapping"):
                assert torch.equal(getattr(ref, name), getattr(tri, name).cpu()), name
            assert np.array_equal(ref.shard_mapping_np, tri.shard_mapping_np)
            assert ref.shard_mapping_np.tolist() == ref.shard_mapping.tolist()
            # The assign semantics, spelled out.
            for i, s in enumerate(slots):
                assert ref.shard_mapping_np[s] == i % tp
                row = i // tp if i % tp == rank else -1
                assert ref.row_mapping[s] == row
                if row >= 0:
                    assert ref.inverse_row_mapping[row] == s


@triton.jit
def _rows_test_kernel(out_ptr, slots_ptr, row_mapping_ptr, n, BLOCK: tl.constexpr):
    idx = tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + idx, mask=idx < n, other=-1)
    tl.store(out_ptr + idx, draft_logits_row(slot, row_mapping_ptr), mask=idx < n)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sharded", [False, True])
def test_draft_logits_row(fake_tp, sharded, device):
    fake_tp(2, 1)
    cache = make_cache(max_num_reqs=6, sharded=sharded, device=device)
    batch = build([4, 0, 5, 2], [1, 1, 1, 1], device)
    cache.assign(batch.slots, batch.slots_np)
    slots = torch.tensor([0, 1, 2, 3, 4, 5], dtype=torch.int32, device=device)
    out = torch.empty(6, dtype=torch.int64, device=device)
    _rows_test_kernel[(1,)](out, slots, cache.row_mapping, 6, BLOCK=8)
    assert out.tolist() == cache.rows_of(slots).tolist()
    if sharded:
        # Positions 1 (slot 0) and 3 (slot 2) go to rank 1, rows 0 and 1; slots 1 and 3 keep their
        # slot-based row (slot // 2), slots 4 and 5 went to rank 0.
        assert out.tolist() == [0, 0, 1, 1, -1, -1]
        assert cache.rows_of(torch.tensor([-1, 2], device=device)).tolist() == [-1, 1]
    else:
        assert out.tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("use_triton", [False, True])
def test_skip_scenario_tp1(fake_tp, use_triton):
    """A skipped request whose row was reused has stale drafts; the request that reused it has not."""
    fake_tp(1, 0)
    A, B = 3, 5
    num_steps = 2
    sharded = make_cache(max_num_reqs=8, num_steps=num_steps)
    replicated = make_cache(max_num_reqs=8, num_steps=num_steps, sharded=False)
    step1 = build([A, B], [1, 1])  # prefill: nothing to verify
    sharded.assign(step1.slots, step1.slots_np, use_triton)  # A row 0, B row 1
    assert sharded.rows_of(torch.tensor([A, B])).tolist() == [0, 1]

    step2 = build([B], [num_steps + 1])  # A skipped; B at position 0 takes A's row 0
    assert sharded.stale_drafts(step2, use_triton).tolist() == [False] * (num_steps + 1)
    sharded.assign(step2.slots, step2.slots_np, use_triton)
    assert sharded.rows_of(torch.tensor([A, B])).tolist() == [0, 0]

    step3 = build([A, B], [num_steps + 1, num_steps + 1])
    stale = sharded.stale_drafts(step3, use_triton)
    # A's drafts (step 1) were overwritten by B's; the bonus row (local pos num_steps) reads none.
    assert stale.tolist() == [True, True, False, False, False, False]
    assert sharded.owners_of(step3.slots_np).tolist() == [0, 0]

    # Replicated: rows are slots, never reused, never stale; assign is a no-op.
    replicated.assign(step1.slots, step1.slots_np)
    assert replicated.row_mapping is None and replicated.stale_drafts(step3) is None
    assert replicated.rows_of(torch.tensor([A, B])).tolist() == [A, B]
    assert replicated.owners_of(step3.slots_np).tolist() == [0, 0]
    assert replicated.values.shape == (8, num_steps, 3)


def test_replicated_owners_round_robin(fake_tp):
    fake_tp(3, 2)
    cache = make_cache(max_num_reqs=8, sharded=False)
    assert cache.owners_of(np.array([7, 1, 4, 0, 2], dtype=np.int32)).tolist() == [0, 1, 2, 0, 1]
    assert cache.stale_drafts(build([7], [2])) is None


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(fake_tp, device):
    fake_tp(2, 0)
    for on in (False, True):
        cache = make_cache(device=device)
        batch = build([], [], device)
        cache.assign(batch.slots, batch.slots_np, use_triton=on)
        stale = cache.stale_drafts(batch, use_triton=on)
        assert stale.shape == (0,) and stale.dtype == torch.bool
        assert cache.inverse_row_mapping.tolist() == [-1] * 4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tp", [1, 2, 3])
def test_oracle_all_ranks_in_process(fake_tp, tp, device):
    """Every rank of a tp group, simulated in one process, agrees with the oracle of the dist script
    (on CUDA the cache runs its compiled kernels)."""
    check = _load_script()
    steps = check.make_schedule(num_iters=30, seed=7 + tp)
    assert any(len(s.slots) for s in steps)
    for rank in range(tp):
        fake_tp(tp, rank)
        errors = check.run_rank(tp, rank, torch.device(device), steps, check_triton=(rank == 0))
        assert errors == []


def test_oracle_detects_a_broken_cache(fake_tp, monkeypatch):
    """The dist checks fail when assign forgets to record the row's new slot."""
    check = _load_script()
    fake_tp(2, 0)
    monkeypatch.setattr(draft_logits, "_assign_rows_torch",
                        lambda idx, shard, rows, inverse, n, r: shard.__setitem__(idx.long(), 0))
    errors = check.run_rank(2, 0, torch.device("cpu"), check.make_schedule(20, seed=3))
    assert errors


@pytest.mark.parametrize("nproc", [2, 3])
def test_multi_rank(nproc):
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(SCRIPT)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for rank in range(nproc):
        assert f"rank {rank}: OK" in out
        assert f"rank {rank}/{nproc}: values bytes sharded" in out


@pytest.mark.parametrize("subset", [False, True])
def test_writes_of_several_steps_equal_one_step_at_a_time(fake_tp, subset):
    """write / write_subset of logits [num_mine, S, ...] (steps 1 .. S) == S one-step writes; write_subset leaves -inf
    at every id outside its subset (also where the row held other values)."""
    fake_tp(1, 0)
    g = torch.Generator().manual_seed(0)
    caches = [make_cache(max_num_reqs=4, num_steps=4, vocab_size=30, sharded=False) for _ in range(2)]
    V, S = caches[0].values.shape[-1], 2
    ids = torch.randperm(V, generator=g)[: V // 3]
    rows = torch.tensor([2, 0])
    logits = torch.randn(2, S, len(ids) if subset else V, generator=g)
    for c in caches:
        c.values.normal_(generator=g)  # stale values the writes must replace
    many, one = caches
    one.values.copy_(many.values)
    if subset:
        many.write_subset(rows, 1, logits, ids)
        for j in range(S):
            one.write_subset(rows, 1 + j, logits[:, j], ids)
        assert bool((many.values[rows, 1 : 1 + S].isneginf().sum(-1) == V - len(ids)).all())
    else:
        many.write(rows, 1, logits)
        for j in range(S):
            one.write(rows, 1 + j, logits[:, j])
    assert torch.equal(many.values, one.values)
