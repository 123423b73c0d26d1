"""The HTTP side: OpenAI-compatible routes on Starlette, each request handed to the one engine loop."""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
import time
import uuid

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from minispec.serve.engine_loop import EngineLoop, Update
from minispec.serve.logprobs import LogprobsShape
from minispec.serve.metrics import ServerMetrics
from minispec.serve.protocol import APIError, Job, model_not_found, error_line, parse_job, parse_json
from minispec.serve.text import TextStream

MAX_BODY_BYTES = 1 << 20  # larger bodies get 413
RETRY_AFTER_S = 1  # what a 429 asks the client to wait
HEADER_TIMEOUT_S = 10.0  # a connection whose request line and headers take longer is closed
BODY_TIMEOUT_S = 30.0  # a body that takes longer to arrive gets 408
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this (uvicorn's default)
MAX_CONNECTIONS = 1000  # open connections (and requests) beyond which uvicorn answers 503

log = logging.getLogger("minispec.serve")


def error_response(e: APIError) -> Response:
    return Response(e.body(), status_code=e.status, media_type="application/json", headers=e.headers)


class OpenAIServer:
    """The routes over one LLM: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics.

    max_queue: requests admitted beyond the engine's slots (max_num_seqs) before answering 429.
    api_key: if set, /v1 routes need "Authorization: Bearer <api_key>" (else 401).
    header_timeout_s / body_timeout_s: how long a request's line and headers (else the connection is closed) and
    then its body (else 408) may take to arrive. max_connections: uvicorn's limit_concurrency.
    If the engine loop dies, the server stops (and python -m minispec.serve exits 1).
    """

    def __init__(self, llm, model_name: str, max_queue: int = 128, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, header_timeout_s: float = HEADER_TIMEOUT_S,
                 body_timeout_s: float = BODY_TIMEOUT_S, max_connections: int | None = MAX_CONNECTIONS):
        self.llm = llm
        self.model_name = model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.header_timeout_s, self.body_timeout_s = header_timeout_s, body_timeout_s
        self.max_connections = max_connections
        self.max_in_flight = llm.engine.config.max_num_seqs + max_queue
        self.open: set[str] = set()  # ids of admitted requests not yet answered (event-loop thread only)
        self.created = int(time.time())
        config = llm.engine.config
        self.metrics = ServerMetrics(model_name, llm.num_speculative_tokens, config.max_num_seqs * config.max_model_len)
        self.loop = EngineLoop(llm, self.metrics, on_failure=self.shutdown)
        # logprobs' token texts (cached: each top list names up to 20): as spelled, special tokens included; as shown
        tokenizer = llm.tokenizer
        self.token_text = functools.lru_cache(maxsize=1 << 16)(
            lambda t: tokenizer.decode([t], skip_special_tokens=False) if tokenizer is not None else "")
        self.shown_text = functools.lru_cache(maxsize=1 << 16)(lambda t: llm.decode([t]))
        self._uvicorn: uvicorn.Server | None = None
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ]
        handlers = {APIError: self._api_error, HTTPException: self._http_error, Exception: self._server_error}
        self.app = Starlette(routes=routes, exception_handlers=handlers)

    # ---- running --------------------------------------------------------------------------
    def run(self, sock) -> None:
        """Serve on a bound socket until shutdown() or a signal; starts and stops the engine loop."""
        self.loop.start()
        http = functools.partial(HeaderTimeoutProtocol, header_timeout_s=self.header_timeout_s)
        config = uvicorn.Config(self.app, http=http, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                                timeout_keep_alive=KEEP_ALIVE_S, limit_concurrency=self.max_connections)
        self._uvicorn = uvicorn.Server(config)
        try:
            self._uvicorn.run(sockets=[sock])
        finally:
            self.loop.stop()

    def shutdown(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True

    @property
    def started(self) -> bool:
        return self._uvicorn is not None and self._uvicorn.started

    # ---- routes ---------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if not self.loop.alive:
            raise APIError(503, self.loop.error or "the engine loop is not running", type="server_error")
        return JSONResponse({"status": "ok"})

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> Response:
        self._check_key(request)
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        self._check_key(request)
        model_id = request.path_params["model_id"]
        if model_id != self.model_name:
            raise model_not_found(model_id, self.model_name)
        return JSONResponse(self._card())

    def _card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "minispec",
                "max_model_len": self.llm.engine.config.max_model_len}

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    # ---- generation -----------------------------------------------------------------------
    async def _generate(self, request: Request, chat: bool) -> Response:
        self._check_key(request)
        job = parse_job(parse_json(await self._read_body(request)), chat, self.llm, self.model_name)
        if not self.loop.alive:
            raise APIError(503, self.loop.error or "the engine loop is not running", type="server_error")
        if len(self.open) + job.n > self.max_in_flight:
            raise APIError(429, f"the server is full ({len(self.open)} requests in flight); retry later",
                           type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        req_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        updates: asyncio.Queue[tuple[int, Update]] = asyncio.Queue()  # (choice index, update)
        event_loop = asyncio.get_running_loop()

        def sink(index: int, update: Update) -> None:  # called in the engine thread
            try:
                event_loop.call_soon_threadsafe(updates.put_nowait, (index, update))
            except RuntimeError:  # the event loop has closed (shutdown): nobody waits for this request
                pass

        # n choices, n engine requests (one keeps the answer's id)
        choices = [Choice(i, req_id if job.n == 1 else f"{req_id}-{i}", job, self) for i in range(job.n)]
        for c in choices:
            self.open.add(c.req_id)
            self.loop.submit(c.req_id, job.prompt_ids, job.params_of(c.index), functools.partial(sink, c.index))
        if job.stream:
            return EventStream(self._events(req_id, job, choices, updates), on_close=lambda: self._release_all(choices))
        return await self._answer(request, req_id, job, choices, updates)

    async def _answer(self, request: Request, req_id: str, job: Job, choices: list[Choice],
                      updates: asyncio.Queue) -> Response:
        """Wait for every choice's whole answer; a client that disconnects meanwhile aborts the requests."""
        collect = asyncio.ensure_future(self._collect(choices, updates))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():
                return Response(status_code=499)  # nobody reads it
            texts = collect.result()
        finally:
            collect.cancel()
            gone.cancel()
            self._release_all(choices)
        failed = _failed(choices)
        if failed is not None:
            raise APIError(500, failed.error or "the request was aborted", type="server_error")
        return JSONResponse({**self._head(req_id, job, stream=False),
                             "choices": [c.body(text, stream=False) for c, text in zip(choices, texts)],
                             "usage": _usage(job, choices), "spec_decode": _spec([c.last for c in choices])})

    async def _collect(self, choices: list[Choice], updates: asyncio.Queue) -> list[str]:
        """Take updates until every choice has ended (or hit a stop string), or one failed; each choice's text."""
        texts = [""] * len(choices)
        while not all(c.done for c in choices) and _failed(choices) is None:
            i, u = await updates.get()
            if not choices[i].done:  # else: queued before its release
                texts[i] += self._take(choices[i], u)
        return texts

    async def _events(self, req_id: str, job: Job, choices: list[Choice], updates: asyncio.Queue):
        """Server-sent events, one per engine step that gave a choice text; a disconnect cancels this (and aborts)."""
        head = self._head(req_id, job, stream=True)
        try:
            if job.chat:
                yield _event({**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None} for c in choices]})
            while not all(c.done for c in choices):
                i, u = await updates.get()
                c = choices[i]
                if c.done:  # queued before its release
                    continue
                if u.finish_reason in ("error", "abort"):
                    error = APIError(500, u.error or "the request was aborted", type="server_error")
                    yield f"data: {error.body().decode()}\n\n"
                    break
                delta = self._take(c, u)  # a choice's last: released before the client can read its chunk,
                if not delta and not c.done:  # so /metrics then counts it
                    continue
                chunk = {**head, "choices": [c.body(delta, stream=True)]}
                if c.done:
                    chunk["spec_decode"] = _spec([c.last])
                yield _event(chunk)
            else:
                if job.include_usage:
                    yield _event({**head, "choices": [], "usage": _usage(job, choices)})
            yield "data: [DONE]\n\n"
        finally:
            self._release_all(choices)

    def _take(self, c: Choice, u: Update) -> str:
        """Hand a choice its update; release it once it has ended. Returns the text now safe to send."""
        text = c.take(u)
        if c.done:
            self._release(c.req_id, "stop" if c.text.stopped else None)
        return text

    def _release_all(self, choices: list[Choice]) -> None:
        for c in choices:
            self._release(c.req_id)

    def _release(self, req_id: str, reason: str | None = None) -> None:
        """The request's answer is over (or its client left): free its place, and release it in the loop
        (reason "stop" after a stop string; EngineLoop.release). Idempotent."""
        if req_id in self.open:
            self.open.remove(req_id)
            self.loop.release(req_id, reason)

    def _head(self, req_id: str, job: Job, stream: bool) -> dict:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if job.chat else "text_completion"
        return {"id": req_id, "object": kind, "created": int(time.time()), "model": self.model_name}

    # ---- checks ---------------------------------------------------------------------------
    def _check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def _read_body(self, request: Request) -> bytes:
        too_big = APIError(413, f"the body is over {self.max_body_bytes} bytes")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise too_big
        body = bytearray()
        try:
            async with asyncio.timeout(self.body_timeout_s):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > self.max_body_bytes:
                        raise too_big
        except TimeoutError:
            raise APIError(408, f"the body did not arrive within {self.body_timeout_s:g} s",
                           headers={"connection": "close"}) from None
        except ClientDisconnect:
            log.warning("%s %s: the client left after %d of %s body bytes", request.method, request.url.path,
                        len(body), length or "?")
            raise APIError(400, "the client left mid-body") from None  # nobody reads the answer
        return bytes(body)

    # ---- errors ---------------------------------------------------------------------------
    async def _api_error(self, request: Request, e: APIError) -> Response:
        return error_response(e)

    async def _http_error(self, request: Request, e: HTTPException) -> Response:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {e.detail}"
        return error_response(APIError(e.status_code, message, type=kind, headers=e.headers))

    async def _server_error(self, request: Request, e: Exception) -> Response:
        return error_response(APIError(500, f"internal error: {error_line(e)}", type="server_error"))


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose next request line and headers have not all arrived
    header_timeout_s after it opened or its last answer ended (uvicorn times out neither)."""

    def __init__(self, *args, header_timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late, self.cycle)

    def _headers_late(self, cycle) -> None:
        """No request has begun since the timer was set (the cycle is the one then, answered or None): close."""
        if self.cycle is cycle and (cycle is None or cycle.response_complete) and not self.transport.is_closing():
            self.transport.close()


class EventStream(StreamingResponse):
    """Server-sent events; on_close runs however the response ends, even if cancelled before its first event."""

    def __init__(self, events, on_close):
        super().__init__(events, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body must have been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _failed(choices: list[Choice]) -> Update | None:
    """The last update of a choice that ended in an error or abort, if one did."""
    return next((c.last for c in choices if c.last.finish_reason in ("error", "abort")), None)


def _usage(job: Job, choices: list[Choice]) -> dict:
    """The prompt counted once (as OpenAI counts it for n > 1; its cached tokens as the first choice's), every
    choice's tokens."""
    n = sum(len(c.text.token_ids) for c in choices)
    return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": n, "total_tokens": len(job.prompt_ids) + n,
            "prompt_tokens_details": {"cached_tokens": choices[0].last.num_cached_tokens}}


def _spec(lasts: list[Update]) -> dict:
    """The extension field: the requests' speculation counters (summed over choices) and the rates they give."""
    s = {}
    for key in lasts[0].spec:
        values = [u.spec[key] for u in lasts]
        s[key] = [sum(v) for v in zip(*values)] if isinstance(values[0], list) else sum(values)
    if s:
        s["acceptance_rate"] = s["num_accepted_tokens"] / s["num_draft_tokens"] if s["num_draft_tokens"] else 0.0
        n = s["num_spec_verifications"]
        s["mean_accepted_length"] = s["num_emitted_tokens"] / n if n else 1.0
    return s


class Choice:
    """One of an answer's n choices: its engine request, its text and logprobs so far."""

    def __init__(self, index: int, req_id: str, job: Job, server: OpenAIServer):
        self.index, self.req_id, self.job = index, req_id, job
        self.text = TextStream(server.llm.decode, job.stop)
        self.last = Update([])  # the latest update
        self.echoed = not job.echo  # the prompt has been sent (or is not to be)
        self.shape = None if job.logprobs is None else LogprobsShape(job.chat, server.token_text, server.shown_text)
        self.entries: list[tuple[int, tuple | None]] = []  # (token id, logprobs) not yet sent

    @property
    def done(self) -> bool:
        return self.last.finish_reason is not None or self.text.stopped

    def take(self, u: Update) -> str:
        """Take one update; returns the text now safe to send (echo: the prompt's first)."""
        self.last = u
        head = ""
        if not self.echoed:
            head, self.echoed = self.job.prompt_text, True
            if self.shape is not None:
                self.entries += zip(self.job.prompt_ids, u.prompt_logprobs or [None] * len(self.job.prompt_ids))
        before = len(self.text.token_ids)
        delta = self.text.add(u.new_token_ids)
        if self.shape is not None:  # the tokens the text took: up to the one that completed a stop string
            taken = len(self.text.token_ids) - before
            self.entries += zip(u.new_token_ids[:taken], (u.logprobs or [])[:taken])
        if self.done:
            delta += self.text.finish()
        return head + delta

    def body(self, content: str, stream: bool) -> dict:
        """The choice's object: the text given (a delta when streaming), its tokens' logprobs since the last."""
        finish = ("stop" if self.text.stopped else self.last.finish_reason) if self.done else None
        logprobs = None
        if self.shape is not None:
            logprobs, self.entries = self.shape.fragment(self.entries), []
        if self.job.chat:
            message = {"content": content} if stream else {"role": "assistant", "content": content}
            return {"index": self.index, "delta" if stream else "message": message, "logprobs": logprobs,
                    "finish_reason": finish}
        return {"index": self.index, "text": content, "logprobs": logprobs, "finish_reason": finish}
