"""LLM configurations against each other, alternated in one process: a speed ratio that machine noise moves less.

    python scripts/interleaved.py --batch-size 16 --rounds 6                      # LLM() against LLM(draft=None)
    python scripts/interleaved.py --variants "target capture default" --batch-size 4

Each round runs every variant once on the bench's eval prompts (max_tokens new tokens each, the chat template,
greedy unless --temperature) over one loaded target; prints each round's tok/s and each variant's median ratio to
the first.
Variants: default (LLM()), target (draft=None), capture (the default's head attached, k always 0: the cost of
capturing its states), k1 .. k4 (the head at a fixed k; k2@int4 with the head at int4).
"default:prior_weight=8,probe_every=16" is the default with those attributes of its k policy (AdaptiveK) or proposer
set after it is built; "k4:min_confidence=0.3" the head at k = 4 with that proposer attribute.
"target|MINISPEC_LAYERS_OP_BY_OP=1" runs that variant with those environment variables set (the kernels' switches).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch

from minispec.bench import load_prompt_texts
from minispec.llm import DEFAULT_TARGET, LLM
from minispec.models.loader import load_model
from minispec.sampling_params import SamplingParams


def build(name: str, target, b: int) -> LLM:
    """The LLM a variant names, over the loaded target; settings after ':' set attributes of its k policy or
    proposer."""
    name, _, _env = name.partition("|")
    base, _, settings = name.partition(":")
    k, _, quant = base.partition("@")
    if k.startswith("default"):  # default6: num_speculative_tokens = 6; default@int4: the auto head at int4
        llm = LLM(target, max_num_seqs=b, num_speculative_tokens=int(k[7:] or 4), draft_quantization=quant or None)
    elif base == "target":
        llm = LLM(target, draft=None, max_num_seqs=b)
    elif base == "capture":
        llm = LLM(target, draft="smollm2-135m-instruct-eagle3", draft_quantization="int8", max_num_seqs=b,
                  k_policy=lambda reqs: [0] * len(reqs))
    elif k[:1] == "k" and k[1:].isdigit():
        llm = LLM(target, draft="smollm2-135m-instruct-eagle3", draft_quantization=quant or "int8", max_num_seqs=b,
                  num_speculative_tokens=int(k[1:]))
    else:
        raise SystemExit(f"unknown variant {name!r}: default[N], target, capture, kN (k2@int4: the head at int4)")
    for item in filter(None, settings.split(",")):
        key, value = item.split("=")
        owner = next((o for o in (llm.engine.k_policy, llm.engine.proposer) if hasattr(o, key)), None)
        if owner is None:
            raise SystemExit(f"{name}: neither the k policy nor the proposer has an attribute {key!r}")
        setattr(owner, key, None if value == "None" else int(value) if value.isdigit() else float(value))
    return llm


@contextlib.contextmanager
def environment(settings: str):
    """Environment variables "A=1,B=0" set for the block, then restored."""
    pairs = [item.split("=", 1) for item in filter(None, settings.split(","))]
    old = {key: os.environ.get(key) for key, _ in pairs}
    os.environ.update(dict(pairs))
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="target default", help="space-separated; ratios are to the first")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--stop-at-eos", action="store_true", help="end at EOS (default: ignore_eos, equal work)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None, help="seed every request (sampled: coupled verification)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(DEFAULT_TARGET, dtype=torch.float32, device="cpu")
    names = args.variants.split()
    llms = {n: build(n, target, args.batch_size) for n in names}
    for n, llm in llms.items():
        if getattr(llm, "auto_draft", None):
            print(f"{n}: auto_draft {llm.auto_draft}")
    prompts, _ = load_prompt_texts(args.num_prompts)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=not args.stop_at_eos,
                            seed=args.seed)
    for llm in llms.values():  # warm-up
        llm.generate(prompts[:2], params, use_chat_template=True)
    rates: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        line = []
        for n in names if r % 2 == 0 else names[::-1]:
            with environment(n.partition("|")[2]):
                llms[n].reset_prefix_cache()  # each round reuses prefixes among its own prompts only
                t0 = time.perf_counter()
                outs = llms[n].generate(prompts, params, use_chat_template=True)
                dt = time.perf_counter() - t0
            rates[n].append(sum(len(o.token_ids) for o in outs) / dt)
            line.append(f"{n} {rates[n][-1]:.1f}")
        print(f"round {r + 1}: " + ", ".join(line) + " tok/s", flush=True)
    base = names[0]
    for n in names[1:]:
        ratios = [a / b for a, b in zip(rates[n], rates[base])]
        print(f"{n} / {base}: median {statistics.median(ratios):.3f}x (rounds {min(ratios):.3f}-{max(ratios):.3f}),"
              f" batch {args.batch_size}")
    for n, llm in llms.items():
        if (counts := getattr(llm.engine.k_policy, "counts", None)) is not None:
            print(f"{n}: k chosen per request-step (k = 0, 1, ...) {counts.tolist()}")


if __name__ == "__main__":
    main()
