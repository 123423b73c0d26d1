"""The distillation recipe: one flat dataclass, read from a TOML file (configs/distill-*.toml)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from minispec.tools.config import load_settings


@dataclass
class DistillConfig:
    """What to build, on what data, and how to train it: a full-width draft by default (configs/distill-smollm2.toml
    is the shipped draft's recipe)."""

    target: str = "smollm2-135m-instruct"
    device: str = "auto"  # "auto": cuda if available, else cpu
    seed: int = 0
    threads: int = 0  # torch intra-op threads; 0 = torch's default (1 is often fastest on a busy shared CPU)

    # ---- draft -----------------------------------------------------------------------------
    num_layers: int = 2  # decoder layers of the draft
    hidden_size: int = 0  # 0 = the target's; smaller: embedding = the target's projected on its top hidden directions
    intermediate_size: int = 0  # MLP width; 0 = the target's (same hidden) or the target's ratio to hidden
    num_attention_heads: int = 0  # 0 = the target's (same hidden) or hidden / the target's head_dim
    num_key_value_heads: int = 0  # 0 = the target's (same hidden) or num_attention_heads
    init: str = "target"  # "target": copy target layers `init_layers`; "random": fresh layers
    init_layers: list[int] = field(default_factory=list)  # target layer ids to copy; [] = the first num_layers
    freeze_embeddings: bool = True  # the target's token embedding (and LM head, tied or not) stays fixed
    save_dtype: str = "float32"  # dtype of the exported model.safetensors ("bfloat16" halves the file)

    # ---- data: the target's own responses, then its top-k next-token logits per token -------
    train_prompts: int = 0  # train-split prompts used; 0 = all
    eval_prompts: int = 24  # eval-split prompts whose responses form the held-out set
    synth_prompts: int = 0  # extra train prompts from minispec/data/synth.json (templates x topics); 0 = none
    samples_per_prompt: int = 1  # responses per train prompt (distinct seeds)
    max_tokens: int = 128  # response length cap
    gen_temperature: float = 0.8  # 0 = greedy: the text the target writes at greedy decoding
    gen_batch: int = 32  # max_num_seqs of minispec's engine while generating
    gen_dtype: str = "float32"  # the target's dtype while generating ("bfloat16": ~2x faster on AMX CPUs)
    teacher_dtype: str = "float32"  # the target's dtype for the cached top-k
    chat: str = "auto"  # "auto" (use the chat template when the tokenizer has one), "true", "false"
    top_k: int = 32  # teacher logits cached per token
    teacher_batch: int = 8  # sequences per teacher forward

    # ---- training ----------------------------------------------------------------------------
    steps: int = 4000
    time_budget_min: float = 0.0  # minutes of training per invocation; 0 = no limit
    batch_size: int = 8  # sequences per step
    max_seq_len: int = 512  # prompt + response tokens kept per sequence
    lr: float = 5e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    bf16: bool = True  # autocast the draft's matmuls to bfloat16 (AMX / tensor cores); master weights fp32
    ckpt_every: int = 200
    eval_every: int = 100  # teacher-forced agreement on the held-out set, every this many steps

    # ---- speculative eval with minispec's engine ---------------------------------------------
    engine_prompts: int = 8  # eval prompts run greedy with LLM(target, draft); 0 = skip
    engine_max_tokens: int = 64
    engine_k: int = 4  # num_speculative_tokens
    engine_every: int = 0  # steps between engine evals; 0 = only at the end

    def validate(self) -> None:
        """Raise ValueError (one line, naming the field) on settings that make no sense."""
        if self.init not in ("target", "random"):
            raise ValueError(f"init must be 'target' or 'random', got {self.init!r}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.init_layers and len(self.init_layers) != self.num_layers:
            raise ValueError(f"init_layers names {len(self.init_layers)} layers but num_layers is {self.num_layers}")
        if self.chat not in ("auto", "true", "false"):
            raise ValueError(f"chat must be 'auto', 'true' or 'false', got {self.chat!r}")
        for name in ("top_k", "batch_size", "max_seq_len", "max_tokens", "gen_batch", "teacher_batch",
                     "samples_per_prompt", "ckpt_every", "eval_every", "engine_k", "engine_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("threads", "steps", "train_prompts", "synth_prompts", "eval_prompts", "engine_prompts", "engine_every",
                     "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = derived from the target), got {getattr(self, name)}")
        if self.hidden_size and self.init == "target":
            raise ValueError("init = 'target' copies the target's layers and needs its hidden size: "
                             "set hidden_size = 0 or init = 'random'")
        if self.hidden_size and self.freeze_embeddings:
            raise ValueError("a draft with its own hidden_size trains its (projected) embedding: "
                             "set freeze_embeddings = false")
        for name in ("gen_dtype", "teacher_dtype", "save_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"{name} must be 'float32', 'bfloat16' or 'float16', got {getattr(self, name)!r}")
        if self.gen_temperature < 0:
            raise ValueError(f"gen_temperature must be >= 0, got {self.gen_temperature}")
        if self.gen_temperature == 0 and self.samples_per_prompt > 1:
            raise ValueError("samples_per_prompt > 1 needs gen_temperature > 0 (greedy responses would repeat)")
        if self.time_budget_min < 0:
            raise ValueError(f"time_budget_min must be >= 0, got {self.time_budget_min}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")

    def data_key(self) -> dict:
        """The fields that decide each cached response (data.pt is reused only when these match)."""
        keys = ("target", "seed", "max_tokens", "gen_temperature", "gen_dtype", "teacher_dtype", "chat", "top_k")
        return {k: getattr(self, k) for k in keys}

    def as_dict(self) -> dict:
        return asdict(self)


def load_config(path: str | None = None, **overrides) -> DistillConfig:
    """The defaults < a TOML file < keyword overrides (None values are ignored); validated."""
    return load_settings(DistillConfig, path, overrides)
