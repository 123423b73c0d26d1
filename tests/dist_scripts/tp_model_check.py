"""Multi-rank check of the tensor-parallel model against the same checkpoint at tp=1.

Run: python -m torch.distributed.run --standalone --nproc-per-node N tests/dist_scripts/tp_model_check.py MODEL_DIR
Every rank loads MODEL_DIR sharded over the job and whole (a single-rank group), feeds both the
same padded prefill, token-by-token decode and a 3-token verify chunk, and checks the gathered
logits (and its own vocab shard) against the tp=1 logits. Prints "rank R/N: OK" or exits non-zero.
"""
from __future__ import annotations

import sys

import torch

from minispec.distributed import TPGroup, init_distributed
from minispec.runner.kv_cache import KVCache
from minispec.layers.attention import ForwardBatch
from minispec.models.loader import load_model
from tests.dist_scripts.leave import leave

ATOL = 1e-5


def forward(model, kv, slots, starts, queries, gather=True):
    """Logits of every real token, requests concatenated: [sum(len(q)), vocab]."""
    batch = ForwardBatch.build(slots, starts, queries, kv.scratch_slot, "cpu")
    hidden = model(batch, kv)  # [B, L, hidden]
    rows = torch.cat([hidden[i, : len(q)] for i, q in enumerate(queries)])  # [num_tokens, hidden]
    return model.compute_logits(rows, gather=gather)


def main() -> None:
    path = sys.argv[1]
    tp = init_distributed()
    rank, n = tp.rank_in_group, tp.world_size
    sharded = load_model(path, dtype=torch.float32, device="cpu").model
    whole = load_model(path, dtype=torch.float32, device="cpu", tp_group=TPGroup()).model
    assert sharded.num_kv_heads * n == whole.num_kv_heads and sharded.num_heads * n == whole.num_heads
    assert sharded.vocab_size_padded % n == 0 and sharded.vocab_size_padded - sharded.vocab_size < n
    shard = sharded.vocab_size_padded // n

    def kv_for(model):
        return KVCache(model.num_layers, 3, 32, model.num_kv_heads, model.head_dim, dtype=torch.float32, device="cpu")

    kv_sharded, kv_whole = kv_for(sharded), kv_for(whole)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, whole.vocab_size, (20,), generator=gen).tolist() for _ in range(2)]
    slots, lens = [2, 0], [7, 3]
    steps = [([s[:n_] for s, n_ in zip(seqs, lens)], [0, 0])]  # (queries, starts): padded prefill
    for _ in range(4):  # decode
        steps.append(([[s[n_]] for s, n_ in zip(seqs, lens)], list(lens)))
        lens = [n_ + 1 for n_ in lens]
    steps.append(([s[n_ : n_ + 3] for s, n_ in zip(seqs, lens)], list(lens)))  # verify chunk

    worst = 0.0
    with torch.inference_mode():
        for queries, starts in steps:
            ref = forward(whole, kv_whole, slots, starts, queries)  # [T, vocab]
            got = forward(sharded, kv_sharded, slots, starts, queries)
            assert got.shape == ref.shape, (got.shape, ref.shape)
            worst = max(worst, (got - ref).abs().max().item())
            # This rank's shard (the same forward again: K/V rewrites are idempotent).
            part = forward(sharded, kv_sharded, slots, starts, queries, gather=False)  # [T, shard]
            padded = torch.full((ref.shape[0], sharded.vocab_size_padded), float("-inf"))
            padded[:, : whole.vocab_size] = ref
            expected = padded[:, rank * shard : (rank + 1) * shard]
            assert part.shape == expected.shape, (part.shape, expected.shape)
            assert torch.equal(torch.isinf(part), torch.isinf(expected))
            fin = torch.isfinite(expected)
            worst = max(worst, (part[fin] - expected[fin]).abs().max().item())
    if worst > ATOL:
        print(f"rank {rank}/{n}: FAIL max abs diff {worst:.3e} > {ATOL}", flush=True)
        leave(1)
    print(f"rank {rank}/{n}: OK max abs diff {worst:.3e}", flush=True)
    leave(0)

if __name__ == "__main__":
    main()
