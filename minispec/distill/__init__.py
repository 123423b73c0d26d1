"""Distil a small draft model for a target: python -m minispec.distill --target T --out DIR.

The draft shares the target's tokenizer, vocabulary and hidden size; by default it is the target's
embedding (tied LM head, frozen) plus a copy of the target's first 2 layers, trained on the target's
own responses to the bundled train prompts against the target's cached top-32 next-token
probabilities. The result is a standard Hugging Face checkpoint that transformers and minispec load.
"""
from .config import DistillConfig, load_config
from .data import build_data, teacher_topk
from .draft import build_draft, export_draft, load_hf_target
from .train import distill_loss, evaluate_teacher_forced, run_distill

__all__ = ["DistillConfig", "build_data", "build_draft", "distill_loss", "evaluate_teacher_forced",
           "export_draft", "load_config", "load_hf_target", "run_distill", "teacher_topk"]
