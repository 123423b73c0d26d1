"""Greedy tokens of minispec's packed target against transformers on the dequantised GGUF (float32), per
eval prompt; at any divergence, transformers' logit gap between its token and minispec's.

    .venv/bin/python scripts/packed_greedy.py [--target smollm2-135m-instruct] [--num-prompts 16] [--max-tokens 64]

minispec runs the prompts as one batch (the packed kernel's multi-row path); transformers one at a time.
"""
from __future__ import annotations

import argparse

import torch

from minispec import LLM, SamplingParams
from minispec.bench import encode_prompts, load_prompt_texts
from minispec.models.loader import load_hf_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    llm = LLM(target=args.target, draft=None, max_num_seqs=args.num_prompts)
    hf, tokenizer = load_hf_model(args.target)
    texts, source = load_prompt_texts(args.num_prompts)
    prompts, _ = encode_prompts(tokenizer, texts, True, 1024)  # (ids, tokens cut)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
    equal, gaps = 0, []
    for i, (ids, out) in enumerate(zip(prompts, outs)):
        x = torch.tensor([ids])
        with torch.inference_mode():
            # eos_token_id=None runs through EOS as ignore_eos does (min_new_tokens would forbid EOS)
            ref = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=args.max_tokens,
                              eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        want = ref.sequences[0, len(ids):].tolist()
        if want == out.token_ids:
            equal += 1
            continue
        t = next(j for j, (a, b) in enumerate(zip(want, out.token_ids)) if a != b)
        logits = ref.logits[t][0].float()
        gap = (logits[want[t]] - logits[out.token_ids[t]]).item()
        gaps.append(gap)
        print(f"prompt {i}: diverges at token {t}: transformers {want[t]} vs minispec {out.token_ids[t]}, "
              f"transformers' logit gap {gap:.2e}")
    print(f"{equal}/{len(prompts)} prompts ({source}) equal over {args.max_tokens} greedy tokens; "
          f"divergences: {len(gaps)}" + (f", largest logit gap {max(gaps):.2e}" if gaps else ""))


if __name__ == "__main__":
    main()
