"""Write a sweep's results: results.json, results.csv, PNG plots (matplotlib, Agg) and summary.md."""
from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from minispec.tools.metrics import expected_tokens

PLOTS = {
    "acceptance_by_position": "acceptance_by_position.png",
    "tau_vs_k": "tau_vs_k.png",
    "speedup_vs_k": "speedup_vs_k.png",
    "beta_hist": "beta_hist.png",
}

CSV_SCALARS = [
    "config_id", "target", "draft", "draft_label", "policy", "k", "temperature", "top_p", "prompt_set", "batch_size",
    "num_prompts", "max_tokens", "chat", "dtype", "seed", "prompts_truncated",
    "num_generated", "elapsed_s", "tokens_per_s", "baseline_tokens_per_s", "speedup", "baseline_drift",
    "num_verifications", "tokens_per_verification", "num_spec_verifications", "num_draft_tokens", "num_accepted_tokens",
    "num_stale_drafts", "draft_coverage", "mean_k",
    "alpha", "acceptance_rate", "first_position_rate", "tau", "tau_theory", "beta_mean", "beta_min", "beta_max", "beta_count",
    "c", "verify_ratio", "verify_ratio_fit", "target_step_ms", "draft_step_ms", "predicted_speedup", "predicted_speedup_from_tau",
    "torch_version", "cpu", "threads",
]


def write_results(result: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write every output file of a sweep into out_dir; returns name -> path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "csv": out_dir / "results.csv"}
    with open(paths["json"], "w") as f:
        json.dump(result, f, indent=1, default=_jsonable)
    write_csv(result["rows"], paths["csv"])
    paths.update(write_plots(result["rows"], out_dir))
    paths["summary"] = out_dir / "summary.md"
    paths["summary"].write_text(summary_markdown(result))
    return paths


def _jsonable(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def write_csv(rows: list[dict], path: Path) -> None:
    """One row per configuration; per-position rates as accept_pos_1.., histograms as ';'-joined counts."""
    k_max = max((len(r["accept_rate_by_position"]) for r in rows), default=0)
    pos_cols = [f"accept_pos_{j + 1}" for j in range(k_max)]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_SCALARS + pos_cols + ["k_counts", "beta_hist"])
        for r in rows:
            rates = r["accept_rate_by_position"]
            w.writerow([_cell(r.get(c)) for c in CSV_SCALARS]
                       + [_cell(rates[j]) if j < len(rates) else "" for j in range(k_max)]
                       + [";".join(map(str, r["k_counts"])), ";".join(map(str, r["beta_hist"]))])


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


# ---- plots ----------------------------------------------------------------------------------
def _series_label(row: dict, varying: list[str]) -> str:
    """A legend entry: temperature, plus whichever of top_p / prompt set / batch size vary in the sweep."""
    parts = [f"T={row['temperature']:g}"]
    names = {"top_p": "top_p", "prompt_set": "prompts", "batch_size": "bs"}
    parts += [f"{names[k]}={row[k]}" for k in varying]
    return " ".join(parts)


def _groups(rows: list[dict]):
    """Speculative rows as {draft label: {series label: [rows]}} and the dims that vary besides T and k."""
    spec = [r for r in rows if r["draft"] != "none"]
    varying = [k for k in ("top_p", "prompt_set", "batch_size") if len({r[k] for r in spec}) > 1]
    out: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in spec:
        out[r["draft_label"]][_series_label(r, varying)].append(r)
    return out


def _axes(plt, n: int, title: str):
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
    fig.suptitle(title)
    flat = axes.ravel()
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat


def write_plots(rows: list[dict], out_dir: Path) -> dict[str, Path]:
    """The four PNGs of PLOTS (a panel per draft); returns name -> path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    groups = _groups(rows)
    n = max(1, len(groups))
    paths = {name: out_dir / fname for name, fname in PLOTS.items()}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    # Acceptance by position: the largest fixed k of each series (all positions present).
    fig, axes = _axes(plt, n, "acceptance rate by draft position (accepted at j / verifications)")
    for ax, (label, series) in zip(axes, groups.items()):
        for i, (name, rs) in enumerate(series.items()):
            fixed = [r for r in rs if r["policy"] == "fixed"] or rs
            r = max(fixed, key=lambda r: r["k"])
            rates = r["accept_rate_by_position"]
            ax.plot(range(1, len(rates) + 1), rates, "o-", color=colors[i % len(colors)], label=f"{name} k={r['k']}")
        ax.set(title=label, xlabel="draft position j", ylabel="P(first j drafts accepted)", ylim=(-0.02, 1.02))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths["acceptance_by_position"], dpi=110)
    plt.close(fig)

    # tau vs k: measured and (1 - alpha^(k+1)) / (1 - alpha) at each run's measured alpha.
    fig, axes = _axes(plt, n, "mean accepted length tau vs k (solid: measured, dashed: i.i.d. theory)")
    for ax, (label, series) in zip(axes, groups.items()):
        for i, (name, rs) in enumerate(series.items()):
            fixed = sorted((r for r in rs if r["policy"] == "fixed"), key=lambda r: r["k"])
            if not fixed:
                continue
            color = colors[i % len(colors)]
            ks = [r["k"] for r in fixed]
            ax.plot(ks, [r["tau"] for r in fixed], "o-", color=color, label=name)
            ax.plot(ks, [expected_tokens(r["alpha"], r["k"]) for r in fixed], "x--", color=color)
        ax.set(title=label, xlabel="k", ylabel="tau")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths["tau_vs_k"], dpi=110)
    plt.close(fig)

    # Speedup vs k per temperature: measured, predicted, and the adaptive policy at its mean k.
    fig, axes = _axes(plt, n, "speedup over target-only (solid: measured, dashed: predicted, *: adaptive at mean k)")
    for ax, (label, series) in zip(axes, groups.items()):
        for i, (name, rs) in enumerate(series.items()):
            color = colors[i % len(colors)]
            fixed = sorted((r for r in rs if r["policy"] == "fixed"), key=lambda r: r["k"])
            if fixed:
                ks = [r["k"] for r in fixed]
                ax.plot(ks, [r["speedup"] for r in fixed], "o-", color=color, label=name)
                ax.plot(ks, [r["predicted_speedup"] for r in fixed], "x--", color=color)
            for r in rs:
                if r["policy"] == "adaptive":
                    ax.plot([r["mean_k"]], [r["speedup"]], "*", color=color, markersize=13,
                            label=f"{name} adaptive" if not fixed else None)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(title=label, xlabel="k", ylabel="speedup")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths["speedup_vs_k"], dpi=110)
    plt.close(fig)

    # beta histogram: every verified draft's sum_x min(p, q), pooled over k.
    fig, axes = _axes(plt, n, "beta = sum_x min(p, q) per verified draft (pooled over k)")
    for ax, (label, series) in zip(axes, groups.items()):
        for i, (name, rs) in enumerate(series.items()):
            counts = np.sum([r["beta_hist"] for r in rs], axis=0)
            if counts.sum() == 0:
                continue
            edges = np.linspace(0.0, 1.0, len(counts) + 1)
            mean = np.average([r["beta_mean"] for r in rs if r["beta_count"]],
                              weights=[r["beta_count"] for r in rs if r["beta_count"]])
            ax.stairs(counts / counts.sum(), edges, color=colors[i % len(colors)], lw=1.5,
                      label=f"{name} (mean {mean:.3f})")
        ax.set(title=label, xlabel="beta", ylabel="fraction of drafts", xlim=(0, 1))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths["beta_hist"], dpi=110)
    plt.close(fig)
    return paths


# ---- summary.md -----------------------------------------------------------------------------
def _fmt(v, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def summary_markdown(result: dict) -> str:
    """summary.md: settings, environment, cost ratios, the results table and the plots."""
    cfg, env, rows = result["settings"], result["env"], result["rows"]
    lines = [f"# {cfg.get('title', 'playground')}", ""]
    lines += ["## Settings", "", "```", json.dumps(cfg, indent=1, default=str), "```", ""]
    lines += ["Prompt sets: " + "; ".join(f"`{k}`: {v}" for k, v in result["prompt_sets"].items()), ""]
    lines += ["## Environment", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()] + [""]
    lines += ["## Cost ratios (fixed context of "
              f"{cfg['cost_context']} tokens, fastest of {cfg['cost_repeats']} samples)", ""]
    for b, c in result["costs"].items():
        lines.append(f"batch size {b}: target step {c['target_step_ms']:.2f} ms; "
                     + "; ".join(f"draft `{name}` c = {v:.3f} ({c['draft_step_ms'][name]:.2f} ms)"
                                 for name, v in c["c"].items()))
        lines.append("")
        lines.append("| k | " + " | ".join(str(k) for k in c["verify_ratio"]) + " |")
        lines.append("|---|" + "---|" * len(c["verify_ratio"]))
        lines.append("| verify ratio ((k+1)-token / 1-token forward) | "
                     + " | ".join(f"{v:.2f}" for v in c["verify_ratio"].values()) + " |")
        lines.append("| its least-squares line (used by predictions and AdaptiveK) | "
                     + " | ".join(f"{v:.2f}" for v in c["verify_ratio_fit"].values()) + " |")
        lines.append("")
    lines += ["## Results", "",
              "alpha = the maximum-likelihood per-token acceptance of the i.i.d. model (fixed k only); accept = "
              "accepted / drafted tokens (below alpha: drafts after a rejection are never tried); first = "
              "verifications whose first draft was accepted / verifications with drafts; tau = 1 + accepted / "
              "verifications with drafts; tau theory = (1 - alpha^(k+1)) / (1 - alpha); predicted speedup = tau theory / (k c + fitted verify ratio); "
              "speedup = tokens/s over target-only tokens/s with the same prompts and sampling, in this run. "
              "coverage = verifications with >= 1 draft / draft attempts (n-gram finds no match: < 1); mean k = k the "
              "policy asked for per step (0 = speculation off). Timed runs record beta (builds p and q even for "
              "greedy batches).", ""]
    drifts = [r["baseline_drift"] for r in rows if r.get("baseline_drift") is not None]
    if drifts:
        lines += [f"Target-only tokens/s is the mean of a run before and one after the speculative runs; after / before "
                  f"ranged {min(drifts):.2f} to {max(drifts):.2f} (how far the machine's speed moved: read speedups "
                  "with that error bar).", ""]
    head = ["draft", "policy", "k", "T", "top_p", "prompts", "bs", "alpha", "accept", "first", "tau", "tau theory", "beta",
            "coverage", "mean k", "tok/s", "speedup", "predicted"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for r in rows:
        vals = [r["draft_label"], r["policy"], r["k"], _fmt(r["temperature"], 2), _fmt(r["top_p"], 2),
                r["prompt_set"], r["batch_size"], _fmt(r.get("alpha")), _fmt(r.get("acceptance_rate")),
                _fmt(r.get("first_position_rate")), _fmt(r.get("tau")),
                _fmt(r.get("tau_theory")), _fmt(r.get("beta_mean")), _fmt(r.get("draft_coverage"), 2),
                _fmt(r.get("mean_k"), 2), _fmt(r["tokens_per_s"], 2), _fmt(r["speedup"], 2),
                _fmt(r.get("predicted_speedup"), 2)]
        lines.append("| " + " | ".join(str(v) for v in vals) + " |")
    lines.append("")
    lines += ["## Plots", ""]
    for name, fname in PLOTS.items():
        lines += [f"### {name.replace('_', ' ')}", "", f"![{name}]({fname})", ""]
    return "\n".join(lines)
