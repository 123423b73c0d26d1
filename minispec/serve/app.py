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
from minispec.serve.metrics import ServerMetrics
from minispec.serve.protocol import APIError, Job, model_not_found, one_line, parse_job, parse_json
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
        if len(self.open) >= self.max_in_flight:
            raise APIError(429, f"the server is full ({len(self.open)} requests in flight); retry later",
                           type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        req_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        updates: asyncio.Queue[Update] = asyncio.Queue()
        event_loop = asyncio.get_running_loop()

        def sink(update: Update) -> None:  # called in the engine thread
            try:
                event_loop.call_soon_threadsafe(updates.put_nowait, update)
            except RuntimeError:  # the event loop has closed (shutdown): nobody waits for this request
                pass

        self.open.add(req_id)
        self.loop.submit(req_id, job.prompt_ids, job.params, sink)
        if job.stream:
            return EventStream(self._events(req_id, job, updates), on_close=lambda: self._release(req_id))
        return await self._answer(request, req_id, job, updates)

    async def _answer(self, request: Request, req_id: str, job: Job, updates: asyncio.Queue) -> Response:
        """Wait for the whole answer; a client that disconnects meanwhile aborts the request."""
        text = TextStream(self.llm.decode, job.stop)
        pieces, last = [], Update([])
        collect = asyncio.ensure_future(self._collect(text, updates, pieces))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():
                return Response(status_code=499)  # nobody reads it
            last = collect.result()
            self._release(req_id, "stop" if text.stopped else None)
        finally:
            collect.cancel()
            gone.cancel()
            self._release(req_id)
        if last.finish_reason in ("error", "abort"):
            raise APIError(500, last.error or "the request was aborted", type="server_error")
        finish = "stop" if text.stopped else last.finish_reason
        content = "".join(pieces)
        choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
                   "finish_reason": finish} if job.chat else
                  {"index": 0, "text": content, "logprobs": None, "finish_reason": finish})
        return JSONResponse({**self._head(req_id, job, stream=False), "choices": [choice],
                             "usage": _usage(job, text), "spec_decode": _spec(last)})

    @staticmethod
    async def _collect(text: TextStream, updates: asyncio.Queue, pieces: list[str]) -> Update:
        """Take updates until the request ends (or hits a stop string); returns the last."""
        while True:
            u = await updates.get()
            pieces.append(text.add(u.new_token_ids))
            if u.finish_reason is not None or text.stopped:
                pieces.append(text.finish())
                return u

    async def _events(self, req_id: str, job: Job, updates: asyncio.Queue):
        """Server-sent events, one per engine step that gave text; a disconnect cancels this (and aborts)."""
        text = TextStream(self.llm.decode, job.stop)
        head = self._head(req_id, job, stream=True)
        last = Update([])
        try:
            if job.chat:
                yield _event({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}]})
            while True:
                last = await updates.get()
                if last.finish_reason in ("error", "abort"):
                    error = APIError(500, last.error or "the request was aborted", type="server_error")
                    yield f"data: {error.body().decode()}\n\n"
                    break
                delta = text.add(last.new_token_ids)
                done = last.finish_reason is not None or text.stopped
                if done:  # released before the client can read its last chunk, so /metrics then counts it
                    delta += text.finish()
                    self._release(req_id, "stop" if text.stopped else None)
                if not delta and not done:
                    continue
                finish = ("stop" if text.stopped else last.finish_reason) if done else None
                part = {"content": delta} if job.chat else {"text": delta}
                choice = {"index": 0, **({"delta": part} if job.chat else part), "logprobs": None,
                          "finish_reason": finish}
                chunk = {**head, "choices": [choice]}
                if done:
                    chunk["spec_decode"] = _spec(last)
                yield _event(chunk)
                if done:
                    break
            if job.include_usage and last.finish_reason not in ("error", "abort"):
                yield _event({**head, "choices": [], "usage": _usage(job, text)})
            yield "data: [DONE]\n\n"
        finally:
            self._release(req_id)

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
        return error_response(APIError(500, f"internal error: {one_line(e)}", type="server_error"))


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


def _usage(job: Job, text: TextStream) -> dict:
    n = len(text.token_ids)
    return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": n, "total_tokens": len(job.prompt_ids) + n}


def _spec(last: Update) -> dict:
    """The extension field: the request's speculation counters and the rates they give."""
    s = dict(last.spec)
    if s:
        s["acceptance_rate"] = s["num_accepted_tokens"] / s["num_draft_tokens"] if s["num_draft_tokens"] else 0.0
        n = s["num_spec_verifications"]
        s["mean_accepted_length"] = s["num_emitted_tokens"] / n if n else 1.0
    return s
