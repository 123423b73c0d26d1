"""Target-only greedy tok/s: minispec vs transformers' generate, same prompts, alternating, one run.

    .venv/bin/python scripts/compare_hf.py [--target smollm2-135m-instruct] [--max-tokens 128] [--rounds 2]
"""
from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import AutoModelForCausalLM

from minispec import LLM, SamplingParams
from minispec.data import load_prompts
from minispec.models.loader import ALIASES, resolve_alias

PROMPTS = load_prompts("eval", limit=4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default=None, help="also time minispec speculative with this draft")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    llm = LLM(target=args.target, draft=None, max_num_seqs=1)
    spec = LLM(target=args.target, draft=args.draft, max_num_seqs=1) if args.draft else None
    path = resolve_alias(args.target) if args.target.lower() in ALIASES else args.target
    kw = {}
    if path.endswith(".gguf"):
        path, kw = os.path.dirname(path), {"gguf_file": os.path.basename(path)}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    ids = [llm.encode(p, use_chat_template=True) for p in PROMPTS]

    def run_minispec(engine):
        n = 0
        for p in ids:  # batch 1: one prompt at a time
            n += len(engine.generate([p], sp)[0].token_ids)
        return n

    def run_hf():
        n = 0
        for p in ids:
            x = torch.tensor([p])
            with torch.inference_mode():
                out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=args.max_tokens,
                                  min_new_tokens=args.max_tokens, pad_token_id=0)
            n += out.shape[1] - x.shape[1]
        return n

    systems = {"transformers generate": run_hf, "minispec target-only": lambda: run_minispec(llm)}
    if spec is not None:
        systems[f"minispec speculative ({args.draft})"] = lambda: run_minispec(spec)
    for f in systems.values():  # warm-up
        ids_backup = ids[:]
        ids[:] = ids[:1]
        f()
        ids[:] = ids_backup
    totals = {name: [0, 0.0] for name in systems}
    for _ in range(args.rounds):
        for name, f in systems.items():  # alternate so machine drift hits all alike
            t = time.perf_counter()
            n = f()
            totals[name][0] += n
            totals[name][1] += time.perf_counter() - t
    base = totals["transformers generate"][0] / totals["transformers generate"][1]
    print(f"{'system':40s} {'tok/s':>8s} {'vs transformers':>16s}")
    for name, (n, s) in totals.items():
        print(f"{name:40s} {n / s:8.1f} {n / s / base:15.2f}x")


if __name__ == "__main__":
    main()
