"""Where a decode step's time goes: the weight GEMMs against everything else, per op.

    .venv/bin/python scripts/profile_step.py [--target smollm2-135m-instruct] [--shapes 1x1,1x4,4x4]
        [--ctx 200] [--steps 20] [--threads 2] [--top 12]

For each shape BxL (B requests, L query tokens each: 1 + k drafts) it prefills B contexts of --ctx
tokens, then times ModelRunner.forward over B x L new tokens (the same positions each time, as a
rolled-back verify would). Figures per step, in ms:
  step       wall time of the forward (logits included), no profiler
  gemm       every linear module's forward replayed back to back on the inputs it saw in that
             step, plus compute_logits (the LM head): the weight matrix products alone
  rest       step - gemm: norms, RoPE, attention, residuals, host work
and a torch.profiler table of the ops by self time (the profiler adds its own per-op cost: read
the shares, not the absolute sums).
"""
from __future__ import annotations

import argparse
import re
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from minispec.engine.model_runner import ModelRunner
from minispec.models.loader import load_model

GEMM_OPS = re.compile(r"linear|addmm|^aten::mm$|matmul|gemv|gemm|int4|int8|quant|packed")


def timed(fn, steps: int) -> float:
    """Median seconds of fn() over steps calls (after two warm-up calls)."""
    fn(), fn()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def linear_inputs(model, step) -> list[tuple[torch.nn.Module, torch.Tensor]]:
    """(module, input) of every linear-layer call in one step, in call order."""
    seen = []
    hooks = [m.register_forward_hook(lambda m, args, out: seen.append((m, args[0])))
             for m in model.modules() if "Linear" in type(m).__name__]
    try:
        step()
    finally:
        for h in hooks:
            h.remove()
    return seen


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
        calls = linear_inputs(model, step)
        rows = torch.randn(B * L, model.hidden_size, dtype=model.dtype)

        def gemms():
            for m, x in calls:
                m(x)
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
    ap.add_argument("--top", type=int, default=12, help="ops listed per shape")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    t = time.perf_counter()
    loaded = load_model(args.target, dtype=torch.float32, device="cpu")
    print(f"loaded {loaded.name} in {time.perf_counter() - t:.1f} s; threads {torch.get_num_threads()}, "
          f"context {args.ctx}, {args.steps} steps per figure")
    model = loaded.model
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
    for r in results:
        print(f"\n{r['B']}x{r['L']}: top ops by self time (profiled), ms per step")
        print("| op | ms | calls |")
        print("|---|---|---|")
        for k, ms, c in r["ops"]:
            print(f"| {k} | {ms:.3f} | {c} |")


if __name__ == "__main__":
    main()
