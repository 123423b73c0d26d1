"""Load on a running server through the openai client: concurrent streams, some dropped mid-stream; RSS, throughput.

    python -m minispec.serve.load --requests 2000 [server flags, e.g. --target DIR --draft DIR -k 3]

starts `python -m minispec.serve` on a free port, warms it up, then prints: requests, disconnects,
tokens, errors, the server's RSS before and after the load, leftovers in /metrics, and the
throughput of 16 concurrent requests over 16 sequential ones. Needs the openai package (the test extra).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

PROMPT = "Request {i}: write a short note about the number {i}."


@dataclass(slots=True)
class Result:
    """One request as its client saw it."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    disconnected: bool = False
    error: str | None = None


async def one(client, model: str, i: int, max_tokens: int, temperature: float, top_k: int, stream: bool,
              drop_after: int | None = None) -> Result:
    """Request i (seed i, prompt PROMPT); drop_after: close the stream after that many chunks."""
    r = Result(i)
    kwargs = dict(model=model, prompt=PROMPT.format(i=i), max_tokens=max_tokens, temperature=temperature, seed=i,
                  extra_body={"ignore_eos": True, "top_k": top_k})
    try:
        if not stream:
            out = await client.completions.create(**kwargs)
            r.text, r.finish_reason = out.choices[0].text, out.choices[0].finish_reason
            r.completion_tokens = out.usage.completion_tokens
            return r
        chunks = await client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
        n = 0
        async for chunk in chunks:
            if chunk.usage is not None:
                r.completion_tokens = chunk.usage.completion_tokens
            if chunk.choices:
                r.text += chunk.choices[0].text
                r.finish_reason = chunk.choices[0].finish_reason or r.finish_reason
                n += 1
                if drop_after is not None and n >= drop_after:
                    await chunks.close()
                    r.disconnected = True
                    break
    except Exception as e:  # noqa: BLE001 — counted, not raised: a load run reports its errors
        r.error = f"{type(e).__name__}: {e}"
    return r


async def drive(base_url: str, model: str, indices, concurrency: int, max_tokens: int = 16,
                temperature: float = 0.8, top_k: int = 8, stream: bool = True, drop_every: int = 0,
                api_key: str = "none") -> list[Result]:
    """Requests `indices` with at most `concurrency` at once; every drop_every-th (i % drop_every == 0) is
    dropped after its second chunk.

    top_k: sampling among a few tokens keeps the text independent of the batch: over the whole
    vocabulary a float32 near-tie between two candidates, which padding a batch differently can flip,
    turns up about once in 500 tokens of a random 49k-vocabulary model.
    """
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)

    async def gated(i):
        async with gate:
            drop = 2 if drop_every and i % drop_every == 0 else None
            return await one(client, model, i, max_tokens, temperature, top_k, stream, drop)

    try:
        return list(await asyncio.gather(*(gated(i) for i in indices)))
    finally:
        await client.close()


def rss_mib(pid: int) -> float:
    """Resident set size of a process (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def metric(text: str, name: str, label: str = "") -> float:
    """Sum of a metric's samples in Prometheus text (those whose labels include `label`, e.g. 'position="0"')."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        if label in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def start_server(server_args: list[str], nproc: int = 1, timeout: float = 300
                 ) -> tuple[subprocess.Popen, str, str]:
    """python -m minispec.serve on a free port (under torchrun with nproc > 1 ranks); returns (process,
    base url, model name) once it listens. The process's output stays readable on proc.stdout."""
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  f"--nproc-per-node={nproc}"]
    cmd = [*launch, "-m", "minispec.serve", "--port", "0", *server_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"serving (\S+) at (http://\S+/v1)", line)
        if m:
            return proc, m.group(2), m.group(1)
    proc.kill()
    raise RuntimeError("the server did not start:\n" + "".join(lines[-20:]))


def wait_ready(base_url: str, timeout: float = 60) -> None:
    import urllib.request

    root = base_url.rsplit("/v1", 1)[0]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(root + "/health", timeout=5):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{root}/health did not answer")


def get_metrics(base_url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(base_url.rsplit("/v1", 1)[0] + "/metrics", timeout=30) as f:
        return f.read().decode()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minispec.serve.load", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--drop-every", type=int, default=5, help="drop every n-th stream mid-way (5: 20%%)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--throughput-tokens", type=int, default=32, help="max_tokens of the 16 + 16 throughput requests")
    p.add_argument("--tp", type=int, default=1, help="serve under torchrun with this many ranks")
    p.add_argument("--json", default=None, help="also write the figures here")
    args, server_args = p.parse_known_args(argv)
    proc, url, model = start_server(server_args + ["--tp", str(args.tp)], nproc=args.tp)
    figures = {}
    try:
        wait_ready(url)
        warm = asyncio.run(drive(url, model, range(64), args.concurrency, args.max_tokens, drop_every=args.drop_every))
        figures["warmup_errors"] = sum(r.error is not None for r in warm)
        rss_before = rss_mib(proc.pid)
        t0 = time.perf_counter()
        res = asyncio.run(drive(url, model, range(64, 64 + args.requests), args.concurrency, args.max_tokens,
                                drop_every=args.drop_every))
        load_s = time.perf_counter() - t0
        rss_after = rss_mib(proc.pid)
        text = get_metrics(url)
        figures.update(
            requests=len(res), disconnects=sum(r.disconnected for r in res),
            completed=sum(r.finish_reason is not None and not r.disconnected for r in res),
            errors=sum(r.error is not None for r in res),
            first_error=next((r.error for r in res if r.error), None),
            tokens_received=sum(r.completion_tokens or 0 for r in res if not r.disconnected),
            generation_tokens_total=metric(text, "vllm:generation_tokens_total"),
            running_after=metric(text, "vllm:num_requests_running"),
            waiting_after=metric(text, "vllm:num_requests_waiting"),
            aborted_total=metric(text, "vllm:request_success_total", 'finished_reason="abort"'),
            load_s=round(load_s, 2), rss_before_mib=round(rss_before, 1), rss_after_mib=round(rss_after, 1),
        )
        seq_t0 = time.perf_counter()
        seq = asyncio.run(drive(url, model, range(10_000, 10_016), 1, args.throughput_tokens, stream=False))
        seq_s = time.perf_counter() - seq_t0
        conc_t0 = time.perf_counter()
        conc = asyncio.run(drive(url, model, range(10_000, 10_016), 16, args.throughput_tokens, stream=False))
        conc_s = time.perf_counter() - conc_t0
        figures.update(
            sequential_s=round(seq_s, 3), concurrent_s=round(conc_s, 3),
            throughput_ratio=round(seq_s / conc_s, 2),
            throughput_same_text=[r.text for r in seq] == [r.text for r in conc],
            throughput_tokens=sum(r.completion_tokens or 0 for r in conc),
        )
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    figures["server_exit_code"] = proc.returncode
    for k, v in figures.items():
        print(f"{k}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0 if figures["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
