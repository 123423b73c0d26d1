"""GGUF files read directly (models/gguf.py): tensors equal transformers' dequantisation, packed models
equal the float32 model on the dequantised weights, tensor-parallel shards, one-line errors."""
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

from minispec.kernels.cpu import ops
from minispec.kernels.ggml import Q4_1, Q4_1_SPLIT, Q8_0, file_type
from minispec.layers.linear import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from minispec.layers.quant import PackedWeight, kernel_qtype
from minispec.models.errors import ModelLoadError
from minispec.layers.rotary import rope_parameters
from minispec.models.gguf import GGUF_CONFIG_KEYS, GGUFFile
from minispec.models.llama import SUPPORTED_MODEL_TYPES, head_dim_of, sliding_window_of
from minispec.models.loader import load_model
from tests.test_models import new_kv, prompt, run
from tests.utils import make_tiny_gguf, requires_smollm2, smollm2_gguf_path

FORMATS = ["Q4_0", "Q4_1", "Q8_0", "F16"]


def hf_from_gguf(path):
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


@pytest.mark.parametrize("qtype", FORMATS)
def test_tensors_equal_transformers_dequantisation(qtype, tmp_path):
    """Every tensor, dequantised, equals transformers' (q/k rows back in Hugging Face order), bit for bit."""
    path = make_tiny_gguf(tmp_path / "m.gguf", qtype, tied=False)
    ref = hf_from_gguf(path).state_dict()
    with GGUFFile(path) as f:
        weights = f.weights(f.config(), dense=True)
        assert set(weights) == set(ref)
        for name in ref:
            assert torch.equal(weights[name], ref[name]), name


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_packed_model_equals_float32_model(qtype, tmp_path):
    """Packed model logits == transformers' float32 model on the dequantised GGUF (abs 1e-4, as for
    safetensors checkpoints) and == minispec's dense model (abs 1e-5): only summation order differs."""
    path = make_tiny_gguf(tmp_path / "m.gguf", qtype, types={"token_embd.weight": "Q8_0"})
    packed = load_model(path, dtype=torch.float32, device="cpu").model
    dense = load_model(path, dtype=torch.float32, device="cpu", packed=False).model
    assert isinstance(packed.layers[0].qkv_proj.weight, PackedWeight)
    assert isinstance(packed.embed_tokens.weight, PackedWeight)
    assert not isinstance(dense.layers[0].qkv_proj.weight, PackedWeight)
    ids = prompt(24, seed=2)
    hf = hf_from_gguf(path)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = run(packed, new_kv(packed), [0], [0], [ids])[0]
    assert ref.std() > 0.1
    assert (ours - ref).abs().max().item() <= 1e-4
    assert (ours - run(dense, new_kv(dense), [0], [0], [ids])[0]).abs().max().item() <= 1e-5
    # decode-sized forwards (the packed kernel's row loop) against the prefill's rows
    kv = new_kv(packed)
    run(packed, kv, [0], [0], [ids[:20]])
    step = run(packed, kv, [0], [20], [ids[20:]])[0]  # 4 rows
    assert (step - ours[20:]).abs().max().item() <= 1e-4
    for i in range(20, 24):  # one row at a time (the split rows' one-row kernel where the build has it)
        assert (run(packed, kv, [0], [i], [ids[i : i + 1]])[0] - ours[i]).abs().max().item() <= 1e-4


def test_q4_layers_load_in_the_kernels_layout(tmp_path, monkeypatch):
    """Q4 layers load tiled where the AMX kernel runs them (whole groups of 16 rows), else split where the AVX-512
    one-row kernel reads them so; the embedding (the tied LM head, its rows looked up by id) tiles too where Q4, and
    Q8_0 stays.
    The file's values: the same logits as the file's layout (MINISPEC_FILE_LAYOUT=1) and the split one
    (MINISPEC_NO_TILES=1), abs 1e-5."""
    for embed in ("Q8_0", "Q4_1"):
        path = make_tiny_gguf(tmp_path / f"m-{embed}.gguf", "Q4_1", types={"token_embd.weight": embed})
        monkeypatch.delenv("MINISPEC_NO_TILES", raising=False)
        monkeypatch.delenv("MINISPEC_FILE_LAYOUT", raising=False)
        kernel = load_model(path, dtype=torch.float32, device="cpu").model
        w = kernel.layers[0].gate_up_proj.weight
        assert w.qtype == kernel_qtype(Q4_1, "cpu", w.shape[0])
        monkeypatch.setenv("MINISPEC_NO_TILES", "1")
        split = load_model(path, dtype=torch.float32, device="cpu").model
        monkeypatch.setenv("MINISPEC_FILE_LAYOUT", "1")
        file = load_model(path, dtype=torch.float32, device="cpu").model
        assert file.layers[0].gate_up_proj.weight.qtype == Q4_1
        assert w.tiled == (ops() is not None and ops().packed_amx())
        assert split.layers[0].gate_up_proj.weight.qtype == (Q4_1_SPLIT if ops() is not None and ops().PACKED_SPLIT else Q4_1)
        e = kernel.embed_tokens.weight
        assert e.tiled == (embed == "Q4_1" and ops() is not None and ops().packed_amx() and e.shape[0] % 16 == 0)
        assert file_type(e.qtype) == (Q8_0 if embed == "Q8_0" else Q4_1)
        ids = prompt(12, seed=3)
        for model in (kernel, split):
            assert torch.equal(model.layers[0].gate_up_proj.weight.dequantize(), file.layers[0].gate_up_proj.weight.dequantize())
            for M in (12, 1):
                a = run(model, new_kv(model), [0], [0], [ids[:M]])[0]
                b = run(file, new_kv(file), [0], [0], [ids[:M]])[0]
                assert (a - b).abs().max().item() <= 1e-5


def rank(r: int, tp: int):
    """A stand-in TP group for loading shards (its all_reduce returns this rank's partial sum)."""
    return SimpleNamespace(world_size=tp, rank_in_group=r, all_reduce=lambda x: x)


def test_tp_shards_of_packed_layers(tmp_path):
    """Column shards are row blocks, row-parallel shards block-aligned column slices; the partial sums add up."""
    path = make_tiny_gguf(tmp_path / "m.gguf", "Q4_1")
    with GGUFFile(path) as f:
        weights = f.weights(f.config())
        up = weights["model.layers.0.mlp.up_proj.weight"]  # [128, 64]
        down = weights["model.layers.0.mlp.down_proj.weight"]  # [64, 128]
        embed = weights["model.embed_tokens.weight"]  # [256, 64]
        x = torch.randn(3, 128)
        total = 0
        for r in range(2):
            col = ColumnParallelLinear(64, [128], False, tp_group=rank(r, 2), dtype=torch.float32, device="cpu",
                                       packed=True)
            col.load_part(0, up)
            assert torch.equal(col.weight.dequantize(), up.dequantize()[64 * r : 64 * (r + 1)])
            row = RowParallelLinear(128, 64, False, tp_group=rank(r, 2), dtype=torch.float32, device="cpu",
                                    packed=True)
            row.load(down)
            assert torch.equal(row.weight.dequantize(), down.dequantize()[:, 64 * r : 64 * (r + 1)])
            total = total + row(x[:, 64 * r : 64 * (r + 1)])
            emb = VocabParallelEmbedding(255, 64, tp_group=rank(r, 2), dtype=torch.float32, device="cpu", packed=True)
            emb.load(embed.rows(0, 255))
            assert torch.equal(emb.weight.dequantize()[: emb.num_real], embed.dequantize()[128 * r : 128 * r + emb.num_real])
            assert not emb.weight.dequantize()[emb.num_real :].any()  # the padded row is zero
        assert (total - F.linear(x, down.dequantize())).abs().max() <= 1e-5 * F.linear(x, down.dequantize()).abs().max()
        # a shard boundary inside a block of 32 is an error
        bad = RowParallelLinear(96, 64, False, tp_group=rank(1, 2), dtype=torch.float32, device="cpu", packed=True)
        with pytest.raises(ValueError, match="not block-aligned"):
            bad.load(down.cols(0, 96))


def test_fused_parts_of_different_types_is_an_error(tmp_path):
    path = make_tiny_gguf(tmp_path / "m.gguf", "Q4_1", types={"blk.0.attn_k.weight": "Q8_0"})
    with pytest.raises(ModelLoadError, match="stored differently"):
        load_model(path, dtype=torch.float32, device="cpu")


def test_unsupported_tensor_type_names_the_supported_ones(tmp_path):
    path = make_tiny_gguf(tmp_path / "m.gguf", "Q4_1", types={"blk.1.ffn_up.weight": "Q5_0"})
    with pytest.raises(ModelLoadError) as e:
        load_model(path, dtype=torch.float32, device="cpu")
    msg = str(e.value)
    assert "\n" not in msg and "Q5_0" in msg and "blk.1.ffn_up.weight" in msg
    assert "Q4_0, Q4_1, Q8_0, F16, BF16" in msg


@pytest.mark.parametrize("cut", [0.5, 0.02])
def test_truncated_gguf_is_a_one_line_error(cut, tmp_path):
    """Cut in the tensor data (0.5) or inside the header (0.02)."""
    path = make_tiny_gguf(tmp_path / "m.gguf", "Q8_0")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: int(len(data) * cut)])
    with pytest.raises(ModelLoadError, match="truncated or corrupt") as e:
        load_model(path, dtype=torch.float32, device="cpu")
    assert "\n" not in str(e.value)


def test_not_a_gguf_is_a_one_line_error(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"not a gguf file at all, just some bytes" * 4)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(str(path), dtype=torch.float32, device="cpu")


def test_gguf_tokenizer_is_cached_by_header(tmp_path, monkeypatch):
    """The tokenizer built from a GGUF is saved once and read back; another header builds its own."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    import minispec.models.loader as loader

    inner = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    built = PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="[UNK]")
    calls = []
    monkeypatch.setattr(loader, "_load_tokenizer", lambda *a: calls.append(a) or built)
    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path))
    first = loader._gguf_tokenizer(tmp_path / "m.gguf", b"header", "m")
    again = loader._gguf_tokenizer(tmp_path / "m.gguf", b"header", "m")
    assert len(calls) == 1 and again is not built
    assert again("a b a")["input_ids"] == first("a b a")["input_ids"] == [1, 2, 1]
    (cache,) = (tmp_path / "gguf-tokenizers").iterdir()
    auto = AutoTokenizer.from_pretrained(cache)  # what the cache read went through before
    assert type(again) is type(auto) and auto("a b a")["input_ids"] == [1, 2, 1]
    loader._gguf_tokenizer(tmp_path / "m.gguf", b"another header", "m")
    assert len(calls) == 2


# ---- the config, built without transformers' model-config modules ----------------------------

CONFIG_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
                 "hidden_act", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")


def transformers_config(f: GGUFFile, model_type: str):
    """The config transformers builds from the same metadata: its GGUF key mapping, AutoConfig.for_model."""
    values = {hf: v.tolist() if hasattr(v, "tolist") else v for key, hf in GGUF_CONFIG_MAPPING[model_type].items()
              if hf is not None and (v := f.metadata.get(f"{f.architecture}.{key}")) is not None}
    if "vocab_size" not in values and "tokenizer.ggml.tokens" in f.metadata:
        values["vocab_size"] = len(f.metadata["tokenizer.ggml.tokens"])
    values["tie_word_embeddings"] = "output.weight" not in f.tensors
    for key, hf in (("bos", "bos"), ("eos", "eos"), ("padding", "pad")):
        if f"tokenizer.ggml.{key}_token_id" in f.metadata:
            values[f"{hf}_token_id"] = int(f.metadata[f"tokenizer.ggml.{key}_token_id"])
    return AutoConfig.for_model(model_type, **values)


def assert_same_config(ours, ref):
    for name in CONFIG_FIELDS:
        assert getattr(ours, name, None) == getattr(ref, name, None), name
    for name in ("attention_bias", "mlp_bias"):  # read as getattr(config, name, False)
        assert bool(getattr(ours, name, False)) == bool(getattr(ref, name, False)), name
    assert head_dim_of(ours) == head_dim_of(ref)
    assert sliding_window_of(ours) == sliding_window_of(ref)
    assert rope_parameters(ours) == rope_parameters(ref)


def test_gguf_config_keys_are_transformers_mapping():
    for model_type in SUPPORTED_MODEL_TYPES:
        assert GGUF_CONFIG_KEYS[model_type] == {k: v for k, v in GGUF_CONFIG_MAPPING[model_type].items() if v}


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_gguf_config_equals_transformers(model_type, tmp_path):
    """GGUFFile.config() == transformers' config of the same metadata on every field minispec reads, for a
    llama file and the same file read as mistral (renamed, as llama.cpp stores it) and qwen2."""
    with GGUFFile(make_tiny_gguf(tmp_path / "m.gguf", tied=False)) as f:
        if model_type == "mistral":
            f.metadata["general.name"] = "Mistral tiny"
        if model_type == "qwen2":
            f.metadata = {k.replace("llama.", "qwen2.", 1): v for k, v in f.metadata.items()}
            f.metadata["general.architecture"] = "qwen2"
        f.metadata.pop(f"{f.architecture}.context_length", None)  # transformers' default, per model type
        assert_same_config(f.config(), transformers_config(f, model_type))


@requires_smollm2
def test_smollm2_gguf_config_equals_transformers():
    with GGUFFile(smollm2_gguf_path()) as f:
        assert_same_config(f.config(), transformers_config(f, "llama"))
