"""python -m minispec.bench: a --quick run on tiny models (table + JSON), config precedence, the efficiency math."""
import json
import os
import re
import subprocess
import sys
import types

import pytest
import torch

from minispec import bench
from tests.utils import make_tiny_model_dir, requires_smollm2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K = 4
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One --quick run: a tiny target, a draft dir with the same weights, and n-gram lookup."""
    root = tmp_path_factory.mktemp("bench")
    target = make_tiny_model_dir(str(root / "target"), with_tokenizer=True)
    draft = make_tiny_model_dir(str(root / "draft"), with_tokenizer=True)  # same seed: the target's twin
    from minispec.models.eagle import save_head
    from minispec.models.loader import load_model
    from minispec.tools.tiny import make_tiny_head

    head = str(root / "head")  # an EAGLE-3 head over 4096 of the tokens: minispec only
    save_head(make_tiny_head(load_model(target, dtype=torch.float32, device="cpu").config, draft_vocab_size=4096), head)
    out = root / "bench.json"
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    r = subprocess.run(
        [sys.executable, "-m", "minispec.bench", "--quick", "--target", target, "--draft", draft, "--draft", "ngram", "--draft", head,
         "-k", str(K), "--max-tokens", str(MAX_TOKENS), "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r, json.loads(out.read_text()), target, draft, head


@pytest.mark.slow
@requires_smollm2
def test_quick_run_table_and_json(quick_run):
    r, result, target, draft, head = quick_run
    rows = result["rows"]
    keys = {(x["system"], x["method"], x["draft"], x["batch_size"], x["temperature"]) for x in rows}
    expected = set()
    for t in (0.0, 0.8):
        expected |= {("transformers", "target-only", None, 1, t), ("transformers", "assisted", draft, 1, t),
                     ("transformers", "prompt-lookup", "ngram", 1, t), ("minispec", "target-only", None, 1, t),
                     ("minispec", "speculative", draft, 1, t), ("minispec", "speculative", "ngram", 1, t),
                     ("minispec", "adaptive-k", draft, 1, t), ("minispec", "adaptive-k", "ngram", 1, t),
                     ("minispec", "speculative", head, 1, t), ("minispec", "adaptive-k", head, 1, t)}
    assert keys == expected and len(rows) == len(expected)
    num_prompts = result["prompts"]["num"]
    for x in rows:
        assert x["tok_s"] > 0 and x["seconds"] > 0, x
        assert x["tokens"] == num_prompts * MAX_TOKENS, x  # same work for every system (ignore_eos)
        assert x["ratio_vs_transformers"] == pytest.approx(x["tok_s"] / next(
            y["tok_s"] for y in rows if y["system"] == "transformers" and y["method"] == "target-only"
            and y["temperature"] == x["temperature"]))
    for x in rows:
        if x["method"] == "adaptive-k":
            assert x["measured_speedup"] > 0 and x["alpha"] is None
            assert x["drafted_share"] is None or x["drafted_share"] >= 0
            continue
        if x["method"] != "speculative":
            assert x["alpha"] is None and x["engine_efficiency"] is None
            continue
        assert 0.0 <= x["alpha"] <= 1.0 and 0.0 <= x["acceptance_rate"] <= 1.0
        assert x["verify_ratio"] > 0 and x["predicted_speedup"] > 0 and x["engine_efficiency"] > 0
        assert x["measured_speedup"] > 0
        assert len(x["acceptance_by_position"]) == K
        if x["draft"] == "ngram":
            assert x["draft_cost_ratio"] == 0.0
        elif x["draft"] == head:  # a random head: acceptance is whatever it is, its cost is measured
            assert x["draft_cost_ratio"] > 0
        else:
            assert x["draft_cost_ratio"] > 0
            # The draft is the target's twin: every draft is accepted, so alpha is exactly 1.
            assert x["acceptance_rate"] == 1.0 and x["alpha"] == 1.0
            assert x["predicted_speedup"] == pytest.approx((K + 1) / (K * x["draft_cost_ratio"] + x["verify_ratio"]))

    roof = result["roofline"]
    assert roof["bandwidth_gb_s"] > 0 and roof["roofline_tok_s"] > 0
    # Parameter bytes of the tiny float32 target, counted from transformers' copy of it.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target)
    assert roof["bytes_per_token"] == sum(p.numel() * 4 for p in hf.parameters())
    assert roof["roofline_tok_s"] == pytest.approx(roof["bandwidth_gb_s"] * 1e9 / roof["bytes_per_token"])
    assert roof["minispec_fraction"] == pytest.approx(roof["minispec_tok_s"] / roof["roofline_tok_s"])
    assert roof["minispec_decode_tok_s"] > 0  # after each request's first token (llama-bench's tg)
    assert set(result["costs"]["verify_ratio"]) == {"1"}
    assert result["costs"]["draft_cost_ratio"]["ngram"] == {"1": 0.0}
    assert result["costs"]["draft_cost_ratio"][draft]["1"] > 0
    assert result["costs"]["draft_cost_ratio"][head]["1"] > 0
    assert "acceptance by position" in r.stdout

    # The table: header, one line per row, the roofline and cost lines.
    for needle in ("tok/s", "vs HF", "eff", "memory bandwidth", "roofline", "verify cost ratio",
                   "draft cost ratio", "transformers assisted", "transformers prompt-lookup", "minispec speculative"):
        assert needle in r.stdout, needle
    row_lines = [line for line in r.stdout.splitlines()
                 if re.match(r"(transformers|minispec) (target-only|assisted|prompt-lookup|speculative|adaptive-k) ", line)]
    assert len(row_lines) == len(rows)


def _cfg(**kw):
    cfg = bench.BenchConfig(drafts=["ngram", "/some/draft"], batch_sizes=[1, 4], temperatures=[0.0, 0.8])
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def test_rows_transformers_spec_batch1_only():
    """Assisted generation and prompt lookup rows exist at every batch size but only run at batch 1."""
    cfg = _cfg()
    model = types.SimpleNamespace(device="cpu")
    rows = bench.build_rows(cfg, model, {"/some/draft": model}, {None: None, "ngram": None, "/some/draft": None}, 0)
    assert len(rows) == 2 * 2 * (3 + 3)
    for r in rows:
        hf_spec = r.system == "transformers" and r.method != "target-only"
        assert (r.run is None) == (hf_spec and r.batch_size > 1), r.label
        assert (r.note == "batch 1 only") == (r.run is None)
    table_rows = [dict(system=r.system, method=r.method, draft=r.draft, batch_size=r.batch_size,
                       temperature=r.temperature, note=r.note, tok_s=None if r.run is None else 10.0) for r in rows]
    for col in bench.COLUMNS:
        for x in table_rows:
            bench._cell(x, col[2], col[3])
    na = [x for x in table_rows if x["tok_s"] is None]
    assert na and all(bench._cell(x, "tok_s", "{:.1f}") == "n/a" for x in na)


def test_config_precedence(tmp_path):
    """Defaults < TOML < --quick < flags; unknown TOML keys are an error."""
    f = tmp_path / "c.toml"
    f.write_text('target = "a"\ndrafts = ["ngram", "d"]\nk = 3\nmax_tokens = 50\nrounds = 5\n')
    args = bench.build_parser().parse_args(["--config", str(f), "--quick", "--max-tokens", "7", "--batch-sizes", "1,2"])
    cfg = bench.config_from_args(args)
    assert (cfg.target, cfg.drafts, cfg.k) == ("a", ["ngram", "d"], 3)  # from the file
    assert (cfg.rounds, cfg.num_prompts) == (1, 2)  # --quick over the file
    assert (cfg.max_tokens, cfg.batch_sizes) == (7, [1, 2])  # flags over --quick
    args = bench.build_parser().parse_args(["--config", str(f), "--draft", "none", "--temperatures", "0.5"])
    cfg = bench.config_from_args(args)
    assert cfg.drafts == [] and cfg.temperatures == [0.5] and cfg.max_tokens == 50
    f.write_text("batch_size = 4\n")
    with pytest.raises(ValueError, match="unknown key"):
        bench.load_config(str(f))
    with pytest.raises(ValueError, match="batch_sizes"):
        bench.check_config(_cfg(batch_sizes=[0]))


def test_shipped_config_parses():
    cfg = bench.load_config(os.path.join(ROOT, "configs", "bench-smollm2.toml"))
    bench.check_config(cfg)
    assert cfg.target == "smollm2-135m-instruct" and "ngram" in cfg.drafts
    assert cfg.batch_sizes == [1, 4, 16] and cfg.temperatures == [0.0, 0.8]
    assert cfg.drafts == ["smollm2-135m-instruct-draft", "ngram"] and cfg.adaptive


def test_batches_cycle_prompts():
    prompts = [[1], [2], [3]]
    b = bench.batches_of(prompts, 2)
    assert [[i for i, _ in x] for x in b] == [[0, 1], [2, 3]]
    assert b[1][1][1] == [1]  # index 3 cycles back to prompt 0
    assert [len(x) for x in bench.batches_of(prompts, 16)] == [16]


def test_drafted_share_counts_decode_verifications():
    """One request, hand-counted: its first token from the prompt, then a step that verified 2 drafts and accepted
    1 (2 tokens), a step without drafts (1 token), a step that accepted both of 2 (3 tokens)."""
    m = dict(num_tokens=7, num_requests=1, num_accepted_tokens=3, num_spec_verifications=2)
    assert bench.drafted_share(m) == pytest.approx(2 / 3)
    assert bench.drafted_share(dict(m, num_tokens=1, num_accepted_tokens=0, num_spec_verifications=0)) is None


def test_stream_rate():
    """GB/s of weights per token at a tok/s (one pass per step of b tokens), and the share of bandwidth."""
    r = bench.stream_rate(50.0, 100e6, 2, 10.0)
    assert r["gb_s"] == pytest.approx(2.5) and r["roofline_share"] == pytest.approx(0.25)
    assert bench.stream_rate(None, 100e6, 1, 10.0) == dict(gb_s=None, roofline_share=None)


def test_llama_cpp_decode_reads_llama_bench_json(tmp_path):
    """The decode row of llama-bench's JSON; a crash or a missing binary is a note, not an error."""
    fake = tmp_path / "llama-bench"
    fake.write_text('#!/bin/sh\necho \'[{"n_prompt": 64, "n_gen": 0, "avg_ts": 180.0}, '
                    '{"n_prompt": 0, "n_gen": 128, "avg_ts": 85.7}]\'\n')
    fake.chmod(0o755)
    ts, note = bench.llama_cpp_decode(str(fake), "m.gguf", 2, 128)
    assert ts == 85.7 and "-t 2" in note and "-n 128" in note
    crash = tmp_path / "crash"
    crash.write_text("#!/bin/sh\nkill -ILL $$\n")
    crash.chmod(0o755)
    ts, note = bench.llama_cpp_decode(str(crash), "m.gguf", 2, 128)
    assert ts is None and "SIGILL" in note
    ts, note = bench.llama_cpp_decode(str(tmp_path / "missing"), "m.gguf", 2, 128)
    assert ts is None and note.startswith("llama-bench failed")


def test_stop_at_eos_counts_each_answer_to_its_end(quick_run):
    """stop_at_eos: transformers and minispec rows count the same tokens, each answer up to its first EOS
    (here the 3rd token of a greedy answer made the EOS on both sides)."""
    from minispec import LLM

    _, _, target, _, _ = quick_run
    assert bench.answer_length([5, 7, 2, 9, 2], {2}) == 3 and bench.answer_length([5, 7], {2}) == 2
    cfg = bench.BenchConfig(target=target, stop_at_eos=True)
    prompt = [[0, [3, 14, 15, 92, 6]]]
    llm = LLM(target, None)
    _, (free,) = bench.minispec_runner(llm, bench.BenchConfig(target=target), 0.0)([prompt], 12)
    eos = free.token_ids[2]
    llm.engine.eos_token_ids = {eos}
    tokens, _ = bench.minispec_runner(llm, cfg, 0.0)([prompt], 12)
    model, _ = bench.load_hf(target, torch.float32, torch.device("cpu"))
    model.generation_config.eos_token_id = eos
    hf_tokens, _ = bench.hf_runner(model, 0, cfg, 0.0)([prompt], 12)
    assert tokens == hf_tokens == free.token_ids.index(eos) + 1
