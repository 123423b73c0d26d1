"""The CLI: help, real runs, --output-json, and one-line errors (exit 2) on bad input."""
import json
import os
import subprocess
import sys

import pytest

from tests.utils import make_tiny_model_dir, requires_smollm2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "minispec.generate", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_tok")), with_tokenizer=True)


def test_help():
    r = run_cli("--help")
    assert r.returncode == 0
    for flag in ("--target", "--draft", "--prompt-file", "--no-chat", "--num-speculative-tokens", "--tp",
                 "--stream", "--output-json", "--top-p", "--ignore-eos", "--seed"):
        assert flag in r.stdout


def test_tiny_run_writes_json(tiny_dir, tmp_path):
    out = tmp_path / "out.json"
    pf = tmp_path / "prompts.txt"
    pf.write_text("The quick brown fox\nOnce upon a time\n")
    r = run_cli("--target", tiny_dir, "--draft", tiny_dir, "--prompt", "Hello there", "--prompt-file", str(pf),
                "--no-chat", "--max-tokens", "6", "--ignore-eos", "-k", "2", "--stream", "--output-json", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert [d["prompt"] for d in data] == ["Hello there", "The quick brown fox", "Once upon a time"]
    for d in data:
        assert len(d["token_ids"]) == 6 and d["finish_reason"] == "length"
        assert d["metrics"]["acceptance_rate"] == 1.0  # its own draft
        assert set(d) >= {"prompt", "text", "token_ids", "finish_reason", "metrics"}
    assert "[minispec] 3 prompt(s), 18 tokens" in r.stdout
    assert "mean accepted length" in r.stdout


@requires_smollm2
def test_default_model_real_run(tmp_path):
    out = tmp_path / "o.json"
    r = run_cli("--max-tokens", "8", "--output-json", str(out), timeout=600)  # may build the C++ kernels first
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert len(data) == 1 and len(data[0]["token_ids"]) >= 1 and data[0]["text"].strip()


@pytest.mark.parametrize("args,needle", [
    (["--target", "/nonexistent/model"], "not found"),
    (["--target", "no-such-alias"], "unknown model alias"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--prompt", "  "], "empty prompt"),
])
def test_bad_input_one_line_exit_2(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert needle in r.stderr.strip().splitlines()[-1]


def test_prompt_longer_than_context(tiny_dir):
    r = run_cli("--target", tiny_dir, "--no-chat", "--prompt", "word " * 400)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "context" in r.stderr.strip().splitlines()[-1]
