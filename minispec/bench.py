"""python -m minispec.bench — minispec and transformers side by side: same prompts, same models, one run.

    .venv/bin/python -m minispec.bench [--config configs/bench-smollm2.toml] [--quick] [--out bench.json]

Every system generates the same number of tokens for the same token prompts (ignore_eos; transformers
gets min_new_tokens = max_new_tokens), or with stop_at_eos each stops at the target's end of answer (the
tokens a server would send; a draft trained on answers is not asked to guess past them). Each round runs every row once, in alternating order, so machine
drift hits all rows alike. Besides tok/s the run measures the memory bandwidth (roofline at batch 1),
the draft and verify cost ratios of minispec's own forwards, and from them each speculative row's
engine efficiency: measured speedup / speedup predicted from its per-token acceptance alpha,

    predicted = (1 - alpha^(k+1)) / (1 - alpha) / (k * c + verify_ratio).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import tomllib
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from minispec.llm import DEFAULT_TARGET, param_bytes
from minispec.models.quantize import check_quantization, is_self_draft
from minispec.spec_decode.costs import measure_costs
from minispec.tools.config import load_settings
from minispec.tools.metrics import (acceptance_by_position, aggregate, decode_verifications, predicted_speedup,
                                    tau_from_acceptance)
from minispec.tools.prompts import encode_prompts, load_prompt_set
from minispec.utils import one_line

NGRAM = "ngram"
NGRAM_N = (1, 3)  # minispec's n-gram sizes; transformers prompt lookup matches up to the same max
HF_BATCH1_NOTE = "transformers assisted generation / prompt lookup run at batch size 1 only"

@dataclass
class BenchConfig:
    """What to run: a small run by default (configs/bench-smollm2.toml is the full one)."""

    target: str = DEFAULT_TARGET
    drafts: list[str] = field(default_factory=lambda: [NGRAM])  # model specs, "ngram" and / or self-drafts ("self-int4")
    quantizations: list[str] = field(default_factory=list)  # "int8" / "int4": target-only rows of the target quantised at load
    k: int = 4
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16])
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.8])
    max_tokens: int = 128
    num_prompts: int = 16
    rounds: int = 2
    seed: int = 0
    dtype: str = "float32"
    device: str | None = None  # None: minispec's default (the TP group's device)
    threads: int | None = None  # torch CPU threads; None: torch's default
    chat: bool = True  # apply the target's chat template when it has one
    stop_at_eos: bool = False  # end each answer at the target's EOS (else every system makes max_tokens tokens)
    prefix_caching: bool = True  # minispec's (LLM enable_prefix_caching); each run starts with an empty cache
    cost_reps: int = 20  # timed forwards per cost-ratio measurement
    adaptive: bool = True  # also run each draft with AdaptiveK (measured costs; may turn speculation off)
    bandwidth_mib: int = 512  # size of the tensor copied to measure memory bandwidth
    llama_bench: str | None = None  # a llama-bench binary: adds llama.cpp's decode on the target GGUF as a peer row


QUICK = dict(max_tokens=8, num_prompts=2, batch_sizes=[1], rounds=1, cost_reps=3, bandwidth_mib=256)


def load_config(path: str | None, overrides: dict | None = None) -> BenchConfig:
    """Defaults < a TOML file (unknown keys are an error) < overrides."""
    return load_settings(BenchConfig, path, overrides)


def check_config(cfg: BenchConfig) -> None:
    if cfg.threads is not None and cfg.threads < 1:
        raise ValueError(f"threads must be >= 1, got {cfg.threads}")
    if not cfg.batch_sizes or min(cfg.batch_sizes) < 1:
        raise ValueError(f"batch_sizes must be positive integers, got {cfg.batch_sizes}")
    if not cfg.temperatures or min(cfg.temperatures) < 0:
        raise ValueError(f"temperatures must be >= 0, got {cfg.temperatures}")
    for q in cfg.quantizations + [q for _, q in map(split_draft, cfg.drafts) if q is not None]:
        check_quantization(q)
    for name in ("k", "max_tokens", "num_prompts", "rounds", "cost_reps", "bandwidth_mib"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")


# ---- models and prompts ------------------------------------------------------------------------


def load_hf(spec: str, dtype: torch.dtype, device: torch.device):
    """transformers' own model (and tokenizer, None if it has none) for a spec, in eval mode on device."""
    from minispec.models.loader import load_hf_model

    model, tokenizer = load_hf_model(spec, dtype)
    return model.to(device), tokenizer


def load_prompt_texts(num_prompts: int) -> tuple[list[str], str]:
    """num_prompts eval prompts of prompts.json, round-robin over its categories (cycled if the set is smaller),
    and their source: a short run covers every kind of request, not the first category's alone."""
    texts, _ = load_prompt_set("eval", num_prompts)
    return [texts[i % len(texts)] for i in range(num_prompts)], "minispec.data (eval, round-robin over categories)"


def batches_of(prompts: list[list[int]], batch_size: int) -> list[list[tuple[int, list[int]]]]:
    """Split (index, prompt) pairs into batches of batch_size, cycling prompts to fill the last one."""
    n = math.ceil(len(prompts) / batch_size) * batch_size
    items = [(i, prompts[i % len(prompts)]) for i in range(n)]
    return [items[j : j + batch_size] for j in range(0, n, batch_size)]


def split_draft(draft: str) -> tuple[str, str | None]:
    """A bench draft entry -> (model spec, quantisation or None): "SPEC@int8" is SPEC quantised at load."""
    spec, _, quantization = draft.rpartition("@") if "@" in draft else (draft, "", None)
    return spec, quantization


def is_head(draft: str) -> bool:
    """Whether a draft entry names an EAGLE head (a checkpoint directory or a shipped head)."""
    from minispec.llm import HEAD_WITH_LOOKUP
    from minispec.models.eagle import SHIPPED_HEADS, is_head_checkpoint

    spec = split_draft(draft)[0].removesuffix(HEAD_WITH_LOOKUP)
    return is_head_checkpoint(SHIPPED_HEADS.get(spec.lower(), spec))


def minispec_only(draft: str) -> bool:
    """A draft transformers cannot run as an assistant: a self-draft, a draft quantised at load or an EAGLE head."""
    return is_self_draft(draft) or split_draft(draft)[1] is not None or is_head(draft)


def cost_draft(llm):
    """What measure_costs times for an LLM's proposer: its draft model, its head's runner, or "ngram"."""
    if llm.head is not None:
        return llm.engine.proposer.runner
    return NGRAM if llm.draft is None else llm.draft.model



def draft_label(draft: str | None) -> str:
    if draft is None:
        return "-"
    if draft == NGRAM:
        return NGRAM
    spec, quantization = split_draft(draft)
    label = os.path.basename(os.path.normpath(spec)) or spec
    return label if quantization is None else f"{label}@{quantization}"


# ---- timing --------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device: torch.device, mib: int, reps: int = 5) -> float:
    """Memory bandwidth in GB/s (read + write) of the best of reps copies of a mib-MiB tensor."""
    n = mib * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32, device=device)  # [n]
    dst = torch.empty_like(src)  # [n]
    dst.copy_(src)  # touch both before timing
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    del src, dst
    return 2 * n * 4 / best / 1e9


# ---- rows ---------------------------------------------------------------------------------


@dataclass
class Row:
    """One (system, method, draft, batch size, temperature) cell; run is None when unsupported."""

    system: str  # "transformers" | "minispec"
    method: str  # "target-only" | "assisted" | "prompt-lookup" | "speculative"
    draft: str | None
    batch_size: int
    temperature: float
    run: object = None  # run(batches, max_tokens) -> (tokens, minispec outputs or None)
    note: str = ""
    tokens: int = 0
    seconds: float = 0.0
    outputs: list = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.system} {self.method} {draft_label(self.draft)} b={self.batch_size} T={self.temperature:g}"


def minispec_runner(llm, cfg: BenchConfig, temperature: float):
    """A row's run function for a minispec LLM: each batch submitted together, seeded per prompt."""
    from minispec.sampling_params import SamplingParams

    def run(batches, max_tokens):
        tokens, outputs = 0, []
        llm.reset_prefix_cache()  # a round reuses prefixes among its own prompts only, never the last round's
        for batch in batches:
            params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=not cfg.stop_at_eos,
                                     seed=cfg.seed + i) for i, _ in batch]
            outs = llm.generate([p for _, p in batch], params)
            tokens += sum(len(o.token_ids) for o in outs)
            outputs += outs
        return tokens, outputs

    return run


def hf_runner(model, pad_id: int, cfg: BenchConfig, temperature: float, **extra):
    """A row's run function for transformers' generate: left-padded batches with an attention mask; with
    cfg.stop_at_eos it counts each answer's tokens up to its first EOS."""
    device = model.device
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)
    def run(batches, max_tokens):
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        tokens = 0
        for j, batch in enumerate(batches):
            width = max(len(p) for _, p in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.int64)  # [b, width]
            mask = torch.zeros(len(batch), width, dtype=torch.int64)  # [b, width]
            for r, (_, p) in enumerate(batch):
                ids[r, width - len(p) :] = torch.tensor(p)
                mask[r, width - len(p) :] = 1
            torch.manual_seed(cfg.seed + j)
            length = {} if cfg.stop_at_eos else dict(min_new_tokens=max_tokens)
            with torch.inference_mode():
                out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_tokens,
                                     pad_token_id=pad_id, **length, **sampling, **extra)
            new = out[:, width:].cpu()  # [b, n]
            tokens += sum(answer_length(row.tolist(), eos) for row in new) if cfg.stop_at_eos else new.numel()
        return tokens, None

    return run


def answer_length(ids: list[int], eos: set[int]) -> int:
    """Tokens of a generated row up to and including its first EOS (all of them without one)."""
    return next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))


def build_rows(cfg: BenchConfig, hf_target, hf_drafts: dict, llms: dict, pad_id: int,
               adaptive_llms: dict | None = None) -> list[Row]:
    """Every row in table order: transformers first, then minispec; batch size, then temperature.
    adaptive_llms: draft -> an LLM built with an adaptive k policy (the adaptive-k rows)."""
    rows = []
    for b in cfg.batch_sizes:
        for t in cfg.temperatures:
            rows.append(Row("transformers", "target-only", None, b, t, hf_runner(hf_target, pad_id, cfg, t)))
            for d in cfg.drafts:
                if minispec_only(d):  # transformers has no self-draft, no quantised draft
                    continue
                if d == NGRAM:
                    method, extra = "prompt-lookup", dict(prompt_lookup_num_tokens=cfg.k,
                                                          max_matching_ngram_size=NGRAM_N[1])
                else:
                    method, extra = "assisted", dict(assistant_model=hf_drafts[d])
                run = hf_runner(hf_target, pad_id, cfg, t, **extra) if b == 1 else None
                rows.append(Row("transformers", method, d, b, t, run, "" if b == 1 else "batch 1 only"))
    for b in cfg.batch_sizes:
        for t in cfg.temperatures:
            rows.append(Row("minispec", "target-only", None, b, t, minispec_runner(llms[None], cfg, t)))
            for q in cfg.quantizations:
                rows.append(Row("minispec", f"target-only {q}", None, b, t, minispec_runner(llms[q], cfg, t)))
            for d in cfg.drafts:
                rows.append(Row("minispec", "speculative", d, b, t, minispec_runner(llms[d], cfg, t)))
            for d, llm in (adaptive_llms or {}).items():
                rows.append(Row("minispec", "adaptive-k", d, b, t, minispec_runner(llm, cfg, t)))
    return rows


def llama_cpp_decode(binary: str, gguf: str, threads: int, max_tokens: int) -> tuple[float | None, str]:
    """llama.cpp's decode tok/s on a GGUF (llama-bench, 3 repetitions), or (None, why not)."""
    cmd = [binary, "-m", gguf, "-t", str(threads), "-p", "64", "-n", str(max_tokens), "-r", "3", "-o", "json"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode:
            why = {-4: " (SIGILL: the build uses instructions this CPU lacks)"}.get(done.returncode, "")
            return None, f"llama-bench exited with {done.returncode}{why}"
        runs = json.loads(done.stdout)
        return float(next(r["avg_ts"] for r in runs if r.get("n_gen", 0) > 0)), " ".join(cmd[1:])
    except (OSError, subprocess.SubprocessError, ValueError, StopIteration, KeyError, TypeError) as e:
        return None, f"llama-bench failed: {one_line(e, limit=None)}"


def drafted_share(m: dict) -> float | None:
    """Of a run's decode verifications (tools/metrics.decode_verifications), the share that verified drafts; None
    without any."""
    decode = decode_verifications(m)
    return m["num_spec_verifications"] / decode if decode > 0 else None


def stream_rate(tok_s: float | None, weight_bytes: int | None, batch_size: int, bandwidth_gb_s: float) -> dict:
    """GB/s of weights a plain decoder streams at tok_s (one weight pass per step of batch_size tokens),
    and its share of the measured bandwidth (the roofline)."""
    if not tok_s or not weight_bytes:
        return dict(gb_s=None, roofline_share=None)
    gb_s = tok_s * weight_bytes / batch_size / 1e9
    return dict(gb_s=gb_s, roofline_share=gb_s / bandwidth_gb_s)


def greedy_agreement(outputs: list, reference: list, num_prompts: int) -> dict:
    """Greedy tokens of one row against a reference row (the first round's num_prompts outputs): per prompt the
    first position where they part (-1: none), and the tokens before it."""
    first = []
    for o, ref in zip(outputs[:num_prompts], reference[:num_prompts]):
        a, b = o.token_ids, ref.token_ids
        first.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), -1 if len(a) == len(b) else min(len(a), len(b))))
    agreeing = sum(len(o.token_ids) if f < 0 else f for o, f in zip(outputs, first))
    return dict(first_divergence=first, tokens_agreeing=agreeing,
                tokens=sum(len(o.token_ids) for o in outputs[:num_prompts]))


# ---- the run --------------------------------------------------------------------------------


def run_bench(cfg: BenchConfig, progress: bool = True) -> dict:
    """Load everything, warm up, measure bandwidth and cost ratios, run the rounds; the result as a dict."""
    import transformers
    from tqdm import tqdm

    from minispec.llm import LLM
    from minispec.utils import parse_dtype

    check_config(cfg)
    transformers.logging.set_verbosity_error()
    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dtype = parse_dtype(cfg.dtype)
    t_load = time.perf_counter()

    # The target-only LLM first: it settles the device every other model goes to.
    max_b = max(cfg.batch_sizes)
    device = torch.device(cfg.device) if cfg.device else None
    hf_target, tokenizer = load_hf(cfg.target, dtype, device or torch.device("cpu"))
    max_pos = getattr(hf_target.config, "max_position_embeddings", None) or 2048
    texts, prompt_source = load_prompt_texts(cfg.num_prompts)
    prompts, _ = encode_prompts(tokenizer, texts, cfg.chat, min(max_pos, 2048) - cfg.max_tokens - cfg.k - 2)
    max_len = max(len(p) for p in prompts) + cfg.max_tokens + 1
    common = dict(num_speculative_tokens=cfg.k, max_num_seqs=max_b, dtype=cfg.dtype, max_model_len=max_len,
                  seed=cfg.seed, device=cfg.device, max_num_batched_tokens=max(2048, max_b * max_len),
                  enable_prefix_caching=cfg.prefix_caching)
    llms = {None: LLM(cfg.target, None, **common)}
    device = llms[None].device
    hf_target = hf_target.to(device)
    for d in cfg.drafts:
        spec, quantization = split_draft(d)
        llms[d] = LLM(cfg.target, spec, ngram_n=NGRAM_N, draft_quantization=quantization, **common)
    for q in cfg.quantizations:
        llms[q] = LLM(cfg.target, None, quantization=q, **common)
    hf_drafts = {}
    for d in cfg.drafts:
        if d != NGRAM and not minispec_only(d):
            model, _ = load_hf(d, dtype, device)
            # Fixed k drafts per step, like minispec: no heuristic schedule, no early stop on confidence.
            model.generation_config.num_assistant_tokens = cfg.k
            model.generation_config.num_assistant_tokens_schedule = "constant"
            model.generation_config.assistant_confidence_threshold = 0.0
            hf_drafts[d] = model
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    load_s = time.perf_counter() - t_load

    adaptive_llms = {}
    if cfg.adaptive:  # per draft, LLM(adaptive_k=True) on the same loaded models: what a user of it gets
        for d in cfg.drafts:
            # a head by its spec (a "+ngram" suffix keeps its lookup), a draft model as loaded
            draft = NGRAM if d == NGRAM else split_draft(d)[0] if llms[d].head is not None else llms[d].draft
            quantization = split_draft(d)[1] if llms[d].head is not None else None
            adaptive_llms[d] = LLM(llms[d].target, draft, ngram_n=NGRAM_N, adaptive_k=True,
                                   draft_quantization=quantization, **common)
    rows = build_rows(cfg, hf_target, hf_drafts, llms, pad_id, adaptive_llms)
    runnable = [r for r in rows if r.run is not None]
    batches = {b: batches_of(prompts, b) for b in cfg.batch_sizes}
    bar = tqdm(total=len(runnable) * (cfg.rounds + 1), desc="bench", unit="run", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)

    # Warm-up: every row once, one batch, a few tokens.
    for row in runnable:
        bar.set_postfix_str(f"warm-up {row.label}", refresh=False)
        row.run(batches[row.batch_size][:1], min(cfg.max_tokens, 8))
        bar.update(1)

    # Machine figures: bandwidth, and minispec's forward cost ratios at each batch size.
    bandwidth = measure_bandwidth(device, cfg.bandwidth_mib)
    ctx = min(int(np.mean([len(p) for p in prompts])) + cfg.max_tokens // 2, max_len - 1)
    model_drafts = {d: cost_draft(llms[d]) for d in cfg.drafts if d != NGRAM}
    decode_s, verify_ratio, draft_c = {}, {}, {d: {} for d in model_drafts}
    for b in cfg.batch_sizes:
        bar.set_postfix_str(f"cost ratios b={b}", refresh=True)
        costs = measure_costs(llms[None].target.model, model_drafts, cfg.k, b, ctx, cfg.cost_reps,
                              llms[None].target.vocab_size, dtype, device, NGRAM_N, cfg.seed)
        decode_s[b], verify_ratio[b] = costs["target_step_ms"] / 1e3, costs["verify_ratio"][cfg.k]
        for d in model_drafts:
            draft_c[d][b] = costs["c"][d]

    # The rounds: every row once per round, the order reversed every other round.
    for rnd in range(cfg.rounds):
        order = runnable if rnd % 2 == 0 else runnable[::-1]
        for row in order:
            bar.set_postfix_str(f"round {rnd + 1} {row.label}", refresh=False)
            sync(device)
            t = time.perf_counter()
            n, outs = row.run(batches[row.batch_size], cfg.max_tokens)
            sync(device)
            row.seconds += time.perf_counter() - t
            row.tokens += n
            if outs:
                row.outputs += outs
            bar.update(1)
    bar.close()

    # The llama.cpp peer: its own repetitions, after minispec's and transformers' rounds.
    llama = None
    if cfg.llama_bench:
        from minispec.models.loader import hf_source

        source, kw = hf_source(cfg.target)
        threads = cfg.threads or torch.get_num_threads()
        if "gguf_file" in kw:
            gguf = os.path.join(source, kw["gguf_file"])
            ts, note = llama_cpp_decode(cfg.llama_bench, gguf, threads, cfg.max_tokens)
            llama = dict(tok_s=ts, note=note, bytes=os.path.getsize(gguf), threads=threads)
        else:
            llama = dict(tok_s=None, note="the target is not a GGUF file", bytes=None, threads=threads)

    # Results.
    tok_s = {id(r): r.tokens / r.seconds if r.run is not None and r.seconds > 0 else None for r in rows}
    hf_base = {(r.batch_size, r.temperature): tok_s[id(r)] for r in rows
               if r.system == "transformers" and r.method == "target-only"}
    ms_base = {(r.batch_size, r.temperature): tok_s[id(r)] for r in rows
               if r.system == "minispec" and r.method == "target-only"}
    ms_base_rows = {(r.batch_size, r.temperature): r for r in rows if r.system == "minispec" and r.method == "target-only"}
    # Weight bytes each system streams per decode step (transformers: its dequantised float32 copy).
    weight_bytes = {"transformers": param_bytes(hf_target), "minispec": param_bytes(llms[None].target.model)}
    out_rows = []
    for r in rows:
        ts = tok_s[id(r)]
        key = (r.batch_size, r.temperature)
        d = dict(system=r.system, method=r.method, draft=r.draft, batch_size=r.batch_size,
                 temperature=r.temperature, tokens=r.tokens, seconds=r.seconds, tok_s=ts,
                 ratio_vs_transformers=ts / hf_base[key] if ts and hf_base.get(key) else None,
                 acceptance_rate=None, mean_accepted_length=None, alpha=None, draft_cost_ratio=None,
                 verify_ratio=None, measured_speedup=None, predicted_speedup=None, engine_efficiency=None,
                 note=r.note, **stream_rate(ts, weight_bytes[r.system], r.batch_size, bandwidth))
        if r.system == "minispec" and r.method == "speculative" and r.outputs:
            m = aggregate(r.outputs)
            alpha = m["alpha"]
            c = 0.0 if r.draft == NGRAM else draft_c[r.draft][r.batch_size]
            v = verify_ratio[r.batch_size]
            pred = predicted_speedup(alpha, cfg.k, c, v)
            meas = ts / ms_base[key] if ts and ms_base.get(key) else None
            d.update(acceptance_rate=m["acceptance_rate"], mean_accepted_length=m["mean_accepted_length"],
                     alpha=alpha, draft_cost_ratio=c, verify_ratio=v, measured_speedup=meas, predicted_speedup=pred,
                     engine_efficiency=meas / pred if meas else None,
                     num_spec_verifications=m["num_spec_verifications"], num_draft_tokens=m["num_draft_tokens"], num_accepted_tokens=m["num_accepted_tokens"],
                     accepted_per_position=m["accepted_per_position"], acceptance_by_position=acceptance_by_position(m))
        elif r.system == "minispec" and r.method.startswith("target-only ") and r.outputs:  # a quantised target
            q = r.method.split()[1]
            d.update(measured_speedup=ts / ms_base[key] if ts and ms_base.get(key) else None,
                     **stream_rate(ts, param_bytes(llms[q].target.model), r.batch_size, bandwidth))
            if r.temperature == 0:
                d["greedy_agreement"] = greedy_agreement(r.outputs, ms_base_rows[key].outputs, len(prompts))
        elif r.system == "minispec" and r.method == "adaptive-k" and r.outputs:
            m = aggregate(r.outputs)
            d.update(acceptance_rate=m["acceptance_rate"], mean_accepted_length=m["mean_accepted_length"],
                     measured_speedup=ts / ms_base[key] if ts and ms_base.get(key) else None,
                     num_spec_verifications=m["num_spec_verifications"], num_draft_tokens=m["num_draft_tokens"],
                     num_accepted_tokens=m["num_accepted_tokens"], drafted_share=drafted_share(m))
        out_rows.append(d)
    if llama is not None:
        out_rows.append(dict(system="llama.cpp", method="target-only", draft=None, batch_size=1, temperature=0.0,
                             tokens=None, seconds=None, tok_s=llama["tok_s"],
                             ratio_vs_transformers=llama["tok_s"] / hf_base[(1, 0.0)]
                             if llama["tok_s"] and hf_base.get((1, 0.0)) else None,
                             note=llama["note"], **stream_rate(llama["tok_s"], llama["bytes"], 1, bandwidth)))

    # minispec's decode rate at batch 1, as llama-bench's tg measures llama.cpp's: the tokens after each
    # request's first, over the time after its first token (the prompt's forward left out).
    decode_tok_s = None
    b1_row = ms_base_rows.get((1, min(cfg.temperatures))) if 1 in cfg.batch_sizes else None
    if b1_row is not None and b1_row.outputs:
        after_first = [(len(o.token_ids) - 1, o.metrics["elapsed_s"] - o.metrics["time_to_first_token_s"])
                       for o in b1_row.outputs if o.metrics.get("time_to_first_token_s") is not None]
        seconds = sum(s for _, s in after_first)
        decode_tok_s = sum(n for n, _ in after_first) / seconds if seconds > 0 else None
    bytes_per_token = param_bytes(llms[None].target.model)
    roofline = bandwidth * 1e9 / bytes_per_token
    b1 = min(cfg.batch_sizes)
    t0 = min(cfg.temperatures)
    ms_b1, hf_b1 = ms_base.get((b1, t0)), hf_base.get((b1, t0))
    return {
        "config": asdict(cfg),
        "prompts": {"source": prompt_source, "num": len(prompts), "mean_len": float(np.mean([len(p) for p in prompts])),
                    "chat": cfg.chat and bool(getattr(tokenizer, "chat_template", None))},
        "machine": {
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
            or platform.machine(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "load_s": load_s,
        },
        "roofline": {
            "bandwidth_gb_s": bandwidth,
            "bytes_per_token": bytes_per_token,
            "dtype": cfg.dtype,
            "roofline_tok_s": roofline,
            "batch_size": b1,
            "temperature": t0,
            "minispec_tok_s": ms_b1,
            "minispec_decode_tok_s": decode_tok_s,  # batch 1 only: after each request's first token
            "minispec_fraction": ms_b1 / roofline if ms_b1 else None,
            "transformers_tok_s": hf_b1,
            "transformers_fraction": hf_b1 / roofline if hf_b1 else None,
            "transformers_bytes_per_token": weight_bytes["transformers"],
        },
        "llama_cpp": llama,
        "costs": {
            "context": ctx,
            "target_decode_s": {str(b): s for b, s in decode_s.items()},
            "verify_ratio": {str(b): v for b, v in verify_ratio.items()},
            # n-gram lookup runs no forward: c = 0 (its host-side cost shows in the engine efficiency).
            "draft_cost_ratio": {d: {str(b): 0.0 for b in cfg.batch_sizes} if d == NGRAM else
                                 {str(b): c for b, c in draft_c[d].items()} for d in cfg.drafts},
        },
        "rows": out_rows,
    }


# ---- printing ------------------------------------------------------------------------------

COLUMNS = [  # header, width, key, format
    ("system", 28, None, None),
    ("draft", 14, "draft", None),
    ("b", 3, "batch_size", "{:d}"),
    ("T", 4, "temperature", "{:g}"),
    ("tok/s", 9, "tok_s", "{:.1f}"),
    ("vs HF", 7, "ratio_vs_transformers", "{:.2f}x"),
    ("GB/s", 6, "gb_s", "{:.1f}"),
    ("roof", 5, "roofline_share", "{:.0%}"),
    ("accept", 7, "acceptance_rate", "{:.3f}"),
    ("mean acc", 8, "mean_accepted_length", "{:.2f}"),
    ("alpha", 6, "alpha", "{:.3f}"),
    ("c", 6, "draft_cost_ratio", "{:.3f}"),
    ("verify", 6, "verify_ratio", "{:.2f}"),
    ("speedup", 7, "measured_speedup", "{:.2f}x"),
    ("pred", 7, "predicted_speedup", "{:.2f}x"),
    ("eff", 5, "engine_efficiency", "{:.2f}"),
]


def _cell(row: dict, key, fmt) -> str:
    if key is None:
        return f"{row['system']} {row['method']}"
    if key == "draft":
        return draft_label(row["draft"])
    value = row.get(key)
    if value is None:
        return "n/a" if key in ("tok_s", "ratio_vs_transformers") and row["note"] else "-"
    return fmt.format(value) if fmt else str(value)


def format_table(result: dict) -> str:
    """The result as a plain-text report: header figures, the rows, footnotes."""
    cfg, roof, costs, mach = result["config"], result["roofline"], result["costs"], result["machine"]
    lines = [
        f"minispec bench: target {cfg['target']}, drafts {', '.join(cfg['drafts']) or '-'}, k={cfg['k']}, "
        f"{cfg['max_tokens']} tokens x {result['prompts']['num']} prompts ({result['prompts']['source']}, "
        f"mean {result['prompts']['mean_len']:.0f} tokens), {cfg['rounds']} round(s), {cfg['dtype']}, "
        f"prefix caching {'on' if cfg.get('prefix_caching', True) else 'off'}, "
        f"device {mach['device']} ({mach['device_name']}, torch threads={mach['torch_threads']})",
        f"memory bandwidth {roof['bandwidth_gb_s']:.1f} GB/s (copy, read+write); target {roof['bytes_per_token'] / 1e6:.1f} MB "
        f"per token -> roofline {roof['roofline_tok_s']:.1f} tok/s at batch 1",
    ]
    if roof["minispec_tok_s"]:
        lines.append(
            f"batch {roof['batch_size']}, T={roof['temperature']:g}: minispec target-only {roof['minispec_tok_s']:.1f} tok/s "
            f"= {100 * roof['minispec_fraction']:.0f}% of roofline; transformers {roof['transformers_tok_s']:.1f} tok/s "
            f"= {100 * roof['transformers_fraction']:.0f}%"
        )
    llama = result.get("llama_cpp")
    if llama:
        ratio = roof["minispec_tok_s"] / llama["tok_s"] if llama["tok_s"] and roof["minispec_tok_s"] else None
        decode = roof.get("minispec_decode_tok_s")
        lines.append(f"llama.cpp ({llama['threads']} threads): {llama['note']}" + (
            f"; minispec target-only / llama.cpp decode = {ratio:.2f}x end to end (prompt included)" if ratio else ""))
        if decode and llama["tok_s"]:
            lines.append(f"minispec decode (batch 1, after the first token, as llama-bench's tg): {decode:.1f} tok/s = "
                         f"{decode / llama['tok_s']:.2f}x llama.cpp")
    verify = ", ".join(f"b={b}: {v:.2f}" for b, v in costs["verify_ratio"].items())
    lines.append(f"verify cost ratio ({cfg['k'] + 1}-token / 1-token target forward, context {costs['context']}): {verify}")
    for d, per_b in costs["draft_cost_ratio"].items():
        text = ", ".join(f"b={b}: {c:.3f}" for b, c in per_b.items())
        if d == NGRAM:
            text = "0 (no forward: host-side lookup; its cost shows in eff)"
        lines.append(f"draft cost ratio c ({draft_label(d)} / target 1-token forward): {text}")
    lines.append("")
    header = " ".join(h.ljust(w) if i < 2 else h.rjust(w) for i, (h, w, _, _) in enumerate(COLUMNS))
    lines += [header, "-" * len(header)]
    for row in result["rows"]:
        cells = [_cell(row, key, fmt) for _, _, key, fmt in COLUMNS]
        lines.append(" ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, (_, w, _, _)) in enumerate(zip(cells, COLUMNS))))
    for row in result["rows"]:
        if row.get("acceptance_by_position"):
            acc = row["acceptance_by_position"]
            lines.append(f"{draft_label(row['draft'])} k={cfg['k']} b={row['batch_size']} T={row['temperature']:g}: "
                         f"acceptance by position (given the earlier ones accepted) "
                         + " / ".join(f"{a:.3f}" for a in acc) + "; tau at k = "
                         + ", ".join(f"{k}: {tau_from_acceptance(acc, k):.2f}" for k in range(1, len(acc) + 1)))
    for row in result["rows"]:
        if row.get("drafted_share") is not None:
            lines.append(f"{draft_label(row['draft'])} adaptive k b={row['batch_size']} T={row['temperature']:g}: "
                         f"drafted in {row['drafted_share']:.0%} of its decode steps")
    for row in result["rows"]:
        if "greedy_agreement" in row:
            g = row["greedy_agreement"]
            lines.append(f"greedy {row['method']} vs target-only, b={row['batch_size']}: {g['tokens_agreeing']} / "
                         f"{g['tokens']} tokens before the first divergence; first divergence per prompt (-1: none): "
                         f"{g['first_divergence']}")
    lines += [
        "",
        f"n/a: {HF_BATCH1_NOTE}.",
        "GB/s: weight bytes a plain decoder streams per token at this tok/s (the system's own weights: transformers "
        "float32, minispec as loaded, llama.cpp the GGUF; one pass per step of b tokens); roof: GB/s / measured "
        "bandwidth (speculative rows can pass 100%).",
        "vs HF: tok/s over transformers target-only at the same batch size and temperature. speedup: over minispec "
        "target-only (same b, T).",
        "accept: accepted / drafted tokens; mean acc: tokens per verification with drafts; alpha: per-token "
        "acceptance (MLE, n-gram misses count as rejections).",
        "pred = (1 - alpha^(k+1)) / (1 - alpha) / (k*c + verify); eff = speedup / pred (1.0: the engine loses nothing "
        "beyond the forwards).",
        "target-only int8 / int4: the target quantised at load (another model); speedup over the unquantised one. "
        "self-int8 / self-int4[:N]: the target's own quantised (N-layer) copy as its draft (minispec only).",
        "adaptive-k: the same draft under LLM(adaptive_k=True): one k in [0, k] per step from the requests' running "
        "acceptance, the draft / verify costs measured at the batch size and the engine's own step overhead (0 = "
        "speculation off where it does not pay; spec_decode/adaptive.py).",
        "The bench seeds every request: at T > 0 each row then generates the target-only row's tokens, and drafts are "
        "verified by coupling (SamplingParams.coupled), whose acceptance is below the rejection sampler's.",
    ]
    return "\n".join(lines)


# ---- CLI ------------------------------------------------------------------------------------


def _csv(kind):
    def parse(text: str):
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s, got {text!r}") from None

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minispec.bench",
        description="Benchmark minispec against transformers (generate, assisted generation, prompt lookup) "
        "on the same prompts and models, systems alternated per round.",
    )
    p.add_argument("--config", default=None, help="TOML file (see configs/bench-*.toml); flags override it")
    p.add_argument("--quick", action="store_true", help="smoke test: 8 tokens, 2 prompts, batch 1, one round")
    p.add_argument("--target", default=None, help=f"target model spec (default {DEFAULT_TARGET})")
    p.add_argument("--draft", action="append", default=None,
                   help="a draft: model spec (SPEC@int8 / SPEC@int4: quantised at load), 'ngram' or a self-draft such as "
                   "self-int4 (repeatable; replaces the config's drafts; 'none' for none)")
    p.add_argument("--quantization", action="append", default=None, dest="quantizations",
                   help="add target-only rows of the target quantised at load: int8 or int4 (repeatable)")
    p.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, default=None)
    p.add_argument("--batch-sizes", type=_csv(int), default=None, help="e.g. 1,4,16")
    p.add_argument("--temperatures", type=_csv(float), default=None, help="e.g. 0,0.8")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the target's chat template (default: on)")
    p.add_argument("--stop-at-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="end each answer at the target's EOS (default: off, every system makes --max-tokens)")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="minispec's prefix caching, emptied before each run (default: on)")
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="also run each draft with adaptive k (default: on)")
    p.add_argument("--cost-reps", type=int, default=None, help="timed forwards per cost-ratio measurement")
    p.add_argument("--bandwidth-mib", type=int, default=None, help="tensor size of the bandwidth copy")
    p.add_argument("--llama-bench", default=None, metavar="PATH",
                   help="a llama-bench binary: add llama.cpp's decode tok/s on the target GGUF as a peer row")
    p.add_argument("--out", default=None, metavar="FILE", help="write the result as JSON")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return p


def config_from_args(args) -> BenchConfig:
    """Defaults < --config file < --quick < explicit flags."""
    overrides = dict(QUICK) if args.quick else {}
    if args.draft is not None:
        overrides["drafts"] = [d for d in args.draft if d.lower() != "none"]
    for name in ("target", "quantizations", "k", "batch_sizes", "temperatures", "max_tokens", "num_prompts", "rounds", "seed",
                 "dtype", "device", "threads", "chat", "stop_at_eos", "prefix_caching", "cost_reps", "bandwidth_mib",
                 "adaptive", "llama_bench"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    return load_config(args.config, overrides)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
        check_config(cfg)
    except (OSError, ValueError, tomllib.TOMLDecodeError) as e:
        parser.error(str(e))
    result = run_bench(cfg, progress=not args.no_progress)
    print(format_table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
