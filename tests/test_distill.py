"""minispec.distill on tiny targets: data alignment, the loss, an end-to-end run whose checkpoint
transformers and minispec both load, and --resume."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from minispec.distill import DistillConfig, distill_loss, load_config, run_distill
from minispec.distill.__main__ import main
from minispec.distill.train import lr_at
from tests.utils import make_tiny_model_dir, requires_smollm2

ROOT = Path(__file__).resolve().parent.parent
TINY_CONFIG = str(ROOT / "configs" / "distill-tiny.toml")
pytestmark = requires_smollm2  # the tiny targets carry the SmolLM2 tokenizer (string prompts, chat template)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    path = make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_target")), with_tokenizer=True)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(path).chat_template  # so chat = "auto" templates the prompts
    return path


@pytest.fixture(scope="module")
def first_run(tiny_target, tmp_path_factory):
    """4 steps of the tiny recipe through the CLI (checkpoints at steps 2 and 4)."""
    out = tmp_path_factory.mktemp("distilled")
    assert main(["--config", TINY_CONFIG, "--target", tiny_target, "--out", str(out), "--no-progress"]) == 0
    return out


def test_loss_is_cross_entropy_to_renormalised_top_k():
    torch.manual_seed(0)
    topk_logp = torch.randn(5, 4).log_softmax(-1) - 0.5  # top-4 of a teacher, carrying e^-0.5 of its mass
    topk_ids = torch.stack([torch.randperm(10)[:4] for _ in range(5)])  # [5, 4]
    match = torch.full((5, 10), -1e9).scatter(1, topk_ids, topk_logp)  # draft = the renormalised teacher
    ce, kl = distill_loss(match, topk_ids, topk_logp)
    p = topk_logp.softmax(-1)
    torch.testing.assert_close(ce, -(p * p.log()).sum(-1))
    torch.testing.assert_close(kl, torch.zeros(5), atol=1e-5, rtol=0)
    _, kl_other = distill_loss(torch.randn(5, 10), topk_ids, topk_logp)
    assert (kl_other > 1e-3).all()


def test_lr_schedule_and_config_errors(tmp_path):
    cfg = DistillConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(cfg, 0, 100, 0.0) == pytest.approx(0.1)
    assert lr_at(cfg, 10, 100, 0.0) == pytest.approx(1.0)
    assert lr_at(cfg, 100, 100, 0.0) == pytest.approx(0.1)
    assert lr_at(cfg, 10, 100, 1.0) == pytest.approx(0.1)  # the time budget ran out first
    assert lr_at(cfg, 55, 100, 0.0) == pytest.approx(0.55)
    bad = tmp_path / "bad.toml"
    bad.write_text('init = "copy"\n')
    with pytest.raises(ValueError, match="init"):
        load_config(str(bad))
    bad.write_text("num_layerz = 2\n")
    with pytest.raises(ValueError, match="num_layerz"):
        load_config(str(bad))
    assert main(["--config", str(bad), "--out", str(tmp_path / "x")]) == 2
    assert main(["--config", TINY_CONFIG, "--target", str(tmp_path / "missing"), "--out", str(tmp_path / "y"),
                 "--no-progress"]) == 1


def test_end_to_end_checkpoint_loads_everywhere(first_run, tiny_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = first_run
    for name in ("config.json", "model.safetensors", "tokenizer.json", "metrics.json", "README.md", "data.pt",
                 "ckpt/state.pt"):
        assert (out / name).is_file(), name
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["step"] == 4 and [h["step"] for h in metrics["history"]] == [2, 4]
    final = metrics["final"]
    assert 0.0 <= final["agreement_tf"] <= 1.0 and 1.0 <= final["mean_accepted_length_tf"] <= 1 + 3
    assert 0.0 <= final["first_position_rate_engine"] <= 1.0 and final["mean_accepted_length_engine"] >= 1.0
    assert "first_position_rate_engine" in metrics["history"][0]  # engine_every = 2: evaluated mid-run too
    readme = (out / "README.md").read_text()
    assert "agreement_tf" in readme
    # The README reports this run's own figures: its parameter count and file size.
    size = metrics["size"]
    assert size["file_bytes"] == (out / "model.safetensors").stat().st_size
    assert f"parameters: {size['params'] / 1e6:.1f} M" in readme and "12.6 M" not in readme

    # transformers: a 1-layer draft with the target's (frozen) embedding and trained copy of layer 0.
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert draft.config.num_hidden_layers == 1 and draft.config.vocab_size == target.config.vocab_size
    torch.testing.assert_close(draft.model.embed_tokens.weight, target.model.embed_tokens.weight, rtol=0, atol=0)
    assert not torch.equal(draft.model.layers[0].mlp.down_proj.weight, target.model.layers[0].mlp.down_proj.weight)

    # transformers' assisted generation accepts it and stays greedy-exact.
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok("Tell me a story about a cat", return_tensors="pt").input_ids
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    plain = target.generate(ids, **kw)
    assisted = target.generate(ids, assistant_model=draft, **kw)
    assert torch.equal(plain, assisted)

    # minispec loads it as a draft; greedy output equals the target alone.
    from minispec.llm import LLM
    from minispec.sampling_params import SamplingParams

    prompts = ["Write a haiku about the sea.", "How do I boil an egg?"]
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    alone = LLM(target=tiny_target, seed=0).generate(prompts, sp, use_chat_template=True)
    spec_llm = LLM(target=tiny_target, draft=str(out), num_speculative_tokens=3, seed=0)
    spec = spec_llm.generate(prompts, sp, use_chat_template=True)
    assert [o.token_ids for o in spec] == [o.token_ids for o in alone]
    assert all(o.metrics["num_spec_verifications"] > 0 for o in spec)

    # The run's final engine eval (its LLM built at step 2, draft weights reloaded in place at step 4)
    # measured what a fresh LLM on the exported checkpoint measures.
    from minispec.data import load_prompts
    from minispec.tools.metrics import aggregate

    outs = spec_llm.generate(load_prompts("eval", limit=2), SamplingParams(temperature=0.0, max_tokens=8),
                             use_chat_template=True)
    m = aggregate(outs)
    assert final["first_position_rate_engine"] == m["accepted_per_position"][0] / m["num_spec_verifications"]
    assert final["mean_accepted_length_engine"] == m["mean_accepted_length"]


def test_resume_continues_from_checkpoint(first_run, tiny_target, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(first_run, out)
    data_mtime = (out / "data.pt").stat().st_mtime_ns
    before = torch.load(out / "ckpt" / "state.pt", weights_only=False)
    assert before["step"] == 4
    assert main(["--config", TINY_CONFIG, "--target", tiny_target, "--out", str(out), "--steps", "6",
                 "--resume", "--no-progress"]) == 0
    after = torch.load(out / "ckpt" / "state.pt", weights_only=False)
    assert after["step"] == 6
    assert [h["step"] for h in after["history"]] == [2, 4, 6]  # the first run's history carried over
    assert after["optimizer"]["state"][0]["step"].item() == 6  # AdamW went on counting, not restarting
    assert (out / "data.pt").stat().st_mtime_ns == data_mtime  # cached data reused
    w = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(before["model"][w], after["model"][w])
    with pytest.raises(FileNotFoundError):
        run_distill(load_config(TINY_CONFIG, target=tiny_target), tmp_path / "empty", resume=True, progress=False)


def test_resume_with_more_synthetic_prompts(first_run, tiny_target, tmp_path, capsys):
    """--resume --synth-prompts N: the checkpoint goes on training, on the old responses plus the new ones."""
    out = tmp_path / "grown"
    shutil.copytree(first_run, out)
    before = json.loads((out / "metrics.json").read_text())
    assert before["config"]["synth_prompts"] == 0
    assert main(["--config", TINY_CONFIG, "--target", tiny_target, "--out", str(out), "--steps", "6",
                 "--synth-prompts", "3", "--resume", "--no-progress"]) == 0
    assert "generating 3 responses" in capsys.readouterr().out
    after = json.loads((out / "metrics.json").read_text())
    assert after["step"] == 6 and after["config"]["synth_prompts"] == 3
    assert after["data"]["train_tokens"] > before["data"]["train_tokens"]
    assert [h["step"] for h in after["history"]] == [2, 4, 6]
    assert main(["--config", TINY_CONFIG, "--out", str(out), "--synth-prompts", "-1"]) == 2


def test_growing_the_prompt_set_generates_only_the_new_responses(first_run, tiny_target, tmp_path):
    """data.pt caches responses per prompt: more synthetic prompts reuse the first run's responses (same
    records, same order), the new ones are generated once, and changed generation settings refuse it."""
    from minispec.distill import build_data

    shutil.copy(first_run / "data.pt", tmp_path / "data.pt")
    before, _, _ = build_data(load_config(TINY_CONFIG, target=tiny_target), tmp_path / "data.pt", "cpu",
                              log=lambda *_: None)
    logs = []
    cfg = load_config(TINY_CONFIG, target=tiny_target, synth_prompts=3)
    grown, target, _ = build_data(cfg, tmp_path / "data.pt", "cpu", log=logs.append)
    assert target is not None and any("generating 3 responses" in m for m in logs)
    assert len(grown["train"]) == 6 + 3 and len(grown["eval"]) == 3
    for old, new in zip(before["train"] + before["eval"], grown["train"][:6] + grown["eval"]):
        assert torch.equal(old["ids"], new["ids"]) and torch.equal(old["topk_logp"], new["topk_logp"])
    assert grown["stats"]["train_tokens"] == sum(len(r["topk_ids"]) for r in grown["train"])
    assert grown["stats"]["cache_generate_s"] > before["stats"]["cache_generate_s"]

    logs.clear()
    again, target, _ = build_data(cfg, tmp_path / "data.pt", "cpu", log=logs.append)  # nothing left to make
    assert target is None and any("reusing" in m for m in logs)
    assert [r["ids"].tolist() for r in again["train"]] == [r["ids"].tolist() for r in grown["train"]]
    with pytest.raises(ValueError, match="other settings"):
        build_data(load_config(TINY_CONFIG, target=tiny_target, max_tokens=5), tmp_path / "data.pt", "cpu")


def test_draft_equal_to_target_agrees_everywhere(first_run, tiny_target, tmp_path):
    """A 'draft' that is the whole target (both layers copied, 0 steps): alpha 1 on the cached data and in
    minispec's engine, which pins the alignment of cached top-k rows to token positions."""
    out = tmp_path / "same"
    out.mkdir()
    shutil.copy(first_run / "data.pt", out / "data.pt")
    cfg = load_config(TINY_CONFIG, target=tiny_target, num_layers=2, steps=0)
    result = run_distill(cfg, out, progress=False, log=lambda *_: None)
    final = result["final"]
    assert final["agreement_tf"] == 1.0
    assert final["mean_accepted_length_tf"] > 2.5  # runs are capped at k = 3 and by the response ends
    assert final["first_position_rate_engine"] == 1.0 and final["acceptance_rate_engine"] == 1.0


def test_build_draft_options(tiny_target):
    from minispec.distill import build_draft, load_hf_target
    from minispec.distill.draft import set_trainable

    target, tokenizer = load_hf_target(tiny_target)
    assert tokenizer.chat_template
    w = "mlp.down_proj.weight"
    copy1 = build_draft(target, DistillConfig(num_layers=1, init_layers=[1]))
    torch.testing.assert_close(copy1.model.layers[0].state_dict()[w], target.model.layers[1].state_dict()[w],
                               rtol=0, atol=0)
    fresh = build_draft(target, DistillConfig(num_layers=2, init="random"))
    assert fresh.config.num_hidden_layers == 2 and fresh.config.hidden_size == target.config.hidden_size
    assert not torch.equal(fresh.model.layers[1].state_dict()[w], target.model.layers[1].state_dict()[w])
    for draft in (copy1, fresh):
        torch.testing.assert_close(draft.model.embed_tokens.weight, target.model.embed_tokens.weight, rtol=0, atol=0)
        torch.testing.assert_close(draft.lm_head.weight, target.lm_head.weight, rtol=0, atol=0)
        assert draft.config.tie_word_embeddings == target.config.tie_word_embeddings
    trainable = set_trainable(fresh, freeze_embeddings=True)
    frozen = {id(fresh.model.embed_tokens.weight), id(fresh.lm_head.weight)}  # one tensor when tied
    assert not frozen & {id(p) for p in trainable}
    assert len(set_trainable(fresh, freeze_embeddings=False)) == len(trainable) + len(frozen)
    with pytest.raises(ValueError, match="init_layers"):
        build_draft(target, DistillConfig(num_layers=1, init_layers=[2]))
    # A GGUF target's config says how its file was quantised; the draft's float checkpoint must not.
    target.config.quantization_config = {"quant_method": "gguf", "gguf_file": "x.gguf", "dequantize": False}
    assert "quantization_config" not in build_draft(target, DistillConfig(num_layers=1)).config.to_dict()


def test_tied_target_gives_tied_draft(tmp_path):
    from minispec.distill import build_draft, load_hf_target
    from minispec.distill.draft import set_trainable

    tied_dir = make_tiny_model_dir(str(tmp_path / "tied"), with_tokenizer=True, tie_word_embeddings=True)
    target, _ = load_hf_target(tied_dir)
    draft = build_draft(target, DistillConfig(num_layers=1))
    assert draft.config.tie_word_embeddings
    assert draft.lm_head.weight is draft.model.embed_tokens.weight
    torch.testing.assert_close(draft.lm_head.weight, target.model.embed_tokens.weight, rtol=0, atol=0)
    assert all(p is not draft.lm_head.weight for p in set_trainable(draft, freeze_embeddings=True))
    draft.save_pretrained(tmp_path / "d")
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "d"))
    assert again.lm_head.weight is again.model.embed_tokens.weight


def test_narrow_draft_projects_the_target_read_out(tiny_target):
    """hidden_size = d: the tied embedding is the target's LM head on the top-d directions of its final
    hidden states; at d = the target's width that basis is a rotation, so the read-out is exact."""
    from minispec.distill import build_draft, load_hf_target
    from minispec.distill.draft import hidden_basis

    target, tokenizer = load_hf_target(tiny_target)
    records = [{"ids": torch.tensor(tokenizer(p * 8).input_ids, dtype=torch.int32)}
               for p in ("Tell me about the sea. ", "How do I boil an egg? Explain in three steps. ")]
    width = target.config.hidden_size
    basis, _ = hidden_basis(target, records, width)
    torch.testing.assert_close(basis.T @ basis, torch.eye(width), atol=1e-4, rtol=0)
    h = target.model(input_ids=records[0]["ids"].long()[None]).last_hidden_state[0]  # [L, H]
    torch.testing.assert_close((h @ basis) @ (target.lm_head.weight @ basis).T, target.lm_head(h), atol=1e-4, rtol=0)

    cfg = DistillConfig(num_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=2,
                        num_key_value_heads=1, init="random", freeze_embeddings=False)
    draft = build_draft(target, cfg, records=records)
    c = draft.config
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == \
        (32, 48, 2, 1, 16)
    assert c.tie_word_embeddings and draft.lm_head.weight is draft.model.embed_tokens.weight
    basis, rms = hidden_basis(target, records, 32)
    torch.testing.assert_close(draft.model.embed_tokens.weight, target.lm_head.weight @ basis)
    torch.testing.assert_close(draft.model.norm.weight, torch.full((32,), rms))
    with pytest.raises(ValueError, match="records"):
        build_draft(target, cfg)
    with pytest.raises(ValueError, match="positions"):
        hidden_basis(target, [{"ids": records[0]["ids"][:10]}], 32)
    for bad, match in ((dict(hidden_size=32), "init"), (dict(hidden_size=32, init="random"), "freeze"),
                       (dict(intermediate_size=64), "hidden_size"), (dict(gen_temperature=0.0, samples_per_prompt=2),
                                                                     "samples_per_prompt"),
                       (dict(save_dtype="int8"), "save_dtype")):
        with pytest.raises(ValueError, match=match):
            cfg_bad = DistillConfig(**bad)
            cfg_bad.validate()
            build_draft(target, cfg_bad, records=records)


def test_narrow_bf16_draft_end_to_end(tiny_target, tmp_path):
    """The shipped recipe's shape on a tiny target: greedy bf16 responses to train + synthetic prompts, a
    narrow draft exported in bfloat16 that transformers and minispec load (greedy = target alone)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    cfg = load_config(TINY_CONFIG, target=tiny_target, hidden_size=32, num_attention_heads=2, init="random",
                      freeze_embeddings=False, save_dtype="bfloat16", gen_temperature=0.0, gen_dtype="bfloat16",
                      synth_prompts=4, steps=2, engine_every=0)
    result = run_distill(cfg, tmp_path, progress=False, log=lambda *_: None)
    assert len(torch.load(tmp_path / "data.pt", weights_only=False)["records"]) == 6 + 4 + 3
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    draft = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert draft.config.hidden_size == 32 and draft.config.num_hidden_layers == 1
    assert 0.0 <= result["final"]["first_position_rate_engine"] <= 1.0

    from minispec.llm import LLM
    from minispec.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    alone = LLM(target=tiny_target).generate(["Write a haiku about the sea."], sp)
    spec = LLM(target=tiny_target, draft=str(tmp_path), num_speculative_tokens=3).generate(
        ["Write a haiku about the sea."], sp)
    assert spec[0].token_ids == alone[0].token_ids and spec[0].metrics["num_spec_verifications"] > 0
