"""The bundled chat prompt set: size, uniqueness, a disjoint split, every category in both halves."""
import json
import runpy
from collections import Counter
from pathlib import Path

import pytest

from minispec.data import CATEGORIES, PROMPTS_PATH, load_prompt_items, load_prompts

BUILDER = Path(__file__).resolve().parents[1] / "scripts" / "build_prompts.py"


def test_prompt_set_size_and_uniqueness():
    prompts = load_prompts("all")
    assert len(prompts) >= 320
    assert len(set(prompts)) == len(prompts) >= 300
    assert all(isinstance(p, str) and len(p.strip()) >= 10 for p in prompts)
    ids = [it["id"] for it in load_prompt_items("all")]
    assert len(set(ids)) == len(ids)


def test_split_disjoint_and_categories_in_both():
    train, evl = load_prompt_items("train"), load_prompt_items("eval")
    assert len(evl) >= 60 and len(train) >= 4 * len(evl) - 20
    assert not {it["prompt"] for it in train} & {it["prompt"] for it in evl}
    assert not {it["id"] for it in train} & {it["id"] for it in evl}
    for items in (train, evl):
        counts = Counter(it["category"] for it in items)
        assert set(counts) == set(CATEGORIES), counts
        assert min(counts.values()) >= 5


def test_json_matches_builder():
    """prompts.json is exactly what scripts/build_prompts.py writes (the split is fixed, not re-drawn)."""
    assert json.loads(PROMPTS_PATH.read_text()) == runpy.run_path(str(BUILDER))["build"]()


def test_filters():
    code = load_prompts("eval", categories="code")
    assert code and all(it["category"] == "code" for it in load_prompt_items("eval", categories=["code"]))
    assert len(load_prompts("train", categories=["poem", "math"], limit=3)) == 3
    assert load_prompts("eval", limit=5) == load_prompts("eval")[:5]
    with pytest.raises(ValueError):
        load_prompts("test")
    with pytest.raises(ValueError):
        load_prompts("eval", categories=["cooking"])


def test_synthetic_prompts_are_distinct_balanced_and_keep_eval_held_out():
    from minispec.data.synth import synth_count, synth_prompts

    assert synth_count() >= 4000
    first = synth_prompts(3000, seed=0)
    assert len(set(first)) == 3000 and synth_prompts(3000, seed=0) == first != synth_prompts(3000, seed=1)
    assert synth_prompts(20) == first[:20]  # a prefix of the same shuffle
    assert not set(first) & set(load_prompts("all"))
    evl = " ".join(load_prompts("eval")).lower()
    data = json.loads((PROMPTS_PATH.parent / "synth.json").read_text())
    for category in CATEGORIES:
        assert all(t.lower() not in evl for t in data["topics"][category])
    assert "{topic}" not in " ".join(first)
    with pytest.raises(ValueError, match="available"):
        synth_prompts(synth_count() + 1)
