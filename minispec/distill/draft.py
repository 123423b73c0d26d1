"""The target as a transformers model, and the small draft built from it (same tokenizer, same vocabulary)."""
from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch

from minispec.models.loader import ALIASES, ModelLoadError, resolve_alias

from .config import DistillConfig


def load_hf_target(spec: str, dtype: torch.dtype = torch.float32):
    """(transformers model, tokenizer) of a target given as alias, HF directory, .gguf file or hub id.

    A GGUF is dequantised by transformers, exactly as minispec's loader does, so the teacher here and
    the target minispec verifies with have the same weights.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(spec).expanduser()
    if spec.lower() in ALIASES:
        path = Path(resolve_alias(spec))
    if path.is_file() and path.suffix.lower() == ".gguf":
        source, kwargs = str(path.parent), {"gguf_file": path.name}
    elif path.is_dir() or "/" in spec and not spec.startswith(("/", ".", "~")):
        source, kwargs = str(path) if path.is_dir() else spec, {}
    else:
        raise ModelLoadError(f"target not found: {spec} (an alias, HF directory, .gguf file or hub id)")
    try:
        from minispec.models.loader import _quiet_progress_bars as quiet  # hides the GGUF dequantisation bar
    except ImportError:
        quiet = contextlib.nullcontext
    try:
        with quiet():
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    except Exception as e:
        raise ModelLoadError(f"could not load target {spec}: {str(e).strip().splitlines()[0]}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    except Exception as e:
        raise ModelLoadError(f"could not load the tokenizer of {spec} (distillation needs one): {e}") from None
    return model.eval(), tokenizer


def draft_config(target_config, num_layers: int):
    """The target's config with num_layers decoder layers (same hidden size, heads, vocabulary, RoPE)."""
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = num_layers
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list):  # qwen2 / mistral configs list one attention type per layer
        config.layer_types = layer_types[:num_layers]
    if hasattr(config, "max_window_layers"):
        config.max_window_layers = min(config.max_window_layers, num_layers)
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
def build_draft(target, cfg: DistillConfig, device="cpu"):
    """A transformers causal LM with cfg.num_layers layers, initialised from the target.

    Always the target's token embedding (and LM head), final norm and config; the decoder layers are
    the target's layers cfg.init_layers (default 0 .. n-1) for init="target", fresh ones for "random".
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    config = draft_config(target.config, cfg.num_layers)
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    src, dst = target.model, draft.model
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


def export_draft(draft, out_dir: str | Path, tokenizer=None) -> None:
    """Write a standard Hugging Face checkpoint (config.json, model.safetensors, tokenizer files)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(out_dir)  # safetensors
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
