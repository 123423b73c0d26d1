"""python -m minispec.serve: the OpenAI API through the official openai client, under load and faults."""
import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

from minispec.engine.observer import Observer
from minispec.tools.tiny import make_tiny_char_model_dir

openai = pytest.importorskip("openai")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    target = make_tiny_char_model_dir(str(tmp_path_factory.mktemp("serve_target")))
    draft = make_tiny_char_model_dir(str(tmp_path_factory.mktemp("serve_draft")), seed=1, num_hidden_layers=1)
    return target, draft


@contextmanager
def serving(target, draft, k=3, max_num_seqs=16, observer=None, **server_kw):
    """An in-process server on 127.0.0.1 and a free port; yields (server, base url)."""
    from minispec.llm import LLM
    from minispec.serve.app import OpenAIServer

    llm = LLM(target=target, draft=draft, num_speculative_tokens=k, max_num_seqs=max_num_seqs, observer=observer)
    server = OpenAIServer(llm, "tiny", **server_kw)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, args=(sock,), daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    try:
        yield server, f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.shutdown()
        thread.join(30)
        assert not thread.is_alive()


@pytest.fixture(scope="module")
def server(model_dirs):
    with serving(*model_dirs) as s:
        yield s


def http(url, method, path, body=b"", headers=None):
    """A raw request (stdlib http.client): (status, headers, text)."""
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request(method, u.path.rstrip("/") + path, body=body,
                     headers={"content-type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()
    finally:
        conn.close()


def client(url, api_key="none", timeout=120):
    return openai.OpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=timeout)


def engine_state(server) -> dict:
    """What the engine holds, read in the engine thread between steps."""
    def read(engine):
        s = engine.scheduler
        return {"requests": len(engine.requests), "running": len(s.running), "waiting": len(s.waiting),
                "free_slots": sorted(s.free_slots)}
    return server.loop.call(read).result(30)


def idle_state(max_num_seqs=16):
    return {"requests": 0, "running": 0, "waiting": 0, "free_slots": list(range(max_num_seqs))}


def wait_idle(server, max_num_seqs=16):
    """The engine state once nothing runs (bounded wait: aborts land between steps)."""
    for _ in range(100):
        state = engine_state(server)
        if state == idle_state(max_num_seqs):
            break
        time.sleep(0.05)
    return state


def test_models_completion_and_chat(server):
    srv, url = server
    c = client(url)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    assert c.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")
    status, _, text = http(url, "GET", "/models/org/gpt-4")
    assert status == 404 and json.loads(text)["error"] == {
        "message": "the model \"org/gpt-4\" does not exist; this server serves 'tiny'", "type": "invalid_request_error",
        "param": "model", "code": "model_not_found"}
    out = c.completions.create(model="tiny", prompt="Hello there", max_tokens=7, temperature=0, seed=1,
                               extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    assert out.usage.completion_tokens == 7
    assert out.usage.prompt_tokens == len(srv.llm.encode("Hello there", False))
    spec = out.model_extra["spec_decode"]
    assert spec["num_draft_tokens"] >= spec["num_accepted_tokens"] >= 0 and spec["num_spec_verifications"] >= 1
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    chat = c.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.usage.prompt_tokens == len(srv.llm.encode_chat(messages))  # the chat template was applied
    status, _, text = http(url.rsplit("/v1", 1)[0], "GET", "/health")
    assert status == 200 and json.loads(text) == {"status": "ok"}


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_equals_non_streaming_and_seeds_reproduce(server, chat):
    _, url = server
    c = client(url)
    kw = dict(model="tiny", max_tokens=12, temperature=0.8, extra_body={"ignore_eos": True, "top_k": 8})

    def run(seed, stream):
        if chat:
            call = lambda **a: c.chat.completions.create(messages=[{"role": "user", "content": "Tell a story"}], **a)
        else:
            call = lambda **a: c.completions.create(prompt="Once upon a time", **a)
        if not stream:
            out = call(seed=seed, **kw)
            return out.choices[0].message.content if chat else out.choices[0].text, out.choices[0].finish_reason
        text, finish = "", None
        for chunk in call(seed=seed, stream=True, **kw):
            part = chunk.choices[0].delta.content if chat else chunk.choices[0].text
            text += part or ""
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    a, b, streamed = run(7, False), run(7, False), run(7, True)
    assert a == b == streamed and a[1] == "length"
    assert run(8, False)[0] != a[0]


def test_stop_string_inside_an_accepted_draft_run(model_dirs):
    """The target drafting for itself: every draft is accepted, each step gives k + 1 = 4 tokens. A stop
    string that ends inside the second step's run cuts the text there and drops the run's later tokens."""
    target, _ = model_dirs
    with serving(target, target, k=3) as (srv, url):
        c = client(url)
        kw = dict(model="tiny", prompt="Why?", max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
        steps = [ch.choices[0].text for ch in c.completions.create(stream=True, **kw)]
        # One character per token; the prefill step samples 1 token, then each step accepts 3 drafts + 1.
        assert [len(s) for s in steps] == [1, 4, 4, 3]
        full, before, run = "".join(steps), steps[0] + steps[1], steps[2]
        stop = next(run[:n] for n in range(1, 4) if full.find(run[:n]) == len(before))
        out = c.completions.create(stop=[stop, "never"], **kw)
        assert out.choices[0].text == before and out.choices[0].finish_reason == "stop"
        # Counted up to the token that completed the stop string; the run's later tokens are dropped.
        assert out.usage.completion_tokens == len(before) + len(stop) < 9
        spec = out.model_extra["spec_decode"]
        assert spec["num_accepted_tokens"] == spec["num_draft_tokens"] > 0
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, stop=stop, **kw))
        assert streamed == before
        assert wait_idle(srv) == idle_state()
        from minispec.serve.load import metric

        text = srv.metrics.render().decode()
        count = lambda reason: metric(text, "vllm:request_success_total", f'finished_reason="{reason}"')
        # A stop string counts as "stop" (not "abort"), also when the engine reached max_tokens before the
        # server found it: the metrics count the reason the client was given.
        assert (count("stop"), count("length"), count("abort")) == (2, 1, 0)


def test_bad_input_gets_one_line_openai_errors_and_the_server_keeps_serving(server):
    srv, url = server
    ctx = srv.llm.engine.config.max_model_len
    cases = [
        (b'{"prompt": "hi", ', 400, None),  # malformed JSON
        (b'[1, 2]', 400, None),
        ({"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
        ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
        ({"prompt": "hi", "stop": 5}, 400, "stop"),
        ({"prompt": {"text": "hi"}}, 400, "prompt"),
        ({"prompt": list(range(ctx + 10))}, 400, "prompt"),  # longer than the context
        ({"prompt": [1, 2, 10**9]}, 400, "prompt"),
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
        ({"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
        ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
        ({"prompt": "hi", "n": 0}, 400, "n"),
        ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
        (b'{"prompt": "' + b"x" * (1 << 20) + b'"}', 413, None),  # over the body limit
    ]
    for body, status, param in cases:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        got, _, text = http(url, "POST", "/completions", content)
        assert got == status, (content[:60], text)
        assert text.count("\n") == 0
        err = json.loads(text)["error"]
        assert err["message"] and err["type"] and err["param"] == param, text
    for messages in ("hi", [{"role": "wizard", "content": "hi"}], [{"role": "user", "content": 3}]):
        got, _, text = http(url, "POST", "/chat/completions", json.dumps({"messages": messages}).encode())
        assert got == 400 and json.loads(text)["error"]["param"] == "messages", text
    assert http(url, "GET", "/nowhere")[0] == 404 and http(url, "GET", "/completions")[0] == 405
    with pytest.raises(openai.NotFoundError):  # the real client raises its own error classes
        client(url).completions.create(model="gpt-4", prompt="hi")
    out = client(url).completions.create(model="tiny", prompt="still here?", max_tokens=3)
    assert out.usage.completion_tokens >= 1
    assert wait_idle(srv) == idle_state()


class SlowSteps(Observer):
    """An observer that makes every engine step last at least `seconds`: a long request outlasts a client's
    timeout on any machine (the tiny model runs its whole context in well under a second)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_step(self, step) -> None:
        time.sleep(max(0.0, self.seconds - step.step_s))


def test_api_key_and_bounded_queue(model_dirs):
    """2 slots + a queue of 1: a fourth request in flight gets 429 with Retry-After; no key gets 401."""
    with serving(*model_dirs, max_num_seqs=2, max_queue=1, api_key="sekret", observer=SlowSteps(0.01)) as (srv, url):
        with pytest.raises(openai.AuthenticationError):
            client(url).completions.create(model="tiny", prompt="hi", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            client(url, api_key="wrong").models.list()
        c = client(url, api_key="sekret")
        kw = dict(model="tiny", prompt="Go on and on", max_tokens=200, stream=True, extra_body={"ignore_eos": True})
        streams = [c.completions.create(**kw) for _ in range(3)]  # 2 running, 1 waiting
        status, headers, text = http(url, "POST", "/completions", b'{"prompt": "one more", "max_tokens": 2}',
                                     {"authorization": "Bearer sekret"})
        assert status == 429 and headers["retry-after"] == "1", text
        assert json.loads(text)["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            c.completions.create(model="tiny", prompt="one more", max_tokens=2)
        for s in streams[:2]:
            next(iter(s))
        from minispec.serve.load import metric

        usage = lambda: metric(srv.metrics.render().decode(), "vllm:kv_cache_usage_perc")
        assert 0 < usage() <= 1  # two running requests hold their prompts' and outputs' KV
        for s in streams:
            s.close()  # the clients leave: their requests are aborted
        assert wait_idle(srv, 2) == idle_state(2)
        engine_state(srv)  # one more loop iteration: the metrics of the last one are set
        assert usage() == 0 and metric(srv.metrics.render().decode(), "vllm:num_preemptions_total") == 0
        assert c.completions.create(model="tiny", prompt="now", max_tokens=2).usage.completion_tokens >= 1
        # A non-streaming client that gives up: its request is aborted, not run to its 250 tokens.
        aborted = lambda: metric(srv.metrics.render().decode(), "vllm:request_success_total", 'reason="abort"')
        before = aborted()
        with pytest.raises(openai.APITimeoutError):
            client(url, api_key="sekret", timeout=0.5).completions.create(
                model="tiny", prompt="long", max_tokens=250, extra_body={"ignore_eos": True})
        assert wait_idle(srv, 2) == idle_state(2)
        assert aborted() == before + 1


def test_64_streams_with_disconnects(server):
    """64 concurrent streaming clients, every fifth (13) dropping after two chunks: the rest finish with
    finish_reason "length" and exactly the text of a non-streamed run with the same seed; afterwards
    no request, slot or draft-logits row is held and /metrics agrees."""
    from minispec.serve.load import drive, metric

    srv, url = server
    before = srv.metrics.render().decode()
    got = asyncio.run(drive(url, "tiny", range(64), 64, max_tokens=24, drop_every=5))
    assert not [r.error for r in got if r.error]
    dropped = [r for r in got if r.disconnected]
    done = [r for r in got if not r.disconnected]
    assert len(dropped) == 13 and len(done) == 51
    assert all(r.finish_reason == "length" and r.completion_tokens == 24 for r in done)
    assert wait_idle(srv) == idle_state()  # every slot is free again
    # The draft-logits rows of a replicated cache are the slots; all 16 serve a full batch again:
    ref = asyncio.run(drive(url, "tiny", [r.index for r in done], 16, max_tokens=24, stream=False))
    assert [r.text for r in ref] == [r.text for r in done]
    after = srv.metrics.render().decode()
    delta = lambda name, label="": metric(after, name, label) - metric(before, name, label)
    assert delta("vllm:request_success_total", 'finished_reason="abort"') == 13
    assert delta("vllm:request_success_total", 'finished_reason="length"') == 51 * 2
    assert metric(after, "vllm:num_requests_running") == metric(after, "vllm:num_requests_waiting") == 0
    assert delta("vllm:generation_tokens_total") >= 51 * 2 * 24 + 13 * 2
    drafts = delta("vllm:spec_decode_num_drafts_total")
    per_pos = [delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", f'position="{j}"') for j in range(3)]
    assert drafts > 0 and drafts >= per_pos[0] >= per_pos[1] >= per_pos[2]
    assert sum(per_pos) == delta("vllm:spec_decode_num_accepted_tokens_total")
    assert delta("vllm:time_to_first_token_seconds_count") == 64 + 51


def test_cli_serves_and_keeps_rss_flat(model_dirs, tmp_path):
    """The users' path: python -m minispec.serve, driven by the load script (200 requests, 20% dropped; the
    script's default of 2,000 is the figure the README reports)."""
    target, draft = model_dirs
    out = tmp_path / "load.json"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "minispec.serve.load", "--requests", "200", "--json", str(out),
                        "--throughput-tokens", "8",
                        "--target", target, "--draft", draft, "-k", "3"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    f = json.loads(out.read_text())
    assert f["errors"] == 0 and f["warmup_errors"] == 0 and f["disconnects"] == 40
    assert f["running_after"] == f["waiting_after"] == 0
    assert f["throughput_same_text"]
    assert f["rss_after_mib"] - f["rss_before_mib"] < 24, f  # flat: no per-request growth
    assert f["server_exit_code"] == 0  # SIGTERM: a graceful stop


def test_torchrun_rank0_serves_and_rank1_follows(model_dirs, tmp_path):
    """tp=2 under torchrun (gloo): rank 0 serves and broadcasts each step's new and aborted requests, rank 1
    steps the same engine. Seeded answers equal a tp=1 server's; a dropped stream and SIGTERM stop cleanly."""
    from minispec.serve.load import drive, start_server

    target, draft = model_dirs
    env_keys = {"OMP_NUM_THREADS": "1", "MINISPEC_DIST_TIMEOUT": "60", "PYTHONPATH": ROOT}
    old = {k: os.environ.get(k) for k in env_keys}
    os.environ.update(env_keys)
    try:
        proc, url, model = start_server(["--target", target, "--draft", draft, "-k", "3", "--tp", "2"], nproc=2)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    try:
        got = asyncio.run(drive(url, model, range(6), 6, max_tokens=16, drop_every=5))  # 0 and 5 are dropped
        with serving(target, draft) as (_, url1):
            ref = asyncio.run(drive(url1, "tiny", range(1, 5), 4, max_tokens=16, stream=False))
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    assert not [r.error for r in got if r.error]
    assert [r.disconnected for r in got] == [True, False, False, False, False, True]
    assert [r.text for r in got[1:5]] == [r.text for r in ref]
    assert all(r.finish_reason == "length" and r.completion_tokens == 16 for r in got[1:5])
    assert "rank 1: stopped with rank 0" in out, out[-3000:]
    assert "CollectiveError" not in out and "error:" not in out, out[-3000:]


# ---- issue 28: every bad input a 4xx, one request never the service -------------------------------------------
NEST = 50_000  # deep enough for a RecursionError in json.loads
# Values no numeric field takes: past int64, past float, NaN / inf (Python's json reads those literals), deep
# nesting below and above json's own recursion limit, a lone surrogate, wrong types. Raw JSON text each.
FUZZ_VALUES = ["100000000000000000000", str(2**63), str(-(2**63) - 1), str(2**64), "1e400", "-1e400", "NaN",
               "Infinity", "-Infinity", "[" * 100 + "]" * 100, '"\\ud800"', '"7"', "[7]", '{"x": 7}', "true", "-1.5"]
FUZZ_FIELDS = ["top_k", "seed", "max_tokens", "temperature", "top_p", "stop_token_ids", "n", "logprobs",
               "top_logprobs", "stop", "stream", "ignore_eos", "stream_options", "prompt"]
# (field, value) pairs that are valid requests: an answer (200) rather than a 400.
FUZZ_VALID = {("temperature", "100000000000000000000"), ("temperature", str(2**63)), ("temperature", str(2**64)),
              ("stream", "true"), ("ignore_eos", "true"), ("stream_options", '{"x": 7}'), ("prompt", "[7]"),
              ("prompt", '"7"'), ("stop", '"7"'), ("stop_token_ids", "[7]")}


class Records(logging.Handler):
    """Collects the log records of one logger (uvicorn's, whose records do not propagate to pytest's caplog)."""

    def __init__(self, name: str):
        super().__init__(logging.DEBUG)
        self.records, self.logger = [], logging.getLogger(name)

    def __enter__(self):
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)

    def emit(self, record):
        self.records.append(record)


def fuzz_cases() -> list[tuple[str, bytes, int, str | None]]:
    """(path, raw body, status, param): every field with every value, the issue's bodies, the refused fields."""
    cases = []
    for field in FUZZ_FIELDS:
        for value in FUZZ_VALUES:
            head = '{"prompt": "Hi", "max_tokens": 2' if field != "max_tokens" else '{"prompt": "Hi"'
            if field == "prompt":
                head = '{"max_tokens": 2'
            status = 200 if (field, value) in FUZZ_VALID else 400
            cases.append(("/completions", f'{head}, "{field}": {value}}}'.encode(), status, field))
    deep = ("[" * NEST + "]" * NEST).encode()
    cases += [
        ("/completions", b'{"prompt": "Hi", "max_tokens": 2, "top_k": ' + deep + b"}", 400, None),
        ("/completions", b'{"prompt": ' + deep + b"}", 400, None),
        ("/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "prompt"),
        ("/completions", b'{"prompt": "a\xed\xa0\x80b", "max_tokens": 2}', 400, "prompt"),  # raw, as UTF-8 would be
        ("/completions", b'{"prompt": [1, 100000000000000000000], "max_tokens": 2}', 400, "prompt"),
        ("/completions", b'{"prompt": "Hi", "stop_token_ids": [1, 9223372036854775808]}', 400, "stop_token_ids"),
        ("/chat/completions", b'{"messages": [{"role": "user", "content": "a\\udfffb"}], "max_tokens": 2}', 400,
         "messages"),
        ("/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": '
         b"100000000000000000000}", 400, "max_completion_tokens"),
    ]
    refused = {"response_format": {"type": "json_object"}, "tools": [{"type": "function"}], "tool_choice": "auto",
               "parallel_tool_calls": False, "modalities": ["text", "audio"], "reasoning_effort": "low",
               "functions": [{"name": "f"}], "echo": True, "top_logprobs": 2}  # top_logprobs needs logprobs
    for field, value in refused.items():
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, field: value}
        cases.append(("/chat/completions", json.dumps(body).encode(), 400, field))
    return cases


def test_fuzzed_fields_get_400s_while_seeded_streams_finish_their_text(server):
    """The fuzz (four threads) beside four seeded streams: each bad body gets a one-line 400 naming its field,
    nothing is logged as a traceback, and the streams' text equals a run without the fuzz."""
    from concurrent.futures import ThreadPoolExecutor

    from minispec.serve.load import drive

    srv, url = server
    ref = asyncio.run(drive(url, "tiny", range(4), 4, max_tokens=48))
    cases = fuzz_cases()
    half = threading.Event()

    def send(i):
        path, body, _, _ = cases[i]
        if i == len(cases) // 4:
            half.set()
        return http(url, "POST", path, body)

    def healthy():
        half.wait(60)
        return asyncio.run(drive(url, "tiny", range(4), 4, max_tokens=48))

    with Records("uvicorn.error") as log, ThreadPoolExecutor(5) as pool:
        streams = pool.submit(healthy)
        answers = list(pool.map(send, range(len(cases))))
        got = streams.result(120)
    assert [(r.text, r.finish_reason, r.error) for r in got] == [(r.text, "length", None) for r in ref]
    for (path, body, status, param), (got_status, _, text) in zip(cases, answers):
        assert got_status == status, (body[:90], text[:300])
        if status == 400:
            err = json.loads(text)["error"]
            assert text.count("\n") == 0 and err["param"] == param and err["message"], (body[:90], text)
    assert not [r.getMessage() for r in log.records if r.levelno >= logging.ERROR or r.exc_info]
    assert http(url.rsplit("/v1", 1)[0], "GET", "/health")[0] == 200
    assert wait_idle(srv) == idle_state()


def test_ranges_and_the_context_are_named_in_the_errors(server):
    srv, url = server
    ctx = srv.llm.engine.config.max_model_len
    prompt = [1] * (ctx - 10)
    for body, param, words in [
        ({"prompt": "Hi", "top_k": 2**63}, "top_k", "[-1, 2147483647]"),
        ({"prompt": "Hi", "seed": 2**63}, "seed", "[-9223372036854775808, 9223372036854775807]"),
        ({"prompt": "Hi", "top_p": 1.5}, "top_p", "(0, 1]"),
        ({"prompt": "Hi", "temperature": -1}, "temperature", ">= 0"),
        ({"prompt": "Hi", "stop_token_ids": [10**9]}, "stop_token_ids", f"[0, {srv.llm.engine.vocab_size - 1}]"),
        ({"prompt": prompt, "max_tokens": 11}, "max_tokens", "must be in [1, 10]"),  # vLLM's 400, not 10 tokens
        ({"prompt": "Hi", "stop": ["x"] * 17}, "stop", "at most 16 strings"),
    ]:
        status, _, text = http(url, "POST", "/completions", json.dumps(body).encode())
        err = json.loads(text)["error"]
        assert status == 400 and err["param"] == param and words in err["message"], text
    status, _, text = http(url, "POST", "/completions", json.dumps({"prompt": prompt}).encode())
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] <= 10  # the default 16, as many as fit
    out = client(url).completions.create(model="tiny", prompt=prompt, max_tokens=10, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 10 and out.choices[0].finish_reason == "length"


def test_a_chat_template_error_is_a_400(server, monkeypatch):
    """Chat templates reject conversations by raise_exception (roles that do not alternate, say)."""
    srv, url = server
    monkeypatch.setattr(srv.llm.tokenizer, "chat_template", "{{ raise_exception('roles must alternate') }}")
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    status, _, text = http(url, "POST", "/chat/completions", json.dumps(body).encode())
    assert status == 400 and json.loads(text)["error"] == {"message": "messages: TemplateError: roles must alternate",
                                                         "type": "invalid_request_error", "param": "messages",
                                                         "code": None}


def test_a_failing_request_ends_alone(server, monkeypatch):
    """An error while adding one request (here injected) answers that request 500; the loop serves on."""
    srv, url = server
    add = srv.llm.add_request

    def failing(prompt, params, **kw):
        if list(prompt) == [5, 5, 5]:
            raise OverflowError("injected")
        return add(prompt, params, **kw)

    monkeypatch.setattr(srv.llm, "add_request", failing)
    status, _, text = http(url, "POST", "/completions", b'{"prompt": [5, 5, 5]}')
    assert status == 500 and "OverflowError: injected" in json.loads(text)["error"]["message"]
    out = client(url).completions.create(model="tiny", prompt=[5, 5], max_tokens=3)
    assert out.usage.completion_tokens >= 1 and srv.loop.alive


class FailingStep(Observer):
    """Raises in the engine's fifth step (of one request of 200 tokens, 4 at most a step): the engine loop
    itself cannot go on."""

    steps = 0

    def on_step(self, step) -> None:
        self.steps += 1
        if self.steps == 5:
            raise RuntimeError("injected step failure")


def test_a_dead_engine_loop_stops_the_server(model_dirs, caplog):
    """The running stream ends with the reason, the reason is logged, and the server stops (the CLI then
    exits 1) rather than answering 503 for ever."""
    with serving(*model_dirs, observer=FailingStep()) as (srv, url):
        stream = client(url).completions.create(model="tiny", prompt="Go on", max_tokens=200, stream=True,
                                                extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIError, match="engine loop failed: RuntimeError: injected step failure"):
            list(stream)
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        for _ in range(200):  # bounded: the server stops within its graceful-shutdown time
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
            except ConnectionRefusedError:
                break
            except ConnectionResetError:  # the listening socket closed mid-handshake: ask again
                pass
            time.sleep(0.1)
        else:
            pytest.fail("the server still listens after its engine loop died")
        assert srv.loop.error == "engine loop failed: RuntimeError: injected step failure"
    assert any(r.name == "minispec.serve" and "engine loop failed" in r.getMessage() for r in caplog.records)


def raw_exchange(port: int, data: bytes, then_close: bool = False) -> bytes:
    """Send data on a fresh connection (then close it, or wait); what the server sent before it closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(data)
        if then_close:
            return b""
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_stalled_and_leaving_clients(model_dirs, caplog):
    """A stalled body gets 408 and the connection closes; stalled or missing headers close the connection; a
    client that leaves mid-body is one log line, no traceback; the server answers on."""
    with serving(*model_dirs, header_timeout_s=1.0, body_timeout_s=1.0) as (srv, url):
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        with Records("uvicorn.error") as log:
            answer = raw_exchange(port, head + b'{"prompt": ')
            assert answer.startswith(b"HTTP/1.1 408 ") and b"the body did not arrive within 1 s" in answer
            assert raw_exchange(port, head[:40]) == b""  # headers cut short: closed, unanswered
            assert raw_exchange(port, b"") == b""  # nothing sent at all
            raw_exchange(port, head + b'{"prompt": ', then_close=True)
            for _ in range(100):  # bounded: the server notices the close at its next read
                if any("left after" in r.getMessage() for r in caplog.records):
                    break
                time.sleep(0.05)
            out = client(url).completions.create(model="tiny", prompt="still here?", max_tokens=3)
        left = [r.getMessage() for r in caplog.records if "left after" in r.getMessage()]
        assert left == ["POST /v1/completions: the client left after 11 of 100 body bytes"]
        assert not [r.getMessage() for r in log.records if r.levelno >= logging.WARNING or r.exc_info]
        assert out.usage.completion_tokens >= 1


def test_connection_limit(model_dirs):
    """max_connections open connections: a request on one more gets uvicorn's 503, and 200 once they close."""
    with serving(*model_dirs, max_connections=4) as (srv, url):
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        idle = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(4)]
        try:
            assert http(url, "GET", "/models")[0] == 503
        finally:
            for s in idle:
                s.close()
        for _ in range(100):  # bounded: the server sees the closes at its next read
            if http(url, "GET", "/models")[0] == 200:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the server still answers 503 with its connections closed")


# ---- issue 28: logprobs, echo, n ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_log_softmax(model_dirs):
    from tests.utils import hf_log_softmax

    return hf_log_softmax(model_dirs[0])


def post(url, path, body) -> dict:
    status, _, text = http(url, "POST", path, json.dumps(body).encode())
    assert status == 200, text
    return json.loads(text)


def stream_choices(url, path, body) -> dict[int, dict]:
    """A streamed answer joined per choice index: text, logprobs (joined fragments), finish_reason."""
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", u.path + path, body=json.dumps({**body, "stream": True}),
                 headers={"content-type": "application/json"})
    lines = conn.getresponse().read().decode().split("\n\n")
    conn.close()
    out: dict[int, dict] = {}
    for line in lines:
        if not line.startswith("data: {"):
            continue
        for c in json.loads(line[6:])["choices"]:
            got = out.setdefault(c["index"], {"text": "", "logprobs": None, "finish_reason": None})
            got["text"] += (c["delta"].get("content") or "") if "delta" in c else c["text"]
            got["finish_reason"] = c["finish_reason"] or got["finish_reason"]
            if c["logprobs"] is not None:
                if got["logprobs"] is None:
                    got["logprobs"] = {k: [] for k in c["logprobs"]}
                for k, v in c["logprobs"].items():
                    got["logprobs"][k] += v
    return out


def check_entries(lp, ids, start, logprobs, tops, num_top, tok_of):
    """The answer's logprobs (tops: [(token text, logprob)] per token) equal transformers' (tests/utils)."""
    from tests.utils import check_logprobs

    check_logprobs(lp, ids, start, [(x, [(tok_of(t), v) for t, v in top]) for x, top in zip(logprobs, tops)], num_top)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("with_draft", [True, False])
def test_completion_logprobs_equal_transformers(model_dirs, server, hf_log_softmax, stream, with_draft):
    """Sampled tokens' logprobs (accepted drafts and drawn tokens alike) are the target's log-softmax."""
    from contextlib import nullcontext

    target, _ = model_dirs
    with (nullcontext(server) if with_draft else serving(target, None)) as (srv, url):
        body = {"prompt": "Hello there", "max_tokens": 10, "temperature": 0.8, "seed": 3, "logprobs": 5,
                "ignore_eos": True}
        got = stream_choices(url, "/completions", body)[0] if stream else post(url, "/completions", body)["choices"][0]
        prompt = srv.llm.encode("Hello there", False)
        shape = got["logprobs"]
        tok_of = srv.llm.tokenizer.convert_tokens_to_ids  # the character tokenizer: a token's text is its name
        out_ids = [tok_of(t) for t in shape["tokens"]]
        lp, n = hf_log_softmax(prompt + out_ids), len(out_ids)
        assert len(shape["token_logprobs"]) == len(shape["top_logprobs"]) == n == 10
        assert srv.llm.decode(out_ids) == got["text"]
        assert shape["text_offset"] == [len(srv.llm.decode(out_ids[:j])) for j in range(n)]
        check_entries(lp, prompt + out_ids, len(prompt), shape["token_logprobs"],
                      [list(d.items()) for d in shape["top_logprobs"]], 5, tok_of)
        for x, top in zip(shape["token_logprobs"], shape["top_logprobs"]):
            assert 5 <= len(top) <= 6 and x in top.values()  # the top 5 and the chosen token
        if with_draft:
            spec = post(url, "/completions", body)["spec_decode"]
            assert spec["num_accepted_tokens"] > 0  # some logprobs were read at accepted drafts' positions


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_equal_transformers(server, hf_log_softmax, stream):
    srv, url = server
    messages = [{"role": "user", "content": "Tell a story"}]
    body = {"messages": messages, "max_tokens": 8, "temperature": 0.7, "seed": 5, "logprobs": True,
            "top_logprobs": 3, "ignore_eos": True}
    if stream:
        got = stream_choices(url, "/chat/completions", body)[0]
        text, content = got["text"], got["logprobs"]["content"]
    else:
        got = post(url, "/chat/completions", body)["choices"][0]
        text, content = got["message"]["content"], got["logprobs"]["content"]
    prompt = srv.llm.encode_chat(messages)
    tok_of = srv.llm.tokenizer.convert_tokens_to_ids
    out_ids = [tok_of(e["token"]) for e in content]
    assert len(content) == 8 and srv.llm.decode(out_ids) == text
    assert all(e["bytes"] == list(e["token"].encode()) and len(e["top_logprobs"]) == 3 for e in content)
    check_entries(hf_log_softmax(prompt + out_ids), prompt + out_ids, len(prompt), [e["logprob"] for e in content],
                  [[(t["token"], t["logprob"]) for t in e["top_logprobs"]] for e in content], 3, tok_of)
    # without logprobs nothing changes: the same seeded text, logprobs null
    plain = post(url, "/chat/completions", {**body, "logprobs": None, "top_logprobs": None})["choices"][0]
    assert plain["message"]["content"] == text and plain["logprobs"] is None


def test_echo_with_max_tokens_0_scores_the_prompt(server, hf_log_softmax):
    """lm-eval's loglikelihood request: echo, logprobs, max_tokens 0 (or 1); the first prompt token's logprob is
    null; the prompt's logprobs equal transformers'."""
    srv, url = server
    prompt = srv.llm.encode("The cat sat on the mat", False)
    lp = hf_log_softmax(prompt)
    for prompt_field, stream in (("The cat sat on the mat", False), (prompt, False), (prompt, True)):
        body = {"prompt": prompt_field, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
        got = stream_choices(url, "/completions", body)[0] if stream else post(url, "/completions", body)["choices"][0]
        shape = got["logprobs"]
        assert got["text"] == "The cat sat on the mat" and got["finish_reason"] == "length"
        assert shape["token_logprobs"][0] is None and shape["top_logprobs"][0] is None
        assert len(shape["token_logprobs"]) == len(prompt) and shape["text_offset"] == list(range(len(prompt)))
        check_entries(lp, prompt, 1, shape["token_logprobs"][1:], [list(d.items()) for d in shape["top_logprobs"][1:]],
                      1, srv.llm.tokenizer.convert_tokens_to_ids)
    out = post(url, "/completions", {"prompt": prompt, "max_tokens": 0, "echo": True})
    assert out["choices"][0]["text"] == "The cat sat on the mat" and out["choices"][0]["logprobs"] is None
    assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 0, "total_tokens": len(prompt),
                            "prompt_tokens_details": {"cached_tokens": 0}}  # scored: every position computed
    # an answered prompt's K/V (target's and draft's) serve the next request with it: all but its last token
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    post(url, "/completions", body)
    assert post(url, "/completions", body)["usage"]["prompt_tokens_details"] == {"cached_tokens": len(prompt) - 1}
    # echo with a completion: the prompt's text, then the same seeded completion as without echo
    body = {"prompt": "Once", "max_tokens": 5, "seed": 2, "ignore_eos": True}
    plain = post(url, "/completions", body)["choices"][0]["text"]
    assert post(url, "/completions", {**body, "echo": True})["choices"][0]["text"] == "Once" + plain
    assert stream_choices(url, "/completions", {**body, "echo": True})[0]["text"] == "Once" + plain
    assert wait_idle(srv) == idle_state()


@pytest.mark.parametrize("chat", [False, True])
def test_n_choices(server, chat):
    """n = 3: three choices indexed 0..2, choice i the answer of seed + i, usage summed, streamed alike."""
    srv, url = server
    path = "/chat/completions" if chat else "/completions"
    base = {"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Once upon"}
    body = {**base, "max_tokens": 6, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    text = lambda c: c["message"]["content"] if chat else c["text"]
    out = post(url, path, {**body, "n": 3})
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    texts = [text(c) for c in out["choices"]]
    assert [text(c) for c in post(url, path, {**body, "n": 3})["choices"]] == texts  # seeded: reproducible
    assert [text(post(url, path, {**body, "seed": 11 + i})["choices"][0]) for i in range(3)] == texts
    assert len(set(texts)) > 1
    prompt = srv.llm.encode_chat(base["messages"]) if chat else srv.llm.encode(base["prompt"], False)
    usage = dict(out["usage"])
    assert 0 <= usage.pop("prompt_tokens_details")["cached_tokens"] < len(prompt)
    assert usage == {"prompt_tokens": len(prompt), "completion_tokens": 18, "total_tokens": len(prompt) + 18}
    streamed = stream_choices(url, path, {**body, "n": 3, "stream_options": {"include_usage": True}})
    assert [streamed[i]["text"] for i in range(3)] == texts
    assert all(streamed[i]["finish_reason"] == "length" for i in range(3))
    assert wait_idle(srv) == idle_state()


def test_logprobs_echo_and_n_ranges_are_400s(server):
    _, url = server
    for path, body, param in [
        ("/completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
        ("/completions", {"prompt": "Hi", "logprobs": -1}, "logprobs"),
        ("/completions", {"prompt": "Hi", "logprobs": True}, "logprobs"),
        ("/completions", {"prompt": "Hi", "top_logprobs": 2}, "top_logprobs"),
        ("/completions", {"prompt": "Hi", "echo": 1}, "echo"),
        ("/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
        ("/completions", {"prompt": "Hi", "n": 17}, "n"),
        ("/chat/completions", {"logprobs": 3}, "logprobs"),
        ("/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/chat/completions", {"echo": True}, "echo"),
        ("/chat/completions", {"n": 0}, "n"),
    ]:
        if path == "/chat/completions":
            body = {"messages": [{"role": "user", "content": "Hi"}], **body}
        status, _, text = http(url, "POST", path, json.dumps(body).encode())
        assert status == 400 and json.loads(text)["error"]["param"] == param and text.count("\n") == 0, (body, text)
    assert post(url, "/completions", {"prompt": "Hi", "max_tokens": 2, "logprobs": False})["choices"][0]["logprobs"] \
        is None
