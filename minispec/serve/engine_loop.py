"""The engine loop: one thread owns the LLM and steps its engine for every connection (continuous batching).

Requests arrive from any thread as commands (add, release); the loop applies them between steps, so
releasing a running request frees its slot and draft-logits row before the next step. A request's finish
is counted when it is released: the reason its client was given (a stop string the server found after the
engine ran on counts as "stop"). Under torchrun rank 0 runs the loop and broadcasts each iteration's
commands; the other ranks `follow`, applying the same commands and stepping the same engine, so every
collective inside `Engine.step` lines up.
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from minispec.distributed import get_tp_group
from minispec.sampling_params import SamplingParams
from minispec.serve.protocol import error_line

log = logging.getLogger("minispec.serve")


@dataclass(slots=True)
class Update:
    """What one engine step gave one request; finish_reason is set on its last update."""

    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    spec: dict = field(default_factory=dict)  # the request's speculation counters so far
    logprobs: list | None = None  # the new tokens' (SamplingParams.logprobs; Request.logprobs's entries)
    prompt_logprobs: list | None = None  # on the request's first update (SamplingParams.prompt_logprobs)
    num_cached_tokens: int = 0  # prompt tokens the request reused from another slot (prefix caching)


@dataclass(slots=True)
class _Live:
    """Rank 0's view of one running request: where its updates go, and what the metrics last saw."""

    sink: Callable[[Update], None]
    arrival: float
    num_prompt_tokens: int
    last_token_time: float | None = None
    seen: tuple = (0, 0, 0)  # num_spec_verifications, num_draft_tokens, num_accepted_tokens already counted
    seen_per_pos: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # set once the engine has ended it; the answer stays open until released
    end_time: float | None = None
    delivered: bool = False  # an update has gone to sink (the first carries the prompt's logprobs)


def apply_commands(llm, commands: list[tuple]) -> tuple[bool, dict[str, str]]:
    """Apply broadcast engine commands in order; returns (keep running, request id -> why its add failed)."""
    failed = {}
    for cmd in commands:
        if cmd[0] == "add":
            _, req_id, prompt_ids, params = cmd
            try:
                llm.add_request(prompt_ids, params, request_id=req_id)
            except Exception as e:  # noqa: BLE001 — this request alone fails, the same on every rank: each skips it
                failed[req_id] = error_line(e)
        elif cmd[0] == "abort":
            llm.abort(cmd[1])
        elif cmd[0] == "stop":
            return False, failed
    return True, failed


def follow(llm) -> None:
    """A non-zero rank under torchrun: apply rank 0's commands and step the engine until told to stop."""
    tp = get_tp_group()
    while True:
        running, _ = apply_commands(llm, tp.broadcast_object())
        if not running:
            return
        if llm.engine.has_unfinished():
            llm.engine.step()


class EngineLoop:
    """The thread that owns the LLM. submit() / release() / call() are safe from any thread.

    heartbeat_s: an idle loop under TP still broadcasts (empty commands) this often, so the
    followers' collectives do not time out while no request comes.
    on_failure: called (in the engine thread) once the loop has died of an error, after every waiting
    request has been told why; the server stops on it, so that the process exits non-zero.
    """

    def __init__(self, llm, metrics=None, heartbeat_s: float = 10.0, on_failure: Callable[[], None] | None = None):
        self.llm = llm
        self.on_failure = on_failure
        self.engine = llm.engine
        self.metrics = metrics
        self.heartbeat_s = heartbeat_s
        self.error: str | None = None  # why the loop died, if it did
        self._tp = get_tp_group()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="minispec-engine", daemon=True)

    # ---- any thread -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, req_id: str, prompt_ids: list[int], params: SamplingParams,
               sink: Callable[[Update], None]) -> None:
        """Queue a request; sink(update) is called from the engine thread after each step that gave it tokens."""
        self._commands.put(("add", req_id, prompt_ids, params, sink, time.perf_counter()))

    def release(self, req_id: str, reason: str | None = None) -> None:
        """The answer to req_id is over, or its client left: end the request in the engine if it still runs
        there (freeing its slot and draft-logits row before the next step; its sink hears no more) and count
        its finish. Every submitted request is released once; more releases are no-ops.

        reason: "stop" when the server found a stop string; else the engine's finish reason if it ended,
        "abort" if it had not."""
        self._commands.put(("release", req_id, reason))

    def call(self, fn: Callable) -> concurrent.futures.Future:
        """Run fn(engine) in the engine thread between steps (to read its state safely); its result in a Future."""
        future = concurrent.futures.Future()
        self._commands.put(("call", fn, future))
        return future

    def stop(self, timeout: float | None = 60.0) -> None:
        """Stop the loop (and, under TP, the followers); running requests end with finish_reason "abort"."""
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout)

    # ---- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        if self.llm.device.type == "cuda":
            torch.cuda.set_device(self.llm.device)
        reason = "server shutting down"
        try:
            while self._iterate():
                pass
        except Exception as e:  # noqa: BLE001 — the loop is dead: tell every waiting client why, then stop
            reason = f"engine loop failed: {error_line(e)}"
            self.error = reason
            log.exception(reason)
        for live in self._live.values():
            if live.finish_reason is None:
                live.sink(Update([], "abort", reason))
        self._live.clear()
        self._drain_late(reason)
        if self.error is not None and self.on_failure is not None:
            self.on_failure()

    def _take(self) -> list[tuple]:
        """This iteration's commands: wait for one while the engine is idle, then take all queued."""
        commands = []
        if not self.engine.has_unfinished():
            try:
                commands.append(self._commands.get(timeout=self.heartbeat_s))
            except queue.Empty:
                pass
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _iterate(self) -> bool:
        """Apply the queued commands, then run one engine step; False once told to stop."""
        engine_commands, calls = [], []
        for cmd in self._take():
            kind = cmd[0]
            if kind == "add":
                _, req_id, prompt_ids, params, sink, arrival = cmd
                self._live[req_id] = _Live(sink, arrival, len(prompt_ids), seen_per_pos=[0] * self.engine.k)
                engine_commands.append(cmd[:4])
            elif kind == "release":
                _, req_id, reason = cmd
                live = self._live.pop(req_id, None)
                if live is None:
                    continue
                if live.finish_reason is None:
                    engine_commands.append(("abort", req_id))
                if self.metrics is not None:
                    end = live.end_time if live.end_time is not None else time.perf_counter()
                    self.metrics.observe_finish(reason or live.finish_reason or "abort", end - live.arrival)
            elif kind == "call":
                calls.append(cmd)
            else:
                engine_commands.append(cmd)
        if self._tp.world_size > 1:
            self._tp.broadcast_object(engine_commands)
        running, failed = apply_commands(self.llm, engine_commands)
        for req_id, why in failed.items():
            self._live.pop(req_id).sink(Update([], "error", why))
        if self.metrics is not None:
            for cmd in engine_commands:
                if cmd[0] == "add" and cmd[1] not in failed:
                    self.metrics.observe_prompt(len(cmd[2]))
        for _, fn, future in calls:
            try:
                future.set_result(fn(self.engine))
            except Exception as e:  # noqa: BLE001 — the caller gets it
                future.set_exception(e)
        if not running:
            return False
        if self.engine.has_unfinished():
            self._deliver(self.engine.step())
        if self.metrics is not None:
            s = self.engine.scheduler
            self.metrics.observe_queue(len(s.running), len(s.waiting), sum(r.num_computed for r in s.running))
        return True

    def _deliver(self, outputs) -> None:
        """Hand each request its step's tokens; count them in the metrics."""
        now = time.perf_counter()
        for out in outputs:
            req = out.req
            live = self._live.get(req.req_id)
            if live is None:
                continue
            m = req.metrics
            spec = m.counters()
            if self.metrics is not None:
                self._observe(live, req, out.new_token_ids, now)
            if req.finished:
                live.finish_reason, live.end_time = req.finish_reason, now
            new = len(out.new_token_ids)
            logprobs = None if req.logprobs is None else req.logprobs[len(req.logprobs) - new :]
            prompt_logprobs = None if live.delivered else req.prompt_logprobs
            live.delivered = True
            live.sink(Update(out.new_token_ids, req.finish_reason, req.error, spec, logprobs, prompt_logprobs,
                             m.num_cached_tokens))

    def _observe(self, live: _Live, req, new_token_ids: list[int], now: float) -> None:
        m, metrics = req.metrics, self.metrics
        counts = (m.num_spec_verifications, m.num_draft_tokens, m.num_accepted_tokens)
        per_pos = list(m.accepted_per_position)
        metrics.observe_spec(*(c - s for c, s in zip(counts, live.seen)),
                             [c - s for c, s in zip(per_pos, live.seen_per_pos)])
        live.seen, live.seen_per_pos = counts, per_pos
        if new_token_ids:
            if live.last_token_time is None:
                metrics.observe_tokens(len(new_token_ids), ttft_s=now - live.arrival)
            else:
                metrics.observe_tokens(len(new_token_ids), itl_s=now - live.last_token_time)
            live.last_token_time = now

    def _drain_late(self, reason: str) -> None:
        """After the loop ends: answer what was queued since, so no caller waits forever."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                cmd[4](Update([], "abort", reason))
            elif cmd[0] == "call":
                cmd[2].set_exception(RuntimeError(reason))
