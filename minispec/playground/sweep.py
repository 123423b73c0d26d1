"""Run a playground sweep: build each engine once, time every configuration, collect one row each."""
from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from minispec.distributed import init_distributed
from minispec.engine.observer import Observer, StepRecord
from minispec.llm import LLM, has_chat_template
from minispec.models.loader import LoadedModel, load_model
from minispec.models.quantize import is_self_draft, self_draft
from minispec.playground.config import PlaygroundConfig
from minispec.sampling_params import SamplingParams
from minispec.spec_decode.adaptive import AdaptiveK, FixedK
from minispec.spec_decode.costs import measure_costs
from minispec.tools.metrics import aggregate, expected_tokens, predicted_speedup
from minispec.tools.prompts import encode_prompts, load_prompt_set
from minispec.tools.tiny import tiny_model_dir
from minispec.utils import parse_dtype

BETA_BINS = 20  # histogram bins over [0, 1]


# ---- models ---------------------------------------------------------------------------------
class ModelCache:
    """Each model spec loaded once for the whole sweep and handed to every LLM built on it ("tiny:..." specs
    become checkpoint directories under models_dir). A loaded model holds no per-run state: the KV caches
    live in each engine's runners."""

    def __init__(self, models_dir: Path, dtype: str):
        self.models_dir = Path(models_dir)
        self.dtype = parse_dtype(dtype)
        self.device = init_distributed().device
        self.loaded: dict[str, LoadedModel] = {}

    def load(self, spec: str) -> LoadedModel | str:
        """The loaded model of a spec ("ngram" stays a name)."""
        if spec == "ngram":
            return spec
        if spec.startswith("tiny:"):
            spec = tiny_model_dir(spec, self.models_dir)
        if spec not in self.loaded:
            self.loaded[spec] = load_model(spec, dtype=self.dtype, device=self.device)
        return self.loaded[spec]


# ---- environment ----------------------------------------------------------------------------
def env_info() -> dict:
    """What the numbers depend on: versions, CPU, threads, commit."""
    import transformers

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            cpu = names[0]
    commit = ""
    with contextlib.suppress(Exception):
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                                cwd=Path(__file__).resolve().parent).stdout.strip()
    return {
        "time": datetime.datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "numpy_version": np.__version__,
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "minispec_commit": commit,
        "argv": " ".join(sys.argv),
    }


# ---- one configuration ----------------------------------------------------------------------
class _Recorder(Observer):
    """The sweep's engine observer: while recording, counts the k given at each draft opportunity and keeps
    beta (sum_x min(p, q)) of every verified draft when record_beta."""

    def __init__(self, k_max: int):
        self.recording = False
        self.record_beta = False
        self.counts = np.zeros(k_max + 1, dtype=np.int64)  # [k_max + 1]
        self.betas: list[float] = []

    def start(self, record_beta: bool) -> None:
        self.recording, self.record_beta = True, record_beta
        self.counts[:] = 0
        self.betas = []

    def stop(self) -> None:
        self.recording = self.record_beta = False

    def on_step(self, step: StepRecord) -> None:
        if self.recording:
            np.add.at(self.counts, step.ks, 1)

    def on_verify(self, reqs, betas: list[list[float]]) -> None:
        self.betas += [b for bs in betas for b in bs]


class SweepLLM:
    """An LLM on the sweep's loaded models (draft None: target only) with its _Recorder; each run sets its own
    k policy (run_one)."""

    def __init__(self, target: LoadedModel, draft, k: int, b: int, **common):
        self.k = k
        self.drafts = draft is not None
        self.recorder = _Recorder(k)
        self.llm = LLM(target, draft, num_speculative_tokens=max(k, 1), max_num_seqs=b,
                       k_policy=FixedK(k) if self.drafts else None, observer=self.recorder, **common)


def encode_for(llm: LLM, prompts: list[str], chat: bool, max_tokens: int) -> tuple[list[list[int]], int]:
    """Token ids per prompt, cut from the left to leave room for max_tokens; and how many were cut. A target
    without a tokenizer (a tiny random model) gets each prompt's UTF-8 bytes modulo its vocabulary."""
    room = llm.engine.config.max_model_len - max_tokens - 1
    return encode_prompts(llm.tokenizer, prompts, chat, room, llm.target.name, llm.target.vocab_size)


def run_one(run: SweepLLM, prompt_ids: list[list[int]], params: list[SamplingParams], record_beta: bool,
            policy=None) -> dict:
    """Generate every prompt in one call (policy: this run's k policy, None for fixed k); return timing, the
    summed speculation counters, the k counts and the betas."""
    if run.drafts:
        run.llm.engine.k_policy = policy if policy is not None else FixedK(run.k)
    run.recorder.start(record_beta)
    t0 = time.perf_counter()
    outs = run.llm.generate(prompt_ids, params)
    elapsed = time.perf_counter() - t0
    run.recorder.stop()
    return {**aggregate(outs), "elapsed_s": elapsed, "betas": np.array(run.recorder.betas, dtype=np.float64),
            "k_counts": run.recorder.counts.tolist() if run.drafts else []}


def make_row(res: dict, k: int, costs: dict, draft_name: str | None) -> dict:
    """Derived quantities of one run: the estimators of tools/metrics.py, per-position rates, beta stats, predicted
    speedup. alpha (the i.i.d. MLE) assumes a fixed k: the adaptive rows drop it."""
    nd, tau, alpha = res["num_spec_verifications"], res["mean_accepted_length"], res["alpha"]
    betas = res["betas"]
    opportunities = int(np.sum(res["k_counts"][1:])) if res["k_counts"] else 0
    row = {
        "num_generated": res["num_tokens"],
        "elapsed_s": res["elapsed_s"],
        "tokens_per_s": res["num_tokens"] / res["elapsed_s"] if res["elapsed_s"] > 0 else 0.0,
        "num_spec_verifications": nd,
        "num_draft_tokens": res["num_draft_tokens"],
        "num_accepted_tokens": res["num_accepted_tokens"],
        "num_emitted_tokens": res["num_emitted_tokens"],
        "num_stale_drafts": res["num_stale_drafts"],
        "alpha": alpha,
        "acceptance_rate": res["acceptance_rate"],
        "first_position_rate": res["first_position_rate"],
        "tau": tau,
        "accept_rate_by_position": [a / nd if nd else 0.0 for a in res["accepted_per_position"]],
        # The policy is asked after every verification but a request's last: add one per request. Target
        # only, every verification emits one token.
        "num_verifications": int(np.sum(res["k_counts"])) + res["num_requests"] if res["k_counts"]
        else res["num_tokens"],
        "draft_coverage": nd / opportunities if opportunities else None,  # opportunities that gave >= 1 draft
        "mean_k": float(np.dot(res["k_counts"], np.arange(len(res["k_counts"]))) / max(1, sum(res["k_counts"])))
        if res["k_counts"] else 0.0,
        "k_counts": res["k_counts"],
        "beta_mean": float(betas.mean()) if betas.size else None,
        "beta_min": float(betas.min()) if betas.size else None,
        "beta_max": float(betas.max()) if betas.size else None,
        "beta_count": int(betas.size),
        "beta_hist": np.histogram(np.clip(betas, 0.0, 1.0), bins=BETA_BINS, range=(0.0, 1.0))[0].tolist(),
        "target_step_ms": costs["target_step_ms"],
    }
    row["tokens_per_verification"] = res["num_tokens"] / max(1, row["num_verifications"])
    if draft_name is None:  # target only
        row.update(alpha=None, acceptance_rate=None, first_position_rate=None)
        return row
    c = costs["c"][draft_name]
    v = costs["verify_ratio_fit"][k]  # the fitted line: single measurements are noisy
    row.update(c=c, draft_step_ms=costs["draft_step_ms"][draft_name], verify_ratio=costs["verify_ratio"][k],
               verify_ratio_fit=v, tau_theory=expected_tokens(alpha, k))
    row["predicted_speedup"] = predicted_speedup(alpha, k, c, v)
    row["predicted_speedup_from_tau"] = tau / (k * c + v)
    return row


# ---- the sweep ------------------------------------------------------------------------------
def _draft_label(draft: str, target: str) -> str:
    if draft in ("ngram", "target") or draft == target:
        return "ngram" if draft == "ngram" else "target (self)"
    return os.path.basename(os.path.normpath(draft)) or draft


def run_sweep(cfg: PlaygroundConfig, out_dir: str | Path, progress: bool = True) -> dict:
    """Run every configuration of cfg (see minispec.playground.config); returns {env, settings, costs, rows}.

    Per batch size: cost ratios, target-only runs, every draft x k x policy x sampling run, then the
    target-only runs again; speedups divide by the mean of the two target-only runs (their ratio is
    kept as baseline_drift, a measure of how much the machine's speed moved during the sweep).
    """
    from tqdm import tqdm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    cache = ModelCache(out_dir / "models", cfg.dtype)
    prompt_sets = {ps: load_prompt_set(ps, cfg.num_prompts) for ps in cfg.prompt_set}
    sweep = _Sweep(cfg, cache, {ps: prompts for ps, (prompts, _) in prompt_sets.items()})
    ks, fixed, adaptive = sweep.ks, "fixed" in cfg.policy, "adaptive" in cfg.policy
    runs_per_b = len(sweep.sampling) * (2 + len(sweep.drafts) * ((len(ks) if fixed else 0) + adaptive))
    bar = tqdm(total=runs_per_b * len(cfg.batch_size), desc="sweep", unit="run", disable=not progress)
    rows, all_costs = [], {}
    for b in cfg.batch_size:
        all_costs[b], batch_rows = sweep.run_batch_size(b, bar)
        rows += batch_rows
    bar.close()
    env = env_info()
    for i, row in enumerate(rows):
        row["config_id"] = i
        row.update(torch_version=env["torch_version"], cpu=env["cpu"], threads=env["threads"])
    return {"env": env, "settings": asdict(cfg), "prompt_sets": {ps: desc for ps, (_, desc) in prompt_sets.items()},
            "costs": {str(b): c for b, c in all_costs.items()}, "rows": rows}


class _Sweep:
    """The grid of one sweep and the runs of one batch size."""

    def __init__(self, cfg: PlaygroundConfig, cache: ModelCache, prompts: dict[str, list[str]]):
        self.cfg = cfg
        self.cache = cache
        self.prompts = prompts
        self.target = cache.load(cfg.target)
        # draft name (as configured) -> loaded model or "ngram"; "target" and the target's own spec draft for
        # themselves; a self-draft ("self-int4") derived from the loaded target
        self.drafts = {d: self.target if d in ("target", cfg.target) else
                       self_draft(self.target, d) if is_self_draft(d) else cache.load(d) for d in cfg.draft}
        self.ks = sorted(set(cfg.k))
        self.sampling = list(itertools.product(cfg.prompt_set, cfg.temperature, cfg.top_p))
        self.common = dict(dtype=cfg.dtype, seed=cfg.seed, ngram_n=tuple(cfg.ngram_n))

    def params(self, t: float, top_p: float, n: int) -> list[SamplingParams]:
        cfg = self.cfg
        # Unseeded: the rejection sampler verifies (beta is its acceptance); the LLM's seed fixes the requests' seeds.
        return [SamplingParams(temperature=t, top_p=top_p, max_tokens=cfg.max_tokens, ignore_eos=cfg.ignore_eos)
                for _ in range(n)]

    def warm(self, llm: LLM, encoded: dict) -> None:
        """One short untimed generate: first-call allocations stay out of the timed runs."""
        if self.cfg.warmup:
            first = next(iter(encoded.values()))[0][:1]
            llm.generate(first, SamplingParams(temperature=0, max_tokens=min(8, self.cfg.max_tokens), ignore_eos=True))

    def run_batch_size(self, b: int, bar) -> tuple[dict, list[dict]]:
        """Cost ratios and every row of batch size b."""
        cfg, k_max = self.cfg, max(self.ks)
        fixed, adaptive = "fixed" in cfg.policy, "adaptive" in cfg.policy
        bar.set_postfix_str(f"bs={b} target-only")
        base = SweepLLM(self.target, None, 0, b, **self.common)
        base_llm = base.llm
        chat = cfg.chat and has_chat_template(base_llm.tokenizer)
        encoded = {ps: encode_for(base_llm, p, chat, cfg.max_tokens) for ps, p in self.prompts.items()}
        bar.set_postfix_str(f"bs={b} cost ratios")
        draft_models = {name: d if d == "ngram" else d.model for name, d in self.drafts.items()}
        costs = measure_costs(base_llm.target.model, draft_models, k_max, b, cfg.cost_context, cfg.cost_repeats,
                              base_llm.target.vocab_size, self.cache.dtype, base_llm.device, tuple(cfg.ngram_n),
                              cfg.seed)

        def settings(draft, policy, k, ps, t, top_p):
            return {"target": cfg.target, "draft": draft, "policy": policy, "k": k, "temperature": t,
                    "top_p": top_p, "prompt_set": ps, "batch_size": b, "num_prompts": len(encoded[ps][0]),
                    "max_tokens": cfg.max_tokens, "chat": chat, "dtype": cfg.dtype, "seed": cfg.seed,
                    "prompts_truncated": encoded[ps][1]}

        def baseline_runs() -> dict:
            out = {}
            for ps, t, top_p in self.sampling:
                ids = encoded[ps][0]
                out[(ps, t, top_p)] = run_one(base, ids, self.params(t, top_p, len(ids)), False)
                bar.update(1)
            return out

        self.warm(base_llm, encoded)
        first = baseline_runs()
        rows = []
        for name, draft in self.drafts.items():
            label = _draft_label(name, cfg.target)
            for k in self.ks if fixed else [k_max]:
                bar.set_postfix_str(f"bs={b} draft={label} k={k}")
                run = SweepLLM(self.target, draft, k, b, **self.common)
                self.warm(run.llm, encoded)
                policies = (["fixed"] if fixed else []) + (["adaptive"] if adaptive and k == k_max else [])
                for policy, (ps, t, top_p) in itertools.product(policies, self.sampling):
                    ids = encoded[ps][0]
                    pol = None
                    if policy == "adaptive":
                        verify_costs = [1.0] + [costs["verify_ratio_fit"][j] for j in range(1, k + 1)]
                        pol = AdaptiveK(k, draft_cost=costs["c"][name], verify_costs=verify_costs,
                                        **cfg.adaptive)
                    res = run_one(run, ids, self.params(t, top_p, len(ids)), cfg.record_beta, pol)
                    row = {**settings(name, policy, k, ps, t, top_p), "draft_label": label, **make_row(res, k, costs, name)}
                    if policy == "adaptive":  # the fixed-k model does not apply; keep measured numbers only
                        for key in ("alpha", "tau_theory", "predicted_speedup", "predicted_speedup_from_tau"):
                            row[key] = None
                    rows.append(row)
                    bar.update(1)
                del run
        bar.set_postfix_str(f"bs={b} target-only again")
        last = baseline_runs()
        del base, base_llm
        base_rows, base_tps = [], {}
        for key, res in first.items():
            row = {**settings("none", "none", 0, *key), "draft_label": "none", **make_row(res, 0, costs, None)}
            tps_first = row["tokens_per_s"]
            tps_last = last[key]["num_tokens"] / last[key]["elapsed_s"]
            row.update(elapsed_s=(res["elapsed_s"] + last[key]["elapsed_s"]) / 2, tokens_per_s=(tps_first + tps_last) / 2,
                       baseline_tokens_per_s_first=tps_first, baseline_tokens_per_s_last=tps_last,
                       baseline_drift=tps_last / tps_first, speedup=1.0)
            row["baseline_tokens_per_s"] = base_tps[key] = row["tokens_per_s"]
            base_rows.append(row)
        for row in rows:
            row["baseline_tokens_per_s"] = base_tps[(row["prompt_set"], row["temperature"], row["top_p"])]
            row["speedup"] = row["tokens_per_s"] / row["baseline_tokens_per_s"]
        return costs, base_rows + rows
