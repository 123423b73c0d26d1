"""Logprobs in OpenAI's two shapes: /v1/completions' legacy lists and /v1/chat/completions' content entries.

The values are the engine's (SamplingParams.logprobs): the raw log-softmax of the target's logits, before
temperature, top-k and top-p. A token's text is its own decode (special tokens spelled out); text_offset counts
the characters each token adds to the choice's text, so it is approximate where one character spans tokens.
"""
from __future__ import annotations

from collections.abc import Callable

MIN_LOGPROB = -9999.0  # what -inf is written as (JSON has no infinity), as vLLM writes it


class LogprobsShape:
    """One choice's logprobs, fragment by fragment: a stream's chunks join to the whole answer's.

    token_text(id): a token's text, special tokens spelled out; shown(id): the text it adds to the answer."""

    def __init__(self, chat: bool, token_text: Callable[[int], str], shown: Callable[[int], str]):
        self.chat = chat
        self.token_text, self.shown = token_text, shown
        self.offset = 0  # characters of the choice's text before the next token (completions' text_offset)

    def fragment(self, entries: list[tuple[int, tuple | None]]) -> dict:
        """(token id, its (logprob, [(id, logprob)] most likely first) or None: a first prompt token) -> the shape."""
        if self.chat:
            return {"content": [self._chat_entry(t, lp, top) for t, (lp, top) in entries]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, entry in entries:
            out["tokens"].append(self.token_text(t))
            out["text_offset"].append(self.offset)
            self.offset += len(self.shown(t))
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            lp, top = entry
            out["token_logprobs"].append(_finite(lp))
            alternatives = {}  # token text -> logprob: the most likely first, then the chosen token if not among them
            for tid, x in [*top, (t, lp)]:
                alternatives.setdefault(self.token_text(tid), _finite(x))
            out["top_logprobs"].append(alternatives)
        return out

    def _chat_entry(self, t: int, lp: float, top: list[tuple[int, float]]) -> dict:
        return {**self._chat_token(t, lp), "top_logprobs": [self._chat_token(tid, x) for tid, x in top]}

    def _chat_token(self, t: int, lp: float) -> dict:
        text = self.token_text(t)
        return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode("utf-8"))}


def _finite(x: float) -> float:
    return max(x, MIN_LOGPROB)
