"""Where a decode step's time goes: the weight GEMMs against everything else, per op.

    .venv/bin/python scripts/profile_step.py [--target smollm2-135m-instruct] [--shapes 1x1,1x4,4x4]
        [--ctx 200] [--steps 20] [--threads 2] [--clock wall|cpu] [--top 12] [--tokens 0]

For each shape BxL (B requests, L query tokens each: 1 + k drafts) it prefills B contexts of --ctx
tokens, then times ModelRunner.forward over B x L new tokens (the same positions each time, as a
rolled-back verify would). Figures per step, in ms:
  step       wall time of the forward (logits included), no profiler
  gemm       every linear module's weight product replayed back to back on the input it saw in that
             step (a packed weight's C++ op called directly: no module call around it, which would count
             several microseconds of Python per matrix as GEMM time), plus compute_logits (the LM head)
  rest       step - gemm: norms, RoPE, attention, residuals, host work
and a torch.profiler table of the ops by self time (the profiler adds its own per-op cost: read
the shares, not the absolute sums). --clock cpu times with this process's CPU seconds instead of
wall seconds: steadier on a shared machine at --threads 1. --tokens N also times target-only greedy
generation at batch 1 (4 chat prompts x N tokens) through LLM and prints a hash of the tokens, so two
checkouts can be compared for speed and for equal output.
"""
from __future__ import annotations

import argparse
import hashlib
import re
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from minispec import LLM, SamplingParams
from minispec.kernels import cpu
from minispec.layers.quant import PackedWeight, linear
from minispec.runner.model_runner import ModelRunner

GEMM_OPS = re.compile(r"linear|addmm|^aten::mm$|matmul|gemv|gemm|int4|int8|quant|packed")


PROMPTS = [
    "Explain how a refrigerator keeps food cold.",
    "Write a short poem about the sea at night.",
    "List five tips for learning a new language.",
    "What is the difference between a list and a tuple in Python?",
]
clock = time.perf_counter


def timed(fn, steps: int) -> float:
    """Median seconds of fn() over steps calls (after two warm-up calls)."""
    fn(), fn()
    times = []
    for _ in range(steps):
        t = clock()
        fn()
        times.append(clock() - t)
    return statistics.median(times)


def generate_tok_s(llm, num_tokens: int) -> tuple[float, str]:
    """(target-only greedy tok/s at batch 1 over PROMPTS, a hash of the tokens)."""
    sp = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    ids = [llm.encode(p, use_chat_template=True) for p in PROMPTS]
    llm.generate([ids[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    t = clock()
    tokens = [llm.generate([p], sp)[0].token_ids for p in ids]
    seconds = clock() - t
    return sum(map(len, tokens)) / seconds, hashlib.sha1(str(tokens).encode()).hexdigest()[:12]


def linear_inputs(model, step) -> list[tuple[torch.nn.Module, torch.Tensor]]:
    """(module, input) of every linear-layer call in one step, in call order."""
    seen = []
    hooks = [m.register_forward_hook(lambda m, args, out: seen.append((m, args[0])))
             for m in model.modules() if "Linear" in type(m).__name__]
    model.cpu_layers = lambda: None  # the op-by-op path, whose linear modules the hooks see
    try:
        step()
    finally:
        del model.cpu_layers
        for h in hooks:
            h.remove()
    return seen


def product(m: torch.nn.Module, x: torch.Tensor) -> tuple:
    """(function, args) of m's weight product on input x: the packed C++ op itself where layers/quant.py's linear
    would call it (a CPU packed weight, rows within PACKED_MAX_ROWS or a tiled layout), else that linear."""
    w, x2 = m.weight, x.reshape(-1, x.shape[-1]).float().contiguous()  # [M, K]
    ext = cpu.ops()
    if isinstance(w, PackedWeight) and not x.is_cuda and ext is not None and \
            (x2.shape[0] <= ext.PACKED_MAX_ROWS or w.tiled) and m.bias is None:
        return ext.packed_linear, (x2, w.data, w.qtype, w.in_features)
    return linear, (x2, w, m.bias)


def profile_shape(model, runner: ModelRunner, B: int, L: int, ctx: int, steps: int, top: int) -> dict:
    slots = list(range(B))
    g = torch.Generator().manual_seed(0)
    vocab = model.vocab_size
    prompts = [torch.randint(0, vocab, (ctx,), generator=g).tolist() for _ in slots]
    runner.forward(slots, [0] * B, prompts, [1] * B)  # prefill
    queries = [torch.randint(0, vocab, (L,), generator=g).tolist() for _ in slots]

    def step():
        return runner.forward(slots, [ctx] * B, queries, [L] * B)

    with torch.inference_mode():
        calls = [product(m, x) for m, x in linear_inputs(model, step)]
        rows = torch.randn(B * L, model.hidden_size, dtype=model.dtype)

        def gemms():
            for fn, args in calls:
                fn(*args)
            model.compute_logits(rows)

        step_s = timed(step, steps)
        gemm_s = timed(gemms, steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            step()
        prof_wall = (time.perf_counter() - t) / steps
    events = prof.key_averages()
    ops = [(e.key, e.self_cpu_time_total / steps / 1e3, e.count // steps) for e in events]
    ops.sort(key=lambda x: -x[1])
    gemm_prof = sum(ms for k, ms, _ in ops if GEMM_OPS.search(k))
    rest_prof = sum(ms for k, ms, _ in ops if not GEMM_OPS.search(k))
    n_ops = sum(c for _, _, c in ops)
    return dict(B=B, L=L, step=step_s * 1e3, gemm=gemm_s * 1e3, n_linear=len(calls), ops=ops[:top],
                prof_wall=prof_wall * 1e3, gemm_prof=gemm_prof, rest_prof=rest_prof, n_ops=n_ops)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--shapes", default="1x1,1x4,4x4", help="BxL: requests x query tokens (1 + drafts)")
    ap.add_argument("--ctx", type=int, default=200, help="context tokens before the step")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: this process's CPU seconds")
    ap.add_argument("--top", type=int, default=12, help="ops listed per shape")
    ap.add_argument("--tokens", type=int, default=0, help="also time greedy generation of this many tokens")
    args = ap.parse_args()
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    t = time.perf_counter()
    llm = LLM(target=args.target, draft=None, max_num_seqs=1, dtype="float32", device="cpu")
    print(f"loaded {args.target} in {time.perf_counter() - t:.1f} s; threads {torch.get_num_threads()}, "
          f"context {args.ctx}, {args.steps} steps per figure, {args.clock} clock")
    model = llm.target.model
    runner = ModelRunner(model, max(b for b, _ in shapes), args.ctx + 16, dtype=torch.float32, device=torch.device("cpu"))
    results = [profile_shape(model, runner, B, L, args.ctx, args.steps, args.top) for B, L in shapes]
    print("\n| B x L | step ms | gemm ms | rest ms | rest share | linear calls | profiled: ops/step, "
          "gemm ms, other ops ms, outside ops ms |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        outside = r["prof_wall"] - r["gemm_prof"] - r["rest_prof"]
        print(f"| {r['B']}x{r['L']} | {r['step']:.2f} | {r['gemm']:.2f} | {r['step'] - r['gemm']:.2f} | "
              f"{(r['step'] - r['gemm']) / r['step']:.0%} | {r['n_linear']} | {r['n_ops']}, {r['gemm_prof']:.2f}, "
              f"{r['rest_prof']:.2f}, {outside:.2f} |")
    if args.tokens:
        tok_s, digest = generate_tok_s(llm, args.tokens)
        print(f"\ntarget-only greedy, batch 1, {len(PROMPTS)} prompts x {args.tokens} tokens: {tok_s:.1f} tok/s "
              f"({args.clock} clock), tokens {digest}")
    for r in results:
        print(f"\n{r['B']}x{r['L']}: top ops by self time (profiled), ms per step")
        print("| op | ms | calls |")
        print("|---|---|---|")
        for k, ms, c in r["ops"]:
            print(f"| {k} | {ms:.3f} | {c} |")


if __name__ == "__main__":
    main()
