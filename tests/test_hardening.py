"""Hardening: bad input gets a one-line error naming the problem; aborts, long runs and dead or stalled
ranks leave nothing behind and never hang.

API errors are ValueError (ModelLoadError for checkpoints); CLI errors exit 2 with one "error:" line and
no traceback (1 for a failed collective under torchrun). The torchrun tests launch
tests/dist_scripts/fault_check.py, which makes the last rank die or stall mid-generation.
"""
from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import torch

from minispec import LLM, SamplingParams
from minispec import generate as cli
from minispec.distributed import TPGroup
from minispec.engine.request import Request
from minispec.models.loader import ModelLoadError, load_model
from minispec.spec_decode.adaptive import AdaptiveK
from tests.utils import make_tiny_model_dir, requires_smollm2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3], [200, 1, 42, 42, 7, 8], [77], list(range(30, 45))]


@pytest.fixture(scope="module")
def vocab300_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("h_v300")), seed=2, vocab_size=300)


@pytest.fixture(scope="module")
def broken_dirs(tmp_path_factory, target_dir):
    """Copies of the tiny checkpoint, each broken one way; name -> directory."""
    root = tmp_path_factory.mktemp("broken")
    dirs = {}

    def copy(name):
        dirs[name] = str(root / name)
        shutil.copytree(target_dir, dirs[name])
        return dirs[name]

    weights = "model.safetensors"
    with open(os.path.join(target_dir, weights), "rb") as f:
        blob = f.read()
    with open(os.path.join(copy("truncated"), weights), "wb") as f:
        f.write(blob[: len(blob) // 2])  # cut in half
    with open(os.path.join(copy("garbage"), weights), "wb") as f:
        f.write(np.random.default_rng(0).bytes(4096))
    os.remove(os.path.join(copy("no_weights"), weights))
    os.remove(os.path.join(copy("no_config"), "config.json"))
    with open(os.path.join(copy("bad_config"), "config.json"), "w") as f:
        f.write('{"model_type": "llama", "hidden_size": ')  # invalid JSON
    dirs["gpt2"] = make_tiny_model_dir(str(root / "gpt2"), model_type="gpt2", n_embd=64, n_layer=2, n_head=4,
                                       vocab_size=256, n_positions=256)
    return dirs


@pytest.fixture(scope="module")
def llm(target_dir):
    return LLM(target=target_dir, max_num_seqs=4, max_model_len=64, seed=0)


def check_empty(llm: LLM) -> None:
    """The engine holds no request and every slot is free."""
    engine = llm.engine
    assert not engine.requests and not engine.has_unfinished()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert sorted(engine.scheduler.free_slots) == list(range(engine.config.max_num_seqs))


# ==== 1. bad input: the API ======================================================================


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=-1), "temperature must be >= 0, got -1"),
    (dict(temperature=float("nan")), "temperature must be >= 0, got nan"),
    (dict(temperature=float("inf")), "temperature must be finite"),
    (dict(temperature="1"), "temperature must be a number, got '1'"),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(top_p=-0.1), "top_p must be in (0, 1], got -0.1"),
    (dict(top_k=-1), "top_k must be an integer >= 0 (0 = off), got -1"),
    (dict(top_k=2.5), "top_k must be an integer >= 0 (0 = off), got 2.5"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
    (dict(max_tokens=-3), "max_tokens must be an integer >= 1, got -3"),
    (dict(seed=1.5), "seed must be an integer or None, got 1.5"),
    (dict(stop_token_ids=["a"]), "stop_token_ids must be integers >= 0, got ['a']"),
])
def test_sampling_params_reject(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value) == message


def test_sampling_params_accept_numpy_integers():
    sp = SamplingParams(top_k=np.int64(5), max_tokens=np.int32(3), seed=np.uint64(7), stop_token_ids=np.array([4]))
    assert (sp.top_k, sp.max_tokens, sp.seed, sp.stop_token_ids) == (5, 3, 7, [4])
    assert all(type(v) is int for v in (sp.top_k, sp.max_tokens, sp.seed, *sp.stop_token_ids))


def test_params_mutated_after_construction_are_checked_at_add_request(llm):
    sp = SamplingParams(temperature=0, max_tokens=4)
    sp.top_p = 2.0
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        llm.generate([PROMPTS[0]], sp)
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams, got dict"):
        llm.add_request(PROMPTS[0], {"temperature": 0})
    check_empty(llm)


@pytest.mark.parametrize("case", ["k=0", "k=10000", "vocab", "tp", "seqs", "budget", "dtype", "ngram"])
def test_llm_rejects_bad_construction(case, target_dir, draft_dir, vocab300_dir):
    kw, message = {
        "k=0": (dict(draft=draft_dir, num_speculative_tokens=0), "num_speculative_tokens must be in [1, 32], got 0"),
        "k=10000": (dict(draft=draft_dir, num_speculative_tokens=10_000),
                    "num_speculative_tokens must be in [1, 32], got 10000"),
        "vocab": (dict(draft=vocab300_dir), f"draft vocabulary (300 tokens, {vocab300_dir}) differs from the "
                  f"target's (256, {target_dir}); they must share a tokenizer"),
        "tp": (dict(tensor_parallel_size=2),
               "tensor_parallel_size=2 but the job has 1 rank(s); launch with torchrun --nproc-per-node 2"),
        "seqs": (dict(max_num_seqs=0), "max_num_seqs must be >= 1, got 0"),
        "budget": (dict(draft=draft_dir, num_speculative_tokens=4, max_num_batched_tokens=4),
                   "max_num_batched_tokens=4 cannot fit one decode of 1 + 4 draft tokens"),
        "dtype": (dict(dtype="float64"),
                  "unknown dtype 'float64'; choose one of ['bf16', 'bfloat16', 'float16', 'float32', 'fp16', 'fp32']"),
        "ngram": (dict(draft="ngram", ngram_n=(3, 2)), "need 1 <= min_n <= max_n, got min_n=3, max_n=2"),
    }[case]
    with pytest.raises(ValueError) as e:
        LLM(target=target_dir, **kw)
    assert str(e.value) == message


@pytest.mark.parametrize("name,needle", [
    ("truncated", "model.safetensors: corrupt or truncated safetensors (Error while deserializing header"),
    ("garbage", "model.safetensors: corrupt or truncated safetensors (Error while deserializing header"),
    ("no_weights", "no weights (*.safetensors) in "),
    ("no_config", "no config.json in "),
    ("bad_config", "config.json: Expecting value: line 1 column 40"),
    ("gpt2", "unsupported architecture 'gpt2' (model_type); minispec supports: llama, mistral, qwen2"),
])
def test_broken_checkpoints_are_one_line_errors(broken_dirs, name, needle):
    with pytest.raises(ModelLoadError) as e:
        LLM(target=broken_dirs[name])
    assert needle in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ModelLoadError, match="model path not found: /nonexistent/model"):
        LLM(target="/nonexistent/model")


def test_tp_not_dividing_heads(target_dir):
    # 4 heads, 2 KV heads, MLP 128: tp=3 divides none of them (the torchrun CLI case is in test_tp_engine).
    with pytest.raises(ModelLoadError) as e:
        load_model(target_dir, dtype=torch.float32, device="cpu", tp_group=TPGroup(3, 0, torch.device("cpu")))
    assert str(e.value) == f"tp=3 does not divide num_attention_heads=4 of {target_dir}; choose tp from {{1, 2}}"


@pytest.mark.parametrize("prompt,message", [
    ([], "empty prompt: give at least one token"),
    ([1, 2, 256], "token id 256 is outside the vocabulary [0, 256)"),
    ([-1, 2], "token id -1 is outside the vocabulary [0, 256)"),
    (list(range(64)), "prompt of 64 tokens does not fit the model's context (64 tokens, including at least one "
                      "generated)"),
    ("hello", "has no tokenizer: give prompts as lists of token ids"),
])
def test_bad_prompts(llm, prompt, message):
    with pytest.raises(ValueError) as e:
        llm.generate([prompt], GREEDY)
    assert message in str(e.value)
    check_empty(llm)


def test_duplicate_request_id(llm):
    llm.add_request(PROMPTS[0], GREEDY, request_id="dup")
    with pytest.raises(ValueError, match="request id 'dup' is already running"):
        llm.add_request(PROMPTS[1], GREEDY, request_id="dup")
    llm.abort("dup")
    check_empty(llm)


def test_prompt_plus_max_tokens_past_the_context_stops_with_length(llm):
    outs = llm.generate([list(range(60)), list(range(63))], SamplingParams(temperature=0, max_tokens=50,
                                                                              ignore_eos=True))
    assert [(o.finish_reason, len(o.token_ids)) for o in outs] == [("length", 4), ("length", 1)]


def test_more_requests_than_slots_queue_and_all_finish(target_dir, draft_dir):
    llm = LLM(target=target_dir, draft=draft_dir, num_speculative_tokens=2, max_num_seqs=2, seed=0)
    prompts = [PROMPTS[i % 4] + [i] for i in range(11)]
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert all(o.finish_reason == "length" for o in outs)
    check_empty(llm)


def test_bad_prompt_in_a_batch_is_rejected_before_any_work(llm):
    # generate() checks each prompt as it queues it, before the first step: nothing runs, so "the other
    # requests go on" does not apply to one call; a caller retries without the bad prompt.
    steps = llm.engine.scheduler.step_idx
    with pytest.raises(ValueError, match="token id 999 is outside the vocabulary"):
        llm.generate([PROMPTS[0], PROMPTS[1], [1, 999]], GREEDY)
    assert llm.engine.scheduler.step_idx == steps  # no step ran
    for r in list(llm.engine.requests):  # (the leak below) clean up for the next tests
        llm.abort(r)
    assert [o.finish_reason for o in llm.generate(PROMPTS[:2], GREEDY)] == ["length", "length"]


def test_bad_prompt_in_a_batch_leaves_nothing_queued(llm):
    with pytest.raises(ValueError):
        llm.generate([PROMPTS[0], PROMPTS[1], [1, 999]], GREEDY)
    try:
        check_empty(llm)
    finally:
        for r in list(llm.engine.requests):
            llm.abort(r)


def test_bad_request_while_others_run_they_go_on(llm):
    ref = [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)]
    reqs = [llm.add_request(p, GREEDY) for p in PROMPTS[:2]]
    llm.engine.step()
    for bad in ([], [300], list(range(70))):
        with pytest.raises(ValueError):
            llm.add_request(bad, GREEDY)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert [r.output_token_ids for r in reqs] == ref
    check_empty(llm)


# ==== 1. bad input: the CLI =======================================================================


def cli_error(capsys, argv) -> str:
    """Run the CLI in-process; it must exit 2 with exactly one 'error:' line; returns that line."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and err.strip().splitlines()[-1] == lines[0], err
    return lines[0]


@pytest.mark.parametrize("case", [
    "temperature", "top_p", "top_k", "max_tokens", "empty", "k=0", "k=10000", "vocab", "truncated", "garbage",
    "bad_config", "gpt2", "missing", "tp", "tp0", "max_model_len", "seqs", "budget", "dtype", "ngram",
    "json", "binary", "output",
])
def test_cli_bad_input_one_line(capsys, tmp_path, case, target_dir, draft_dir, vocab300_dir, broken_dirs):
    bad_json, binary = tmp_path / "p.json", tmp_path / "p.txt"
    bad_json.write_text('["a", ')
    binary.write_bytes(b"\xff\xfe\x00\x81 not utf-8")
    t = ["--target", target_dir]
    argv, needle = {
        "temperature": (["--temperature", "-0.5"], "temperature must be >= 0, got -0.5"),
        "top_p": (["--top-p", "1.01"], "top_p must be in (0, 1], got 1.01"),
        "top_k": (["--top-k", "-2"], "top_k must be an integer >= 0 (0 = off), got -2"),
        "max_tokens": (["--max-tokens", "-1"], "max_tokens must be an integer >= 1, got -1"),
        "empty": (["--prompt", "hi", "--prompt", ""], "empty prompt"),
        "k=0": (t + ["--draft", draft_dir, "-k", "0"], "num_speculative_tokens must be in [1, 32], got 0"),
        "k=10000": (t + ["--draft", draft_dir, "-k", "10000"], "num_speculative_tokens must be in [1, 32], got 10000"),
        "vocab": (t + ["--draft", vocab300_dir], "draft vocabulary (300 tokens"),
        "truncated": (["--target", broken_dirs["truncated"]], "corrupt or truncated safetensors"),
        "garbage": (["--target", broken_dirs["garbage"]], "corrupt or truncated safetensors"),
        "bad_config": (["--target", broken_dirs["bad_config"]], "config.json: Expecting value"),
        "gpt2": (["--target", broken_dirs["gpt2"]], "unsupported architecture 'gpt2'"),
        "missing": (["--target", "/nonexistent/model"], "model path not found: /nonexistent/model"),
        "tp": (t + ["--tp", "2"], "launch with torchrun --nproc-per-node 2"),
        "tp0": (t + ["--tp", "0"], "--tp must be >= 1, got 0"),
        "max_model_len": (t + ["--max-model-len", "-5"], "--max-model-len must be >= 2, got -5"),
        "seqs": (t + ["--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
        "budget": (t + ["--draft", draft_dir, "-k", "4", "--max-num-batched-tokens", "3"],
                   "max_num_batched_tokens=3 cannot fit one decode of 1 + 4 draft tokens"),
        "dtype": (t + ["--dtype", "int8"], "unknown dtype 'int8'"),
        "ngram": (t + ["--draft", "ngram", "--ngram-min", "0"], "need 1 <= min_n <= max_n, got min_n=0"),
        "json": (["--prompt-file", str(bad_json)], "p.json: invalid JSON (Expecting value"),
        "binary": (["--prompt-file", str(binary)], "cannot read prompt file"),
        "output": (["--output-json", "/nonexistent/dir/o.json"], "--output-json: folder not found: /nonexistent/dir"),
    }[case]
    line = cli_error(capsys, argv)
    assert line.startswith("python -m minispec.generate: error: ") and needle in line


@pytest.mark.parametrize("extra,needle", [
    (["--prompt-file", "PROMPT_FILE"], "invalid JSON"),
    (["--draft", "VOCAB300"], "draft vocabulary (300 tokens"),
])
def test_cli_subprocess_exit_2_no_traceback(tmp_path, target_dir, vocab300_dir, extra, needle):
    bad = tmp_path / "prompts.json"
    bad.write_text("{not json")
    extra = [{"PROMPT_FILE": str(bad), "VOCAB300": vocab300_dir}.get(a, a) for a in extra]
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "minispec.generate", "--target", target_dir, *extra],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert needle in r.stderr.strip().splitlines()[-1]


# ==== 2. faults: aborts, closed streams, long runs ================================================


@pytest.mark.parametrize("sharded", [False, True])
def test_abort_frees_slot_and_draft_row_at_once(target_dir, sharded):
    # The target as its own draft accepts every fresh draft: a newcomer in the freed slot that saw a
    # stale or leftover draft-logits row would show it as a rejected draft.
    llm = LLM(target=target_dir, draft=target_dir, num_speculative_tokens=3, max_num_seqs=2, seed=0,
              shard_draft_logits=sharded)
    ref = {tuple(p): o.token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, GREEDY))}
    a, b = (llm.add_request(p, GREEDY) for p in PROMPTS[:2])
    for _ in range(2):
        llm.engine.step()
    assert a.drafts is not None and a.slot >= 0  # running, with drafts in its draft-logits row
    slot = a.slot
    llm.abort(a.req_id)
    assert a.finish_reason == "abort" and a.slot == -1 and a.drafts is None
    assert a.req_id not in llm.engine.requests and a not in llm.engine.scheduler.running
    assert llm.engine.scheduler.free_slots == [slot]
    c = llm.add_request(PROMPTS[2], GREEDY)
    llm.engine.step()
    assert c.slot == slot
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert b.output_token_ids == ref[tuple(PROMPTS[1])] and c.output_token_ids == ref[tuple(PROMPTS[2])]
    assert c.metrics.num_stale_drafts == 0 and c.metrics.num_accepted_tokens == c.metrics.num_draft_tokens > 0
    check_empty(llm)
    llm.abort(a.req_id)  # aborting a finished or unknown request is a no-op
    llm.abort("no-such-request")
    check_empty(llm)


def test_abort_a_waiting_request(llm):
    reqs = [llm.add_request(PROMPTS[i % 4], GREEDY) for i in range(6)]  # 4 slots: two wait
    llm.engine.step()
    waiting = [r for r in reqs if r.slot < 0]
    assert len(waiting) == 2
    for r in waiting:
        llm.abort(r.req_id)
    assert not llm.engine.scheduler.waiting and all(r.finish_reason == "abort" for r in waiting)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert all(r.finish_reason == "length" for r in reqs if r not in waiting)
    check_empty(llm)


@pytest.mark.parametrize("how", ["close", "garbage-collected"])
def test_stream_closed_midway_frees_everything(target_dir, draft_dir, how):
    llm = LLM(target=target_dir, draft=draft_dir, num_speculative_tokens=2, max_num_seqs=2, seed=0,
              shard_draft_logits=True)
    gen = llm.stream(PROMPTS, SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True))  # 2 wait
    for _ in range(3):
        next(gen)
    assert llm.engine.requests
    if how == "close":
        gen.close()
    else:
        del gen
        gc.collect()
    check_empty(llm)
    assert [len(o.token_ids) for o in llm.generate(PROMPTS, GREEDY)] == [12] * 4


def _rss_mb() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


@pytest.mark.parametrize("path", ["default", "draft"])
def test_a_thousand_short_requests_leave_nothing_behind(target_dir, draft_dir, path):
    # On tiny models (SmolLM2 would make 1,000 requests too slow for the suite): LLM()'s default path (the
    # target alone, DRAFT_FOR_TARGET), and the shipped pair's (a draft model, adaptive k on).
    if path == "default":
        llm = LLM(target=target_dir, draft=None, max_num_seqs=8, seed=0, max_num_batched_tokens=64)
    else:
        llm = LLM(target=target_dir, draft=draft_dir, num_speculative_tokens=3, max_num_seqs=8, seed=0,
                  shard_draft_logits=True, max_num_batched_tokens=64, adaptive_k=True)
        assert isinstance(llm.engine.k_policy, AdaptiveK)
    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, Request)}  # other tests' engines
    rng = np.random.default_rng(0)
    sizes = {}
    for batch in range(20):  # 20 x 50 requests, 2-4 tokens each, some sampled, some aborted by closing
        prompts = [rng.integers(0, 256, size=int(rng.integers(1, 20))).tolist() for _ in range(50)]
        params = [SamplingParams(temperature=float(rng.choice([0.0, 1.0])), max_tokens=int(rng.integers(2, 5)),
                                 ignore_eos=True) for _ in prompts]
        if batch % 5 == 4:
            gen = llm.stream(prompts, params)
            for _ in range(30):
                next(gen)
            gen.close()
        else:
            outs = llm.generate(prompts, params)
            assert all(len(o.token_ids) == p.max_tokens for o, p in zip(outs, params))
        check_empty(llm)
        if batch in (3, 19):  # after 200 and after 1,000 requests
            sizes[batch] = (_rss_mb(), len(gc.get_objects()))
    assert llm._next_id == 1000 and llm.engine._num_arrived == 1000
    gc.collect()
    alive = [o for o in gc.get_objects() if isinstance(o, Request) and id(o) not in before]
    assert not alive, f"{len(alive)} Request objects of finished requests are still alive"
    (rss_200, objs_200), (rss_1000, objs_1000) = sizes[3], sizes[19]
    assert rss_1000 - rss_200 < 50, f"RSS grew {rss_1000 - rss_200:.1f} MB from request 200 to 1,000"
    assert objs_1000 - objs_200 < 2000, f"{objs_1000 - objs_200} more Python objects after 1,000 requests"


# ==== 2. faults under torchrun: a rank dies or stalls ==============================================


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("h_tok")), with_tokenizer=True)


DIST_TIMEOUT_S = 10


def torchrun_fault(tok_dir, fault: str, *extra, nproc: int = 2, timeout: int = 180):
    """Launch fault_check.py under torchrun; returns (completed process, seconds it took)."""
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               MINISPEC_DIST_TIMEOUT=str(DIST_TIMEOUT_S))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(ROOT, "tests", "dist_scripts", "fault_check.py"), fault, "2",
           "--target", tok_dir, "--draft", tok_dir, "-k", "2", "--no-chat", "--max-tokens", "40", "--ignore-eos",
           "--prompt", "Hello there", "--prompt", "Once upon a time", "--tp", str(nproc), *extra]
    t0 = time.monotonic()
    # Well above the collective timeout: a hang shows as TimeoutExpired, not as a slow pass.
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    return r, time.monotonic() - t0


def minispec_traceback(stderr: str) -> bool:
    """Whether stderr holds a traceback frame in minispec's code (torchrun's own report is allowed)."""
    package = os.path.join(ROOT, "minispec") + os.sep
    return any('File "' in line and package in line for line in stderr.splitlines())


@requires_smollm2
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["die:0", "stall"])
def test_rank_dies_or_stalls_job_ends_with_one_line_error(tok_dir, fault):
    # die:0: the last rank vanishes (exit 0, so torchrun waits for the others): rank 0's next
    # collective fails at once. stall: the last rank sleeps; rank 0's collective times out after
    # MINISPEC_DIST_TIMEOUT. Either way rank 0 prints one line and exits 1, and torchrun ends the job.
    r, _ = torchrun_fault(tok_dir, fault)
    assert f"rank 1: fault {fault} at step 2" in r.stderr
    assert r.returncode != 0, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("python -m minispec.generate: error:")]
    assert len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("python -m minispec.generate: error: rank 0/2: ")
    timeout = f"(collective timeout {DIST_TIMEOUT_S} s, set by MINISPEC_DIST_TIMEOUT)"
    assert f"another rank may have died or stalled {timeout}" in lines[0]
    cause = {"die:0": "Connection", "stall": f"Timed out waiting {DIST_TIMEOUT_S * 1000}ms"}[fault]
    assert cause in lines[0]
    assert not minispec_traceback(r.stderr)


@requires_smollm2
@pytest.mark.slow
def test_tp_differs_from_torchrun_world_size(tok_dir):
    r, _ = torchrun_fault(tok_dir, "none", "--tp", "3")
    assert r.returncode != 0
    assert "error: tensor_parallel_size=3 but the job has 2 rank(s); launch with torchrun --nproc-per-node 3" \
        in r.stderr
    assert not minispec_traceback(r.stderr)


def test_non_integer_token_ids_rejected(llm):
    for bad in ([1, 2.7], [True, 3]):
        with pytest.raises(ValueError, match="integer token ids"):
            llm.generate([bad], GREEDY)
    check_empty(llm)
