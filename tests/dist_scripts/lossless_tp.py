"""Seeded samples for test_lossless under tensor parallelism: rank 0 writes the generated tokens.

Run: python -m torch.distributed.run --standalone --nproc-per-node TP tests/dist_scripts/lossless_tp.py CONFIG.json
CONFIG: target, draft, k, prompt, n, seed (the LLM's: the requests are unseeded), settings (SamplingParams fields), max_tokens, llm (extra LLM
arguments), out. Every rank runs the same engine (batch-sharded verification); rank 0 writes
{"tokens": [n, max_tokens], "metrics": [n metrics dicts]} to out.
"""
from __future__ import annotations

import json
import sys

from minispec import LLM, SamplingParams
from minispec.distributed import init_distributed
from tests.dist_scripts.leave import leave


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    tp = init_distributed()
    llm = LLM(target=cfg["target"], draft=cfg["draft"], num_speculative_tokens=cfg["k"],
              tensor_parallel_size=tp.world_size, seed=cfg["seed"], **cfg["llm"])
    params = [SamplingParams(max_tokens=cfg["max_tokens"], ignore_eos=True, **cfg["settings"]) for _ in range(cfg["n"])]
    outs = llm.generate([cfg["prompt"]] * cfg["n"], params)
    if tp.rank_in_group == 0:
        with open(cfg["out"], "w") as f:
            json.dump({"tokens": [o.token_ids for o in outs], "metrics": [o.metrics for o in outs]}, f)
    print(f"rank {tp.rank_in_group}/{tp.world_size}: OK")


if __name__ == "__main__":
    main()
    leave(0)
