"""Synthetic chat prompts for distillation: every template x topic of minispec/data/synth.json, per category.

Combinations equal to a prompt of prompts.json, or whose topic appears inside an eval prompt, are left out,
so the eval split stays held out. synth_prompts(n, seed) shuffles each category with random.Random(seed) and
interleaves the categories round-robin, so any prefix is balanced across categories.
"""
from __future__ import annotations

import functools
import json
import random
from pathlib import Path

from minispec.data import CATEGORIES, load_prompts

__all__ = ["synth_count", "synth_prompts"]

SYNTH_PATH = Path(__file__).with_name("synth.json")
PLACEHOLDER = "{topic}"


@functools.lru_cache(maxsize=1)
def _pool() -> tuple[tuple[str, ...], ...]:
    """Usable prompts per category (in CATEGORIES order), each in a fixed template-major order."""
    data = json.loads(SYNTH_PATH.read_text())
    existing = set(load_prompts("all"))
    eval_lower = [p.lower() for p in load_prompts("eval")]
    seen: set[str] = set()
    pool = []
    for category in CATEGORIES:
        templates, topics = data["templates"][category], data["topics"][category]
        bad = [t for t in templates if t.count(PLACEHOLDER) != 1]
        if bad:
            raise ValueError(f"synth.json: {category} templates need exactly one {PLACEHOLDER}: {bad}")
        topics = [t for t in topics if not any(t.lower() in p for p in eval_lower)]
        prompts = []
        for template in templates:
            for topic in topics:
                prompt = template.replace(PLACEHOLDER, topic)
                if prompt not in existing and prompt not in seen:
                    seen.add(prompt)
                    prompts.append(prompt)
        pool.append(tuple(prompts))
    return tuple(pool)


def synth_count() -> int:
    """How many distinct synthetic prompts are available."""
    return sum(len(prompts) for prompts in _pool())


def synth_prompts(n: int, seed: int = 0) -> list[str]:
    """n distinct synthetic prompts, shuffled by seed and interleaved round-robin across categories."""
    available = synth_count()
    if not 0 <= n <= available:
        raise ValueError(f"asked for {n} synthetic prompts; between 0 and {available} are available")
    rng = random.Random(seed)
    shuffled = []
    for prompts in _pool():
        prompts = list(prompts)
        rng.shuffle(prompts)
        shuffled.append(prompts)
    out: list[str] = []
    for i in range(max(map(len, shuffled))):
        for prompts in shuffled:
            if i < len(prompts):
                out.append(prompts[i])
                if len(out) == n:
                    return out
    return out
