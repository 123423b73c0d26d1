"""CLI: python -m minispec.generate — generate with a target (and draft) from the command line."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

DEFAULT_PROMPT = "Give me three tips for writing clear technical documentation."


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model and speculation flags (shared with python -m minispec.serve)."""
    p.add_argument("--target", default=None, help="target model: alias, HF dir, .gguf file or hub id "
                   "(default: smollm2-135m-instruct)")
    p.add_argument("--draft", default=None, help="draft model (same forms as --target), an EAGLE-1 / EAGLE-3 head "
                   "directory (HEAD+ngram: prompt lookup first), 'ngram' for prompt lookup, a self-draft (self-int8, "
                   "self-int4, self-int4:N, self:N: the target's own quantised and / or N-layer copy), or 'none' for "
                   "target-only (default 'auto': the head llm.py's DRAFT_FOR_TARGET names for the target, where it is "
                   "predicted to pay on this machine, measured at start)")
    p.add_argument("--quantization", default=None,
                   help="weight-only quantisation of a float target at load: int8 (Q8_0) or int4 (Q4_1; embedding "
                        "Q8_0); another model than the float one (a GGUF is already packed: an error)")
    p.add_argument("--draft-quantization", default=None,
                   help="the same for a draft model; int8 / int4 pack an EAGLE head's weights")
    p.add_argument("--ngram-min", type=int, default=1, help="smallest n-gram matched by --draft ngram")
    p.add_argument("--draft-min-confidence", type=float, default=None,
                   help="an EAGLE head drafts while its probability of the drafts stays at least this (lossless; "
                        "0: every request drafts its k; default: 0.1 for the auto head, else 0)")
    p.add_argument("--adaptive-k", action=argparse.BooleanOptionalAction, default=None,
                   help="speculation length per step from running acceptance and measured costs; turns "
                        "speculation off where it does not pay (default: on with the target's chosen proposer, off with --draft)")
    p.add_argument("--ngram-max", type=int, default=3, help="largest n-gram matched by --draft ngram")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=4)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (run under torchrun)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="start each request from the longest prompt prefix a slot holds (default: on)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--draft-dtype", default=None, help="the draft model's dtype (default: --dtype)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minispec.generate",
        description="Generate text with speculative decoding (draft proposes, target verifies).",
    )
    add_model_args(p)
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    p.add_argument("--prompt-file", default=None, help="a file of prompts: one per line, or a JSON list of strings")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap prompts in the model's chat template (default: on)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="per-request seed (request i gets seed + i)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stream", action="store_true", help="print text as tokens are accepted")
    p.add_argument("--output-json", default=None, metavar="FILE", help="write one object per prompt")
    return p


def read_prompts(args, parser) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompt_file:
        if not os.path.isfile(args.prompt_file):
            parser.error(f"prompt file not found: {args.prompt_file}")
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            parser.error(f"cannot read prompt file {args.prompt_file}: {e}")
        if args.prompt_file.endswith(".json"):
            try:
                loaded = json.loads(text)
            except ValueError as e:
                parser.error(f"{args.prompt_file}: invalid JSON ({e})")
            if not isinstance(loaded, list) or not all(isinstance(x, str) for x in loaded):
                parser.error(f"{args.prompt_file}: expected a JSON list of strings")
            prompts += loaded
        else:
            prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        prompts = [DEFAULT_PROMPT]
    if any(not p.strip() for p in prompts):
        parser.error("empty prompt")
    return prompts


def check_model_args(args, parser) -> None:
    """parser.error (exit 2, one line) on model sizes that make no sense, before anything loads."""
    for flag, value, low in (("--tp", args.tp, 1), ("--max-num-seqs", args.max_num_seqs, 1),
                             ("--max-num-batched-tokens", args.max_num_batched_tokens, 1),
                             ("--max-model-len", args.max_model_len, 2)):
        if value is not None and value < low:
            parser.error(f"{flag} must be >= {low}, got {value}")


def check_args(args, parser) -> None:
    """parser.error (exit 2, one line) on sizes or paths that make no sense, before anything loads."""
    check_model_args(args, parser)
    if args.output_json:
        folder = os.path.dirname(os.path.abspath(args.output_json))
        if not os.path.isdir(folder):
            parser.error(f"--output-json: folder not found: {folder}")
        if os.path.isdir(args.output_json):
            parser.error(f"--output-json: {args.output_json} is a folder")


def build_llm(args):
    """The LLM the model and speculation flags describe (ValueError, one line, on a bad model or size)."""
    from minispec.llm import DEFAULT_DRAFT, DEFAULT_TARGET, LLM

    return LLM(target=args.target or DEFAULT_TARGET,
               draft=None if args.draft == "none" else args.draft or DEFAULT_DRAFT,
               num_speculative_tokens=args.num_speculative_tokens, tensor_parallel_size=args.tp,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               dtype=args.dtype, draft_dtype=args.draft_dtype, max_model_len=args.max_model_len,
               ngram_n=(args.ngram_min, args.ngram_max), adaptive_k=args.adaptive_k,
               quantization=args.quantization, draft_quantization=args.draft_quantization,
               draft_min_confidence=args.draft_min_confidence, enable_prefix_caching=args.prefix_caching)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args, parser)
    prompts = read_prompts(args, parser)
    from minispec.distributed import CollectiveError

    try:
        return run(args, parser, prompts)
    except CollectiveError as e:  # a rank died or stalled: one line on every surviving rank
        print(f"{parser.prog}: error: {e}", file=sys.stderr, flush=True)
        return 1


def run(args, parser, prompts: list[str]) -> int:
    """Build the LLM, generate (streaming if asked), print and save the results."""
    from minispec.sampling_params import SamplingParams

    try:
        params = [
            SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                           max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                           seed=None if args.seed is None else args.seed + i)
            for i in range(len(prompts))
        ]
    except ValueError as e:
        parser.error(str(e))

    from minispec.tools.metrics import aggregate

    try:
        llm = build_llm(args)
        for p in prompts:  # reject bad prompts before any work starts
            llm.engine.check_fits(len(llm.encode(p, args.chat)))
    except ValueError as e:  # includes ModelLoadError
        parser.error(str(e))

    from minispec.distributed import get_tp_group

    rank0 = get_tp_group().is_first_rank
    t0 = time.perf_counter()
    outputs = [None] * len(prompts)
    tokens = [[] for _ in prompts]
    shown, printed = 0, None  # --stream shows prompts in order; later ones wait for their turn

    def show() -> None:
        nonlocal shown, printed
        while shown < len(prompts):
            if printed is None:
                print(f"=== [{shown}] {prompts[shown]}", flush=True)
                printed = ""
            text = llm.decode(tokens[shown])
            print(text[len(printed):], end="", flush=True)
            printed = text
            if outputs[shown] is None:
                return
            print("\n", flush=True)
            shown, printed = shown + 1, None

    for i, new, done in llm.stream(prompts, params, args.chat):
        tokens[i] += new
        if done is not None:
            outputs[i] = done
        if args.stream and rank0:
            show()
    elapsed = time.perf_counter() - t0
    if rank0:
        if not args.stream:
            for i, o in enumerate(outputs):
                print(f"=== [{i}] {prompts[i]}\n{o.text}\n")
        agg = aggregate(outputs)
        ntok = sum(len(o.token_ids) for o in outputs)
        spec = (f"; acceptance {agg['acceptance_rate']:.3f}, mean accepted length "
                f"{agg['mean_accepted_length']:.2f}, stale drafts {agg['num_stale_drafts']}"
                if llm.num_speculative_tokens else "; target only")
        print(f"[minispec] {len(outputs)} prompt(s), {ntok} tokens in {elapsed:.2f} s "
              f"({ntok / elapsed:.1f} tok/s){spec}")
        if llm.auto_draft:
            print(f"[minispec] draft auto: {llm.auto_draft}")
        cache = llm.engine.draft_logits
        if cache is not None:
            tp = get_tp_group().world_size
            rows = cache.num_rows
            rep = llm.engine.config.max_num_seqs * cache.row_nbytes
            print(f"[minispec] draft-logits cache ({'sharded' if cache.row_mapping is not None else 'replicated'}, "
                  f"tp={tp}): {rows} rows, {cache.nbytes / 2**20:.2f} MiB per rank "
                  f"(replicated: {llm.engine.config.max_num_seqs} rows, {rep / 2**20:.2f} MiB)")
        if args.output_json:
            try:
                with open(args.output_json, "w") as f:
                    json.dump([o.as_dict() for o in outputs], f, indent=1)
            except OSError as e:
                print(f"{parser.prog}: error: cannot write {args.output_json}: {e}", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    from minispec.distributed import exit_process

    exit_process(main())
