"""Fault injection under torchrun: one rank dies or stalls mid-generation, and the CLI must end, not hang.

Run: python -m torch.distributed.run --standalone --nproc-per-node N tests/dist_scripts/fault_check.py \
         FAULT STEP [minispec.generate arguments...]

FAULT is what the last rank does when it reaches engine step STEP:
    die:CODE   os._exit(CODE) at once (no cleanup, sockets closed by the OS)
    stall      sleep forever (its peers wait in a collective until MINISPEC_DIST_TIMEOUT passes)
    none       nothing: a plain CLI run
The other ranks run the CLI unchanged; they must print one line ("error: rank R/N: <collective>
failed ...") and exit 1. Each rank prints "rank R: fault <FAULT> at step <STEP>" when it injects one.
"""
from __future__ import annotations

import os
import sys
import time

from minispec import generate
from minispec.engine.engine import Engine


def inject(fault: str, at_step: int) -> None:
    """Wrap Engine.step so the last rank misbehaves at step `at_step`."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if fault == "none" or rank != world - 1:
        return
    step = Engine.step
    count = 0

    def faulty_step(self):
        nonlocal count
        if count == at_step:
            print(f"rank {rank}: fault {fault} at step {at_step}", file=sys.stderr, flush=True)
            if fault.startswith("die:"):
                os._exit(int(fault.split(":", 1)[1]))
            while True:  # stall
                time.sleep(3600)
        count += 1
        return step(self)

    Engine.step = faulty_step


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    fault, at_step = sys.argv[1], int(sys.argv[2])
    if fault != "none" and fault != "stall" and not fault.startswith("die:"):
        print(f"unknown fault {fault!r}: die:CODE, stall or none", file=sys.stderr)
        return 2
    inject(fault, at_step)
    return generate.main(sys.argv[3:])


if __name__ == "__main__":
    sys.exit(main())
