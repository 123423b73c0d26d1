"""Compiled CPU kernels, each built on first use with a pure-torch fallback: fused_cpu (the decode step's small ops)."""
