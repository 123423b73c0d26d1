// The CPU kernels of one extension (kernels/cpu.py builds them together): packed_cpu.cpp (exact
// float32 linear layers over GGUF-packed weights), fused_cpu.cpp (a decode step's small ops) and
// cpu_ops.cpp (every decoder layer in one call, and the Python bindings).
#pragma once
#include <torch/extension.h>

// GGML type ids (ggml.h) and the packed formats' blocks: the C++ twin of kernels/ggml.py's table
// (tests/test_quant.py checks them equal). F32 also names a dense float32 weight (decode_layers' qtypes).
constexpr int64_t F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, BF16 = 30;
// Memory-only layouts of Q4_0 / Q4_1 rows, never in a file (kernels/ggml.py describes them): a row of G blocks
// holds the G blocks' 16 code bytes each, then their G float16 scales, then (Q4_1) their G float16 minima.
constexpr int64_t Q4_0_SPLIT = 1002, Q4_1_SPLIT = 1003;
// ... and tiled (the AMX kernel's): rows in groups of 16, a group's block g holding the 16 rows' codes in the tiles'
// pair order, then their float16 scales and (Q4_1) minima (packed_cpu.cpp's amx_tiled_linear describes it). Only
// whole groups of 16 rows exist.
constexpr int64_t Q4_0_TILES = 1004, Q4_1_TILES = 1005;
constexpr int64_t TILE_ROWS = 16;
constexpr int64_t GROUP = 32;  // values per block of the quantised formats
struct BlockFormat {
  int64_t type, bytes, values;  // a block's bytes and the values it holds (F16 / BF16: one value)
};
constexpr BlockFormat BLOCK_FORMATS[] = {
    {Q4_0, 18, GROUP}, {Q4_1, 20, GROUP}, {Q8_0, 34, GROUP}, {F16, 2, 1}, {BF16, 2, 1},
    {Q4_0_SPLIT, 18, GROUP}, {Q4_1_SPLIT, 20, GROUP}, {Q4_0_TILES, 18, GROUP}, {Q4_1_TILES, 20, GROUP}};
// The file format whose values a layout holds (a split or tiled layout's; the type itself otherwise).
constexpr int64_t file_type(int64_t qtype) {
  return qtype == Q4_0_SPLIT || qtype == Q4_0_TILES ? Q4_0 : qtype == Q4_1_SPLIT || qtype == Q4_1_TILES ? Q4_1 : qtype;
}
constexpr bool tiled(int64_t qtype) { return qtype == Q4_0_TILES || qtype == Q4_1_TILES; }
// qtype's format; {-1, 0, 0} where it is not a packed one.
constexpr BlockFormat block_format(int64_t qtype) {
  for (const BlockFormat& f : BLOCK_FORMATS)
    if (f.type == qtype) return f;
  return {-1, 0, 0};
}
// [[type id, bytes per block, values per block], ...]: BLOCK_FORMATS for Python.
std::vector<std::vector<int64_t>> block_formats();

// The packed kernels' instruction set ("avx512", "avx2" or "portable") and the activation rows up to which
// packed_linear beats dequantising the weight for one float32 GEMM (layers/quant.py reads both). Every path
// takes every layout.
extern const char* const PACKED_ISA;
extern const int64_t PACKED_MAX_ROWS;
// Whether the few-row kernels read Q4_0 / Q4_1 rows fastest split (layers/quant.py's kernel_layout).
extern const bool PACKED_SPLIT;
// Whether packed_linear takes the AMX tiles (the tiled layout at any rows of x, others at 9 or more): built for a CPU
// with AMX-BF16, the tile state granted by the kernel, MINISPEC_NO_AMX unset.
bool packed_amx();
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor w, int64_t qtype, int64_t K);
torch::Tensor dense_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor packed_dequantize(torch::Tensor w, int64_t qtype, int64_t K);
torch::Tensor packed_rows(torch::Tensor w, int64_t qtype, int64_t K, torch::Tensor ids);
torch::Tensor add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
std::vector<torch::Tensor> greedy_argmax(torch::Tensor logits);
std::vector<torch::Tensor> temperature_softmax(torch::Tensor logits, torch::Tensor temperature);
torch::Tensor exp_noise(torch::Tensor seeds, int64_t vocab);
torch::Tensor exp_race(torch::Tensor probs, torch::Tensor noise, double noise_min, double noise_max);
std::vector<torch::Tensor> rejection_sample_probs(torch::Tensor p, torch::Tensor q, torch::Tensor draft_tokens,
                                                  torch::Tensor stale, torch::Tensor cu_num_logits,
                                                  torch::Tensor uniforms, torch::Tensor noise, double noise_min,
                                                  double noise_max);
torch::Tensor rope_cache_attend(torch::Tensor qkv, torch::Tensor cos_sin, torch::Tensor k_cache,
                                torch::Tensor v_cache, torch::Tensor write_index, torch::Tensor positions,
                                torch::Tensor read_slots, int64_t n_heads, int64_t n_kv_heads, double scale);
