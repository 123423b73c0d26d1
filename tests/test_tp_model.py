"""Tensor parallelism under torchrun: gathered logits on every rank equal the tp=1 logits."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils import make_tiny_gguf, make_tiny_model_dir

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "dist_scripts" / "tp_model_check.py"

# tp=2: GQA 6 heads over 2 KV heads, untied, biases on q/k/v/o and the MLP (row-parallel bias after
# the all_reduce). tp=3: qwen2 with 3 KV heads, tied embeddings, vocab 256 padded to 258. Both use
# hidden 48 with head_dim 16, so the attention width (96) differs from the hidden size.
TINY = dict(hidden_size=48, num_attention_heads=6, head_dim=16, intermediate_size=96)
CASES = {
    2: ("llama", dict(TINY, num_key_value_heads=2, attention_bias=True, mlp_bias=True, tie_word_embeddings=False)),
    3: ("qwen2", dict(TINY, num_key_value_heads=3, tie_word_embeddings=True)),
}


@pytest.mark.parametrize("nproc", [2, 3])
def test_tp_logits_equal_tp1(nproc, tmp_path):
    model_type, overrides = CASES[nproc]
    run_check(make_tiny_model_dir(tmp_path, model_type=model_type, seed=nproc, **overrides), nproc)


def test_tp_packed_gguf_logits_equal_tp1(tmp_path):
    """A packed GGUF (Q4_1 layers, Q8_0 tied embedding) at tp=2: row-parallel shards cut rows on blocks."""
    run_check(make_tiny_gguf(tmp_path / "m.gguf", "Q4_1", types={"token_embd.weight": "Q8_0"}), 2)


def run_check(path: str, nproc: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(SCRIPT), path]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for rank in range(nproc):
        assert f"rank {rank}/{nproc}: OK" in out, out[-4000:]
