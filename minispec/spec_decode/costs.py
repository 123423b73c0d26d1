"""Cost ratios on a fixed context: draft step vs target step (c), and (k + 1)-token vs 1-token target forwards.

Used by the playground's predictions and by AdaptiveK's measured cost model (MeasuredCosts), which
measures them on the engine's own models at every batch-size bucket before serving.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from minispec.distributed import get_tp_group
from minispec.runner.model_runner import ModelRunner
from minispec.spec_decode.adaptive import batch_bucket
from minispec.spec_decode.draft_logits import DraftLogitsCache
from minispec.spec_decode.head import HeadRunner
from minispec.spec_decode.ngram import ngram_drafts


MIN_SAMPLE_S = 0.005  # a timed sample repeats a fast call until it lasts about this long
CATCH_UP_POSITIONS = 64  # positions of one request a head reads in the timed catch-up (MeasuredCosts.catch_up)


class _FixedContext:
    """A model runner whose `num_slots` slots all hold the same `context` random tokens."""

    def __init__(self, model, num_slots: int, context: int, extra: int, vocab_size: int, dtype, device, seed: int):
        self.runner = ModelRunner(model, num_slots, context + extra + 1, dtype=dtype, device=device)
        self.context = context
        rng = np.random.default_rng(seed)
        self.ids = rng.integers(0, vocab_size, size=context).tolist()
        # Prefill slot 0 and copy its K/V into the others: one context forward, whatever the batch.
        self.runner.forward([0], [0], [self.ids], [1])
        for cache in self.runner.kv.k + self.runner.kv.v:  # [num_slots + 1, max_len, heads, head_dim] each
            cache[1:num_slots, :context] = cache[0, :context]

    def step(self, batch_size: int, num_tokens: int) -> None:
        """One forward of num_tokens new tokens in each of the first batch_size slots after the context, with
        logits for all of them. Writes the same positions every call, so the context stays put."""
        q = self.ids[:num_tokens]
        self.runner.forward(list(range(batch_size)), [self.context] * batch_size, [q] * batch_size,
                            [num_tokens] * batch_size)


def _time(fn, n: int = 1) -> float:
    """Seconds per call of n back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def _time_after(fn, n: int, before) -> float:
    """Seconds per call of fn, each call after an untimed call of `before`."""
    total = 0.0
    for _ in range(n):
        before()
        t0 = time.perf_counter()
        fn()
        total += time.perf_counter() - t0
    return total / n


class CostBench:
    """The target and drafts on a fixed context of `context` tokens in up to max_batch_size slots, ready to time
    at any batch size up to that (measure). The context is prefilled once, when it is built.

    drafts: name -> native draft model, a HeadRunner (an EAGLE head: timed on a copy with its own KV cache), or
    "ngram" (prompt lookup: n-gram match + one-hot logits write; a
    k_max-token lookup counts as k_max drafted tokens).
    """

    @torch.inference_mode()
    def __init__(self, target_model, drafts: dict, k_max: int, max_batch_size: int, context: int, vocab_size: int,
                 dtype, device, ngram_n: tuple[int, int] = (1, 3), seed: int = 0):
        self.k_max, self.vocab_size, self.device, self.ngram_n, self.seed = k_max, vocab_size, device, ngram_n, seed
        self.target = _FixedContext(target_model, max_batch_size, context, k_max, vocab_size, dtype, device, seed)
        self.context = context
        self.drafts = {name: model if isinstance(model, str) else
                       model.copy(max_batch_size, context + k_max + 1) if isinstance(model, HeadRunner) else
                       _FixedContext(model, max_batch_size, context, k_max, vocab_size, getattr(model, "dtype", dtype),
                                     device, seed)
                       for name, model in drafts.items()}

    @torch.inference_mode()
    def measure(self, batch_size: int, repeats: int, verify_ks: list[int] | None = None) -> dict:
        """Step times at batch_size (fastest of 1 + `repeats` samples: the warm-up call is one) and the cost ratios
        of the speedup model (each the median of its rounds' ratios):
          target_step_ms       a 1-token target forward of batch_size requests
          verify_ms/_ratio     {k: (k + 1)-token target forward, in ms / over target_step_ms} for k in verify_ks
                               (default 1..k_max)
          verify_ratio_fit     {k: the ratios' least-squares line a + b k (b >= 0, values >= 1)} for k in 1..k_max
          draft_step_ms, c     {name: one draft step in ms / over target_step_ms}, each draft call timed after an
                               untimed 1-token target forward, as in generation (where the target's weights have
                               just streamed through the caches)
        Measurements go round-robin in a shuffled order, so machine noise hits them alike.
        """
        b, k_max, target = batch_size, self.k_max, self.target
        ks = list(range(1, k_max + 1)) if verify_ks is None else sorted(set(verify_ks))
        timers = {"target": lambda: target.step(b, 1)}
        for k in ks:
            timers[f"verify{k}"] = lambda k=k: target.step(b, k + 1)
        per_token = {}  # draft name -> drafted tokens one timed call stands for
        for name, draft in self.drafts.items():
            if draft == "ngram":
                timers[f"draft:{name}"] = _ngram_step(b, k_max, self.vocab_size, target.ids, self.ngram_n, self.device)
                per_token[name] = k_max
            elif isinstance(draft, HeadRunner):
                timers[f"draft:{name}"] = draft.cost_step(b, self.context)
                per_token[name] = 1
            else:
                timers[f"draft:{name}"] = lambda draft=draft: draft.step(b, 1)
                per_token[name] = 1

        def timer(name: str, n: int = 1) -> float:
            if name.startswith("draft:"):  # as in generation: right after a target forward
                return _time_after(timers[name], n, timers["target"])
            return _time(timers[name], n)
        # Warm up (a first sample), and batch calls that take under MIN_SAMPLE_S (tiny models) so timer noise
        # stays small.
        times: dict[str, list[float]] = {name: [timer(name)] for name in timers}
        warm = torch.tensor([t[0] for t in times.values()], dtype=torch.float64)  # [num_timers]
        tp = get_tp_group()
        if tp.world_size > 1:  # the forwards are collective: every rank makes rank 0's number of calls
            warm = tp.broadcast(warm.to(tp.device)).cpu()
        calls = {name: max(1, min(100, int(MIN_SAMPLE_S / max(t, 1e-6)))) for name, t in zip(times, warm.tolist())}
        order = np.random.default_rng(self.seed)
        names = list(timers)
        for _ in range(repeats):
            for i in order.permutation(len(names)):  # a fresh order each round: no timer always goes first
                times[names[i]].append(timer(names[i], calls[names[i]]))
        best = {name: float(np.min(t)) for name, t in times.items()}  # noise only adds: the fastest is the time
        # A ratio is the median over rounds of the two samples' ratio within each round (past the warm-up, given 2+
        # rounds): a slow phase of the host slows both, where the fastest samples of each come from different phases
        # (smollm2 at batch 1, 8 measurements of 10 rounds on a Zen 3: the 2-token ratio 1.31-1.39, of the fastest
        # samples 1.28-1.41; docs/experiments.md).
        rounds = slice(1, None) if repeats >= 2 else slice(None)

        def ratio(name: str) -> float:
            return float(np.median(np.asarray(times[name][rounds]) / np.asarray(times["target"][rounds])))
        t_target = best["target"]
        verify_ratio = {k: ratio(f"verify{k}") for k in ks}
        all_ks = range(1, k_max + 1)
        return {
            "target_step_ms": 1e3 * t_target,
            "verify_ms": {k: 1e3 * best[f"verify{k}"] for k in ks},
            "verify_ratio": verify_ratio,
            "verify_ratio_fit": dict(zip(all_ks, fit_verify_ratios(list(verify_ratio.values()), ks, k_max))),
            "draft_step_ms": {name: 1e3 * best[f"draft:{name}"] / per_token[name] for name in self.drafts},
            "c": {name: ratio(f"draft:{name}") / per_token[name] for name in self.drafts},
        }


def measure_costs(target_model, drafts: dict, k_max: int, batch_size: int, context: int, repeats: int,
                  vocab_size: int, dtype, device, ngram_n: tuple[int, int] = (1, 3), seed: int = 0) -> dict:
    """CostBench(...).measure(batch_size, repeats): step times and cost ratios at one batch size."""
    return CostBench(target_model, drafts, k_max, batch_size, context, vocab_size, dtype, device, ngram_n,
                     seed).measure(batch_size, repeats)


def fit_verify_ratios(ratios: list[float], ks: list[int] | None = None, k_max: int | None = None) -> list[float]:
    """A line a + b k through the verify ratios measured at ks (default 1..len(ratios)), evaluated at
    k = 1..k_max (default max(ks)): non-decreasing (b >= 0), at least 1.

    Scoring more tokens never costs less; a measured dip is noise, and a policy that trusted it
    would favour that k.
    """
    v = np.asarray(ratios, dtype=np.float64)
    ks = np.arange(1, len(v) + 1, dtype=np.float64) if ks is None else np.asarray(ks, dtype=np.float64)
    out = np.arange(1, (int(ks.max()) if k_max is None else k_max) + 1, dtype=np.float64)
    slope = 0.0
    if len(v) > 1:
        slope = max(0.0, float(np.polyfit(ks, v, 1)[0]))
    fit = v.mean() + slope * (out - ks.mean())
    return np.maximum(fit, 1.0).tolist()


def _ngram_step(batch_size: int, k: int, vocab_size: int, history: list[int], ngram_n, device):
    """A prompt-lookup step over batch_size copies of history: match, then write one-hot draft logits."""
    histories = [history] * batch_size
    cache = DraftLogitsCache(batch_size, k, vocab_size, dtype=torch.float32, fill=0.0, device=device)
    slots = np.arange(batch_size, dtype=np.int32)
    cache.assign(torch.from_numpy(slots).to(device), slots)
    rows = cache.rows_of(torch.from_numpy(slots).long().to(device)).long()  # [batch_size]

    def step():
        drafts = ngram_drafts(histories, k, *ngram_n)  # [batch_size, k]
        cache.write_one_hot(rows, torch.from_numpy(drafts).to(device))

    return step


class MeasuredCosts:
    """AdaptiveK's cost model: (c, [v_0 = 1, v_1 .. v_k_max]) at a batch size, measured by measure_costs on
    the engine's own target and draft for every power-of-two batch bucket up to max_batch_size, all of them
    when it is built (before serving: a step never measures).

    draft: the native draft model, or "ngram". Under tensor parallelism every rank measures (the forwards
    are collective) and all use rank 0's numbers, so their choices agree. Runners of its own keep the
    engine's KV cache untouched. measure_s: the seconds measuring took (repeats: samples per timer beyond the
    warm-up call; LLM uses 1). catch_up(b): an EAGLE head's reading of one position it skipped, in 1-token target
    steps at batch b (CATCH_UP_POSITIONS of one request in one forward, after a target step); 0 for other drafts,
    whose catch-up AdaptiveK counts as free.
    """

    def __init__(self, target_model, draft, k_max: int, max_batch_size: int, vocab_size: int, dtype, device,
                 context: int = 128, repeats: int = 3):
        self.k_max, self.max_batch_size = k_max, max_batch_size
        self.table: dict[int, tuple[float, list[float]]] = {}  # bucket -> (c, verify costs)
        self.catch_up_table: dict[int, float] = {}  # bucket -> one caught-up position's cost in target steps
        t0 = time.perf_counter()
        bench = CostBench(target_model, {"draft": draft}, k_max, max_batch_size, context, vocab_size, dtype, device)
        position_s = 0.0  # seconds a head takes to read one position it skipped
        runner = bench.drafts["draft"]
        if isinstance(runner, HeadRunner):
            step = runner.cost_catch_up(CATCH_UP_POSITIONS)
            position_s = min(_time_after(step, 1, lambda: bench.target.step(1, 1))
                             for _ in range(1 + repeats)) / CATCH_UP_POSITIONS
        for b in sorted({self.bucket(n) for n in range(1, max_batch_size + 1)}):
            costs = bench.measure(b, repeats, verify_ks=[1, k_max])  # the fit is a line: its two ends
            values = torch.tensor([costs["c"]["draft"]] + [costs["verify_ratio_fit"][k] for k in range(1, k_max + 1)]
                                  + [position_s * 1e3 / costs["target_step_ms"]], dtype=torch.float64)
            tp = get_tp_group()
            if tp.world_size > 1:  # every rank must choose the same k: rank 0's timings
                values = tp.broadcast(values.to(tp.device)).cpu()
            self.table[b] = (float(values[0]), [1.0] + values[1:-1].tolist())
            self.catch_up_table[b] = float(values[-1])
        self.measure_s = time.perf_counter() - t0

    def bucket(self, batch_size: int) -> int:
        """The power of two at or above batch_size, capped at max_batch_size."""
        return min(self.max_batch_size, batch_bucket(batch_size))

    def __call__(self, batch_size: int) -> tuple[float, list[float]]:
        return self.table[self.bucket(batch_size)]

    def catch_up(self, batch_size: int) -> float:
        """One position a head skipped, read in a probe's catch-up, in 1-token target steps at this batch size."""
        return self.catch_up_table[self.bucket(batch_size)]
