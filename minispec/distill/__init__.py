"""Distil a small draft model for a target: python -m minispec.distill --target T --out DIR.

The draft shares the target's tokenizer and vocabulary and is trained on the target's own responses to
the bundled train prompts against the target's cached top-k next-token probabilities. DistillConfig's
defaults keep the target's hidden size (its embedding and tied LM head, frozen, plus a copy of its first
2 layers); configs/distill-smollm2.toml, the shipped draft's recipe, builds a narrower one (hidden 256, its
embedding the target's LM head projected on the target's top hidden directions). The result is a
standard Hugging Face checkpoint that transformers and minispec load.
"""
from .config import DistillConfig, load_config
from .data import build_data, teacher_topk
from .draft import build_draft, export_draft, load_hf_target
from .train import distill_loss, evaluate_teacher_forced, run_distill

__all__ = ["DistillConfig", "build_data", "build_draft", "distill_loss", "evaluate_teacher_forced",
           "export_draft", "load_config", "load_hf_target", "run_distill", "teacher_topk"]
