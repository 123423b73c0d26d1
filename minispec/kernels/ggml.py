"""The GGML weight formats minispec reads: their type ids (ggml.h) and block sizes, the one Python table.

kernels/packed_cpu.cpp holds the same table in C++ (``BLOCK_FORMATS``, exported as ``block_formats()``);
tests/test_quant.py checks the two equal, and both equal to the gguf package's.
"""
from __future__ import annotations

from typing import NamedTuple

# GGML type ids. F32 also stands for a dense float32 weight where a qtype is asked for (decode_layers' qtypes).
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
GROUP = 32  # values per block of the quantised formats


class BlockFormat(NamedTuple):
    """A packed format: its name, the bytes of one block and the values it holds (F16 / BF16: one value)."""

    name: str
    block_bytes: int
    block_values: int


# Q4_0 [d][16 nibble bytes], Q4_1 [d][m][16 nibble bytes], Q8_0 [d][32 int8], d and m float16.
PACKED_TYPES: dict[int, BlockFormat] = {
    Q4_0: BlockFormat("Q4_0", 18, GROUP),
    Q4_1: BlockFormat("Q4_1", 20, GROUP),
    Q8_0: BlockFormat("Q8_0", 34, GROUP),
    F16: BlockFormat("F16", 2, 1),
    BF16: BlockFormat("BF16", 2, 1),
}
BLOCK_TYPES = (Q4_0, Q4_1, Q8_0)  # the quantised ones: rows are whole blocks
