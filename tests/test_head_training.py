"""The head's tools on a tiny target: distill/head_data.py's records and resumption, distill/head.py's run, --resume
and --init, and the trained head served by LLM(draft=DIR) with target greedy output."""
import json
from pathlib import Path

import pytest
import torch

from minispec import LLM, SamplingParams
from minispec.distill.head import HeadTrainConfig, init_head, train
from minispec.data import load_prompts
from minispec.distill.head_data import generate, load_records, read_manifest
from minispec.models.loader import load_model
from minispec.tools.config import field_help
from tests.utils import make_tiny_model_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny 8-layer target (features from layers 2, 4, 5) with the SmolLM2 tokenizer, its data and one trained head."""
    root = tmp_path_factory.mktemp("head-training")
    target = make_tiny_model_dir(str(root / "target"), seed=0, num_hidden_layers=8, with_tokenizer=True)
    quiet = lambda *a: None  # noqa: E731
    generate(target, root / "train", 6, max_tokens=10, batch=3, shard_size=2, log=quiet)
    generate(target, root / "eval", 3, max_tokens=10, batch=2, split="eval", log=quiet)
    cfg = HeadTrainConfig(data=str(root / "train"), eval_data=str(root / "eval"), out=str(root / "head"),
                          draft_vocab=64, epochs=3, batch_tokens=32, warmup_steps=2, eval_every=4, bf16=False)
    final = train(cfg, progress=False, log=quiet)
    return root, target, cfg, final


def test_records_hold_the_targets_answers_and_states(tiny):
    root, target, _, _ = tiny
    manifest = read_manifest(root / "train")
    assert len(manifest["done"]) == 6 and len(manifest["shards"]) == 3  # 2 answers a shard
    model = load_model(target, dtype=torch.float32, device="cpu").model
    for r in load_records(root / "train"):
        n = len(r["ids"]) - r["start"]  # answer tokens
        assert 1 <= n <= 10 and r["topk_ids"].shape == (n, 20) and r["topk_logp"].shape == (n, 20)
        assert r["states"].shape == (len(r["ids"]) - 1, 3 * model.hidden_size)
        assert (r["topk_logp"][:, :-1] >= r["topk_logp"][:, 1:]).all()  # the top-k, best first
        if r["temperature"] == 0:  # greedy: every answer token is the target's top-1 there
            assert torch.equal(r["ids"][r["start"]:].long(), r["topk_ids"][:, 0].long())


def test_data_resumes_with_only_the_new_prompts(tiny, tmp_path):
    root, target, _, _ = tiny
    out = tmp_path / "more"
    generate(target, out, 2, max_tokens=10, batch=2, log=lambda *a: None)
    first = read_manifest(out)["done"]
    logs = []
    generate(target, out, 3, max_tokens=10, batch=2, log=logs.append)
    assert "2 answers" in logs[0] and "1 to make" in logs[0]
    assert read_manifest(out)["done"][:2] == first and len(read_manifest(out)["done"]) == 3
    with pytest.raises(ValueError, match="other settings"):
        generate(target, out, 3, max_tokens=11, batch=2, log=lambda *a: None)


def test_trained_head_is_served_and_lossless(tiny):
    root, target, cfg, final = tiny
    head_dir = Path(cfg.out)
    assert {"config.json", "model.safetensors", "metrics.json", "README.md", "ckpt.pt"} <= {p.name for p in
                                                                                         head_dir.iterdir()}
    assert 0.0 <= final["acc_1"] <= 1.0 and final["step"] > 0
    prompts = ["The quick brown fox", "1 2 3 4"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in LLM(target=target).generate(prompts, params)]
    llm = LLM(target=target, draft=str(head_dir), num_speculative_tokens=3)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.metrics["num_draft_tokens"] for o in outs) > 0


def test_init_starts_from_an_earlier_head(tiny, tmp_path):
    root, target, cfg, _ = tiny
    model = load_model(target, dtype=torch.float32, device="cpu").model
    head = init_head(Path(cfg.out), model, (2, 4, 5))
    kept = torch.load(Path(cfg.out) / "ckpt.pt", weights_only=False)["head"]
    assert all(torch.equal(head.state_dict()[k], v) for k, v in kept.items())  # the float32 weights, not bf16's
    with pytest.raises(ValueError, match="reads target layers"):
        init_head(Path(cfg.out), model, (5,))
    again = HeadTrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "again"), "init": cfg.out, "epochs": 0.5,
                               "draft_vocab": 16})
    train(again, progress=False, log=lambda *a: None)
    trained = init_head(tmp_path / "again", model, (2, 4, 5))
    assert torch.equal(trained.draft_ids, head.draft_ids)  # the earlier vocabulary (64 ids), not a new one of 16


def test_a_second_seed_makes_new_answers_and_trains_beside_the_first(tiny, tmp_path):
    root, target, cfg, _ = tiny
    quiet = lambda *a: None  # noqa: E731
    generate(target, tmp_path / "s1", 6, max_tokens=10, batch=3, sampled_every=1, seed=1, log=quiet)
    first = {tuple(r["ids"].tolist()) for r in load_records(root / "train")}
    second = load_records(tmp_path / "s1")
    assert len(second) == 6 and all(r["temperature"] == 0.8 for r in second)
    assert sum(tuple(r["ids"].tolist()) not in first for r in second) >= 4  # sampled with another seed: new answers
    both = load_records([root / "train", tmp_path / "s1"])
    assert len(both) == 12
    run = HeadTrainConfig(**{**cfg.__dict__, "data": f"{root / 'train'},{tmp_path / 's1'}", "out": str(tmp_path / "h"),
                             "max_steps": 7})
    assert train(run, progress=False, log=quiet)["step"] == 7  # a fixed step count, whatever the epochs
    other = tmp_path / "other"
    generate(target, other, 1, max_tokens=10, batch=1, log=quiet)
    manifest = read_manifest(other)
    manifest["settings"]["capture_layers"] = [1, 2, 3]
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="layers"):
        train(HeadTrainConfig(**{**run.__dict__, "data": f"{root / 'train'},{other}"}), progress=False, log=quiet)


def test_a_prompt_file_gives_the_train_prompts_and_keeps_eval_held_out(tiny, tmp_path, capsys):
    _, target, _, _ = tiny
    quiet = lambda *a: None  # noqa: E731
    mine = ["Name three birds.", "What is a verb?", "Count to five."]
    (tmp_path / "p.json").write_text(json.dumps(mine))
    manifest = generate(target, tmp_path / "d", 2, max_tokens=10, batch=2, prompt_file=tmp_path / "p.json", log=quiet)
    assert manifest["done"] == mine[:2] and manifest["settings"]["prompt_file"] == "p.json"
    with pytest.raises(ValueError, match="other settings"):  # a cache made from the train split is not extended
        generate(target, tmp_path / "d", 3, max_tokens=10, batch=2, log=quiet)
    (tmp_path / "bad.json").write_text(json.dumps(mine + load_prompts("eval")[:1]))
    with pytest.raises(ValueError, match="1 eval prompts"):
        generate(target, tmp_path / "e", 4, max_tokens=10, prompt_file=tmp_path / "bad.json", log=quiet)
    (tmp_path / "notlist.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match="JSON list"):
        generate(target, tmp_path / "f", 1, max_tokens=10, prompt_file=tmp_path / "notlist.json", log=quiet)
    from minispec.distill.head_data import main  # the command line says it in one line, not a traceback

    with pytest.raises(SystemExit) as exit_:
        main(["--target", target, "--out", str(tmp_path / "g"), "--prompts", str(tmp_path / "bad.json")])
    assert exit_.value.code == 2 and "1 eval prompts" in capsys.readouterr().err


def test_every_training_flag_has_help_from_its_field_comment(capsys):
    from minispec.distill.head import main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--lr LR AdamW's peak learning rate (default: 0.001)" in text
    assert "--max-steps MAX_STEPS optimiser steps (0 = epochs over the data)" in text
    assert set(field_help(HeadTrainConfig)) == set(HeadTrainConfig.__dataclass_fields__)  # no flag without its help


def test_a_saved_head_evaluates_as_its_run_did(tiny, capsys):
    """--evaluate DIR: the saved head's held-out acceptance, as the run's own final eval computed it."""
    from minispec.distill.head import evaluate_head, main

    root, _, cfg, final = tiny
    ev = evaluate_head(Path(cfg.out), root / "eval", cfg.features, cfg.ttt_steps, batch_tokens=cfg.batch_tokens)
    assert [ev[f"acc_{j}"] for j in (1, 2, 3)] == [final[f"acc_{j}"] for j in (1, 2, 3)]
    main(["--evaluate", cfg.out, "--eval-data", str(root / "eval"), "--ttt-steps", "2"])
    assert f"{cfg.out}: held-out greedy acceptance over {ev['eval_positions']} positions: " in capsys.readouterr().out


def test_eval_data_without_greedy_answers_is_refused_in_one_line(tiny, tmp_path, capsys):
    """Acceptance is measured on greedy answers only: an all-sampled eval directory is an error, not "0 positions"."""
    from minispec.distill.head import evaluate_head, main

    root, target, cfg, _ = tiny
    generate(target, tmp_path / "sampled", 2, max_tokens=6, batch=2, split="eval", sampled_every=1, log=lambda *a: None)
    with pytest.raises(ValueError, match="no greedy answers"):
        evaluate_head(Path(cfg.out), tmp_path / "sampled", cfg.features, 2)
    with pytest.raises(SystemExit) as exit_:
        main(["--evaluate", cfg.out, "--eval-data", str(tmp_path / "sampled")])
    assert exit_.value.code == 2 and "holds no greedy answers" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # training refuses it too, before any step
        main(["--data", str(root / "train"), "--eval-data", str(tmp_path / "sampled"), "--out", str(tmp_path / "h")])
    assert "holds no greedy answers" in capsys.readouterr().err and not (tmp_path / "h" / "ckpt.pt").exists()


def test_exported_answers_rebuild_the_data_by_teacher_forcing(tiny, tmp_path, capsys):
    """export -> rebuild gives the records generate() made: the same ids, and states / top-k equal up to float
    summation order (one forward over the whole answer against a prefill and one decode step a token)."""
    from minispec.distill.head_data import export_answers, main, read_answers, rebuild

    root, target, _, _ = tiny
    quiet = lambda *a: None  # noqa: E731
    made = load_records(root / "train")
    n_tokens = export_answers(root / "train", tmp_path / "answers")  # the name as given, no .npz added
    assert n_tokens == sum(len(r["topk_ids"]) for r in made) and (tmp_path / "answers").is_file()
    answers = read_answers(tmp_path / "answers")
    assert answers["settings"] == read_manifest(root / "train")["settings"]
    assert answers["prompts"] == read_manifest(root / "train")["done"]
    out = tmp_path / "re"
    rebuild(target, tmp_path / "answers", out, batch_tokens=40, max_rows=2, shard_size=4, log=quiet)
    assert read_manifest(out)["settings"] == read_manifest(root / "train")["settings"]
    assert read_manifest(out)["done"] == read_manifest(root / "train")["done"]
    again = load_records(out)
    assert len(again) == len(made)
    moved = same = 0
    for a, b in zip(made, again):
        assert torch.equal(a["ids"], b["ids"]) and a["start"] == b["start"] and a["temperature"] == b["temperature"]
        assert b["ids"].dtype == torch.int32 and b["topk_ids"].dtype == torch.int32 and b["states"].dtype == torch.float16
        torch.testing.assert_close(b["states"].float(), a["states"].float(), rtol=2e-3, atol=1e-3)  # 1-2 float16 ulps
        torch.testing.assert_close(b["topk_logp"].float(), a["topk_logp"].float(), rtol=0, atol=1e-2)
        for ids_a, lp_a, ids_b in zip(a["topk_ids"].tolist(), a["topk_logp"].float().tolist(), b["topk_ids"].tolist()):
            for r, t in enumerate(ids_a):  # an id at another rank, or past the k-th, only within a near-tie
                if ids_b[r] == t:
                    same += 1
                    continue
                moved += 1
                near = lp_a[ids_a.index(ids_b[r])] if ids_b[r] in ids_a else lp_a[-1]
                assert abs(lp_a[r] - near) <= 2e-2, (r, lp_a[r], near)
    assert same > 0 and moved <= same // 10  # near-ties move few ids (none in this run: 1,200 ranks equal)
    # resumption: a directory missing its last shard rebuilds only that shard's answers
    manifest = read_manifest(out)
    last = torch.load(out / manifest["shards"][-1], weights_only=False)
    manifest["shards"], manifest["done"] = manifest["shards"][:-1], manifest["done"][: -len(last)]
    (out / "manifest.json").write_text(json.dumps(manifest))
    logs = []
    rebuild(target, tmp_path / "answers", out, batch_tokens=40, max_rows=2, shard_size=4, log=logs.append)
    assert f"{len(made) - len(last)} answers" in logs[0] and f"{len(last)} to rebuild" in logs[0]
    assert [torch.equal(a["states"], b["states"]) for a, b in zip(again, load_records(out))] == [True] * len(made)
    # the command line: export, then one-line errors for a file of another target and a file that is not one
    main(["--out", str(root / "train"), "--export", str(tmp_path / "cli.npz")])
    assert "answer tokens" in capsys.readouterr().out
    other = make_tiny_model_dir(str(tmp_path / "other"), seed=1, num_hidden_layers=8, with_tokenizer=True)
    with pytest.raises(ValueError, match="holds answers of"):
        rebuild(other, tmp_path / "cli.npz", tmp_path / "x", log=quiet)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(SystemExit) as exit_:
        main(["--target", target, "--out", str(tmp_path / "y"), "--from-answers", str(tmp_path / "junk.npz")])
    assert exit_.value.code == 2 and "not an answers file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "y"), "--export", "a.npz", "--from-answers", str(tmp_path / "cli.npz")])
    assert "give one" in capsys.readouterr().err
    with pytest.raises(ValueError, match="other settings"):  # a directory of other data is not mixed with these
        rebuild(target, tmp_path / "cli.npz", root / "eval", log=quiet)


def test_branched_greedy_answers_continue_greedily_after_the_second_choice(tiny, tmp_path):
    root, target, _, _ = tiny
    made = dict(zip(read_manifest(root / "train")["done"], load_records(root / "train")))  # prompt -> record
    manifest = generate(target, tmp_path / "br", 6, max_tokens=10, batch=3, sampled_every=0, branch_within=4,
                        log=lambda *a: None)
    assert manifest["settings"]["branch_within"] == 4 and sorted(manifest["done"]) == sorted(made)
    greedy = 0
    for prompt, b in zip(manifest["done"], load_records(tmp_path / "br")):
        assert b["temperature"] == 0
        assert torch.equal(b["ids"][b["start"]:].long(), b["topk_ids"][:, 0].long())  # greedy after the branch
        assert len(b["topk_ids"]) == len(b["ids"]) - b["start"] and b["states"].shape[0] == len(b["ids"]) - 1
        a = made[prompt]
        if a["temperature"] != 0:
            continue
        greedy += 1  # the fixture's greedy answer to the same prompt
        prompt_len = a["start"]
        at = b["start"] - 1  # the second choice's index
        assert prompt_len <= at < prompt_len + 4
        assert torch.equal(b["ids"][:at], a["ids"][:at])  # the greedy answer up to the branch
        assert int(b["ids"][at]) == int(a["topk_ids"][at - prompt_len, 1]) != int(a["ids"][at])  # its second choice
    assert greedy == 3
    with pytest.raises(ValueError, match="branch-within -1"):
        generate(target, tmp_path / "neg", 1, branch_within=-1, log=lambda *a: None)


def test_bf16_autocast_defaults_to_cpus_that_have_it(monkeypatch):
    """Emulated bfloat16 matmuls are several times slower than float32 (an AVX2 Zen 3: 6x), so the head trains in
    float32 there unless --bf16 true is given."""
    import minispec.kernels as kernels

    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    assert HeadTrainConfig().bf16 is False
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert HeadTrainConfig().bf16 is True
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    assert HeadTrainConfig().bf16 is True
