"""The one error type of model loading."""
from __future__ import annotations


class ModelLoadError(ValueError):
    """A model could not be loaded; the message is one human-readable line (the CLI prints it)."""
