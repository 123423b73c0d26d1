// The CPU kernels of one extension (kernels/cpu.py builds them together): packed_cpu.cpp (exact
// float32 linear layers over GGUF-packed weights), fused_cpu.cpp (a decode step's small ops) and
// cpu_ops.cpp (every decoder layer in one call, and the Python bindings).
#pragma once
#include <torch/extension.h>

#include <cstdint>
#include <vector>

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
// packed_linear and dense_linear by rows of the weight, for a caller that runs its own threads (decode_layers): the
// work of one call split as (prepare_packed once, packed_range per share of the rows [begin, end) of out [M, N]).
// Only where *_range_takes: packed_linear would take these paths (no AMX tiles, K whole blocks), dense_linear would
// not hand the rows to at::linear. x [M, K] contiguous; out's columns [begin, end) get what the layer gives them.
struct PackedInput {  // x and what packed_range reads beside it: per-group sums, rows in the split kernels' order
  const float* x = nullptr;
  int64_t M = 0, G = 0;
  std::vector<float> sx, xs_buf;
  const float* xs = nullptr;
};
// n values of T, 64-byte aligned (a kernel's loads then never cross a cache line): the calling thread's scratch, one
// per T and slot, kept between calls (the AMX kernels' uint32 / uint16 operands, decode_layers' float residual
// streams in slot 0, the AVX2 kernels' dequantised panels in slot 1).
template <class T, int SLOT = 0>
T* thread_scratch(int64_t n) {
  thread_local std::vector<T> buf;
  const int64_t pad = 64 / sizeof(T);
  if ((int64_t)buf.size() < n + pad) buf.resize(n + pad);
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
}
bool packed_range_takes(int64_t qtype, int64_t M, int64_t K);
void prepare_packed(PackedInput& in, const float* x, int64_t M, int64_t K, int64_t qtype);
void packed_range(const PackedInput& in, const uint8_t* wd, int64_t wstride, int64_t qtype, int64_t K, int64_t begin,
                  int64_t end, float* out, int64_t N);
bool dense_range_takes(int64_t M);
void dense_range(const float* x, int64_t M, int64_t K, const float* w, int64_t begin, int64_t end, float* out,
                 int64_t N);
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

// The small ops by parts, for decode_layers' threads: add_rms_norm over rows [begin, end) (residual may be null),
// silu_mul over rows [begin, end) and columns [c0, c1) of out [N, I], rope_cache_attend as its checked arguments, the
// rotation of every token and the attention by units (Attention::units, at least grain a share): the same floats.
void rms_norm_rows(const float* x, float* residual, const float* weight, double eps, float* out, int64_t begin,
                   int64_t end, int64_t H);
void silu_mul_rows(const float* gate_up, int64_t I, int64_t begin, int64_t end, int64_t c0, int64_t c1, float* out);
struct Attention {
  int64_t T, B, L, hd, max_len, slots, kv_row, width, n_heads, n_kv_heads, g, max_keys;
  const float* cs;
  const int64_t *wi, *pos, *rs;
  float scale;
  bool grouped;  // a unit is one token's KV head with its query heads (AVX2), else one query head
  int64_t units() const;
  int64_t grain() const;
  void rope(float* qkv, float* k_cache, float* v_cache) const;  // every token, in order
  void attend(const float* qkv, const float* k_cache, const float* v_cache, int64_t begin, int64_t end,
              float* out) const;
};
// Checks rope_cache_attend's arguments but qkv (its sizes: Attention::T and ::width); caches of these sizes take them.
Attention attention_args(const torch::Tensor& cos_sin, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                         const torch::Tensor& write_index, const torch::Tensor& positions,
                         const torch::Tensor& read_slots, int64_t n_heads, int64_t n_kv_heads, double scale);
