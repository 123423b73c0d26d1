"""How a torchrun check script ends: leave the process group, flush, and exit at once."""
from __future__ import annotations

import torch

from minispec.distributed import exit_process


def leave(code: int) -> None:
    """Barrier, then minispec.distributed.exit_process(code): leave the process group, flush and os._exit."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    exit_process(code)
