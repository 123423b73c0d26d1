"""The GGML weight formats minispec reads: their type ids (ggml.h) and block sizes, the one Python table.

kernels/cpu_ops.h holds the same table in C++ (``BLOCK_FORMATS``, exported as ``block_formats()``);
tests/test_quant.py checks the two equal, and the file formats equal to the gguf package's.
"""
from __future__ import annotations

from typing import NamedTuple

# GGML type ids. F32 also stands for a dense float32 weight where a qtype is asked for (decode_layers' qtypes).
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
# Memory-only layouts, never in a file: Q4_0 / Q4_1 rows split for the AVX-512 one-row kernel. A row of G blocks
# holds the blocks' 16 code bytes each (as the file has them), then their G float16 scales, then (Q4_1) their G
# float16 minima: the same bytes and values as the file's row, in another order (layers/quant.py's split_rows).
Q4_0_SPLIT, Q4_1_SPLIT = 1002, 1003
SPLIT_OF = {Q4_0: Q4_0_SPLIT, Q4_1: Q4_1_SPLIT}
# ... and tiled, for the AMX kernel: rows in groups of TILE_ROWS, a group's block g holding the 16 rows' codes in the
# tiles' pair order, then their float16 scales and (Q4_1) minima (layers/quant.py's tile_rows; kernels/packed_cpu.cpp's
# amx_tiled_linear). Only whole groups exist, and a row is not a slice of the bytes.
Q4_0_TILES, Q4_1_TILES = 1004, 1005
TILES_OF = {Q4_0: Q4_0_TILES, Q4_1: Q4_1_TILES}
TILE_ROWS = 16
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
    Q4_0_SPLIT: BlockFormat("Q4_0 split", 18, GROUP),
    Q4_1_SPLIT: BlockFormat("Q4_1 split", 20, GROUP),
    Q4_0_TILES: BlockFormat("Q4_0 tiles", 18, GROUP),
    Q4_1_TILES: BlockFormat("Q4_1 tiles", 20, GROUP),
}
BLOCK_TYPES = (Q4_0, Q4_1, Q8_0, Q4_0_SPLIT, Q4_1_SPLIT, Q4_0_TILES, Q4_1_TILES)  # quantised: rows of whole blocks


FILE_TYPE_OF = {layout: t for of in (SPLIT_OF, TILES_OF) for t, layout in of.items()}  # memory-only layout -> file's


def file_type(qtype: int) -> int:
    """The file format whose values a layout holds: a split or tiled layout's, else the type itself."""
    return FILE_TYPE_OF.get(qtype, qtype)
