"""CLI: python -m minispec.distill --target T --out DIR [--config TOML] [--steps N] [--time-budget MIN]
[--synth-prompts N] [--resume]"""
from __future__ import annotations

import argparse
import sys
import tomllib


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minispec.distill",
        description="Distil a small draft model (the target's tokenizer and vocabulary) for speculative decoding.",
    )
    p.add_argument("--target", default=None, help="target: alias, HF dir, .gguf file or hub id "
                   "(default: the config's, smollm2-135m-instruct)")
    p.add_argument("--out", required=True, help="output directory: the HF checkpoint, data.pt, ckpt/, README.md")
    p.add_argument("--config", default=None, help="TOML recipe (configs/distill-*.toml); flags override it")
    p.add_argument("--steps", type=int, default=None, help="total training steps (counting resumed ones)")
    p.add_argument("--time-budget", type=float, default=None, metavar="MIN",
                   help="minutes of training in this invocation (0 = no limit)")
    p.add_argument("--synth-prompts", type=int, default=None, metavar="N",
                   help="synthetic train prompts (the config's synth_prompts); with --resume, a larger N "
                   "generates the new responses and trains on all of them")
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt/state.pt")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: the config's, auto)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from minispec.models.errors import ModelLoadError

    from .config import load_config
    from .train import run_distill

    try:
        cfg = load_config(args.config, target=args.target, steps=args.steps, time_budget_min=args.time_budget,
                          synth_prompts=args.synth_prompts, device=args.device, seed=args.seed)
    except (OSError, ValueError, TypeError, tomllib.TOMLDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        result = run_distill(cfg, args.out, resume=args.resume, progress=not args.no_progress)
    except (ModelLoadError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    f = result["final"]
    msg = f"wrote {args.out} at step {f['step']}"
    if "agreement_tf" in f:
        msg += f"; teacher-forced agreement {f['agreement_tf']:.3f}"
    if "first_position_rate_engine" in f:
        msg += (f"; engine first-position rate {f['first_position_rate_engine']:.3f}, mean accepted length "
                f"{f['mean_accepted_length_engine']:.2f}")
    print(msg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
