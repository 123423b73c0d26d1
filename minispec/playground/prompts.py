"""Prompt sets of the playground: a built-in list, the project's split (minispec.data), or a JSON file."""
from __future__ import annotations

import json
import os

# A mix that spans low and high acceptance: open-ended writing, facts, code, and rewrites that copy
# their input (where prompt lookup shines).
BUILTIN_PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Rewrite this sentence in the passive voice: The committee approved the new budget on Monday "
    "after a long discussion about the costs of the new library building.",
    "List five fruits and one fact about each.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Fix the bug in this code and return the corrected code:\n\ndef mean(xs):\n    total = 0\n"
    "    for x in xs:\n        total += x\n    return total / len(x)\n",
    "Summarise the following paragraph in one sentence: The city council met on Tuesday to discuss "
    "the plan for the new park. The plan includes a playground, a pond and two football fields. "
    "Several residents said the park would bring families to the area, while others worried about "
    "traffic and parking near the park.",
    "What are the differences between a list and a tuple in Python?",
    "Write a haiku about autumn leaves.",
    "Translate to French: Good morning, how are you today? I would like a coffee, please.",
    "Give me step-by-step instructions to make a cup of tea.",
    "Convert this JSON to YAML:\n{\"name\": \"minispec\", \"version\": \"0.1.0\", \"dependencies\": "
    "[\"torch\", \"numpy\", \"transformers\"], \"license\": \"MIT\"}",
    "What is 17 times 23? Show your working.",
    "Compare cats and dogs as pets in a short paragraph.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Repeat the following list, sorted alphabetically: pear, apple, mango, banana, cherry, kiwi, grape.",
]


def load_prompt_set(name: str, limit: int) -> tuple[list[str], str]:
    """The first `limit` prompts of a set, and a one-line description of where they came from.

    name: "builtin"; "eval", "train" or "all" (minispec.data.load_prompts, optionally
    "eval:code+math" for categories); or a path to a .json list of strings or of {"prompt": ...}.
    """
    if name == "builtin":
        return BUILTIN_PROMPTS[:limit], f"builtin ({len(BUILTIN_PROMPTS)} prompts)"
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
    if split not in ("eval", "train", "all"):
        raise ValueError(f"prompt_set: expected 'builtin', 'eval', 'train', 'all' or a .json file, got {name!r}")
    try:
        from minispec.data import load_prompt_items
    except ImportError:
        raise ValueError(f"prompt_set {name!r} needs minispec.data (the project's prompt set)") from None
    categories = cats.split("+") if cats else None
    items = load_prompt_items(split=split, categories=categories)
    if not items:
        raise ValueError(f"prompt_set {name!r}: no prompts")
    # The file groups prompts by category: take them round-robin so a short limit covers every category.
    by_cat: dict[str, list[str]] = {}
    for it in items:
        by_cat.setdefault(it["category"], []).append(it["prompt"])
    columns = list(by_cat.values())
    prompts = [col[i] for i in range(max(map(len, columns))) for col in columns if i < len(col)]
    return prompts[:limit], f"minispec.data split={split} categories={categories or 'all'} (round-robin)"
