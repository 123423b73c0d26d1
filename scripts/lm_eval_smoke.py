"""lm-evaluation-harness against python -m minispec.serve: a generation task and a log-likelihood one (make eval-smoke).

Starts the server on 127.0.0.1 (a free port) over the default target, saves its tokenizer for lm-eval's
local-completions, runs `lm_eval` on tests/data/lm_eval's two 10-item tasks and stops the server.
Needs the eval extra (pip install -e ".[eval]"). Extra arguments go to python -m minispec.serve.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASKS = "minispec_tiny_gen,minispec_tiny_mc"


def main(server_args: list[str]) -> int:
    from minispec.serve.load import start_server, wait_ready
    from minispec.tools.tiny import smollm2_tokenizer

    tokenizer_dir = tempfile.mkdtemp(prefix="minispec-lm-eval-tokenizer-")
    smollm2_tokenizer().save_pretrained(tokenizer_dir)  # the default target's tokenizer, as lm-eval loads one
    proc, url, model = start_server(server_args)
    threading.Thread(target=lambda: [print("[server]", line, end="") for line in proc.stdout], daemon=True).start()
    try:
        wait_ready(url)
        model_args = (f"model={model},base_url={url}/completions,tokenizer_backend=huggingface,"
                      f"tokenizer={tokenizer_dir},num_concurrent=1,max_retries=1,tokenized_requests=True")
        cmd = ["lm_eval", "--model", "local-completions", "--model_args", model_args, "--tasks", TASKS,
               "--include_path", str(ROOT / "tests" / "data" / "lm_eval"), "--batch_size", "1",
               "--log_samples", "--output_path", tempfile.mkdtemp(prefix="minispec-lm-eval-out-")]
        print("+", " ".join(cmd), flush=True)
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        lm_eval = Path(sys.executable).parent / "lm_eval"
        return subprocess.run([str(lm_eval) if lm_eval.exists() else "lm_eval", *cmd[1:]], cwd=ROOT, env=env,
                              timeout=1800).returncode
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
