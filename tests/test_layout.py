"""The package's layers: every import inside minispec points down (parsed with ast, nothing imported)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "minispec"

# Each top-level module or package of minispec and its layer: a module may import only from lower layers
# (or from its own package). spec_decode sits below engine, runner below both, the tools above the facade.
LAYERS = {
    "utils": 0,
    "sampling_params": 1, "distributed": 1, "data": 1,
    "kernels": 2,
    "sample": 3, "layers": 3,
    "models": 4,
    "runner": 5,
    "spec_decode": 6,
    "engine": 7,
    "llm": 8,
    "__init__": 9, "tools": 9,
    "generate": 10,
    "serve": 11, "bench": 11, "playground": 11, "distill": 11,
}


def minispec_imports(path: Path) -> set[str]:
    """The top-level minispec modules a file imports (`import minispec.x.y`, `from minispec.x import y`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "minispec" else [f"minispec.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n.split(".")[1] for n in names if n.startswith("minispec.")}
    return found


def test_every_import_points_down():
    """No module imports from its own layer's neighbours or above: e.g. spec_decode never imports engine."""
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        top = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        assert top in LAYERS, f"{rel}: {top!r} has no layer in LAYERS; give it one"
        for imported in minispec_imports(path) - {top}:
            assert imported in LAYERS, f"{rel} imports minispec.{imported}, which has no layer in LAYERS"
            if LAYERS[imported] >= LAYERS[top]:
                wrong.append(f"{rel} (layer {LAYERS[top]}) imports minispec.{imported} (layer {LAYERS[imported]})")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def test_the_check_sees_an_upward_import(tmp_path):
    """The parser finds both import forms, so an upward import would fail the test above."""
    f = tmp_path / "m.py"
    f.write_text("import minispec.engine.request\nfrom minispec import llm\nfrom minispec.runner.model_runner import X\n"
                 "from . import sibling\n")
    assert minispec_imports(f) == {"engine", "llm", "runner"}
