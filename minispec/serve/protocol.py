"""The OpenAI API's request fields, checked into a Job at the API edge, and its error shape.

Every field the server reads is checked here: its type, and numbers against the range the engine takes
(so no request's values reach the engine thread unchecked); a 400 names the field and the range.
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass

from jinja2 import TemplateError

from minispec.sampling_params import SamplingParams
from minispec.utils import one_line

# Fields of the OpenAI (and vLLM) API this server does not implement: the values each may take (null or
# absent always may), compared by type and value, so that true is not taken for 1.
UNSUPPORTED = {
    "best_of": (1,), "suffix": ("",),
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "min_p": (0, 0.0), "min_tokens": (0,), "logit_bias": ({},), "include_stop_str_in_output": (False,),
    "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (True,), "functions": ([],),
    "function_call": ("none",), "response_format": ({"type": "text"},), "modalities": (["text"],),
    "reasoning_effort": (), "audio": (), "prediction": (), "web_search_options": (), "guided_json": (),
    "guided_regex": (), "guided_choice": (), "guided_grammar": (), "structured_outputs": (),
}
ROLES = ("system", "user", "assistant", "developer", "tool")
MAX_DEPTH = 64  # how deep a body's arrays and objects may nest
INT64 = (-(2**63), 2**63 - 1)  # seed's range, as OpenAI's API takes it
MAX_TOP_K = 2**31 - 1  # a top_k at or above the vocabulary's size keeps every token
MAX_STOP = 16  # stop strings a request may give (OpenAI takes 4): each is searched for after every token
MAX_LOGPROBS = 20  # most likely tokens a logprobs entry may list (OpenAI's limit)
MAX_N = 16  # choices per request (each one engine request)


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


def error_line(e: Exception) -> str:
    """An exception as one line: its type, then its message's first line (utils.one_line; nothing without one)."""
    return f"{type(e).__name__}: {one_line(e, limit=None) if str(e).strip() else ''}"


def model_not_found(model, model_name: str) -> APIError:
    """The 404 for a model id this server does not serve."""
    return APIError(404, f"the model {_show(model)} does not exist; this server serves {model_name!r}",
                    param="model", code="model_not_found")


@dataclass(slots=True)
class Job:
    """A checked generation request."""

    chat: bool
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    n: int = 1  # choices: n engine requests
    logprobs: int | None = None  # most likely tokens listed beside each token's logprob; None: no logprobs
    echo: bool = False  # completions: the prompt's text (and, with logprobs, its tokens' logprobs) comes first
    prompt_text: str = ""  # what echo sends

    def params_of(self, index: int) -> SamplingParams:
        """Choice index's sampling settings: with a seed, choice i uses seed + i."""
        if index == 0 or self.params.seed is None:
            return self.params
        return dataclasses.replace(self.params, seed=self.params.seed + index)


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object whose strings are valid Unicode and whose values nest at most
    MAX_DEPTH deep, else a 400."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise APIError(400, f"the body nests deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(body).__name__}")
    _check_values(body)
    return body


def _check_values(body: dict) -> None:
    """400 on a string with a lone surrogate (the tokenizer takes only valid Unicode) or nesting past MAX_DEPTH;
    walked without recursion, each error naming the top-level field."""
    stack = [(value, name, 1) for name, value in body.items()]
    for name in body:
        _check_text(name, None)
    while stack:
        value, field, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, field)
        elif isinstance(value, (dict, list)):
            if depth >= MAX_DEPTH:
                raise APIError(400, f"{field} nests deeper than {MAX_DEPTH} levels", param=field)
            if isinstance(value, dict):
                for key in value:
                    _check_text(key, field)
            stack.extend((v, field, depth + 1) for v in (value.values() if isinstance(value, dict) else value))


def _check_text(text: str, field: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = f"{field} is" if field else "a field name is"
        raise APIError(400, f"{where} not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at "
                       f"character {e.start}", param=field) from None


def _show(value) -> str:
    """A value as JSON, cut to 80 characters, for an error message."""
    return json.dumps(value)[:80]


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _typed(body: dict, name: str, kinds: tuple, what: str, default=None):
    """body[name] if present and not null, checked against kinds; else default."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise APIError(400, f"{name} must be {what}, got {_show(value)}", param=name)
    return value


def _int(body: dict, name: str, lo: int, hi: int, default=None):
    """body[name]: an integer in [lo, hi]; default where missing or null."""
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value) or not lo <= value <= hi:
        raise APIError(400, f"{name} must be an integer in [{lo}, {hi}], got {_show(value)}", param=name)
    return int(value)


def _float(body: dict, name: str, default: float, lo: float, hi: float = math.inf, lo_open: bool = False) -> float:
    """body[name]: a finite number in [lo, hi] ((lo, hi] where lo_open); default where missing or null."""
    value = body.get(name)
    if value is None:
        return default
    x = math.nan
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            x = float(value)
        except OverflowError:  # an integer past float's range
            pass
    if not (math.isfinite(x) and (lo < x if lo_open else lo <= x) and x <= hi):
        span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" if hi < math.inf else f"{'>' if lo_open else '>='} {lo:g}"
        raise APIError(400, f"{name} must be a finite number {'in ' if hi < math.inf else ''}{span}, "
                       f"got {_show(value)}", param=name)
    return x


def _is_default(value, allowed: tuple) -> bool:
    return value is None or any(type(value) is type(a) and value == a for a in allowed)


def parse_job(body: dict, chat: bool, llm, model_name: str) -> Job:
    """Check a /v1/completions or /v1/chat/completions body against the model; raise APIError (4xx) on bad input."""
    model = body.get("model")
    if model is not None and model != model_name:
        raise model_not_found(model, model_name)
    for name, allowed in UNSUPPORTED.items():
        if not _is_default(body.get(name), allowed):
            raise APIError(400, f"{name}={_show(body[name])[:40]} is not supported by this server", param=name)
    prompt_field = "messages" if chat else "prompt"
    try:
        prompt_ids, prompt_text = (_chat_ids(body, llm), None) if chat else _prompt_ids(body, llm)
    except (ValueError, TemplateError) as e:  # a tokenizer failure, or a chat template's raise_exception
        raise APIError(400, f"{prompt_field}: {error_line(e)}", param=prompt_field) from None
    n = _int(body, "n", 1, MAX_N, 1)
    logprobs, echo = _chat_logprobs(body) if chat else _completion_logprobs(body)
    if logprobs is not None and llm.engine.tp.world_size > 1:
        raise APIError(400, "logprobs need a server with --tp 1 (under tensor parallelism the logits are split over "
                       "the ranks)", param="logprobs")
    max_len = llm.engine.config.max_model_len
    room = max_len - len(prompt_ids)  # tokens the context has left to generate
    if room < 1:
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; the context holds {max_len} (including at "
                       "least one generated)", param=prompt_field, code="context_length_exceeded")
    length_field = "max_completion_tokens" if chat and body.get("max_tokens") is None else "max_tokens"
    max_tokens = _int(body, length_field, 0 if echo else 1, INT64[1])  # echo + 0: score the prompt, generate nothing
    if max_tokens is None:  # OpenAI's defaults: 16 for completions (as many as fit), the rest of the context for chat
        max_tokens = room if chat else min(16, room)
    elif max_tokens > room:  # vLLM's answer too, rather than a silently shorter one
        raise APIError(400, f"the context holds {max_len} tokens, but {len(prompt_ids) + max_tokens} were asked "
                       f"for ({len(prompt_ids)} in the prompt, {length_field}={max_tokens}); {length_field} must be "
                       f"in [{0 if echo else 1}, {room}]", param=length_field, code="context_length_exceeded")
    stop = _typed(body, "stop", (str, list), "a string or a list of strings", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP:
        raise APIError(400, f"stop must be a string or a list of at most {MAX_STOP} strings", param="stop")
    vocab = llm.engine.vocab_size
    stop_token_ids = _typed(body, "stop_token_ids", (list,), "a list of token ids", None)
    if stop_token_ids is not None and not all(_is_int(t) and 0 <= t < vocab for t in stop_token_ids):
        raise APIError(400, f"stop_token_ids must be integers in [0, {vocab - 1}]", param="stop_token_ids")
    stream = _typed(body, "stream", (bool,), "true or false", False)
    options = _typed(body, "stream_options", (dict,), "an object", {})
    include_usage = _typed(options, "include_usage", (bool,), "true or false", False)
    top_k = _int(body, "top_k", -1, MAX_TOP_K, 0)
    scored = echo and (logprobs is not None or max_tokens == 0)  # echo's prompt logprobs; max_tokens 0 needs them
    params = SamplingParams(
        temperature=_float(body, "temperature", 1.0, 0.0), top_p=_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=max(top_k, 0),  # -1 = off, as vLLM spells it; so is 0
        max_tokens=max_tokens, seed=_int(body, "seed", *INT64),
        ignore_eos=_typed(body, "ignore_eos", (bool,), "true or false", False), stop_token_ids=stop_token_ids,
        logprobs=logprobs, prompt_logprobs=(logprobs or 0) if scored else None,
    )
    if echo and prompt_text is None:  # token ids: their text
        prompt_text = llm.decode(prompt_ids)
    return Job(chat, prompt_ids, params, stop, stream, include_usage, n, logprobs, echo, prompt_text or "")


def _completion_logprobs(body: dict) -> tuple[int | None, bool]:
    """/v1/completions: (logprobs: the most likely tokens to list, or None; echo)."""
    if not _is_default(body.get("top_logprobs"), (0,)):
        raise APIError(400, f"top_logprobs is a chat field; /v1/completions takes logprobs: an integer in "
                       f"[0, {MAX_LOGPROBS}]", param="top_logprobs")
    logprobs = None if body.get("logprobs") is False else _int(body, "logprobs", 0, MAX_LOGPROBS)  # false: none
    return logprobs, _typed(body, "echo", (bool,), "true or false", False)


def _chat_logprobs(body: dict) -> tuple[int | None, bool]:
    """/v1/chat/completions: (top_logprobs if logprobs is true, else None; echo: always False)."""
    if not _is_default(body.get("echo"), (False,)):
        raise APIError(400, "echo is not supported by /v1/chat/completions", param="echo")
    wanted = _typed(body, "logprobs", (bool,), "true or false", False)
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not wanted:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if wanted else None, False


def _prompt_ids(body: dict, llm) -> tuple[list[int], str | None]:
    """prompt: a string or a list of token ids (or a batch of one of either); (its ids, the string or None)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    vocab = llm.engine.vocab_size
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        ids = llm.encode(prompt, use_chat_template=False)
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {_show(bad[0])} is outside the vocabulary [0, {vocab - 1}]", param="prompt")
        ids = [int(t) for t in prompt]
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, f"got {len(prompt)} prompts; this server takes one per request", param="prompt")
    else:
        raise APIError(400, "prompt must be a non-empty string or list of token ids", param="prompt")
    if not ids:
        raise APIError(400, "prompt is empty after tokenization", param="prompt")
    return ids, prompt if isinstance(prompt, str) else None


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
