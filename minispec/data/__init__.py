"""The project's chat prompt set (minispec/data/prompts.json): a fixed train/eval split by category."""
from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path

__all__ = ["CATEGORIES", "load_prompt_items", "load_prompts"]

PROMPTS_PATH = Path(__file__).with_name("prompts.json")
CATEGORIES = ("explanation", "howto", "list", "story", "poem", "code", "math", "rewrite", "comparison", "advice")


@functools.lru_cache(maxsize=1)
def _load() -> dict[str, list[dict]]:
    return json.loads(PROMPTS_PATH.read_text())


def load_prompt_items(split: str = "eval", categories: Iterable[str] | str | None = None,
                      limit: int | None = None) -> list[dict]:
    """Items {"id", "category", "prompt"} of one split ("train", "eval" or "all"), in file order."""
    data = _load()
    if split == "all":
        items = data["train"] + data["eval"]
    elif split in data:
        items = data[split]
    else:
        raise ValueError(f"unknown split {split!r}; use 'train', 'eval' or 'all'")
    if categories is not None:
        wanted = {categories} if isinstance(categories, str) else set(categories)
        unknown = wanted - set(CATEGORIES)
        if unknown:
            raise ValueError(f"unknown categories {sorted(unknown)}; known: {', '.join(CATEGORIES)}")
        items = [it for it in items if it["category"] in wanted]
    if limit is not None:
        items = items[:limit]
    return [dict(it) for it in items]


def load_prompts(split: str = "eval", categories: Iterable[str] | str | None = None,
                 limit: int | None = None) -> list[str]:
    """Prompt strings of one split ("train", "eval" or "all"), optionally filtered by category and cut to limit."""
    return [it["prompt"] for it in load_prompt_items(split, categories, limit)]
