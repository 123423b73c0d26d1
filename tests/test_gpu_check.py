"""scripts/gpu_check.py's stages on CPU at tiny sizes (the dry run of scripts/gpu_check.sh, in process),
and the shell script's answer on a machine without CUDA."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def early_exit(gpu_check, tmp_path_factory):
    """The early-exit draft `prepare` writes from the shipped checkpoint."""
    out = str(tmp_path_factory.mktemp("early-exit"))
    assert gpu_check.main(["prepare", "--out", out]) == 0
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without CUDA")
def test_script_without_cuda_says_so_and_runs_nothing(tmp_path):
    env = dict(os.environ, PY=sys.executable, OUT=str(tmp_path / "out"))
    env.pop("GPU_CHECK_DEVICE", None)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "needs a CUDA GPU" in proc.stdout and "nothing was run" in proc.stdout
    assert not (tmp_path / "out").exists()


def test_env(gpu_check, capsys):
    assert gpu_check.main(["env", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "## torch:" in out and "## triton kernels: {'rejection_sample':" in out


def test_kernels_compile_for_sm90():
    """The compiled (not interpreted) path: every kernel, with the signatures the engine launches it with
    (a process of its own: this one imported the kernels for the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "compile"], env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    for name in ("_assign_rows_kernel", "_stale_drafts_kernel", "_rejection_sample_kernel(HAS_STALE=False",
                 "_rejection_sample_kernel(HAS_STALE=True"):
        assert f"## compiled for sm_90: {name}" in out


def test_e2e_float32(gpu_check, early_exit, capsys):
    args = ["e2e", "--device", "cpu", "--draft", early_exit, "--dtypes", "float32", "--num-prompts", "1",
            "--max-tokens", "5"]  # 1 prefill token + 4 accepted drafts: the cut bonus is not counted as a rejection
    assert gpu_check.main(args) == 0
    out = capsys.readouterr().out
    assert "## float32 target-only greedy == transformers: 1/1 prompts x 5 tokens; all equal" in out
    assert "## float32 speculative (target as draft, k=4) greedy == target-only: 1/1; all equal; acceptance 1.000" in out
    assert "## float32 speculative (early-exit draft, k=4) T=0.8: valid tokens True" in out


def test_compare_names_the_first_divergence(gpu_check, target_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    assert gpu_check.compare([[1, 2]], [[1, 2]], hf, [[5, 6]]) == (1, "all equal")
    equal, note = gpu_check.compare([[1, 2], [1, 2, 3]], [[1, 2], [1, 2, 4]], hf, [[5], [5, 6]])
    assert equal == 1 and note.startswith("prompt 1 first differs at token 2 (transformers' top-2 logit gap there ")


def test_count_host_reads_by_call_site(gpu_check):
    x = torch.ones(3)
    with gpu_check.count_host_reads(torch.device("cpu")) as reads:
        x.sum().item()
        x.tolist()
        bool(x[0])
    assert sorted(k.split()[0] for k in reads) == ["__bool__", "item", "tolist"]
    assert all("tests/test_gpu_check.py:" in k for k in reads) and sum(reads.values()) == 3
    assert "item" not in vars(torch.Tensor) and x.sum().item() == 3.0  # the patch is gone


def test_overheads(gpu_check, early_exit, capsys):
    args = ["overheads", "--device", "cpu", "--draft", early_exit, "--batch-sizes", "2", "--steps", "2",
            "--reps", "1", "--graph-ctx", "16"]
    assert gpu_check.main(args) == 0
    out = capsys.readouterr().out
    for label in ("speculative b=2", "target-only b=2"):
        assert f"## {label} step:" in out and f"## {label} host reads per step:" in out
        assert f"## {label} profile per step: aten_ops_per_step" in out
    assert "## cuda graph verify (target, k+1 tokens) b=2: eager" in out
