"""The Python stages of scripts/gpu_check.sh: the real model end to end, torchrun, per-step overheads.

    python scripts/gpu_check.py env|prepare|e2e|tp|overheads --device cuda [options]

Every subcommand prints its figures as `## ` lines (the shell script collects them into the summary)
and exits 1 when one of its checks fails. With --device cpu the same code runs (the dry run): the
Triton kernels then take their torch references, torchrun uses gloo, and CUDA-only measures say so.

The target is the draft minispec ships (a 3-layer Llama with the SmolLM2 tokenizer, 30 MB: the
98 MB SmolLM2 GGUF does not travel to the GPU machine). Its drafts: `prepare` writes an early-exit
draft (the target's first layer with the target's own embedding, final norm and head), the target
itself (every draft should be accepted), and n-gram prompt lookup.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from minispec import LLM, SamplingParams  # noqa: E402
from minispec.models.loader import load_hf_model  # noqa: E402
from minispec.tools.metrics import aggregate  # noqa: E402
from minispec.tools.prompts import load_prompt_set  # noqa: E402
from minispec.utils import parse_dtype  # noqa: E402

SHIPPED_TARGET = str(REPO / "minispec" / "drafts" / "smollm2-135m-instruct-draft")


def report(key: str, value) -> None:
    """One result line for the summary."""
    print(f"## {key}: {value}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompt_ids(llm: LLM, num_prompts: int) -> list[list[int]]:
    """The first num_prompts eval prompts (round-robin over categories), chat-templated by the target's tokenizer."""
    texts, _ = load_prompt_set("eval", num_prompts)
    return [llm.encode(t, use_chat_template=True) for t in texts]


# ---- env --------------------------------------------------------------------------------------


def cmd_env(args) -> int:
    """Versions, the device, and whether the Triton kernels are compiled (JITFunction) or interpreted."""
    import transformers
    import triton

    from minispec.spec_decode import draft_logits, rejection_sampler

    report("python", sys.version.split()[0])
    report("torch", f"{torch.__version__} (cuda {torch.version.cuda}, available {torch.cuda.is_available()})")
    report("triton", triton.__version__)
    report("transformers", transformers.__version__)
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        report("device", f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
    try:
        import gguf

        report("gguf", gguf.__version__ if hasattr(gguf, "__version__") else "importable")
    except ImportError as e:
        report("gguf", f"not importable ({e}); only needed for .gguf models")
    kernels = {"rejection_sample": rejection_sampler._rejection_sample_kernel,
               "assign_rows": draft_logits._assign_rows_kernel, "stale_drafts": draft_logits._stale_drafts_kernel}
    kinds = {name: type(k).__name__ for name, k in kernels.items()}
    report("triton kernels", f"{kinds} (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')!r})")
    return 0


# ---- compile ----------------------------------------------------------------------------------

TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
                torch.int32: "i32", torch.uint8: "u8", torch.bool: "i1"}


class _Recorder:
    """Stands in for a Triton kernel: records each launch's arguments instead of running it."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def kernel_launches() -> list[tuple]:
    """(kernel, arguments by name) of every launch the engine's Triton paths make on a small CPU batch:
    the draft-logits cache (assign, stale drafts) and the rejection sampler (with and without stale flags)."""
    from minispec.distributed import TPGroup
    from minispec.engine.input_batch import InputBatch
    from minispec.spec_decode import draft_logits, rejection_sampler

    names = {draft_logits: ("_assign_rows_kernel", "_stale_drafts_kernel"),
             rejection_sampler: ("_rejection_sample_kernel",)}
    recorders = {(m, n): _Recorder(getattr(m, n)) for m, ns in names.items() for n in ns}
    saved = draft_logits.get_tp_group
    try:
        for (m, n), rec in recorders.items():
            setattr(m, n, rec)
        draft_logits.get_tp_group = lambda: TPGroup(2, 1)
        cache = draft_logits.DraftLogitsCache(8, 3, 5, dtype=torch.float32, fill=0.0, device="cpu", sharded=True)
        batch = InputBatch.build(["a", "b", "c"], np.array([4, 0, 6], dtype=np.int32), np.array([4, 1, 4]), "cpu")
        cache.assign(batch.slots, batch.slots_np, use_triton=True)
        cache.stale_drafts(batch, use_triton=True)
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(6, 50, generator=g)  # [num_logits, V]
        cu = torch.tensor([0, 3, 6])
        drafts = torch.tensor([1, 2, -1, 3, 4, -1])
        params = (torch.tensor([1.0, 0.7]), torch.tensor([0, 5]), torch.tensor([1.0, 0.9]))
        u, noise = torch.rand(2, 2, generator=g), torch.empty(2, 50).exponential_(generator=g)
        for stale in (None, torch.zeros(6, dtype=torch.bool)):
            rejection_sampler.rejection_sample(logits, logits + 1, drafts, stale, cu, *params, u, noise,
                                               use_triton=True)
    finally:
        for (m, n), rec in recorders.items():
            setattr(m, n, rec.kernel)
        draft_logits.get_tp_group = saved
    launches = []
    for rec in recorders.values():
        for args, kwargs in rec.calls:
            launches.append((rec.kernel, {**dict(zip(rec.kernel.arg_names, args)), **kwargs}))
    return launches


def cmd_compile(args) -> int:
    """Compile every Triton kernel for a CUDA target (PTX and cubin by Triton's own ptxas), no GPU needed:
    the signatures are those of the launches the engine's code makes (kernel_launches)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from minispec.spec_decode import rejection_sampler

    if not isinstance(rejection_sampler._rejection_sample_kernel, triton.runtime.JITFunction):
        report("compile", "needs TRITON_INTERPRET unset (the kernels were built for the interpreter)")
        return 1
    target = GPUTarget("cuda", args.arch, 32)
    ok = True
    for kernel, named in kernel_launches():
        const_idx = set(kernel.constexprs)
        signature, constexprs = {}, {}
        for i, name in enumerate(kernel.arg_names):
            value = named[name]
            if i in const_idx or value is None:
                signature[name], constexprs[name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[name] = "*" + TRITON_TYPES[value.dtype]
            elif isinstance(value, bool):
                signature[name] = "i1"
            elif isinstance(value, int):
                signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            else:
                signature[name] = "fp32"
        label = f"{kernel.fn.__name__}({', '.join(f'{k}={v}' for k, v in constexprs.items())})"
        try:
            compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=target)
            report(f"compiled for sm_{args.arch}", f"{label}: cubin {len(compiled.asm['cubin'])} bytes")
        except Exception as e:
            ok = False
            report(f"compile FAILED for sm_{args.arch}", f"{label}: {type(e).__name__}: {str(e).splitlines()[0]}")
    return 0 if ok else 1


# ---- prepare ----------------------------------------------------------------------------------


def cmd_prepare(args) -> int:
    """Write the early-exit draft: the target's first --layers layers, its embedding, final norm and head."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16)
    model.model.layers = model.model.layers[: args.layers]
    model.config.num_hidden_layers = args.layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[: args.layers]
    model.save_pretrained(args.out)
    AutoTokenizer.from_pretrained(args.target).save_pretrained(args.out)
    report("early-exit draft", f"{args.out}: first {args.layers} layer(s) of {Path(args.target).name}")
    return 0


# ---- e2e --------------------------------------------------------------------------------------


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy generate, exactly n new tokens."""
    x = torch.tensor([ids], device=model.device)
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, pad_token_id=0)
    return out[0, len(ids):].tolist()


@torch.inference_mode()
def top2_gap(model, ids: list[int]) -> float:
    """transformers' gap between its two largest next-token logits after ids (a near tie flips greedy)."""
    logits = model(torch.tensor([ids], device=model.device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def compare(got: list[list[int]], want: list[list[int]], hf, prompts: list[list[int]]) -> tuple[int, str]:
    """(number of equal sequences, a note on the first divergence with transformers' top-2 logit gap there)."""
    equal = sum(g == w for g, w in zip(got, want))
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            pos = next(j for j in range(min(len(g), len(w))) if g[j] != w[j])
            gap = top2_gap(hf, prompts[i] + w[:pos])
            return equal, f"prompt {i} first differs at token {pos} (transformers' top-2 logit gap there {gap:.2e})"
    return equal, "all equal"


def cmd_e2e(args) -> int:
    """float32 and bfloat16: target-only greedy vs transformers, speculative greedy vs target-only, acceptance."""
    device = torch.device(args.device)
    ok = True
    for dtype in args.dtypes:
        strict = dtype == "float32"  # bfloat16 kernels differ between systems and shapes: reported, not asserted
        hf, _ = load_hf_model(args.target, parse_dtype(dtype))
        hf.to(device)
        common = dict(dtype=dtype, device=args.device, max_num_seqs=args.num_prompts, seed=0)
        base = LLM(args.target, draft=None, **common)
        prompts = prompt_ids(base, args.num_prompts)
        greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        t = time.perf_counter()
        ms = [o.token_ids for o in base.generate(prompts, greedy)]
        sync(device)
        ms_s = time.perf_counter() - t
        ref = [hf_greedy(hf, p, args.max_tokens) for p in prompts]
        equal, note = compare(ms, ref, hf, prompts)
        ok &= equal == len(prompts) or not strict
        report(f"{dtype} target-only greedy == transformers",
               f"{equal}/{len(prompts)} prompts x {args.max_tokens} tokens; {note} ({ms_s:.2f} s)")
        del base
        # At tp=1 the draft-logits cache is replicated and its kernels idle unless sharding is asked for.
        runs = (("early-exit draft", args.draft, False), ("early-exit draft, sharded cache", args.draft, True),
                ("target as draft", args.target, False), ("ngram", "ngram", False))
        for name, draft, sharded in runs:
            llm = LLM(args.target, draft=draft, num_speculative_tokens=args.k, adaptive_k=False,
                      shard_draft_logits=sharded, **common)
            outs = llm.generate(prompts, greedy)
            m = aggregate(outs)
            equal, note = compare([o.token_ids for o in outs], ms, hf, prompts)
            ok &= equal == len(prompts) or not strict
            if name == "target as draft" and strict:
                # draft == target: rejections only at float32 near ties, besides the drafts that max_tokens cuts
                # from each request's last verification (metrics count what was emitted: at most k per request).
                rejected = m["num_draft_tokens"] - m["num_accepted_tokens"]
                ok &= rejected <= args.k * len(prompts) + 0.1 * m["num_draft_tokens"]
            report(f"{dtype} speculative ({name}, k={args.k}) greedy == target-only",
                   f"{equal}/{len(prompts)}; {note}; acceptance {m['acceptance_rate']:.3f}, mean accepted length "
                   f"{m['mean_accepted_length']:.2f}, per position {m['accepted_per_position']}")
            if draft == args.draft:  # sampled: the rejection sampler's kernel inside the engine (greedy skips it)
                sampled = [SamplingParams(temperature=0.8, max_tokens=args.max_tokens, ignore_eos=True, seed=i)
                           for i in range(len(prompts))]
                outs = llm.generate(prompts, sampled)
                m = aggregate(outs)
                vocab = llm.target.vocab_size
                valid = all(len(o.token_ids) == args.max_tokens and all(0 <= t < vocab for t in o.token_ids)
                            for o in outs)
                ok &= valid
                report(f"{dtype} speculative ({name}, k={args.k}) T=0.8",
                       f"valid tokens {valid}; acceptance {m['acceptance_rate']:.3f}, mean accepted length "
                       f"{m['mean_accepted_length']:.2f}, per position {m['accepted_per_position']}")
            del llm
        del hf
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0 if ok else 1


# ---- tp ---------------------------------------------------------------------------------------


def cmd_tp(args) -> int:
    """Under torchrun (1 rank): minispec at tp=1 equals transformers; then the collectives minispec uses,
    on this backend (nccl on CUDA, gloo on CPU), checked and timed."""
    import torch.distributed as dist

    if "LOCAL_RANK" not in os.environ:
        print("run under torchrun: python -m torch.distributed.run --nproc-per-node 1 scripts/gpu_check.py tp")
        return 2
    device = torch.device(args.device)
    llm = LLM(args.target, draft=args.draft, num_speculative_tokens=args.k, tensor_parallel_size=1,
              device=args.device, max_num_seqs=args.num_prompts, adaptive_k=False, seed=0)
    prompts = prompt_ids(llm, args.num_prompts)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, greedy)
    hf, _ = load_hf_model(args.target, torch.float32)
    hf.to(device)
    equal, note = compare([o.token_ids for o in outs], [hf_greedy(hf, p, args.max_tokens) for p in prompts], hf,
                          prompts)
    m = aggregate(outs)
    report("torchrun tp=1 speculative greedy == transformers",
           f"{equal}/{len(prompts)}; {note}; acceptance {m['acceptance_rate']:.3f} "
           f"(minispec at world size 1 joins no process group: its collectives are no-ops)")
    ok = equal == len(prompts)

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend)
    n = 4096
    x = torch.arange(n, dtype=torch.float32, device=device)  # [n]
    ops = {
        "all_reduce": lambda: dist.all_reduce(x.clone()),
        "all_gather": lambda: dist.all_gather([torch.empty_like(x)], x),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty_like(x), x, [n], [n]),
        "broadcast": lambda: dist.broadcast(x.clone(), 0),
    }
    parts = [torch.empty_like(x)]
    dist.all_gather(parts, x)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, [n], [n])
    y = x.clone()
    dist.all_reduce(y)
    correct = torch.equal(parts[0], x) and torch.equal(out, x) and torch.equal(y, x)
    ok &= correct
    times = {}
    for name, op in ops.items():
        for _ in range(3):
            op()
        sync(device)
        t = time.perf_counter()
        for _ in range(args.reps):
            op()
        sync(device)
        times[name] = (time.perf_counter() - t) / args.reps * 1e6
    report(f"{dist.get_backend()} collectives (world size {dist.get_world_size()}, {n} floats)",
           f"results correct {correct}; us per call " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    dist.destroy_process_group()
    return 0 if ok else 1


# ---- overheads ----------------------------------------------------------------------------------

HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


@contextlib.contextmanager
def count_host_reads(device: torch.device):
    """Count the Python calls that read a device tensor on the host (each a sync on CUDA), by call site.

    On CUDA only reads of CUDA tensors count; on CPU every read counts (an upper bound: the dry run).
    Yields a Counter {"method file:line": calls}; torch.cuda.synchronize calls count as "synchronize".
    """
    counts: collections.Counter = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    own = {name for name in HOST_READS if name in vars(torch.Tensor)}  # the rest are inherited from TensorBase
    sync_fn = torch.cuda.synchronize

    def site() -> str:
        f = sys._getframe(2)
        return f"{os.path.relpath(f.f_code.co_filename, REPO)}:{f.f_lineno}"

    def wrap(name, fn):
        def read(self, *a, **k):
            if self.device.type == device.type:
                counts[f"{name} {site()}"] += 1
            return fn(self, *a, **k)
        return read

    def synchronize(*a, **k):
        counts[f"synchronize {site()}"] += 1
        return sync_fn(*a, **k)

    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    torch.cuda.synchronize = synchronize
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            if name in own:
                setattr(torch.Tensor, name, fn)
            else:
                delattr(torch.Tensor, name)
        torch.cuda.synchronize = sync_fn


@contextlib.contextmanager
def count_cuda_syncs(device: torch.device):
    """CUDA's own count: torch.cuda.set_sync_debug_mode("warn") warns at every synchronising call.
    Yields a Counter {"file:line": syncs} (empty on CPU, where there is nothing to count)."""
    counts: collections.Counter = collections.Counter()
    if device.type != "cuda":
        yield counts
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message).lower():
            counts[f"{os.path.relpath(w.filename, REPO)}:{w.lineno}"] += 1


def steady_engine(llm: LLM, prompts: list[list[int]], max_tokens: int):
    """Add the prompts and step until every request is past its prefill; returns the requests."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [llm.add_request(p, params) for p in prompts]
    while any(r.num_computed < r.num_prompt_tokens for r in reqs):
        llm.engine.step()
    llm.engine.step()
    return reqs


def run_steps(llm: LLM, device: torch.device, steps: int) -> dict:
    """Time steps engine steps: wall and forward seconds per step, tokens per step."""
    runners = [llm.engine.target] + ([llm.engine.proposer.runner] if hasattr(llm.engine.proposer, "runner") else [])
    forward0 = sum(r.forward_s for r in runners)
    tokens = 0
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        tokens += sum(len(o.new_token_ids) for o in llm.engine.step())
    sync(device)
    wall = time.perf_counter() - t
    return dict(step_ms=wall / steps * 1e3, forward_ms=(sum(r.forward_s for r in runners) - forward0) / steps * 1e3,
                tokens_per_step=tokens / steps)


def profile_steps(llm: LLM, device: torch.device, steps: int) -> dict:
    """torch.profiler over steps engine steps: device kernels (CUDA) or aten ops (CPU) per step, and on CUDA the
    GPU busy time per step (kernel durations summed)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            llm.engine.step()
        sync(device)
    events = prof.events()
    if device.type == "cuda":
        gpu = [e for e in events if e.device_type == DeviceType.CUDA]
        if not gpu:
            return {"no CUDA events recorded (CUPTI unavailable?); aten ops per step":
                    sum(e.name.startswith("aten::") for e in events) / steps}
        kernels = [e for e in gpu if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
        busy_us = sum(e.time_range.elapsed_us() for e in gpu)
        launches = sum(1 for e in events if "LaunchKernel" in e.name)
        return dict(kernels_per_step=len(kernels) / steps, copies_per_step=(len(gpu) - len(kernels)) / steps,
                    launch_calls_per_step=launches / steps, gpu_busy_ms_per_step=busy_us / steps / 1e3)
    aten = [e for e in events if e.name.startswith("aten::")]
    return dict(aten_ops_per_step=len(aten) / steps)


@torch.inference_mode()
def graph_vs_eager(runner, batch_size: int, query_len: int, ctx: int, reps: int, device: torch.device) -> dict:
    """One forward (+ logits of the last token) at a fixed shape: eager ms vs CUDA graph replay ms (CUDA only)."""
    from minispec.layers.attention import ForwardBatch

    model, kv = runner.model, runner.kv
    batch = ForwardBatch.build(list(range(batch_size)), [ctx] * batch_size, [[1] * query_len] * batch_size,
                               kv.scratch_slot, device)

    def forward():
        return model.compute_logits(model(batch, kv)[:, -1])  # [batch_size, V]

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        sync(device)
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(device)
        return (time.perf_counter() - t) / reps * 1e3

    out = dict(eager_ms=timed(forward))
    if device.type != "cuda":
        return out
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = forward()
    graph.replay()
    sync(device)
    out["graph_max_diff"] = float((static_out - forward()).abs().max())
    out["graph_ms"] = timed(graph.replay)
    return out


def cmd_overheads(args) -> int:
    """Per engine step, speculative and target-only, batch 1 and the largest batch: time, host syncs, kernels,
    and what CUDA graphs would save on the forwards."""
    device = torch.device(args.device)
    max_b = max(args.batch_sizes)
    common = dict(device=args.device, max_num_seqs=max_b, seed=0, adaptive_k=False)
    llms = {"speculative": LLM(args.target, draft=args.draft, num_speculative_tokens=args.k, **common),
            "target-only": LLM(args.target, draft=None, **common)}
    texts_llm = llms["target-only"]
    prompts = prompt_ids(texts_llm, max_b)
    ok = True
    step_ms = {}
    for name, llm in llms.items():
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
        for b in args.batch_sizes:
            reqs = steady_engine(llm, prompts[:b], max_tokens=args.steps * 4 * (args.k + 1) + 8)
            timing = run_steps(llm, device, args.steps)
            with count_host_reads(device) as reads:
                for _ in range(args.steps):
                    llm.engine.step()
            with count_cuda_syncs(device) as syncs:  # a pass of its own: the read counter would own every site
                for _ in range(args.steps if device.type == "cuda" else 0):
                    llm.engine.step()
            try:
                prof = profile_steps(llm, device, args.steps)
            except Exception as e:  # the profiler is optional: report and go on
                prof = {"profiler failed": f"{type(e).__name__}: {e}"}
                ok = False
            for r in reqs:
                llm.abort(r.req_id)
            step_ms[name, b] = timing["step_ms"]
            label = f"{name} b={b}"
            report(f"{label} step", f"{timing['step_ms']:.2f} ms ({timing['forward_ms']:.2f} ms in forwards, "
                   f"{timing['tokens_per_step']:.2f} tokens per step, "
                   f"{timing['tokens_per_step'] / timing['step_ms'] * 1e3:.0f} tok/s)")
            top = ", ".join(f"{site} x{n / args.steps:g}" for site, n in reads.most_common(6))
            report(f"{label} host reads per step", f"{sum(reads.values()) / args.steps:g} ({top})")
            if device.type == "cuda":
                top = ", ".join(f"{site} x{n / args.steps:g}" for site, n in syncs.most_common(6))
                report(f"{label} CUDA syncs per step (sync debug mode)", f"{sum(syncs.values()) / args.steps:g} ({top})")
            report(f"{label} profile per step", ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                                          for k, v in prof.items()))
    # CUDA graphs: the forwards a decode step runs, eager vs replayed, at a mid-length context.
    spec = llms["speculative"]
    ctx = args.graph_ctx
    for b in args.batch_sizes:
        shapes = {"verify (target, k+1 tokens)": (spec.engine.target, args.k + 1, 1),
                  "draft (1 token)": (spec.engine.proposer.runner, 1, args.k)}
        saved = 0.0
        for label, (runner, q, per_step) in shapes.items():
            try:
                g = graph_vs_eager(runner, b, q, ctx, args.reps, device)
            except Exception as e:
                report(f"cuda graph {label} b={b}", f"failed: {type(e).__name__}: {str(e).splitlines()[0]}")
                ok = False
                continue
            if "graph_ms" in g:
                saved += per_step * (g["eager_ms"] - g["graph_ms"])
                report(f"cuda graph {label} b={b}", f"eager {g['eager_ms']:.3f} ms, graph {g['graph_ms']:.3f} ms "
                       f"({g['eager_ms'] / g['graph_ms']:.1f}x), max |logit difference| {g['graph_max_diff']:.1e}")
            else:
                report(f"cuda graph {label} b={b}", f"eager {g['eager_ms']:.3f} ms; graph capture needs CUDA")
        if device.type == "cuda":
            step = step_ms["speculative", b]
            report(f"cuda graphs would save (speculative b={b})",
                   f"~{saved:.2f} ms of a {step:.2f} ms step ({100 * saved / step:.0f}%): 1 verify + {args.k} draft "
                   f"forwards at context {ctx}")
    return 0 if ok else 1


# ---- CLI --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["env", "compile", "prepare", "e2e", "tp", "overheads"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--target", default=SHIPPED_TARGET, help="the target checkpoint (default: the shipped draft)")
    p.add_argument("--draft", default=None, help="the draft checkpoint (prepare: where to write it)")
    p.add_argument("--out", default=None, help="prepare: the draft's directory")
    p.add_argument("--layers", type=int, default=1, help="prepare: layers the early-exit draft keeps")
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--steps", type=int, default=20, help="overheads: engine steps per measure")
    p.add_argument("--reps", type=int, default=50, help="timed repetitions (collectives, graph replays)")
    p.add_argument("--graph-ctx", type=int, default=256, help="overheads: context of the graph-captured forwards")
    p.add_argument("--arch", type=int, default=90, help="compile: the CUDA compute capability (90: H100 / H200)")
    args = p.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    if args.command == "prepare":
        args.out = args.out or args.draft
        if not args.out:
            p.error("prepare needs --out DIR")
    elif args.command not in ("env", "compile") and not args.draft:
        p.error(f"{args.command} needs --draft (e.g. the directory `prepare` wrote)")
    torch.manual_seed(0)
    np.random.seed(0)
    return {"env": cmd_env, "compile": cmd_compile, "prepare": cmd_prepare, "e2e": cmd_e2e, "tp": cmd_tp,
            "overheads": cmd_overheads}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
