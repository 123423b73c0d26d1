// The CPU kernels of one extension (kernels/cpu.py builds them together): packed_cpu.cpp (exact
// float32 linear layers over GGUF-packed weights), fused_cpu.cpp (a decode step's small ops) and
// cpu_ops.cpp (every decoder layer in one call, and the Python bindings).
#pragma once
#include <torch/extension.h>

// The packed kernels' instruction set ("avx512", "avx2" or "portable") and the activation rows up to which
// packed_linear beats dequantising the weight for one float32 GEMM (layers/quant.py reads both).
extern const char* const PACKED_ISA;
extern const int64_t PACKED_MAX_ROWS;
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor w, int64_t qtype, int64_t K);
torch::Tensor dense_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor packed_dequantize(torch::Tensor w, int64_t qtype, int64_t K);
torch::Tensor add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
std::vector<torch::Tensor> greedy_argmax(torch::Tensor logits);
torch::Tensor rope_cache_attend(torch::Tensor qkv, torch::Tensor cos_sin, torch::Tensor k_cache,
                                torch::Tensor v_cache, torch::Tensor write_index, torch::Tensor positions,
                                torch::Tensor read_slots, int64_t n_heads, int64_t n_kv_heads, double scale);
