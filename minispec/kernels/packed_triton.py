"""The packed linear layer on GPU (Triton): each row is dequantised in registers and dotted with
float32 activations, accumulated in float32. Its torch reference is layers/quant.py ``linear_ref``;
tests compare the two under TRITON_INTERPRET=1. Triton is imported here only, on first use."""
from __future__ import annotations

import functools

import torch

from minispec.kernels.ggml import BF16, F16, GROUP, PACKED_TYPES, Q4_0, Q4_1, Q8_0
from minispec.utils import cdiv


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def packed_linear_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_x, stride_w, stride_o,
                             FORMAT: tl.constexpr, SIZE: tl.constexpr, GROUP: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
        """out[m, n] = sum_k x[m, k] * w[n, k], w dequantised; BLOCK_B bytes of each packed row at a time."""
        # FORMAT: the row format's name (kernels/ggml.py PACKED_TYPES); SIZE: its block's bytes; GROUP: a
        # block's values.
        m = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        n_ok = n < N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        c = tl.arange(0, BLOCK_B)  # [BLOCK_B]
        if FORMAT == "F16" or FORMAT == "BF16":  # one value per 2 bytes (w_ptr viewed as int16)
            for k0 in range(0, K, BLOCK_B):
                k = k0 + c
                ok = n_ok[:, None] & (k < K)[None, :]
                raw = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=ok, other=0)
                if FORMAT == "F16":
                    w = raw.to(tl.float16, bitcast=True).to(tl.float32)
                else:
                    w = raw.to(tl.bfloat16, bitcast=True).to(tl.float32)
                x = tl.load(x_ptr + m * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
                acc += tl.sum(w * x[None, :], axis=1)
        else:
            # A block of GROUP values: Q4_0 [d][16 nibble bytes], Q4_1 [d][m][16 bytes], Q8_0 [d][32 int8].
            QBYTES: tl.constexpr = GROUP if FORMAT == "Q8_0" else GROUP // 2
            HEAD: tl.constexpr = SIZE - QBYTES
            G = K // GROUP
            for j0 in range(0, G * QBYTES, BLOCK_B):
                j = j0 + c  # code byte index within the row, over all blocks
                g = j // QBYTES
                b = j % QBYTES
                ok = n_ok[:, None] & (j < G * QBYTES)[None, :]
                row = w_ptr + n[:, None] * stride_w + (g * SIZE)[None, :]  # [BLOCK_N, BLOCK_B] block starts
                d0 = tl.load(row, mask=ok, other=0).to(tl.uint16)
                d1 = tl.load(row + 1, mask=ok, other=0).to(tl.uint16)
                d = (d0 | (d1 << 8)).to(tl.float16, bitcast=True).to(tl.float32)
                q = tl.load(row + HEAD + b[None, :], mask=ok, other=0)
                xk = m * stride_x + g * GROUP + b
                if FORMAT == "Q8_0":
                    w = d * q.to(tl.int8, bitcast=True).to(tl.float32)
                    x = tl.load(x_ptr + xk, mask=j < G * QBYTES, other=0.0).to(tl.float32)
                    acc += tl.sum(w * x[None, :], axis=1)
                else:
                    lo = (q & 15).to(tl.float32)
                    hi = (q >> 4).to(tl.float32)
                    if FORMAT == "Q4_0":
                        w_lo = d * (lo - 8.0)
                        w_hi = d * (hi - 8.0)
                    else:
                        m0 = tl.load(row + 2, mask=ok, other=0).to(tl.uint16)
                        m1 = tl.load(row + 3, mask=ok, other=0).to(tl.uint16)
                        mn = (m0 | (m1 << 8)).to(tl.float16, bitcast=True).to(tl.float32)
                        w_lo = d * lo + mn
                        w_hi = d * hi + mn
                    x_lo = tl.load(x_ptr + xk, mask=j < G * QBYTES, other=0.0).to(tl.float32)
                    x_hi = tl.load(x_ptr + xk + GROUP // 2, mask=j < G * QBYTES, other=0.0).to(tl.float32)
                    acc += tl.sum(w_lo * x_lo[None, :] + w_hi * x_hi[None, :], axis=1)
        tl.store(out_ptr + m * stride_o + n, acc, mask=n_ok)

    return packed_linear_kernel


def packed_linear_triton(x: torch.Tensor, data: torch.Tensor, qtype: int, k: int,
                         block_n: int = 32, block_b: int = 128) -> torch.Tensor:
    """x [M, K] (any float dtype) @ packed rows data [N, row_bytes]^T -> float32 [M, N]."""
    if qtype not in (F16, BF16, Q4_0, Q4_1, Q8_0):
        raise ValueError(f"the Triton kernel reads a file's row formats, not {PACKED_TYPES[qtype].name}")
    x = x.contiguous()
    if qtype in (F16, BF16):
        data = data.view(torch.int16)  # one F16 / BF16 value per element
    M, N = x.shape[0], data.shape[0]
    out = torch.empty(M, N, dtype=torch.float32, device=x.device)
    grid = (M, cdiv(N, block_n))
    _kernel()[grid](x, data, out, N, k, x.stride(0), data.stride(0), out.stride(0),
                    FORMAT=PACKED_TYPES[qtype].name, SIZE=PACKED_TYPES[qtype].block_bytes, GROUP=GROUP, BLOCK_N=block_n, BLOCK_B=block_b)
    return out
