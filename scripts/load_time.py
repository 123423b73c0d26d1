"""How long loading a GGUF target takes, and what it costs in memory (issue 16's load figures).

    nice -n 19 env OMP_NUM_THREADS=1 python scripts/load_time.py [--target smollm2-135m-instruct]

Prints, for one fresh process: the seconds to import torch and minispec, LLM()'s seconds (target
only unless --draft auto, max_num_seqs=1, max_model_len=256), the resident-memory growth during LLM() (it includes
importing transformers and the tokenizer), the bytes of the loaded weights and of the KV cache
(torch.zeros: its pages become resident only when written), and the GGUF file's size. Run it a few
times on a warm page cache and take the median.
"""
from __future__ import annotations

import argparse
import sys
import os
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's minispec


def rss_bytes() -> int:
    """This process's resident memory (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--draft", default="none", help="none (default: the target alone) or auto (LLM()'s default, which "
                   "loads the target's head and times whether it pays)")
    args = p.parse_args()

    t0 = time.perf_counter()
    import torch  # noqa: F401

    t1 = time.perf_counter()
    from minispec import LLM
    from minispec.llm import param_bytes
    from minispec.models.loader import ALIASES, resolve_alias

    t2 = time.perf_counter()
    rss0 = rss_bytes()
    llm = LLM(target=args.target, draft=None if args.draft == "none" else args.draft, max_num_seqs=1, max_model_len=256)
    t3 = time.perf_counter()
    rss1 = rss_bytes()

    kv = llm.engine.target.kv.nbytes
    weights = param_bytes(llm.target.model)
    path = resolve_alias(args.target) if args.target.lower() in ALIASES else args.target
    mb = 1e6
    print(f"import torch     {t1 - t0:6.2f} s")
    print(f"import minispec  {t2 - t1:6.2f} s")
    print(f"LLM()            {t3 - t2:6.2f} s  (draft {args.draft}{': ' + llm.auto_draft if llm.auto_draft else ''})")
    print(f"RSS delta        {(rss1 - rss0) / mb:6.1f} MB")
    print(f"weights          {weights / mb:6.1f} MB")
    print(f"KV cache         {kv / mb:6.1f} MB  (allocated)")
    print(f"file size        {os.path.getsize(path) / mb:6.1f} MB")


if __name__ == "__main__":
    main()
