"""Triton ships for Linux only: with its import blocked, minispec imports and generates on CPU, token for token
as with Triton installed."""
import json
import os
import subprocess
import sys

from minispec import LLM, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[5, 6, 7], [1, 2, 200, 3]]
SCRIPT = """
import json, sys
sys.modules["triton"] = None  # `import triton` now raises ImportError, as where it is not installed
sys.modules["triton.language"] = None
from minispec import LLM, SamplingParams
target, draft, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = LLM(target=target, draft=draft, num_speculative_tokens=3, max_num_seqs=2, seed=0)
outs = llm.generate(prompts, SamplingParams(temperature=0.8, max_tokens=12, seed=1))
print(json.dumps([o.token_ids for o in outs]))
"""


def test_generate_without_triton(target_dir, draft_dir):
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", SCRIPT, target_dir, draft_dir, json.dumps(PROMPTS)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    llm = LLM(target=target_dir, draft=draft_dir, num_speculative_tokens=3, max_num_seqs=2, seed=0)
    ref = llm.generate(PROMPTS, SamplingParams(temperature=0.8, max_tokens=12, seed=1))
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [o.token_ids for o in ref]
