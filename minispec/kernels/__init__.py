"""Compiled kernels, each built on first use with a pure-torch fallback: fused_cpu (the decode step's small
ops), packed_cpu (the packed-weight linear, C++), packed_triton (the packed-weight linear on GPU)."""
