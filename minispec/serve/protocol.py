"""The OpenAI API's request fields, checked into a Job, and its error shape."""
from __future__ import annotations

import json
import numbers
from dataclasses import dataclass

from minispec.sampling_params import SamplingParams

# Fields of the OpenAI API this server does not implement: the value each must keep (or omit).
UNSUPPORTED = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "logprobs": (None, False, 0),
    "top_logprobs": (None, 0), "suffix": (None, ""), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []),
}
ROLES = ("system", "user", "assistant", "developer", "tool")


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> bytes:
        """One line of JSON."""
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return json.dumps({"error": error}).encode()


@dataclass(slots=True)
class Job:
    """A checked generation request."""

    chat: bool
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object, else a 400."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(body).__name__}")
    return body


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _or(body: dict, name: str, default):
    """body[name], or default where it is missing or null."""
    value = body.get(name)
    return default if value is None else value


def _typed(body: dict, name: str, kinds: tuple, what: str, default=None):
    """body[name] if present and not null, checked against kinds; else default."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise APIError(400, f"{name} must be {what}, got {json.dumps(value)[:80]}", param=name)
    return value


def parse_job(body: dict, chat: bool, llm, model_name: str) -> Job:
    """Check a /v1/completions or /v1/chat/completions body against the model; raise APIError (4xx) on bad input."""
    model = body.get("model")
    if model is not None and model != model_name:
        raise APIError(404, f"the model {json.dumps(model)[:80]} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")
    for name, allowed in UNSUPPORTED.items():
        if name in body and body[name] not in allowed:
            raise APIError(400, f"{name}={json.dumps(body[name])[:40]} is not supported by this server", param=name)
    try:
        prompt_ids = _chat_ids(body, llm) if chat else _prompt_ids(body, llm)
    except ValueError as e:  # a tokenizer or chat-template failure
        raise APIError(400, str(e), param="messages" if chat else "prompt") from None
    max_len = llm.engine.config.max_model_len
    if len(prompt_ids) >= max_len:
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; the context holds {max_len} (including at "
                       "least one generated)", param="messages" if chat else "prompt", code="context_length_exceeded")
    max_tokens = body.get("max_completion_tokens") if chat and body.get("max_tokens") is None else body.get("max_tokens")
    if max_tokens is None:  # OpenAI's defaults: 16 for completions, the rest of the context for chat
        max_tokens = max_len - len(prompt_ids) if chat else 16
    stop = _typed(body, "stop", (str, list), "a string or a list of strings", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise APIError(400, "stop must be a string or a list of strings", param="stop")
    stream = _typed(body, "stream", (bool,), "true or false", False)
    options = _typed(body, "stream_options", (dict,), "an object", {})
    top_k = body.get("top_k")
    try:
        params = SamplingParams(
            temperature=_or(body, "temperature", 1.0), top_p=_or(body, "top_p", 1.0),
            top_k=0 if top_k is None or top_k == -1 else top_k,  # -1 = off, as vLLM spells it
            max_tokens=max_tokens, seed=body.get("seed"),
            ignore_eos=_typed(body, "ignore_eos", (bool,), "true or false", False),
            stop_token_ids=_typed(body, "stop_token_ids", (list,), "a list of token ids", None),
        )
    except ValueError as e:  # SamplingParams names the field first: "temperature must be >= 0, got -1"
        message = str(e)
        raise APIError(400, message, param=message.split(" ", 1)[0]) from None
    return Job(chat, prompt_ids, params, stop, stream, bool(options.get("include_usage", False)))


def _prompt_ids(body: dict, llm) -> list[int]:
    """prompt: a string or a list of token ids (or a batch of one of either)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        ids = llm.encode(prompt, use_chat_template=False)
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        ids = [int(t) for t in prompt]
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, f"got {len(prompt)} prompts; this server takes one per request", param="prompt")
    else:
        raise APIError(400, "prompt must be a non-empty string or list of token ids", param="prompt")
    vocab = llm.engine.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt")
    if not ids:
        raise APIError(400, "prompt is empty after tokenization", param="prompt")
    return ids


def _chat_ids(body: dict, llm) -> list[int]:
    """messages: [{"role", "content": a string or a list of text parts}] through the model's chat template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise APIError(400, f"messages[{i}] must be an object with a role in {ROLES}", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # text parts: [{"type": "text", "text": ...}]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts",
                           param="messages")
        out.append({"role": m["role"], "content": content})
    return llm.encode_chat(out)
