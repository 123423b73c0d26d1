"""minispec: a compact speculative-decoding engine."""
from minispec.sampling_params import SamplingParams


def __getattr__(name):
    # LLM pulls in torch and transformers; import it on first use so `import minispec` stays light.
    if name in ("LLM", "RequestOutput"):
        from minispec import llm

        return getattr(llm, name)
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams"]
