"""CLI: python -m minispec.serve — an OpenAI-compatible server (also under torchrun: rank 0 serves)."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys

from minispec.generate import add_model_args, build_llm, check_model_args
from minispec.serve.app import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, MAX_CONNECTIONS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minispec.serve",
        description="Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models) with "
                    "speculative decoding and continuous batching; /health and /metrics (Prometheus).",
    )
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free one; the address is printed)")
    p.add_argument("--max-queue", type=int, default=128,
                   help="requests waiting beyond the --max-num-seqs running ones before 429 (default: 128)")
    p.add_argument("--api-key", default=os.environ.get("MINISPEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $MINISPEC_API_KEY, else none)")
    p.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S,
                   help="seconds a request line and its headers may take to arrive, else the connection is closed "
                        f"(default: {HEADER_TIMEOUT_S:g})")
    p.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S,
                   help=f"seconds a request body may take to arrive, else 408 (default: {BODY_TIMEOUT_S:g})")
    p.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                   help="open connections beyond which new requests get 503; above --max-num-seqs + --max-queue "
                        f"(default: {MAX_CONNECTIONS})")
    return p


def bind(host: str, port: int, parser) -> socket.socket:
    """A socket bound to host:port (listening starts once the model is loaded), or parser.error."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        parser.error(f"cannot listen on {host}:{port}: {e.strerror or e}")
    return sock


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_model_args(args, parser)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue < 0:
        parser.error(f"--max-queue must be >= 0, got {args.max_queue}")
    for flag, value in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout)):
        if not 0 < value < float("inf"):
            parser.error(f"{flag} must be a positive number of seconds, got {value}")
    if args.max_connections <= args.max_num_seqs + args.max_queue:
        parser.error(f"--max-connections must be above --max-num-seqs + --max-queue = "
                     f"{args.max_num_seqs + args.max_queue} (else 503s come before 429s), got {args.max_connections}")
    logging.basicConfig(format="%(levelname)s:  %(message)s")  # as uvicorn's lines
    rank0 = int(os.environ.get("RANK", "0")) == 0
    sock = bind(args.host, args.port, parser) if rank0 else None
    from minispec.distributed import CollectiveError
    from minispec.llm import DEFAULT_TARGET

    try:
        try:
            llm = build_llm(args)
        except ValueError as e:  # includes ModelLoadError
            parser.error(str(e))
        if not rank0:  # a follower: its signals are rank 0's to handle; it stops when rank 0 says so
            from minispec.serve.engine_loop import follow

            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            follow(llm)
            print(f"[minispec] rank {os.environ.get('RANK')}: stopped with rank 0", flush=True)
            return 0
        from minispec.serve.app import OpenAIServer

        model_name = args.target or DEFAULT_TARGET
        server = OpenAIServer(llm, model_name, max_queue=args.max_queue, api_key=args.api_key,
                              header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                              max_connections=args.max_connections)
        host, port = sock.getsockname()[:2]
        url_host = f"[{host}]" if ":" in host else host
        print(f"[minispec] serving {model_name} at http://{url_host}:{port}/v1 (k={llm.num_speculative_tokens}, "
              f"tp={args.tp}, {args.max_num_seqs} slots, queue {args.max_queue}"
              f"{', API key required' if args.api_key else ''})", flush=True)
        if llm.auto_draft:
            print(f"[minispec] draft auto: {llm.auto_draft}", flush=True)
        for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn stops gracefully on these, then re-raises them here
            signal.signal(sig, lambda *_: None)
        server.run(sock)
        if server.loop.error:
            print(f"{parser.prog}: error: {server.loop.error}", file=sys.stderr, flush=True)
            return 1
        return 0
    except CollectiveError as e:  # a rank died or stalled: one line on every surviving rank
        print(f"{parser.prog}: error: {e}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    from minispec.distributed import exit_process

    exit_process(main())
