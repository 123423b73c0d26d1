"""The package as pip installs it: its package data, its Python floor, and a wheel that runs the C++ kernels."""
import os
import re
import shutil
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
KERNELS = ROOT / "minispec" / "kernels"


def test_package_data_holds_every_kernel_source_and_header():
    """Without a header that the .cpp files include, an installed package falls back to the slow torch path."""
    from minispec.kernels.cpu import SOURCES

    globs = PYPROJECT["tool"]["setuptools"]["package-data"]["minispec"]
    needed = {s.name for s in SOURCES}
    for source in [*KERNELS.glob("*.cpp"), *KERNELS.glob("*.h")]:
        needed |= set(re.findall(r'^\s*#include\s+"([^"]+)"', source.read_text(), re.M))
    assert "cpu_ops.h" in needed
    assert [n for n in sorted(needed) if not any(fnmatch(f"kernels/{n}", g) for g in globs)] == []


def test_requires_python_covers_tomllib():
    """tomllib is new in Python 3.11 and imported without a fallback."""
    users = [p for p in (ROOT / "minispec").rglob("*.py") if re.search(r"^import tomllib", p.read_text(), re.M)]
    floor = re.fullmatch(r">=\s*3\.(\d+)", PYPROJECT["project"]["requires-python"].strip())
    assert users and floor and int(floor.group(1)) >= 11


GENERATE = """
import tempfile
import minispec
from minispec import LLM, SamplingParams
from minispec.kernels import cpu
from minispec.tools.tiny import make_tiny_char_model_dir

print("package", minispec.__file__)
ops = cpu.ops()
print("kernels", ops is not None)
calls = []
argmax = ops.greedy_argmax
ops.greedy_argmax = lambda *a: calls.append(1) or argmax(*a)
llm = LLM(target=make_tiny_char_model_dir(tempfile.mkdtemp()), draft=None)
out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
print("tokens", len(out[0].token_ids), "kernel calls", len(calls))
"""


@pytest.mark.slow
def test_the_wheel_installs_and_runs_the_cpp_kernels(tmp_path):
    """pip wheel (no build isolation) of a copy of the sources, installed with --target, imported from outside
    the checkout: the C++ extension builds from the installed files and the greedy step calls it."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "minispec", src / "minispec", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]

    def run(*args):
        r = subprocess.run([*pip, *args], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]

    run("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src))
    wheel = next((tmp_path / "dist").glob("minispec-*.whl"))
    run("install", "--no-deps", "--no-index", "--target", str(tmp_path / "site"), str(wheel))
    (tmp_path / "run").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "MINISPEC_NO_CPP_KERNELS"}
    env.update(PYTHONPATH=str(tmp_path / "site"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", GENERATE], cwd=tmp_path / "run", env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"package {tmp_path / 'site' / 'minispec' / '__init__.py'}\n" in r.stdout, r.stdout
    assert "kernels True\n" in r.stdout and "could not be built" not in r.stderr, r.stdout + r.stderr[-2000:]
    calls = int(re.search(r"tokens 4 kernel calls (\d+)", r.stdout).group(1))
    assert calls >= 1, r.stdout
