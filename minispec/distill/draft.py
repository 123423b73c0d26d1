"""The target as a transformers model, and the small draft built from it (same tokenizer, same vocabulary)."""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from minispec.models.loader import load_hf_model

from .config import DistillConfig


def load_hf_target(spec: str, dtype: torch.dtype = torch.float32):
    """(transformers model, tokenizer) of a target given as alias, HF directory, .gguf file or hub id:
    the teacher has the same (dequantised) weights as the target minispec verifies with, and distillation
    needs its tokenizer."""
    return load_hf_model(spec, dtype, require_tokenizer=True)


def draft_config(target_config, cfg: DistillConfig):
    """The target's config cut to cfg.num_layers layers and, when cfg.hidden_size is set, narrowed to it.

    A narrow draft keeps the target's head size, vocabulary and RoPE and ties its embedding to its LM head.
    """
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = cfg.num_layers
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list):  # qwen2 / mistral configs list one attention type per layer
        config.layer_types = layer_types[: cfg.num_layers]
    if hasattr(config, "max_window_layers"):
        config.max_window_layers = min(config.max_window_layers, cfg.num_layers)
    if cfg.hidden_size:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        ratio = config.intermediate_size / config.hidden_size
        heads = cfg.num_attention_heads or max(1, cfg.hidden_size // head_dim)
        kv_heads = cfg.num_key_value_heads or heads
        if cfg.hidden_size % heads or heads % kv_heads:
            raise ValueError(f"hidden_size {cfg.hidden_size}, num_attention_heads {heads} and num_key_value_heads "
                             f"{kv_heads} must divide evenly")
        config.hidden_size = cfg.hidden_size
        config.num_attention_heads, config.num_key_value_heads = heads, kv_heads
        config.head_dim = cfg.hidden_size // heads
        config.intermediate_size = cfg.intermediate_size or 64 * max(1, round(ratio * cfg.hidden_size / 64))
        config.tie_word_embeddings = True
    elif cfg.intermediate_size or cfg.num_attention_heads or cfg.num_key_value_heads:
        raise ValueError("intermediate_size / num_attention_heads / num_key_value_heads need hidden_size "
                         "(a full-width draft copies the target's shapes)")
    config.use_cache = True
    return clean_config(config)


def clean_config(config):
    """Drop what describes the target's file, not the draft: a GGUF source's quantization_config
    (the draft is plain float weights) and its model name."""
    for attr in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    config._name_or_path = ""
    return config


@torch.no_grad()
def hidden_basis(target, records: list[dict], dim: int, max_positions: int = 16384):
    """(basis [H, dim], rms): the top `dim` right singular vectors of the target's final (normed) hidden
    states on the records' token sequences, and the rms of the states projected on them."""
    states, n = [], 0
    for rec in records:
        ids = rec["ids"][: max_positions - n].long()[None]  # [1, L]
        h = target.model(input_ids=ids.to(target.device)).last_hidden_state[0].float()  # [L, H]
        states.append(h)
        n += len(h)
        if n >= max_positions:
            break
    hs = torch.cat(states)  # [n, H]
    if len(hs) < dim:
        raise ValueError(f"a {dim}-dimensional basis needs at least {dim} positions of text, got {len(hs)}")
    basis = torch.linalg.svd(hs, full_matrices=False)[2][:dim].T  # [H, dim]
    return basis, float((hs @ basis).pow(2).mean().sqrt())


@torch.no_grad()
def build_draft(target, cfg: DistillConfig, device="cpu", records: list[dict] | None = None):
    """A transformers causal LM with cfg.num_layers layers, initialised from the target.

    Full width (hidden_size = 0): the target's token embedding (and LM head), final norm and config; the
    decoder layers are the target's layers cfg.init_layers (default 0 .. n-1) for init="target", fresh
    ones for "random". Narrow (hidden_size = d): the tied embedding is the target's LM head projected on
    the top d directions of the target's final hidden states on `records` (so the draft's logits start as
    a rank-d reading of the target's), the final norm's scale matches, the layers are fresh.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    config = draft_config(target.config, cfg)
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    src, dst = target.model, draft.model
    if cfg.hidden_size:
        if not records:
            raise ValueError("a narrow draft (hidden_size set) needs training records to find its basis")
        basis, rms = hidden_basis(target, records, cfg.hidden_size)
        dst.embed_tokens.weight.copy_(target.lm_head.weight.float() @ basis)  # [V, d]
        dst.norm.weight.fill_(rms)
    else:
        dst.embed_tokens.weight.copy_(src.embed_tokens.weight)
        if not config.tie_word_embeddings:
            draft.lm_head.weight.copy_(target.lm_head.weight)
        dst.norm.load_state_dict(src.norm.state_dict())
    if cfg.init == "target":
        layer_ids = cfg.init_layers or list(range(cfg.num_layers))
        if max(layer_ids) >= len(src.layers) or min(layer_ids) < 0:
            raise ValueError(f"init_layers {layer_ids} out of range: the target has {len(src.layers)} layers")
        for i, j in enumerate(layer_ids):
            dst.layers[i].load_state_dict(src.layers[j].state_dict())
    if getattr(target, "generation_config", None) is not None:
        draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.to(device)


def set_trainable(draft, freeze_embeddings: bool) -> list[torch.nn.Parameter]:
    """Mark what trains; returns the trainable parameters."""
    for p in draft.parameters():
        p.requires_grad_(True)
    if freeze_embeddings:
        draft.model.embed_tokens.weight.requires_grad_(False)
        draft.lm_head.weight.requires_grad_(False)  # the same tensor when tied
    return [p for p in draft.parameters() if p.requires_grad]


def export_draft(draft, out_dir: str | Path, tokenizer=None, dtype: torch.dtype = torch.float32) -> None:
    """Write a standard Hugging Face checkpoint (config.json, model.safetensors in `dtype`, tokenizer files)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if dtype != torch.float32:
        draft = copy.deepcopy(draft).to(dtype)
    draft.save_pretrained(out_dir)  # safetensors
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
