"""The packed linear op over a model's matrices back to back (one decode step's worth of weight products), by
activation rows: this checkout's kernels on the weights as loaded (Q4 rows split where the kernels read them
so) and on the file's layout, and optionally another checkout's kernels (on the loaded layout where it reads split
rows, else on the file's) side by side.

    .venv/bin/python scripts/packed_kernels.py [--rows 1,2,5,16] [--reps 5] [--threads 2]
        [--target smollm2-135m-instruct] [--baseline OTHER_CHECKOUT/minispec/kernels]

With --resident (best at --threads 1) it times one small matrix at a time instead, so that the weights stay in L2
and the figure is the kernel's own cost per block.

For each row count M it times every packed weight of the model (the decoder layers' q|k|v, o, gate|up and
down, then the tied LM head) multiplied by an [M, K] float32 input, alternating the builds each repetition,
and prints the median ms, GMAC/s and the weight bytes streamed per second; and the largest error of each
build against the float64 layer over the dequantised weights, relative to sum |w x| (float32 rounding is
about 1e-7 here).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from minispec.kernels import build_cpp
from minispec.kernels.cpu import CFLAGS, SOURCES, ops
from minispec.kernels.ggml import SPLIT_OF
from minispec.layers.quant import PackedWeight, type_name
from minispec.models.loader import load_model


def packed_weights(model) -> list[PackedWeight]:
    """The model's packed matrices in the order a forward multiplies them."""
    ws = [m.weight for layer in model.layers
          for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
    ws.append((model.embed_tokens if model.lm_head is None else model.lm_head).weight)
    return [w for w in ws if isinstance(w, PackedWeight)]


def max_rel_err(ext, xs, ws) -> float:
    """Largest |y - y64| / (|x| @ |w|^T) over the first layer's matrices and the LM head."""
    err = 0.0
    for x, w in list(zip(xs, ws))[:4] + [(xs[-1], ws[-1])]:
        wd = w.dequantize().double()
        y = ext.packed_linear(x, w.data, w.qtype, w.in_features).double()
        err = max(err, float(((y - x.double() @ wd.T).abs() / (x.double().abs() @ wd.abs().T).clamp_min(1e-30)).max()))
    return err


def resident(builds, rows: str, reps: int, calls: int = 300) -> None:
    """--resident: per build, the median over reps of `calls` back-to-back products with one matrix, in ns per block
    and row of the matrix, for the first layer's q|k|v and down (indices 0 and 3 of packed_weights), then the LM head
    (the last; too big for the caches: streamed, calls / 10 of them)."""
    g = torch.Generator().manual_seed(0)
    for index, name in ((0, "q|k|v"), (3, "down"), (-1, "LM head")):
        n_calls = calls if index >= 0 else max(1, calls // 10)
        for M in (int(r) for r in rows.split(",")):
            w0 = builds[0][2][index]
            x = torch.randn(M, w0.in_features, generator=g)
            blocks = w0.shape[0] * ((w0.in_features + 31) // 32)
            times = {b: [] for b, _, _ in builds}
            for _ in range(reps):
                for b, ext, wl in builds:
                    w = wl[index]
                    t = time.perf_counter()
                    for _ in range(n_calls):
                        ext.packed_linear(x, w.data, w.qtype, w.in_features)
                    times[b].append((time.perf_counter() - t) / n_calls / blocks * 1e9)
            med = {b: statistics.median(v) for b, v in times.items()}
            print(f"{name} {tuple(w0.shape)} M={M}: " + "  ".join(f"{b} {t:.3f} ns/block" for b, t in med.items())
                  + "".join(f"  loaded / {b} {med['loaded'] / med[b]:.3f}x" for b in list(med)[1:]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--rows", default="1,2,3,5,8,16", help="activation rows M, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--baseline", type=Path, help="another checkout's minispec/kernels directory, built beside this one")
    ap.add_argument("--resident", action="store_true",
                    help="instead: the first layer's q|k|v and down matrices alone, 300 calls each (held in L2 at one "
                         "thread), ns per block: the kernels' own cost without the memory's; then the LM head, streamed")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    this = ops()
    if this is None:
        raise SystemExit("the C++ kernels could not be built here")
    if args.baseline:
        srcs = [args.baseline / s.name for s in SOURCES]
        if missing := [str(s) for s in srcs if not s.is_file()]:
            raise SystemExit(f"--baseline: missing {', '.join(missing)}")
        baseline = build_cpp("cpu_baseline", srcs, CFLAGS, "the baseline's kernels")
    model = load_model(args.target, dtype=torch.float32, device="cpu", packed=True).model
    loaded = packed_weights(model)
    if not loaded:
        raise SystemExit(f"{args.target} has no packed weights (load a .gguf)")
    files = [w.joined() for w in loaded]
    splits = [f.split() if f.qtype in SPLIT_OF else f for f in files]
    # (name, build, weights): the loaded layout, the split one where the loaded is tiled, the file's, and the
    # baseline's build on split rows where it reads them, else on the file's
    builds = [("loaded", this, loaded)]
    if any(w.tiled for w in loaded):
        builds.append(("split", this, splits))
    if any(w.qtype != f.qtype for w, f in zip(loaded, files)):
        builds.append(("file", this, files))
    if args.baseline:
        builds.append(("baseline", baseline, splits if getattr(baseline, "PACKED_SPLIT", False) else files))
    if args.resident:
        return resident(builds, args.rows, args.reps)
    ws = loaded
    nbytes = sum(w.data.numel() for w in ws)
    kinds = sorted({type_name(w.qtype) for w in loaded})
    print(f"{args.target}: {len(ws)} packed matrices ({', '.join(kinds)}), {nbytes / 1e6:.1f} MB; "
          f"ISA {this.PACKED_ISA}, {args.threads} threads")
    g = torch.Generator().manual_seed(0)
    for M in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(M, w.in_features, generator=g) for w in ws]
        times = {name: [] for name, _, _ in builds}
        for _ in range(args.reps):
            for name, ext, wl in builds:
                t = time.perf_counter()
                for x, w in zip(xs, wl):
                    ext.packed_linear(x, w.data, w.qtype, w.in_features)
                times[name].append(time.perf_counter() - t)
        macs = M * sum(w.shape[0] * w.shape[1] for w in ws)
        cols = []
        for name, ext, wl in builds:
            s = statistics.median(times[name])
            cols.append(f"{name} {s * 1e3:7.2f} ms {macs / s / 1e9:5.1f} GMAC/s {nbytes / s / 1e9:5.1f} GB/s "
                        f"err {max_rel_err(ext, xs, wl):.1e}")
        for name, _, _ in builds[1:]:
            cols.append(f"loaded / {name} {statistics.median(times['loaded']) / statistics.median(times[name]):.2f}x")
        print(f"M={M:3d}  " + "  |  ".join(cols), flush=True)


if __name__ == "__main__":
    main()
