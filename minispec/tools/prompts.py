"""Prompt sets and their token ids for the tools: every built-in prompt comes from minispec/data/prompts.json."""
from __future__ import annotations

import json
import os

from minispec.data import load_prompt_items
from minispec.llm import encode_text, has_chat_template

SPLITS = ("eval", "train", "all")


def load_prompt_set(name: str, limit: int) -> tuple[list[str], str]:
    """The first `limit` prompts of a set, and a one-line description of where they came from.

    name: "eval", "train" or "all" (prompts.json, optionally "eval:code+math" for categories), taken
    round-robin over the categories so a short limit covers each; or a path to a .json list of strings
    or of {"prompt": ...}.
    """
    if name.endswith(".json") or os.path.sep in name:
        if not os.path.isfile(name):
            raise ValueError(f"prompt_set: file not found: {name}")
        with open(name) as f:
            items = json.load(f)
        if not isinstance(items, list) or not items:
            raise ValueError(f"prompt_set {name}: expected a non-empty JSON list")
        prompts = [it["prompt"] if isinstance(it, dict) else it for it in items]
        if not all(isinstance(p, str) and p for p in prompts):
            raise ValueError(f"prompt_set {name}: expected strings or objects with a 'prompt' string")
        return prompts[:limit], f"file {name} ({len(prompts)} prompts)"
    split, _, cats = name.partition(":")
    if split not in SPLITS:
        raise ValueError(f"prompt_set: expected {', '.join(SPLITS)} (optionally ':cat+cat') or a .json file, "
                         f"got {name!r}")
    categories = cats.split("+") if cats else None
    items = load_prompt_items(split=split, categories=categories)
    if not items:
        raise ValueError(f"prompt_set {name!r}: no prompts")
    by_cat: dict[str, list[str]] = {}
    for it in items:
        by_cat.setdefault(it["category"], []).append(it["prompt"])
    columns = list(by_cat.values())
    prompts = [col[i] for i in range(max(map(len, columns))) for col in columns if i < len(col)]
    return prompts[:limit], f"minispec.data split={split} categories={categories or 'all'} (round-robin)"


def encode_prompts(tokenizer, texts: list[str], chat: bool, room: int, name: str = "the target",
                   vocab_size: int | None = None) -> tuple[list[list[int]], int]:
    """Token ids of each text (LLM's encoding; the chat template when asked and the tokenizer has one),
    cut from the left to at most room tokens; and how many were cut.

    A model without a tokenizer (a tiny random one) gets each text's UTF-8 bytes modulo vocab_size when
    vocab_size is given, and is a ValueError otherwise.
    """
    if tokenizer is None and vocab_size is not None:
        ids = [[b % vocab_size for b in t.encode()] for t in texts]
    else:
        use_chat = chat and has_chat_template(tokenizer)
        ids = [encode_text(tokenizer, t, use_chat, name) for t in texts]
    room = max(1, room)
    return [t[-room:] for t in ids], sum(len(t) > room for t in ids)
