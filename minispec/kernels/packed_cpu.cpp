// Exact float32 linear layers over GGUF-packed weight rows (Q4_0, Q4_1, Q8_0, F16, BF16), CPU.
//
// A weight row of K values is stored as ceil(K / 32) groups of 32 in the file's block format.
// Each group unpacks to 32 integer codes q (or 32 floats for F16/BF16) with a scale d and a
// minimum m; the row's value is d * q + m. With float32 activations and float32 accumulation, the
// layer computes either, per group, d * sum(q * x) + m * sum(x) (one activation row: the cheapest
// per block) or x . (d * q + m) with the block dequantised once for several rows: the same real
// number; only the rounding order differs from F.linear over the dequantised row. Three paths, chosen
// at compile time: AVX-512 (16-float vectors, 32 registers for wider tiles), AVX2 + FMA, portable C++; on
// a CPU with AMX-BF16 the AVX-512 build also multiplies 9 or more rows of x through the AMX tiles.
#include "cpu_ops.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MS_AVX2 1
#endif
#if defined(MS_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define MS_AVX512 1
#endif
#if defined(MS_AVX512) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define MS_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdlib>
#endif

namespace {

// Bytes per block of a block type (the SIMD paths' template argument), and the file format of its values.
template <int64_t QT>
constexpr int64_t GB = block_format(QT).bytes;
template <int64_t QT>
constexpr int64_t FT = file_type(QT);

// Where block g of a packed row of G blocks keeps its scale d, its minimum m (Q4_1) and its codes: inside the
// block in a file's layout; in the row's runs of codes, scales and minima in a split one (cpu_ops.h).
template <int64_t QT>
struct Blocks {
  static constexpr bool SPLIT = FT<QT> != QT;
  const uint8_t* row;
  int64_t G;
  const uint8_t* scale(int64_t g) const { return SPLIT ? row + 16 * G + 2 * g : row + g * GB<QT>; }
  const uint8_t* minimum(int64_t g) const { return SPLIT ? row + 18 * G + 2 * g : row + g * GB<QT> + 2; }
  const uint8_t* codes(int64_t g) const { return SPLIT ? row + 16 * g : row + g * GB<QT> + (FT<QT> == Q4_1 ? 4 : 2); }
};

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef MS_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) { bits = sign; } else {  // subnormal: renormalise
      int e = -1; uint32_t m = man;
      do { e++; m <<= 1; } while (!(m & 0x400));
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
    }
  } else if (exp == 31) { bits = sign | 0x7f800000 | (man << 13); }
  else { bits = sign | ((exp + 112) << 23) | (man << 13); }
  float f; std::memcpy(&f, &bits, 4); return f;
#endif
}

inline float bf16_to_float(const uint8_t* p) {
  uint16_t h; std::memcpy(&h, p, 2);
  uint32_t bits = (uint32_t)h << 16; float f; std::memcpy(&f, &bits, 4); return f;
}

// Row bytes of K values: F16/BF16 rows hold exactly K values, block types whole groups.
int64_t row_bytes(int64_t qtype, int64_t K) {
  const BlockFormat f = block_format(qtype);
  TORCH_CHECK(f.type != -1, "packed kernel: unsupported GGML type id ", qtype);
  return K / f.values * f.bytes;
}

// Unpack a 4-bit row (Q4_0, Q4_1 or a split layout of them): w[G * 32] codes, d[G], m[G] (zero unless Q4_1).
template <int64_t QT>
void unpack_q4_row(const uint8_t* row, int64_t G, float* w, float* d, float* m) {
  const Blocks<QT> b{row, G};
  const float shift = FT<QT> == Q4_0 ? -8.0f : 0.0f;
  for (int64_t g = 0; g < G; g++) {
    d[g] = half_to_float(b.scale(g));
    m[g] = FT<QT> == Q4_1 ? half_to_float(b.minimum(g)) : 0.0f;
    const uint8_t* qs = b.codes(g);
    float* wg = w + g * GROUP;
    for (int j = 0; j < 16; j++) {
      wg[j] = (float)(qs[j] & 15) + shift;
      wg[j + 16] = (float)(qs[j] >> 4) + shift;
    }
  }
}

// Unpack row n of a tiled layout (wd: its first group): w[G * 32] codes, d[G], m[G] (zero unless Q4_1), Q4_0's codes
// shifted by -8 as unpack_q4_row's. Code k of row j (of its group) is nibble s of word 2 j + k % 2 of chunk c, for
// k = 8 c + 2 s + k % 2 (amx_tiled_linear describes the layout).
void unpack_tiled_row(int64_t qtype, const uint8_t* wd, int64_t n, int64_t G, float* w, float* d, float* m) {
  const int64_t tb = TILE_ROWS * block_format(qtype).bytes, j = n % TILE_ROWS;  // bytes of one block of a group
  const bool q41 = file_type(qtype) == Q4_1;
  for (int64_t g = 0; g < G; g++) {
    const uint8_t* b = wd + ((n / TILE_ROWS) * G + g) * tb;
    d[g] = half_to_float(b + 256 + 2 * j);
    m[g] = q41 ? half_to_float(b + 288 + 2 * j) : 0.0f;
    for (int k = 0; k < GROUP; k++) {
      const int c = k / 8, sh = 4 * ((k % 8) / 2), i = 2 * (int)j + k % 2;
      uint16_t word;
      std::memcpy(&word, b + 64 * c + 2 * i, 2);
      w[g * GROUP + k] = (float)((word >> sh) & 15) + (q41 ? 0.0f : -8.0f);
    }
  }
}

// Unpack one row: w[G * 32] codes (zero past K), d[G], m[G] (zero unless Q4_1).
void unpack_row(int64_t qtype, const uint8_t* row, int64_t K, float* w, float* d, float* m) {
  const int64_t G = (K + GROUP - 1) / GROUP;
  switch (qtype) {
    case Q4_0: return unpack_q4_row<Q4_0>(row, G, w, d, m);
    case Q4_1: return unpack_q4_row<Q4_1>(row, G, w, d, m);
    case Q4_0_SPLIT: return unpack_q4_row<Q4_0_SPLIT>(row, G, w, d, m);
    case Q4_1_SPLIT: return unpack_q4_row<Q4_1_SPLIT>(row, G, w, d, m);
    case Q8_0: {
      for (int64_t g = 0; g < G; g++) {
        const uint8_t* b = row + g * GB<Q8_0>;
        d[g] = half_to_float(b);
        m[g] = 0.0f;
        const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
        float* wg = w + g * GROUP;
        for (int j = 0; j < 32; j++) wg[j] = (float)qs[j];
      }
      break;
    }
    case F16: case BF16: {
      for (int64_t k = 0; k < K; k++) w[k] = qtype == F16 ? half_to_float(row + 2 * k) : bf16_to_float(row + 2 * k);
      for (int64_t k = K; k < G * GROUP; k++) w[k] = 0.0f;
      for (int64_t g = 0; g < G; g++) { d[g] = 1.0f; m[g] = 0.0f; }
      break;
    }
  }
}

// out[r * ldo] = sum_g d[g] * (w_g . x_r,g) for RT activation rows x (row stride ldx, zero padded to G * 32).
template <int RT>
inline void dot_rows(const float* w, const float* d, int64_t G, const float* x, int64_t ldx, float* out, int64_t ldo) {
#ifdef MS_AVX2
  __m256 acc[RT];
  for (int r = 0; r < RT; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    const float* wg = w + g * GROUP;
    const __m256 w0 = _mm256_loadu_ps(wg), w1 = _mm256_loadu_ps(wg + 8);
    const __m256 w2 = _mm256_loadu_ps(wg + 16), w3 = _mm256_loadu_ps(wg + 24);
    const __m256 dg = _mm256_set1_ps(d[g]);
    for (int r = 0; r < RT; r++) {
      const float* xg = x + r * ldx + g * GROUP;
      __m256 p = _mm256_mul_ps(w0, _mm256_loadu_ps(xg));
      p = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), p);
      p = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), p);
      p = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), p);
      acc[r] = _mm256_fmadd_ps(dg, p, acc[r]);
    }
  }
  for (int r = 0; r < RT; r++) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    out[r * ldo] = _mm_cvtss_f32(s);
  }
#else
  for (int r = 0; r < RT; r++) {
    float acc = 0.0f;
    for (int64_t g = 0; g < G; g++) {
      float p = 0.0f;
      for (int j = 0; j < GROUP; j++) p += w[g * GROUP + j] * x[r * ldx + g * GROUP + j];
      acc += d[g] * p;
    }
    out[r * ldo] = acc;
  }
#endif
}


#ifdef MS_AVX2
// One block of 32 codes as 4 x 8 floats (codes 0-7, 8-15, 16-23, 24-31), with its scale d and
// minimum m (0 unless Q4_1). Q4 codes are widened a byte (two codes) per 32-bit lane and split
// with a mask and a shift: two shuffles per block, where widening each half-byte costs four.
template <int64_t QT>
inline void load_block(Blocks<QT> b, int64_t g, __m256 w[4], float& d, float& m) {
  d = half_to_float(b.scale(g));
  if constexpr (QT == Q8_0) {
    m = 0.0f;
    for (int i = 0; i < 4; i++)
      w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.codes(g) + 8 * i))));
  } else {
    m = FT<QT> == Q4_1 ? half_to_float(b.minimum(g)) : 0.0f;
    const uint8_t* qs = b.codes(g);
    const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs)));
    const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8)));
    const __m256i mask = _mm256_set1_epi32(15);
    __m256i q[4] = {_mm256_and_si256(lo, mask), _mm256_and_si256(hi, mask), _mm256_srli_epi32(lo, 4),
                    _mm256_srli_epi32(hi, 4)};
    for (int i = 0; i < 4; i++) {
      if constexpr (FT<QT> == Q4_0) q[i] = _mm256_sub_epi32(q[i], _mm256_set1_epi32(8));  // codes q - 8 in [-8, 7]
      w[i] = _mm256_cvtepi32_ps(q[i]);
    }
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// w . x for one block: (w0 . x0 + w1 . x1) + (w2 . x2 + w3 . x3), two chains of two.
inline __m256 block_dot(const __m256 w[4], const __m256 x[4]) {
  return _mm256_add_ps(_mm256_fmadd_ps(w[1], x[1], _mm256_mul_ps(w[0], x[0])),
                       _mm256_fmadd_ps(w[3], x[3], _mm256_mul_ps(w[2], x[2])));
}

// A software prefetch of `bytes` bytes from p spread over the G blocks of a loop: part(g) fetches block g's
// share of the cache lines (measured: half the time of a decode step's GEMVs, whose weights stream from
// memory).
struct Prefetch {
  const char* p;
  int64_t lines, per_block;
  Prefetch(const uint8_t* p, int64_t bytes, int64_t G)
      : p(reinterpret_cast<const char*>(p)), lines((bytes + 63) / 64), per_block(((bytes + 63) / 64 + G - 1) / G) {}
  void part(int64_t g) const {
    for (int64_t i = g * per_block; i < std::min(lines, (g + 1) * per_block); i++) _mm_prefetch(p + 64 * i, _MM_HINT_T0);
  }
};

// RT activation rows x (stride ldx) against one packed row of G blocks: out[r * ldo] for each r.
// Each block is dequantised once for the RT rows, rounded as gguf rounds it (d * q, then + m): the
// weights are exactly the dequantised layer's, and only the summation order differs. Two
// accumulators per row up to 5 rows (shorter chains), one beyond (registers).
template <int64_t QT, int RT>
inline void block_row_dot(const uint8_t* row, int64_t G, const float* x, int64_t ldx, float* out, int64_t ldo) {
  constexpr int A = RT <= 5 ? 2 : 1;
  __m256 acc[RT][A];
  for (int r = 0; r < RT; r++)
    for (int a = 0; a < A; a++) acc[r][a] = _mm256_setzero_ps();
  const Prefetch ahead(row + 2 * G * GB<QT>, G * GB<QT>, G);  // the row after next
  for (int64_t g = 0; g < G; g++) {
    ahead.part(g);
    __m256 w[4];
    float d, m;
    load_block<QT>(Blocks<QT>{row, G}, g, w, d, m);
    const __m256 dg = _mm256_set1_ps(d), mg = _mm256_set1_ps(m);
    for (int i = 0; i < 4; i++) {
      w[i] = _mm256_mul_ps(dg, w[i]);
      if constexpr (FT<QT> == Q4_1) w[i] = _mm256_add_ps(w[i], mg);
    }
    for (int r = 0; r < RT; r++) {
      const float* xg = x + r * ldx + g * GROUP;
      for (int i = 0; i < 4; i++) acc[r][i % A] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xg + 8 * i), acc[r][i % A]);
    }
  }
  for (int r = 0; r < RT; r++) out[r * ldo] = hsum(A == 2 ? _mm256_add_ps(acc[r][0], acc[r][A - 1]) : acc[r][0]);
}

// RT activation rows x (stride ldx) against NT packed rows (stride wstride) at once: out[r * ldo + j] = sum_g d_g
// (q_g . x_r,g) + m_g sx[r * G + g] (the minima's term Q4_1 only): each block's codes converted once for the RT rows,
// x read once per block for the NT rows, the NT x RT accumulators independent chains.
template <int64_t QT, int NT, int RT>
inline void block_rows_dot(const uint8_t* rows, int64_t wstride, int64_t G, const float* x, int64_t ldx,
                           const float* sx, float* out, int64_t ldo) {
  __m256 acc[RT][NT];
  float macc[RT][NT];
  for (int r = 0; r < RT; r++)
    for (int j = 0; j < NT; j++) { acc[r][j] = _mm256_setzero_ps(); macc[r][j] = 0.0f; }
  const Prefetch ahead(rows + 2 * NT * wstride, NT * wstride, G);  // the tile after next: NT contiguous rows
  for (int64_t g = 0; g < G; g++) {
    ahead.part(g);
    for (int j = 0; j < NT; j++) {
      __m256 w[4];
      float d, m;
      load_block<QT>(Blocks<QT>{rows + j * wstride, G}, g, w, d, m);
      for (int r = 0; r < RT; r++) {
        const float* xg = x + r * ldx + g * GROUP;
        const __m256 xv[4] = {_mm256_loadu_ps(xg), _mm256_loadu_ps(xg + 8), _mm256_loadu_ps(xg + 16),
                              _mm256_loadu_ps(xg + 24)};
        acc[r][j] = _mm256_fmadd_ps(_mm256_set1_ps(d), block_dot(w, xv), acc[r][j]);
        if constexpr (FT<QT> == Q4_1) macc[r][j] += m * sx[r * G + g];
      }
    }
  }
  for (int r = 0; r < RT; r++)
    for (int j = 0; j < NT; j++) out[r * ldo + j] = hsum(acc[r][j]) + macc[r][j];
}

// The split layout's few-row kernels (tile_dot_split under AVX-512, split_dot_256 under AVX2) read a run of
// SPLIT_LANES / 4 blocks as one vector of code bytes: SPLIT_LANES 32-bit lanes, each holding 8 codes of one block.
#ifdef MS_AVX512
constexpr int64_t SPLIT_LANES = 16;
#else
constexpr int64_t SPLIT_LANES = 8;
#endif
constexpr int64_t SPLIT_RUN = SPLIT_LANES / 4;  // blocks per run
// Rows of x up to which split rows take the split kernels (docs/experiments.md): AVX-512's beat the tiles up to 3
// rows on a Zen 4 (0.93-0.95x the model's matrices streamed at 3 rows; one weight row a tile at 4 rows measured
// slower streamed); AVX2's up to 5 rows (0.8-0.95x the file layout's kernel).
constexpr int64_t SPLIT_MAX_ROWS = SPLIT_LANES == 16 ? 3 : 5;
// Floats between consecutive rows of x in split_order: whole runs, so each row stays 64-byte aligned.
inline int64_t split_stride(int64_t G) { return G / SPLIT_RUN * 32 * SPLIT_RUN; }

// x in the order the split kernels read codes: for each run c of SPLIT_RUN blocks (R = 32 SPLIT_RUN values),
// xp[R c + SPLIT_LANES p + l] is the value whose code is nibble p of 32-bit lane l of the run's code bytes: code
// 4 (l % 4) + p / 2 + 16 (p % 2) of block l / 4 (nibbles 5-7 are read as nibbles 2-4 of the lanes shifted by 12
// bits), times the 2^(-4P) that undoes the nibble's scale (nibble / nibble8). A power of two: every product q x
// rounds as before, unless x * 2^(-4P) is subnormal (|x| < 2^-110).
void split_order(const float* x, int64_t G, float* xp) {
  constexpr int64_t R = 32 * SPLIT_RUN;
  for (int64_t c = 0; c < G / SPLIT_RUN; c++)
    for (int p = 0; p < 8; p++) {
      const float unit = std::ldexp(1.0f, -4 * (p < 5 ? p : p - 3));
      for (int64_t l = 0; l < SPLIT_LANES; l++)
        xp[R * c + SPLIT_LANES * p + l] = x[R * c + 32 * (l / 4) + 4 * (l % 4) + p / 2 + 16 * (p % 2)] * unit;
    }
}

#ifndef MS_AVX512
// Nibble P (0-4) of every 32-bit lane of v times 2^(4P), an exact float (below 2^20): one AND and one conversion.
template <int P>
inline __m256 nibble8(__m256i v) {
  return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15 << (4 * P))));
}

// AVX2's twin of tile_dot_split: RT rows of x (1 to 5; each in split_order, xp + r * ldxp; x and sx of stride ldx
// and G) against NT split rows: out[r * ldo + j] = x_r . row j, as sum_g d_g (q_g . x_g) + sum_g m_g sx_g (Q4_0:
// m_g = -8 d_g). A run of 2 blocks is one 32-byte load of codes and 8 nibble extractions (an AND and a conversion
// each, where the file layout's kernel widens, masks, shifts and converts), made once for the RT rows, then 8 FMAs
// against each row's xp and one FMA with the 2 scales, each over its block's 4 lanes. An odd G's last block goes
// alone against x; the minima's term is 8 blocks per FMA.
template <int64_t QT, int NT, int RT>
inline void split_dot_256(const uint8_t* rows, int64_t wstride, int64_t G, const float* xp, int64_t ldxp,
                          const float* x, int64_t ldx, const float* sx, float* out, int64_t ldo) {
  const int64_t runs = G / 2;
  const __m256i lanes = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);  // lane -> its block
  __m256 acc[RT][NT];
  for (int r = 0; r < RT; r++)
    for (int j = 0; j < NT; j++) acc[r][j] = _mm256_setzero_ps();
  const Prefetch ahead(rows + 2 * NT * wstride, NT * wstride, std::max<int64_t>(runs, 1));  // the tile after next
  for (int64_t c = 0; c < runs; c++) {
    ahead.part(c);
    __m256i v[NT];
    __m256 p[RT][NT];
    for (int j = 0; j < NT; j++) v[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + j * wstride + 32 * c));
    auto step = [&](auto pc) {
      constexpr int P = decltype(pc)::value;  // xp's vector: nibble P (P < 5) of v, else nibble P - 3 of v >> 12
      if constexpr (P == 5)
        for (int j = 0; j < NT; j++) v[j] = _mm256_srli_epi32(v[j], 12);
      for (int j = 0; j < NT; j++) {
        const __m256 nib = nibble8<(P < 5 ? P : P - 3)>(v[j]);
        for (int r = 0; r < RT; r++) {
          const __m256 xv = _mm256_load_ps(xp + r * ldxp + 64 * c + 8 * P);
          p[r][j] = P == 0 ? _mm256_mul_ps(nib, xv) : _mm256_fmadd_ps(nib, xv, p[r][j]);
        }
      }
    };
    step(std::integral_constant<int, 0>{});
    step(std::integral_constant<int, 1>{});
    step(std::integral_constant<int, 2>{});
    step(std::integral_constant<int, 3>{});
    step(std::integral_constant<int, 4>{});
    step(std::integral_constant<int, 5>{});
    step(std::integral_constant<int, 6>{});
    step(std::integral_constant<int, 7>{});
    for (int j = 0; j < NT; j++) {
      int32_t d2;  // the run's 2 float16 scales
      std::memcpy(&d2, rows + j * wstride + 16 * G + 4 * c, 4);
      const __m256 d = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(d2))), lanes);
      for (int r = 0; r < RT; r++) acc[r][j] = _mm256_fmadd_ps(d, p[r][j], acc[r][j]);
    }
  }
  for (int j = 0; j < NT; j++) {
    const Blocks<QT> b{rows + j * wstride, G};
    if (G % 2) {  // byte l of the block: code l (low nibble), code l + 16 (high)
      const uint8_t* qs = b.codes(G - 1);
      const __m256i q0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs)));
      const __m256i q1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8)));
      const __m256 w[4] = {nibble8<0>(q0), nibble8<0>(q1), _mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)),
                           _mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4))};
      const __m256 d = _mm256_set1_ps(half_to_float(b.scale(G - 1)));
      for (int r = 0; r < RT; r++) {
        const float* xg = x + r * ldx + (G - 1) * GROUP;
        const __m256 xv[4] = {_mm256_loadu_ps(xg), _mm256_loadu_ps(xg + 8), _mm256_loadu_ps(xg + 16),
                              _mm256_loadu_ps(xg + 24)};
        acc[r][j] = _mm256_fmadd_ps(d, block_dot(w, xv), acc[r][j]);
      }
    }
    const uint8_t* mins = FT<QT> == Q4_1 ? b.minimum(0) : b.scale(0);
    __m256 macc[RT];
    float mtail[RT];
    for (int r = 0; r < RT; r++) { macc[r] = _mm256_setzero_ps(); mtail[r] = 0.0f; }
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) {
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + 2 * g)));
      for (int r = 0; r < RT; r++) macc[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(sx + r * G + g), macc[r]);
    }
    for (; g < G; g++)
      for (int r = 0; r < RT; r++) mtail[r] += half_to_float(mins + 2 * g) * sx[r * G + g];
    const float unit = FT<QT> == Q4_0 ? -8.0f : 1.0f;  // Q4_0's minimum is -8 d
    for (int r = 0; r < RT; r++)
      out[r * ldo + j] = hsum(_mm256_fmadd_ps(macc[r], _mm256_set1_ps(unit), acc[r][j])) + unit * mtail[r];
  }
}
#endif

template <int64_t QT, int RT>
void block_rows_rt(const uint8_t* wd, int64_t wstride, int64_t begin, int64_t end, int64_t G, const float* x,
                   float* out, int64_t N) {
  for (int64_t n = begin; n < end; n++) block_row_dot<QT, RT>(wd + n * wstride, G, x, G * GROUP, out + n, N);
}

// Rows [begin, end) of a packed matrix dequantised as block_row_dot dequantises them (d * q, then + m): panel[j * Kp
// + k] for row begin + j.
template <int64_t QT>
void dequant_panel(const uint8_t* wd, int64_t wstride, int64_t begin, int64_t end, int64_t G, float* panel) {
  const int64_t Kp = G * GROUP;
  for (int64_t n = begin; n < end; n++) {
    const Prefetch ahead(wd + (n + 4) * wstride, wstride, G);  // the row four ahead
    for (int64_t g = 0; g < G; g++) {
      ahead.part(g);
      __m256 w[4];
      float d, m;
      load_block<QT>(Blocks<QT>{wd + n * wstride, G}, g, w, d, m);
      const __m256 dg = _mm256_set1_ps(d), mg = _mm256_set1_ps(m);
      for (int i = 0; i < 4; i++) {
        w[i] = _mm256_mul_ps(dg, w[i]);
        if constexpr (FT<QT> == Q4_1) w[i] = _mm256_add_ps(w[i], mg);
        _mm256_store_ps(panel + (n - begin) * Kp + g * GROUP + 8 * i, w[i]);
      }
    }
  }
}

// RT rows of x (stride ldx) against NT dequantised rows (panel, stride Kp) over k in [k0, k1): the accumulators
// start at zero (k0 == 0) or from acc_spill (NT * RT vectors) and end summed into out[r * ldo + j] (k1 == Kp) or
// back in acc_spill. One accumulator per pair, in k order: block_row_dot's floats at RT > 5. Each vector of x is loaded once for the
// NT rows (block_row_dot loads it once per weight row, and x outgrows the 32 KB L1 past 8 rows at K = 576, from 6 at
// K = 1536: those loads then come from L2).
template <int NT, int RT>
inline void panel_dot(const float* panel, int64_t Kp, int64_t k0, int64_t k1, const float* x, int64_t ldx,
                      float* acc_spill, float* out, int64_t ldo) {
  __m256 acc[NT][RT];
  for (int j = 0; j < NT; j++)
    for (int r = 0; r < RT; r++)
      acc[j][r] = k0 == 0 ? _mm256_setzero_ps() : _mm256_load_ps(acc_spill + 8 * (j * RT + r));
  for (int64_t k = k0; k < k1; k += 8) {
    __m256 xv[RT];
    for (int r = 0; r < RT; r++) xv[r] = _mm256_loadu_ps(x + r * ldx + k);
    for (int j = 0; j < NT; j++) {
      __m256 w = _mm256_load_ps(panel + j * Kp + k);
      __asm__("" : "+x"(w));  // held in a register: GCC folds the load into each of the RT FMAs (RT loads, not 1)
      for (int r = 0; r < RT; r++) acc[j][r] = _mm256_fmadd_ps(w, xv[r], acc[j][r]);
    }
  }
  if (k1 < Kp) {
    for (int j = 0; j < NT; j++)
      for (int r = 0; r < RT; r++) _mm256_store_ps(acc_spill + 8 * (j * RT + r), acc[j][r]);
    return;
  }
  for (int r = 0; r < RT; r++)
    for (int j = 0; j < NT; j++) out[r * ldo + j] = hsum(acc[j][r]);
}

// PANEL_ROWS weight rows at a time dequantised into a panel (the thread's scratch, slot 1), then every row of x against
// it in tiles of PANEL_X rows: each block dequantised once for all M rows of x, each vector of x loaded once for the
// panel's rows, every operand of the FMAs in a register (5 x 2 accumulators, 2 of x, 1 of w: 13 of the 16). Past
// PANEL_K columns the tiles run over PANEL_K at a time, their accumulators kept between (slot 2), so that the panel's
// part stays in L1 beside x's (at K = 1536 the whole panel is 30 KB).
// docs/experiments.md: ahead of block_row_dot's tiles of 8 from 10 rows of x on a Zen 3, even at 8, behind at 6.
constexpr int PANEL_ROWS = 5, PANEL_X = 2;
constexpr int64_t PANEL_K = 512;
template <int64_t QT>
void panel_rows(const uint8_t* wd, int64_t wstride, int64_t begin, int64_t end, int64_t G, const float* x, int64_t M,
                float* out, int64_t N) {
  const int64_t Kp = G * GROUP;
  float* panel = thread_scratch<float, 1>(PANEL_ROWS * Kp);
  float* spill = thread_scratch<float, 2>(M * PANEL_ROWS * 8);  // each tile's accumulators between parts of k
  auto x_tiles = [&](auto nt, int64_t n) {
    constexpr int NT = decltype(nt)::value;
    for (int64_t k0 = 0; k0 < Kp; k0 += PANEL_K) {
      const int64_t k1 = std::min(Kp, k0 + PANEL_K);
      int64_t r = 0;
      for (; r + PANEL_X <= M; r += PANEL_X)
        panel_dot<NT, PANEL_X>(panel, Kp, k0, k1, x + r * Kp, Kp, spill + r * NT * 8, out + r * N + n, N);
      for (; r < M; r++) panel_dot<NT, 1>(panel, Kp, k0, k1, x + r * Kp, Kp, spill + r * NT * 8, out + r * N + n, N);
    }
  };
  int64_t n = begin;
  for (; n + PANEL_ROWS <= end; n += PANEL_ROWS) {
    dequant_panel<QT>(wd, wstride, n, n + PANEL_ROWS, G, panel);
    x_tiles(std::integral_constant<int, PANEL_ROWS>{}, n);
  }
  for (; n < end; n++) {
    dequant_panel<QT>(wd, wstride, n, n + 1, G, panel);
    x_tiles(std::integral_constant<int, 1>{}, n);
  }
}

// Rows [begin, end) of out [M, N]: a single activation row takes 4 weight rows at a time; up to 8
// rows are one tile (each block unpacked once for all of them); more go through a dequantised panel.
template <int64_t QT>
void block_rows(const uint8_t* wd, int64_t wstride, int64_t begin, int64_t end, int64_t G, const float* x,
                int64_t M, const float* sx, const float* xp, float* out, int64_t N) {
  const int64_t K = G * GROUP;
#ifndef MS_AVX512
  if constexpr (Blocks<QT>::SPLIT) {
    if (M <= SPLIT_MAX_ROWS) {  // split rows: split_dot_256 in tiles of 4 weight rows (1 row of x), 2 (2), else 1
      const int64_t ldxp = split_stride(G);
      auto pass = [&](auto nt, auto rt) {
        constexpr int NT = decltype(nt)::value, RT = decltype(rt)::value;
        int64_t n = begin;
        for (; n + NT <= end; n += NT) split_dot_256<QT, NT, RT>(wd + n * wstride, wstride, G, xp, ldxp, x, K, sx, out + n, N);
        for (; n < end; n++) split_dot_256<QT, 1, RT>(wd + n * wstride, wstride, G, xp, ldxp, x, K, sx, out + n, N);
      };
      if (M == 1) pass(std::integral_constant<int, 4>{}, std::integral_constant<int, 1>{});
      else if (M == 2) pass(std::integral_constant<int, 2>{}, std::integral_constant<int, 2>{});
      else if (M == 3) pass(std::integral_constant<int, 1>{}, std::integral_constant<int, 3>{});
      else if (M == 4) pass(std::integral_constant<int, 1>{}, std::integral_constant<int, 4>{});
      else pass(std::integral_constant<int, 1>{}, std::integral_constant<int, 5>{});
      return;
    }
  }
#else
  (void)xp;
#endif
  auto tiles = [&](auto nt, auto rt) {  // block_rows_dot in tiles of NT weight rows, then single rows
    constexpr int NT = decltype(nt)::value, RT = decltype(rt)::value;
    int64_t n = begin;
    for (; n + NT <= end; n += NT) block_rows_dot<QT, NT, RT>(wd + n * wstride, wstride, G, x, K, sx, out + n, N);
    for (; n < end; n++) block_rows_dot<QT, 1, RT>(wd + n * wstride, wstride, G, x, K, sx, out + n, N);
  };
  switch (M) {
    case 1: return tiles(std::integral_constant<int, 4>{}, std::integral_constant<int, 1>{});
    case 2:  // Q8_0 (the LM head): d (q . x) per block measured faster (docs/experiments.md, twenty-eighth session)
      if constexpr (QT == Q8_0) return tiles(std::integral_constant<int, 2>{}, std::integral_constant<int, 2>{});
      return block_rows_rt<QT, 2>(wd, wstride, begin, end, G, x, out, N);
    case 3:
      if constexpr (QT == Q8_0) return tiles(std::integral_constant<int, 1>{}, std::integral_constant<int, 3>{});
      return block_rows_rt<QT, 3>(wd, wstride, begin, end, G, x, out, N);
    case 4: return block_rows_rt<QT, 4>(wd, wstride, begin, end, G, x, out, N);
    case 5: return block_rows_rt<QT, 5>(wd, wstride, begin, end, G, x, out, N);
    case 6: return block_rows_rt<QT, 6>(wd, wstride, begin, end, G, x, out, N);
    case 7: return block_rows_rt<QT, 7>(wd, wstride, begin, end, G, x, out, N);
    case 8: return block_rows_rt<QT, 8>(wd, wstride, begin, end, G, x, out, N);
  }
  return panel_rows<QT>(wd, wstride, begin, end, G, x, M, out, N);
}

// Dequantise rows [begin, end): d * q, then + m, rounded separately as gguf's numpy code rounds them.
template <int64_t QT>
void block_dequant(const uint8_t* wd, int64_t wstride, int64_t begin, int64_t end, int64_t G, float* out) {
  for (int64_t n = begin; n < end; n++) {
    for (int64_t g = 0; g < G; g++) {
      __m256 w[4];
      float d, m;
      load_block<QT>(Blocks<QT>{wd + n * wstride, G}, g, w, d, m);
      const __m256 dg = _mm256_set1_ps(d), mg = _mm256_set1_ps(m);
      float* o = out + (n * G + g) * GROUP;
      for (int i = 0; i < 4; i++) {
        __m256 v = _mm256_mul_ps(dg, w[i]);
        if constexpr (FT<QT> == Q4_1) v = _mm256_add_ps(v, mg);
        _mm256_storeu_ps(o + 8 * i, v);
      }
    }
  }
}
#ifdef MS_AVX512
// AVX-512: a block of 32 values is two 16-float vectors, lo (values 0-15) and hi (16-31).
//
// A 4-bit block is dequantised through a 16-entry table: table[c] = d * c (+ m), rounded as gguf rounds
// d * q (+ m), so each weight is the dequantised layer's exactly; the 4-bit codes, widened a byte per
// lane, index it with one permute per vector (vpermps reads the low 4 bits: the low nibble as is, the
// high one after a shift).
template <int64_t QT>
inline void load_block16(Blocks<QT> b, int64_t g, __m512& lo, __m512& hi) {
  uint16_t h;
  std::memcpy(&h, b.scale(g), 2);
  const __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16((short)h));
  if constexpr (QT == Q8_0) {
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.codes(g))))));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.codes(g) + 16)))));
  } else {
    const __m512 codes = FT<QT> == Q4_0 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                                        : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table = _mm512_mul_ps(codes, d);
    if constexpr (FT<QT> == Q4_1) {
      std::memcpy(&h, b.minimum(g), 2);
      table = _mm512_add_ps(table, _mm512_cvtph_ps(_mm256_set1_epi16((short)h)));
    }
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.codes(g))));
    lo = _mm512_permutexvar_ps(q, table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
  }
}

// One activation row x against NT packed rows (stride wstride): out[j] = x . row j, as d * (q . x) + m * sum(x)
// per block (sx: the block sums of x; the fewest vector operations per block for one row), x loaded once per
// block for the NT rows.
template <int64_t QT, int NT>
inline void rows_dot_512(const uint8_t* rows, int64_t wstride, int64_t G, const float* x, const float* sx, float* out) {
  static_assert(!Blocks<QT>::SPLIT, "split rows take tile_dot_split");
  __m512 acc[NT];
  float macc[NT];
  for (int j = 0; j < NT; j++) { acc[j] = _mm512_setzero_ps(); macc[j] = 0.0f; }
  const Prefetch ahead(rows + 2 * NT * wstride, NT * wstride, G);  // the tile after next
  for (int64_t g = 0; g < G; g++) {
    ahead.part(g);
    const __m512 xlo = _mm512_loadu_ps(x + g * GROUP), xhi = _mm512_loadu_ps(x + g * GROUP + 16);
    for (int j = 0; j < NT; j++) {
      const uint8_t* b = rows + j * wstride + g * GB<QT>;
      __m512 p;
      if constexpr (QT == Q8_0) {
        p = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)))), xlo);
        p = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)))), xhi, p);
      } else {
        __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (QT == Q4_1 ? 4 : 2))));
        __m512i lo = _mm512_and_si512(q, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(q, 4);
        if constexpr (QT == Q4_0) {  // codes q - 8 in [-8, 7]
          lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(8));
          hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(8));
        }
        p = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), xhi, _mm512_mul_ps(_mm512_cvtepi32_ps(lo), xlo));
      }
      acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(half_to_float(b)), p, acc[j]);
      if constexpr (QT == Q4_1) macc[j] += half_to_float(b + 2) * sx[g];
    }
  }
  for (int j = 0; j < NT; j++) out[j] = _mm512_reduce_add_ps(acc[j]) + macc[j];
}

// Nibble P (0-4) of every 32-bit lane of v times 2^(4P), an exact float (below 2^20): one AND and one int-to-float
// conversion. Reading the nibble as the low mantissa bits of 2^(23 - 4P), minus 2^(23 - 4P), costs as many
// operations, but a ternary-logic op overwrites one input, so v (read 5 times) is copied before each: that measured
// 5-9 % slower in the one- and two-row kernel (docs/experiments.md). split_order scales x by 2^(-4P) to match.
template <int P>
inline __m512 nibble(__m512i v) {
  return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15 << (4 * P))));
}

// RT rows of x (1 to 3; each in split_order, xp + r * ldxp; x and sx of stride ldx and G) against NT split rows
// (Q4_0_SPLIT, Q4_1_SPLIT): out[r * ldo + j] = x_r . row j, as sum_g d_g (q_g . x_g) + sum_g m_g sx_g (Q4_0:
// m_g = -8 d_g). A run of 4 blocks is one 64-byte load of codes, 8 nibble extractions and 4 scales, made once for
// the RT rows, then 8 FMAs against each row's xp (each 16-float vector loaded once for the NT weight rows) and one
// FMA with the scales, each over its block's 4 lanes; the G % 4 blocks past the last run go one at a time against
// x; the minima's term is 16 blocks per FMA.
template <int64_t QT, int NT, int RT>
inline void tile_dot_split(const uint8_t* rows, int64_t wstride, int64_t G, const float* xp, int64_t ldxp,
                           const float* x, int64_t ldx, const float* sx, float* out, int64_t ldo) {
  const int64_t runs = G / 4;
  const __m512i lanes = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);  // lane -> its block
  __m512 acc[RT][NT];
  for (int r = 0; r < RT; r++)
    for (int j = 0; j < NT; j++) acc[r][j] = _mm512_setzero_ps();
  const Prefetch ahead(rows + 2 * NT * wstride, NT * wstride, std::max<int64_t>(runs, 1));  // the tile after next
  for (int64_t c = 0; c < runs; c++) {
    ahead.part(c);
    __m512i v[NT], w[NT];
    __m512 pa[RT][NT], pb[RT][NT];
    for (int j = 0; j < NT; j++) {
      v[j] = _mm512_loadu_si512(rows + j * wstride + 64 * c);
      w[j] = _mm512_srli_epi32(v[j], 12);
    }
    auto step = [&](auto pc, const __m512i* src, auto first) {
      constexpr int P = decltype(pc)::value;  // xp's vector: nibble P % 5 (P < 5) of v, else nibble P - 3 of w
      __m512 nib[NT];
      for (int j = 0; j < NT; j++) nib[j] = nibble<(P < 5 ? P : P - 3)>(src[j]);
      for (int r = 0; r < RT; r++) {
        const __m512 xv = _mm512_load_ps(xp + r * ldxp + 128 * c + 16 * P);
        for (int j = 0; j < NT; j++) {
          __m512& a = P % 2 ? pb[r][j] : pa[r][j];
          if constexpr (decltype(first)::value) a = _mm512_mul_ps(nib[j], xv);
          else a = _mm512_fmadd_ps(nib[j], xv, a);
        }
      }
    };
    using T = std::true_type;
    using F = std::false_type;
    step(std::integral_constant<int, 0>{}, v, T{});
    step(std::integral_constant<int, 1>{}, v, T{});
    step(std::integral_constant<int, 2>{}, v, F{});
    step(std::integral_constant<int, 3>{}, v, F{});
    step(std::integral_constant<int, 4>{}, v, F{});
    step(std::integral_constant<int, 5>{}, w, F{});
    step(std::integral_constant<int, 6>{}, w, F{});
    step(std::integral_constant<int, 7>{}, w, F{});
    for (int j = 0; j < NT; j++) {
      const __m128 d4 = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows + j * wstride + 16 * G + 8 * c)));
      const __m512 d = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(d4));
      for (int r = 0; r < RT; r++) acc[r][j] = _mm512_fmadd_ps(d, _mm512_add_ps(pa[r][j], pb[r][j]), acc[r][j]);
    }
  }
  for (int j = 0; j < NT; j++) {
    const Blocks<QT> b{rows + j * wstride, G};
    for (int64_t g = 4 * runs; g < G; g++) {  // lane l: code l (low nibble), code l + 16 (high)
      const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.codes(g))));
      const __m512 lo = nibble<0>(q), hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));  // q: one byte a lane
      const __m512 d = _mm512_set1_ps(half_to_float(b.scale(g)));
      for (int r = 0; r < RT; r++) {
        const float* xg = x + r * ldx + g * GROUP;
        acc[r][j] = _mm512_fmadd_ps(d, _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(xg))),
                                    acc[r][j]);
      }
    }
    const uint8_t* mins = FT<QT> == Q4_1 ? b.minimum(0) : b.scale(0);
    __m512 macc[RT];
    for (int r = 0; r < RT; r++) macc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g += 16) {
      const __mmask16 k = G - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G - g)) - 1);
      const __m512 m = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mins + 2 * g));
      for (int r = 0; r < RT; r++) macc[r] = _mm512_fmadd_ps(m, _mm512_maskz_loadu_ps(k, sx + r * G + g), macc[r]);
    }
    for (int r = 0; r < RT; r++)
      out[r * ldo + j] = _mm512_reduce_add_ps(FT<QT> == Q4_0 ? _mm512_fmadd_ps(macc[r], _mm512_set1_ps(-8.0f), acc[r][j])
                                                             : _mm512_add_ps(acc[r][j], macc[r]));
  }
}

// RT activation rows x (stride ldx) against NT packed rows: out[r * ldo + j]. Each block of the NT rows is
// dequantised once into registers for all RT rows; the RT x NT accumulators stay in registers
// (2 NT + 2 + RT NT of the 32 vector registers).
template <int64_t QT, int NT, int RT, bool PREFETCH = true>
inline void tile_dot_512(const uint8_t* rows, int64_t wstride, int64_t G, const float* x, int64_t ldx, float* out,
                         int64_t ldo) {
  __m512 acc[RT][NT];
  for (int r = 0; r < RT; r++)
    for (int j = 0; j < NT; j++) acc[r][j] = _mm512_setzero_ps();
  const Prefetch ahead(rows + 2 * NT * wstride, NT * wstride, G);  // the tile after next
  for (int64_t g = 0; g < G; g++) {
    if (PREFETCH) ahead.part(g);
    __m512 lo[NT], hi[NT];
    for (int j = 0; j < NT; j++) load_block16<QT>(Blocks<QT>{rows + j * wstride, G}, g, lo[j], hi[j]);
    for (int r = 0; r < RT; r++) {
      const float* xg = x + r * ldx + g * GROUP;
      const __m512 xlo = _mm512_loadu_ps(xg), xhi = _mm512_loadu_ps(xg + 16);
      for (int j = 0; j < NT; j++) acc[r][j] = _mm512_fmadd_ps(hi[j], xhi, _mm512_fmadd_ps(lo[j], xlo, acc[r][j]));
    }
  }
  for (int r = 0; r < RT; r++)
    for (int j = 0; j < NT; j++) out[r * ldo + j] = _mm512_reduce_add_ps(acc[r][j]);
}

// One tile of NT weight rows against rows [r, r + rt) of x, rt < 8 (rt < 6 for NT = 4, whose 4 x 6 accumulators
// would not fit the registers; tiles_512 never asks for them): rt as a template argument.
template <int64_t QT, int NT, bool PREFETCH>
inline void tile_dot_512_rt(int64_t rt, const uint8_t* rows, int64_t wstride, int64_t G, const float* x, int64_t ldx,
                            float* out, int64_t ldo) {
  if constexpr (NT <= 2) {
    if (rt == 6) return tile_dot_512<QT, NT, 6, PREFETCH>(rows, wstride, G, x, ldx, out, ldo);
    if (rt == 7) return tile_dot_512<QT, NT, 7, PREFETCH>(rows, wstride, G, x, ldx, out, ldo);
  }
  switch (rt) {
    case 1: return tile_dot_512<QT, NT, 1, PREFETCH>(rows, wstride, G, x, ldx, out, ldo);
    case 2: return tile_dot_512<QT, NT, 2, PREFETCH>(rows, wstride, G, x, ldx, out, ldo);
    case 3: return tile_dot_512<QT, NT, 3, PREFETCH>(rows, wstride, G, x, ldx, out, ldo);
    case 4: return tile_dot_512<QT, NT, 4, PREFETCH>(rows, wstride, G, x, ldx, out, ldo);
    case 5: return tile_dot_512<QT, NT, 5, PREFETCH>(rows, wstride, G, x, ldx, out, ldo);
  }
}

// Rows [begin, end) of out [M, N] against activations x [M, G * 32] (M >= 2), in tiles of 2 weight rows by
// up to 8 activation rows (4 weight rows for M < 6: 2 NT + 2 + RT NT of the 32 vector registers): each pass
// over a weight tile takes the next 8 rows of x (the first prefetches the tile after next; the others
// find this one in L1), the last pass the rest.
template <int64_t QT, int NT>
void tiles_512(const uint8_t* wd, int64_t wstride, int64_t begin, int64_t end, int64_t G, const float* x, int64_t M,
               float* out, int64_t N) {
  const int64_t K = G * GROUP;
  auto passes = [&](auto nt, int64_t n) {
    constexpr int T = decltype(nt)::value;
    const uint8_t* tile = wd + n * wstride;
    const int64_t first = std::min<int64_t>(M, 8);
    if (first == 8) tile_dot_512<QT, T, 8, true>(tile, wstride, G, x, K, out + n, N);
    else tile_dot_512_rt<QT, T, true>(first, tile, wstride, G, x, K, out + n, N);
    int64_t r = first;
    for (; r + 8 <= M; r += 8) tile_dot_512<QT, T, 8, false>(tile, wstride, G, x + r * K, K, out + r * N + n, N);
    if (r < M) tile_dot_512_rt<QT, T, false>(M - r, tile, wstride, G, x + r * K, K, out + r * N + n, N);
  };
  int64_t n = begin;
  for (; n + NT <= end; n += NT) passes(std::integral_constant<int, NT>{}, n);
  for (; n < end; n++) passes(std::integral_constant<int, 1>{}, n);
}

// Rows of x per chunk: 64 rows of up to 1536 floats (384 KB) stay in L2 while a thread's weight rows pass them.
constexpr int64_t X_CHUNK_ROWS = 64;

// Rows [begin, end) of out [M, N]: 1-3 rows of x against split rows as tile_dot_split (xp: each row of x in
// split_order, split_stride apart), one row against a file layout as rows_dot_512, other rows up to 5 in tiles of 4
// weight rows, more in tiles of 2 over 64-row chunks of x.
template <int64_t QT>
void block_rows_512(const uint8_t* wd, int64_t wstride, int64_t begin, int64_t end, int64_t G, const float* x,
                    int64_t M, const float* sx, const float* xp, float* out, int64_t N) {
  if constexpr (Blocks<QT>::SPLIT) {
    if (M <= SPLIT_MAX_ROWS) {
      const int64_t K = G * GROUP, ldxp = split_stride(G);
      auto pass = [&](auto rt) {  // tiles of 2 weight rows (4 spill registers at 2 rows of x), then one
        constexpr int RT = decltype(rt)::value;
        int64_t n = begin;
        for (; n + 2 <= end; n += 2)
          tile_dot_split<QT, 2, RT>(wd + n * wstride, wstride, G, xp, ldxp, x, K, sx, out + n, N);
        for (; n < end; n++) tile_dot_split<QT, 1, RT>(wd + n * wstride, wstride, G, xp, ldxp, x, K, sx, out + n, N);
      };
      if (M == 1) pass(std::integral_constant<int, 1>{});
      else if (M == 2) pass(std::integral_constant<int, 2>{});
      else pass(std::integral_constant<int, 3>{});
      return;
    }
  }
  if constexpr (!Blocks<QT>::SPLIT) {
    if (M == 1) {
      int64_t n = begin;
      for (; n + 4 <= end; n += 4) rows_dot_512<QT, 4>(wd + n * wstride, wstride, G, x, sx, out + n);
      for (; n < end; n++) rows_dot_512<QT, 1>(wd + n * wstride, wstride, G, x, sx, out + n);
      return;
    }
  }
  if (M < 6) {
    tiles_512<QT, 4>(wd, wstride, begin, end, G, x, M, out, N);
  } else {
    for (int64_t r = 0; r < M; r += X_CHUNK_ROWS)
      tiles_512<QT, 2>(wd, wstride, begin, end, G, x + r * G * GROUP, std::min(X_CHUNK_ROWS, M - r), out + r * N, N);
  }
}
#endif

#ifdef MS_AMX
// AMX: rows of x against 16 packed weight rows at a time through the tiles, exact in float32.
//
// TDPBF16PS multiplies bf16 pairs exactly and accumulates in float32. A block's codes (Q4: 0-15, Q8_0: -128-127)
// are exact in bf16, and a float32 x is exactly hi + mid + lo, three bf16 limbs of 8 significant bits each (hi: x
// truncated to bf16, mid: the rest truncated, lo: what is left), while every nonzero limb is a normal number (the
// tiles read subnormal bf16 as 0): x finite and |x| >= 2^-100, or 0; amx_x_tiles refuses any other x. So for
// block g of weight row j, C[j][m] = q_g,j . (hi + mid + lo)_g,m = q . x in float32 with some summation order, and
// the layer is sum_g d_g,j C_g[j][m] + sum_g m_g,j sum(x_g,m) as tile_dot_split computes it (Q4_0: m = -8 d).
//
// Tiles: 0 the A operand, 16 weight rows x 32 codes of one block as bf16; 1-3 the B operand, one limb each of up to
// 16 rows of x in the pair order TDPBF16PS reads: row kp holds, for each row m of x, the dword of the limbs of
// x[m][k_a(kp)] (low half) and x[m][k_b(kp)] (high half), the two values A's rows pair at words 2 kp and 2 kp + 1;
// 4 the product C [16 weight rows, 16 rows of x]. Every tile is 16 rows of 64 bytes.

// Rows of x from which packed_linear takes the tiles (amx_ready): below it the AVX-512 paths measured faster, since
// a block's codes cost a store and a tile load on top of their unpacking (docs/experiments.md, eighteenth session).
constexpr int64_t AMX_MIN_ROWS = 9;

// Whether this process may use the tiles: Linux grants their state to a process that asks (once; without it the
// first tile instruction faults). MINISPEC_NO_AMX=1 keeps the AVX-512 paths (to compare the two).
bool amx_ready() {
  static const bool ok = [] {
    const char* off = std::getenv("MINISPEC_NO_AMX");
    if (off && *off && std::strcmp(off, "0") != 0) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// The tile shapes above, loaded once per thread and call (a thread's tile configuration is its own).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16};
};

// Which values of a block A's row pairs at words 2 kp and 2 kp + 1: Q4 (a byte's two nibbles) codes kp and kp + 16,
// Q8_0 (converted 16 at a time) codes 2 kp and 2 kp + 1.
template <int64_t QT>
constexpr bool PAIRS_HALVES = FT<QT> != Q8_0;

// bf16(j % 16) at 16-bit lane j of 32: one permute looks up a lane whose low 5 bits hold a code (a 4-bit code, or
// one with a stray fifth bit as the tiled kernel's shifted words have).
inline __m512i bf16_code_table() {
  return _mm512_setr_epi32(0x3F800000, 0x40404000, 0x40A04080, 0x40E040C0, 0x41104100, 0x41304120, 0x41504140,
                           0x41704160, 0x3F800000, 0x40404000, 0x40A04080, 0x40E040C0, 0x41104100, 0x41304120,
                           0x41504140, 0x41704160);
}

// One block of a weight row as A's row: 32 bf16 codes in pair order (Q4_0's codes as 0-15: its -8 d is a minimum).
template <int64_t QT>
inline __m512i amx_codes(const uint8_t* codes) {
  if constexpr (FT<QT> == Q8_0) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // words 0-15: codes 0-15, 16-31: codes 16-31 (exact)
  } else {
    const __m512i table = bf16_code_table();
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));  // byte kp a lane
    // word 2 kp: the low nibble (code kp), word 2 kp + 1: the high one (code kp + 16)
    const __m512i c = _mm512_and_si512(_mm512_or_si512(v, _mm512_slli_epi32(v, 12)), _mm512_set1_epi32(0x000F000F));
    return _mm512_permutexvar_epi16(c, table);
  }
}

// A row's G scales d[g] and minima m[g] (Q4_0: -8 d; Q8_0: none) as floats, 16 blocks at a time: a split row holds
// them in runs of float16, a file's row one in each block (gathered as dwords: a block holds 2 bytes past each).
template <int64_t QT>
inline void amx_scales(Blocks<QT> b, float* d, float* m) {
  const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                        _mm512_set1_epi32((int)GB<QT>));  // a file row's blocks, in bytes
  for (int64_t g = 0; g < b.G; g += 16) {
    const __mmask16 k = b.G - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (b.G - g)) - 1);
    auto halves = [&](const uint8_t* p) {  // the 16 float16 of blocks g.. from p (block g's)
      return _mm512_cvtph_ps(Blocks<QT>::SPLIT
          ? _mm256_maskz_loadu_epi16(k, p)
          : _mm512_cvtepi32_epi16(_mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, at, p, 1)));
    };
    const __m512 dv = halves(b.scale(g));
    _mm512_mask_storeu_ps(d + g, k, dv);
    if constexpr (FT<QT> == Q4_1) _mm512_mask_storeu_ps(m + g, k, halves(b.minimum(g)));
    if constexpr (FT<QT> == Q4_0) _mm512_mask_storeu_ps(m + g, k, _mm512_mul_ps(dv, _mm512_set1_ps(-8.0f)));
  }
}

// The three bf16 limbs of 16 values of x, each limb's float32 with its low 16 bits zero (exact in bf16); returns the
// lanes the tiles cannot hold: x not finite, or nonzero below 2^-100 in magnitude (a limb would be subnormal).
inline __mmask16 x_limbs(__m512 v, __m512i l[3]) {
  const __m512 av = _mm512_abs_ps(v);
  const __mmask16 bad = _mm512_cmp_ps_mask(av, _mm512_set1_ps(INFINITY), _CMP_NLT_UQ) |
                        (_mm512_cmp_ps_mask(av, _mm512_set1_ps(0x1p-100f), _CMP_LT_OQ) &
                         _mm512_cmp_ps_mask(av, _mm512_setzero_ps(), _CMP_NEQ_UQ));
  const __m512i mask = _mm512_set1_epi32((int)0xFFFF0000u);
  l[0] = _mm512_and_si512(_mm512_castps_si512(v), mask);
  const __m512 r = _mm512_sub_ps(v, _mm512_castsi512_ps(l[0]));  // exact
  l[1] = _mm512_and_si512(_mm512_castps_si512(r), mask);
  l[2] = _mm512_castps_si512(_mm512_sub_ps(r, _mm512_castsi512_ps(l[1])));  // exact, 8 significant bits
  return bad;
}

// x's three limbs as B tiles, tile l of block g holding limb l of rows [0, mc) of x (stride ldx, mc <= 16) in its
// columns m: xb[((3 g + l) 16 + kp) 16 + m] is the dword at pair kp; sxT[16 g + m] the block sums of x. Columns from mc
// on are 0. Each tile row is one gather of a pair's two values across the rows of x, split and stored whole; the
// blocks are shared among the threads. False where a nonzero x is not finite or below 2^-100 in magnitude (a limb
// would be subnormal, or the split undefined): the caller takes another path.
template <int64_t QT>
bool amx_x_tiles(const float* x, int64_t ldx, int64_t mc, int64_t G, uint32_t* xb, float* sxT) {
  const __mmask16 used = (__mmask16)((1u << mc) - 1);
  const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                        _mm512_set1_epi32((int)ldx));  // [16] row m's first value
  std::atomic<bool> ok{true};
  at::parallel_for(0, G, 4, [&](int64_t g0, int64_t g1) {
    __mmask16 bad = 0;
    for (int64_t g = g0; g < g1; g++) {
      const float* xg = x + g * GROUP;
      __m512 sum = _mm512_setzero_ps();  // [16] block g's sum of each row of x
      for (int kp = 0; kp < 16; kp++) {
        const int ka = PAIRS_HALVES<QT> ? kp : 2 * kp, kb = PAIRS_HALVES<QT> ? 16 + kp : 2 * kp + 1;
        const __m512 a = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), used, at, xg + ka, 4);  // [16] x[m, k_a(kp)]
        const __m512 b = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), used, at, xg + kb, 4);  // [16] x[m, k_b(kp)]
        sum = _mm512_add_ps(sum, _mm512_add_ps(a, b));
        __m512i la[3], lb[3];
        bad |= x_limbs(a, la) | x_limbs(b, lb);
        for (int l = 0; l < 3; l++)
          _mm512_storeu_si512(xb + ((3 * g + l) * 16 + kp) * 16, _mm512_or_si512(_mm512_srli_epi32(la[l], 16), lb[l]));
      }
      _mm512_storeu_ps(sxT + 16 * g, sum);
    }
    if (bad) ok.store(false, std::memory_order_relaxed);
  });
  return ok.load();
}

// Weight rows [16 t, 16 t + 16) for t in [t0, t1) against one chunk of rows of x (mc of them) in amx_x_tiles' B
// tiles: out[m * ldo + n] for m < mc. Each block's codes are unpacked once into A (tile 0); the three limbs' products
// go into one C (tile 4), which is scaled by the rows' d into registers, where the minima's term is added too.
template <int64_t QT>
void amx_groups(const uint8_t* wd, int64_t wstride, int64_t G, int64_t t0, int64_t t1, const uint32_t* xb,
                const float* sxT, int64_t mc, float* out, int64_t ldo) {
  constexpr bool HAS_MIN = FT<QT> != Q8_0;
  const TileConfig cfg;
  _tile_loadconfig(&cfg);
  alignas(64) uint16_t abuf[16 * 32];  // [16 weight rows, 32 codes] bf16
  alignas(64) float cbuf[16 * 16];     // [16 weight rows, 16 rows of x]
  std::vector<float> scales(2 * 16 * G);
  float *dsc = scales.data(), *msc = dsc + 16 * G;  // [16, G] each: d and the minimum (Q4_0: -8 d)
  for (int64_t t = t0; t < t1; t++) {
    const uint8_t* rows = wd + 16 * t * wstride;
    for (int j = 0; j < 16; j++) amx_scales<QT>(Blocks<QT>{rows + j * wstride, G}, dsc + j * G, msc + j * G);
    const Prefetch ahead(rows + 16 * wstride, 16 * wstride, G);  // the next group
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
      ahead.part(g);
      for (int j = 0; j < 16; j++)
        _mm512_store_si512(abuf + 32 * j, amx_codes<QT>(Blocks<QT>{rows + j * wstride, G}.codes(g)));
      _tile_loadd(0, abuf, 64);
      _tile_loadd(1, xb + (3 * g) * 256, 64);
      _tile_loadd(2, xb + (3 * g + 1) * 256, 64);
      _tile_loadd(3, xb + (3 * g + 2) * 256, 64);
      _tile_zero(4);
      _tile_dpbf16ps(4, 0, 1);
      _tile_dpbf16ps(4, 0, 2);
      _tile_dpbf16ps(4, 0, 3);
      _tile_stored(4, cbuf, 64);
      const __m512 s = _mm512_loadu_ps(sxT + 16 * g);
      for (int j = 0; j < 16; j++) {
        acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(dsc[j * G + g]), _mm512_load_ps(cbuf + 16 * j), acc[j]);
        if constexpr (HAS_MIN) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(msc[j * G + g]), s, acc[j]);
      }
    }
    alignas(64) float res[16][16];  // [weight row, row of x]
    for (int j = 0; j < 16; j++) _mm512_store_ps(res[j], acc[j]);
    for (int64_t m = 0; m < mc; m++)
      for (int j = 0; j < 16; j++) out[m * ldo + 16 * t + j] = res[j][m];
  }
  _tile_release();
}

// out [M, N] = x [M, G * 32] (stride G * 32) against N packed rows (N a multiple of 16) through the tiles, 16 rows of x
// at a time; false (out untouched) where amx_x_tiles refuses x.
template <int64_t QT>
bool amx_linear(const float* x, int64_t M, int64_t G, const uint8_t* wd, int64_t wstride, int64_t N, float* out) {
  const int64_t chunks = (M + 15) / 16, per_chunk = G * (3 * 256 + 16);  // dwords: B tiles, then sums
  uint32_t* xb = thread_scratch<uint32_t>(chunks * per_chunk);
  auto rows = [&](int64_t c) { return std::min<int64_t>(16, M - 16 * c); };
  auto sums = [&](int64_t c) { return reinterpret_cast<float*>(xb + c * per_chunk + G * 3 * 256); };
  for (int64_t c = 0; c < chunks; c++)
    if (!amx_x_tiles<QT>(x + 16 * c * G * GROUP, G * GROUP, rows(c), G, xb + c * per_chunk, sums(c))) return false;
  at::parallel_for(0, N / 16, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t c = 0; c < chunks; c++)
      amx_groups<QT>(wd, wstride, G, t0, t1, xb + c * per_chunk, sums(c), rows(c), out + 16 * c * N, N);
  });
  return true;
}

// The tiled layout (Q4_0_TILES, Q4_1_TILES; layers/quant.py's tile_rows writes it at load): weight rows in groups of
// 16, a group's G blocks one after another, block g of group t at (t G + g) TB bytes: 256 code bytes, the 16 rows'
// float16 scales, then (Q4_1) their float16 minima. The code bytes are 4 chunks of 32 little-endian words, and
// nibble s of word i of chunk c holds row i / 2's code 8 c + 2 s + i % 2. So each of a chunk's four nibbles, looked
// up as bf16 across the 32 words, is one row of the B operand in TDPBF16PS's pair order (row kp = 4 c + s holds,
// for each weight row j, its codes 2 kp and 2 kp + 1): a block of 16 weight rows costs one load, three shifts and
// four permutes (amx_codes unpacks each weight row alone).
//
// x goes into A: each row as its three bf16 limbs (as amx_x_tiles splits them), 32 values of one block a tile row.
// Up to AMX_LIMB_ROWS rows of x take one A tile a block, row 3 i + l holding limb l of row i; more (up to 16) take
// three, tile l row i. C [rows of A, 16 weight rows] is scaled by the block's d and summed over the limbs in
// registers, where the minima's term is added too.
template <int64_t FTQ>
constexpr int64_t TB = TILE_ROWS * (FTQ == Q4_1 ? 20 : 18);
constexpr int64_t AMX_LIMB_ROWS = 5;
// Blocks between a block's unpacking and its tile load, and the prefetch distance in blocks (docs/experiments.md,
// twenty-third session): a tile load of just-stored bytes waits for the stores to drain.
constexpr int64_t TILED_AHEAD = 2, TILED_PREFETCH = 4;

// x's rows [0, mc) (stride ldx, mc <= 16) as A tiles: block g's at xa + 96 mc g (words), row 3 i + l (mc <=
// AMX_LIMB_ROWS) or l mc + i (else) holding limb l of row i; sx[16 g + i] the block sums. False where a nonzero x
// is not finite or below 2^-100 in magnitude (as amx_x_tiles).
bool tiled_x(const float* x, int64_t ldx, int64_t mc, int64_t G, uint16_t* xa, float* sx) {
  __mmask16 bad = 0;
  for (int64_t g = 0; g < G; g++)
    for (int64_t i = 0; i < mc; i++) {
      const float* xg = x + i * ldx + g * GROUP;
      const __m512 lo = _mm512_loadu_ps(xg), hi = _mm512_loadu_ps(xg + 16);
      __m512i llo[3], lhi[3];  // the limbs of values 0-15 and 16-31
      bad |= x_limbs(lo, llo) | x_limbs(hi, lhi);
      sx[16 * g + i] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
      for (int l = 0; l < 3; l++) {
        const int64_t row = mc <= AMX_LIMB_ROWS ? 3 * i + l : l * mc + i;
        // the high halves of the 32 limbs (each exact in bf16), in order
        const __m512i words = _mm512_permutex2var_epi16(
            llo[l], _mm512_setr_epi32(0x00030001, 0x00070005, 0x000B0009, 0x000F000D, 0x00130011, 0x00170015,
                                      0x001B0019, 0x001F001D, 0x00230021, 0x00270025, 0x002B0029, 0x002F002D,
                                      0x00330031, 0x00370035, 0x003B0039, 0x003F003D), lhi[l]);
        _mm512_storeu_si512(xa + 96 * mc * g + 32 * row, words);
      }
    }
  return bad == 0;
}

// Weight groups [t0, t1) of a tiled layout against mc rows of x in tiled_x's A tiles: out[i * ldo + 16 t + j].
template <int64_t FTQ, bool ONE>  // ONE: mc <= AMX_LIMB_ROWS, one A tile a block
void tiled_groups(const uint8_t* wd, int64_t G, int64_t t0, int64_t t1, const uint16_t* xa, const float* sx,
                  int64_t mc, float* out, int64_t ldo) {
  // ONE: A 0 / 3, B 1 / 4, C 2 / 5 for even / odd blocks; else A (limbs) 0-2, B 3 / 5, C 4 / 6.
  TileConfig cfg;
  const uint8_t arows = (uint8_t)(ONE ? 3 * mc : mc);
  for (int t = 0; t < 7; t++) cfg.colsb[t] = 64;
  if constexpr (ONE) {
    const uint8_t rows[7] = {arows, 16, arows, arows, 16, arows, 0};
    for (int t = 0; t < 7; t++) cfg.rows[t] = rows[t];
    cfg.colsb[6] = 0;
  } else {
    const uint8_t rows[7] = {arows, arows, arows, 16, arows, 16, arows};
    for (int t = 0; t < 7; t++) cfg.rows[t] = rows[t];
  }
  _tile_loadconfig(&cfg);
  const __m512i table = bf16_code_table();
  alignas(64) uint16_t ring[4][16 * 32];  // block g's B rows at ring[g % 4]
  alignas(64) float cbuf[2][16 * 16];     // block g's C at cbuf[g % 2], read a block after its store
  for (int64_t t = t0; t < t1; t++) {
    const uint8_t* grp = wd + t * G * TB<FTQ>;
    __m512 acc[16];  // [16 weight rows] for each row of x
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    auto unpack = [&](int64_t g) {
      const uint8_t* b = grp + g * TB<FTQ>;
      _mm_prefetch((const char*)(b + TILED_PREFETCH * TB<FTQ>), _MM_HINT_T0);
      for (int64_t line = 64; line < TB<FTQ>; line += 64)
        _mm_prefetch((const char*)(b + TILED_PREFETCH * TB<FTQ> + line), _MM_HINT_T0);
      uint16_t* r = ring[g & 3];
      for (int c = 0; c < 4; c++) {
        const __m512i w = _mm512_loadu_si512(b + 64 * c);
        _mm512_store_si512(r + 32 * (4 * c), _mm512_permutexvar_epi16(w, table));
        _mm512_store_si512(r + 32 * (4 * c + 1), _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table));
        _mm512_store_si512(r + 32 * (4 * c + 2), _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 8), table));
        _mm512_store_si512(r + 32 * (4 * c + 3), _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 12), table));
      }
    };
    auto scale = [&](int64_t g) {
      const uint8_t* b = grp + g * TB<FTQ>;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 256)));
      const __m512 m = FTQ == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 288)))
                                   : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
      const float* c = cbuf[g & 1];
      for (int64_t i = 0; i < mc; i++) {
        const __m512 s = ONE ? _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(c + 16 * (3 * i)), _mm512_load_ps(c + 16 * (3 * i + 1))),
                                             _mm512_load_ps(c + 16 * (3 * i + 2)))
                             : _mm512_load_ps(c + 16 * i);
        acc[i] = _mm512_fmadd_ps(d, s, acc[i]);
        acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[16 * g + i]), acc[i]);
      }
    };
    // block g's product into cbuf[g % 2] (tile numbers are literals in the instructions)
#define MS_TILED_ONE(TA, TBB, TC)      \
  {                                    \
    _tile_loadd(TBB, ring[g & 3], 64); \
    _tile_loadd(TA, a, 64);            \
    _tile_zero(TC);                    \
    _tile_dpbf16ps(TC, TA, TBB);       \
    _tile_stored(TC, cbuf[g & 1], 64); \
  }
#define MS_TILED_THREE(TBB, TC)        \
  {                                    \
    _tile_loadd(TBB, ring[g & 3], 64); \
    _tile_loadd(0, a, 64);             \
    _tile_loadd(1, a + 32 * mc, 64);   \
    _tile_loadd(2, a + 64 * mc, 64);   \
    _tile_zero(TC);                    \
    _tile_dpbf16ps(TC, 0, TBB);        \
    _tile_dpbf16ps(TC, 1, TBB);        \
    _tile_dpbf16ps(TC, 2, TBB);        \
    _tile_stored(TC, cbuf[g & 1], 64); \
  }
    for (int64_t g = 0; g < std::min(TILED_AHEAD, G); g++) unpack(g);
    for (int64_t g = 0; g < G; g++) {
      if (g + TILED_AHEAD < G) unpack(g + TILED_AHEAD);
      const uint16_t* a = xa + 96 * mc * g;
      if constexpr (ONE) {
        if (g & 1) MS_TILED_ONE(3, 4, 5) else MS_TILED_ONE(0, 1, 2)
      } else {
        if (g & 1) MS_TILED_THREE(5, 6) else MS_TILED_THREE(3, 4)
      }
      if (g > 0) scale(g - 1);
    }
#undef MS_TILED_ONE
#undef MS_TILED_THREE
    scale(G - 1);
    for (int64_t i = 0; i < mc; i++) _mm512_storeu_ps(out + i * ldo + 16 * t, acc[i]);
  }
  _tile_release();
}

// out [M, N] = x [M, G * 32] (stride G * 32) against a tiled layout of N rows, 16 rows of x at a time; false (out
// untouched) where tiled_x refuses x.
template <int64_t FTQ>
bool amx_tiled_linear(const float* x, int64_t M, int64_t G, const uint8_t* wd, int64_t N, float* out) {
  const int64_t chunks = (M + 15) / 16, per_chunk = G * (16 * 96 + 16 * 2);  // words: A tiles, then sums (floats)
  uint16_t* xa = thread_scratch<uint16_t>(chunks * per_chunk);
  auto rows = [&](int64_t c) { return std::min<int64_t>(16, M - 16 * c); };
  auto sums = [&](int64_t c) { return reinterpret_cast<float*>(xa + c * per_chunk + G * 16 * 96); };
  for (int64_t c = 0; c < chunks; c++)
    if (!tiled_x(x + 16 * c * G * GROUP, G * GROUP, rows(c), G, xa + c * per_chunk, sums(c))) return false;
  for (int64_t c = 0; c < chunks; c++)
    at::parallel_for(0, N / TILE_ROWS, 1, [&](int64_t t0, int64_t t1) {
      if (rows(c) <= AMX_LIMB_ROWS)
        tiled_groups<FTQ, true>(wd, G, t0, t1, xa + c * per_chunk, sums(c), rows(c), out + 16 * c * N, N);
      else
        tiled_groups<FTQ, false>(wd, G, t0, t1, xa + c * per_chunk, sums(c), rows(c), out + 16 * c * N, N);
    });
  return true;
}
#endif

// f(std::integral_constant<int64_t, QT>{}) for a block type QT (the SIMD paths); false for F16 / BF16.
template <class F>
bool with_block_type(int64_t qtype, F&& f) {
  switch (qtype) {
    case Q4_0: f(std::integral_constant<int64_t, Q4_0>{}); return true;
    case Q4_1: f(std::integral_constant<int64_t, Q4_1>{}); return true;
    case Q8_0: f(std::integral_constant<int64_t, Q8_0>{}); return true;
    case Q4_0_SPLIT: f(std::integral_constant<int64_t, Q4_0_SPLIT>{}); return true;
    case Q4_1_SPLIT: f(std::integral_constant<int64_t, Q4_1_SPLIT>{}); return true;
  }
  return false;
}
#endif

// fn(n, w, d, m) for each row n in [begin, end), unpacked by unpack_row: the portable path.
template <class F>
void for_unpacked_rows(int64_t qtype, const uint8_t* wd, int64_t wstride, int64_t begin, int64_t end, int64_t K, F&& fn) {
  const int64_t G = (K + GROUP - 1) / GROUP, Kp = G * GROUP;
  std::vector<float> buf(Kp + 2 * G);
  float *wf = buf.data(), *d = wf + Kp, *m = d + G;
  for (int64_t n = begin; n < end; n++) {
    if (tiled(qtype)) unpack_tiled_row(qtype, wd, n, G, wf, d, m);
    else unpack_row(qtype, wd + n * wstride, K, wf, d, m);
    fn(n, wf, d, m);
  }
}

#ifdef MS_AVX2
// RT activation rows x (stride ldx) against one dense float32 row w of K values: out[r * ldo] for each r.
template <int RT>
inline void dense_row_dot(const float* w, int64_t K, const float* x, int64_t ldx, float* out, int64_t ldo) {
  constexpr int A = RT <= 4 ? 2 : 1;  // accumulators per row: shorter chains while registers last
  __m256 acc[RT][A];
  for (int r = 0; r < RT; r++)
    for (int a = 0; a < A; a++) acc[r][a] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 * A <= K; k += 8 * A)
    for (int a = 0; a < A; a++) {
      const __m256 wv = _mm256_loadu_ps(w + k + 8 * a);
      for (int r = 0; r < RT; r++) acc[r][a] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * ldx + k + 8 * a), acc[r][a]);
    }
  for (int r = 0; r < RT; r++) {
    float s = hsum(A == 2 ? _mm256_add_ps(acc[r][0], acc[r][A - 1]) : acc[r][0]);
    for (int64_t k2 = k; k2 < K; k2++) s += w[k2] * x[r * ldx + k2];
    out[r * ldo] = s;
  }
}
#endif

}  // namespace

// Where the tiles stop beating dequantise + one GEMM (docs/experiments.md, "The prefill GEMM").
#if defined(MS_AVX512)
const char* const PACKED_ISA = "avx512";
const int64_t PACKED_MAX_ROWS = 256;
const bool PACKED_SPLIT = true;
#elif defined(MS_AVX2)
const char* const PACKED_ISA = "avx2";
const int64_t PACKED_MAX_ROWS = 96;  // with the dequantised panels (docs/experiments.md, thirty-second session)
const bool PACKED_SPLIT = true;
#else
const char* const PACKED_ISA = "portable";
const int64_t PACKED_MAX_ROWS = 48;
const bool PACKED_SPLIT = false;
#endif

bool packed_amx() {
#if defined(MS_AMX)
  return amx_ready();
#else
  return false;
#endif
}

std::vector<std::vector<int64_t>> block_formats() {
  std::vector<std::vector<int64_t>> out;
  for (const BlockFormat& f : BLOCK_FORMATS) out.push_back({f.type, f.bytes, f.values});
  return out;
}

// x [M, K] float32, w [N, row_bytes] uint8 -> [M, N] float32.
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor w, int64_t qtype, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == torch::kFloat, "packed_linear: x must be [M, K] float32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.size(1) == row_bytes(qtype, K),
              "packed_linear: w must be [N, row_bytes] uint8");
  TORCH_CHECK(w.stride(1) == 1, "packed_linear: w rows must be contiguous");
  const int64_t M = x.size(0), N = w.size(0), G = (K + GROUP - 1) / GROUP, Kp = G * GROUP;
  // Activations zero-padded to whole groups (F16 / BF16 rows of any width; block rows are whole groups already).
  auto xpad = K == Kp ? x.contiguous() : torch::zeros({M, Kp}, x.options());
  if (K != Kp) xpad.narrow(1, 0, K).copy_(x);
  const float* xd = xpad.data_ptr<float>();
  TORCH_CHECK(!tiled(qtype) || (N % TILE_ROWS == 0 && w.is_contiguous()),
              "packed_linear: a tiled layout holds whole groups of 16 rows, contiguous");
#if defined(MS_AMX)
  if (tiled(qtype) && amx_ready()) {  // any rows of x; where the tiles refuse x, the portable path below
    auto out = torch::empty({M, N}, x.options());
    const uint8_t* wd = w.data_ptr<uint8_t>();
    if (file_type(qtype) == Q4_1 ? amx_tiled_linear<Q4_1>(xd, M, G, wd, N, out.data_ptr<float>())
                                 : amx_tiled_linear<Q4_0>(xd, M, G, wd, N, out.data_ptr<float>()))
      return out;
  }
  if (M >= AMX_MIN_ROWS && N % 16 == 0 && amx_ready()) {
    auto out = torch::empty({M, N}, x.options());
    bool done = false;
    if (with_block_type(qtype, [&](auto qt) {
          done = amx_linear<qt()>(xd, M, G, w.data_ptr<uint8_t>(), w.stride(0), N, out.data_ptr<float>());
        }) && done)
      return out;
  }
#endif
  PackedInput in;
  prepare_packed(in, xd, M, K, qtype);
  auto out = torch::empty({M, N}, x.options());
  const uint8_t* wd = w.data_ptr<uint8_t>();
  float* od = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    packed_range(in, wd, w.stride(0), qtype, K, begin, end, od, N);
  });
  return out;
}

bool packed_range_takes(int64_t qtype, int64_t M, int64_t K) {
  if (block_format(qtype).type == -1 || tiled(qtype) || K % GROUP != 0) return false;
#if defined(MS_AMX)
  if (M >= AMX_MIN_ROWS && amx_ready()) return false;
#endif
  return M >= 1;
}

void prepare_packed(PackedInput& in, const float* x, int64_t M, int64_t K, int64_t qtype) {
  // per-group sums of x for Q4_1's minima and the split kernels
  const int64_t G = (K + GROUP - 1) / GROUP;
  in.x = x;
  in.M = M;
  in.G = G;
  // Up to SPLIT_MAX_ROWS rows of x against split rows: tile_dot_split (AVX-512) or split_dot_256 (AVX2), which also
  // take Q4_0's -8 d through sx.
#if defined(MS_AVX2)
  const bool split_row = (qtype == Q4_0_SPLIT || qtype == Q4_1_SPLIT) && M <= SPLIT_MAX_ROWS;
  const int64_t ldxp = split_stride(G);
#else
  const bool split_row = false;
  const int64_t ldxp = 0;
#endif
  in.sx.resize(file_type(qtype) == Q4_1 || split_row ? M * G : 0);  // [M, G]
  for (int64_t i = 0; i < (int64_t)in.sx.size(); i++) {
    float s = 0.0f;
    for (int j = 0; j < GROUP; j++) s += x[i * GROUP + j];
    in.sx[i] = s;
  }
  // each row in split_order, 64-byte aligned (its 512-bit loads then never cross a cache line)
  in.xs_buf.resize(split_row ? M * ldxp + 16 : 0);
  float* xs = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(in.xs_buf.data()) + 63) & ~uintptr_t(63));
#if defined(MS_AVX2)
  if (split_row)
    for (int64_t r = 0; r < M; r++) split_order(x + r * G * GROUP, G, xs + r * ldxp);
#endif
  in.xs = xs;
}

void packed_range(const PackedInput& in, const uint8_t* wd, int64_t wstride, int64_t qtype, int64_t K, int64_t begin,
                  int64_t end, float* od, int64_t N) {
  const float *xd = in.x, *sxd = in.sx.data(), *xs = in.xs;
  const int64_t M = in.M, G = in.G, Kp = G * GROUP;
#if defined(MS_AVX512)
  if (with_block_type(qtype, [&](auto qt) { block_rows_512<qt()>(wd, wstride, begin, end, G, xd, M, sxd, xs, od, N); }))
    return;
#elif defined(MS_AVX2)
  if (with_block_type(qtype, [&](auto qt) { block_rows<qt()>(wd, wstride, begin, end, G, xd, M, sxd, xs, od, N); }))
    return;
#endif
  const bool has_min = file_type(qtype) == Q4_1;
  for_unpacked_rows(qtype, wd, wstride, begin, end, K, [&](int64_t n, const float* wf, const float* d, const float* m) {
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) dot_rows<4>(wf, d, G, xd + r * Kp, Kp, od + r * N + n, N);
    for (; r < M; r++) dot_rows<1>(wf, d, G, xd + r * Kp, Kp, od + r * N + n, N);
    if (has_min) {
      for (int64_t r2 = 0; r2 < M; r2++) {
        float s = 0.0f;
        for (int64_t g = 0; g < G; g++) s += m[g] * sxd[r2 * G + g];
        od[r2 * N + n] += s;
      }
    }
  });
}

// Rows up to which dense_linear streams the weight itself (past them a GEMM wins on cache-resident layer weights).
constexpr int64_t DENSE_MAX_ROWS = 16;

// x [M, K] float32 @ w [N, K]^T float32 (+ bias) -> [M, N]. A GEMM packs the weight for a few rows
// (a verification's 5 rows cost about two 1-row GEMVs) and torch's 1-row GEMV reads it at half the
// memory's speed; here each weight row is read once for all rows (in groups of 4 while it sits in L1),
// then the bias is added. More than DENSE_MAX_ROWS rows are at::linear's.
torch::Tensor dense_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.scalar_type() == torch::kFloat &&
                  w.scalar_type() == torch::kFloat, "dense_linear: x [M, K] and w [N, K] must be float32");
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  if (dense_range_takes(M) && w.is_contiguous()) {
    auto xc = x.contiguous();
    auto out = torch::empty({M, N}, x.options());
    const float *xd = xc.data_ptr<float>(), *wd = w.data_ptr<float>();
    float* od = out.data_ptr<float>();
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) { dense_range(xd, M, K, wd, begin, end, od, N); });
    return bias.has_value() ? out.add_(*bias) : out;
  }
  return at::linear(x, w, bias);
}

bool dense_range_takes(int64_t M) {
#ifdef MS_AVX2
  return M >= 1 && M <= DENSE_MAX_ROWS;
#else
  return false;
#endif
}

void dense_range(const float* xd, int64_t M, int64_t K, const float* wd, int64_t begin, int64_t end, float* od,
                 int64_t N) {
#ifdef MS_AVX2
  for (int64_t n = begin; n < end; n++) {
    const float* row = wd + n * K;
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) dense_row_dot<4>(row, K, xd + r * K, K, od + r * N + n, N);
    switch (M - r) {
      case 3: dense_row_dot<3>(row, K, xd + r * K, K, od + r * N + n, N); break;
      case 2: dense_row_dot<2>(row, K, xd + r * K, K, od + r * N + n, N); break;
      case 1: dense_row_dot<1>(row, K, xd + r * K, K, od + r * N + n, N); break;
    }
  }
#else
  TORCH_CHECK(false, "dense_range: an AVX2 build's");
#endif
}

// w [N, row_bytes] uint8 -> [N, K] float32: d * q + m per value, as gguf's dequantisation computes it.
torch::Tensor packed_dequantize(torch::Tensor w, int64_t qtype, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.size(1) == row_bytes(qtype, K),
              "packed_dequantize: w must be [N, row_bytes] uint8");
  const int64_t N = w.size(0), G = (K + GROUP - 1) / GROUP;
  auto out = torch::empty({N, K}, w.options().dtype(torch::kFloat));
  const uint8_t* wd = w.data_ptr<uint8_t>();
  const int64_t wstride = w.stride(0);
  float* od = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
#ifdef MS_AVX2
    if (with_block_type(qtype, [&](auto qt) { block_dequant<qt()>(wd, wstride, begin, end, G, od); })) return;
#endif
    for_unpacked_rows(qtype, wd, wstride, begin, end, K, [&](int64_t n, const float* wf, const float* d, const float* m) {
      float* o = od + n * K;
      for (int64_t k = 0; k < K; k++) o[k] = d[k / GROUP] * wf[k] + m[k / GROUP];
    });
  });
  return out;
}

// Rows ids [n] of w [N, row_bytes] -> float32 [n, K], each as packed_dequantize gives it (a tiled layout's rows are no
// slices of its bytes: unpacked from their groups).
torch::Tensor packed_rows(torch::Tensor w, int64_t qtype, int64_t K, torch::Tensor ids) {
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.dim() == 1, "packed_rows: ids must be [n] int64");
  if (!tiled(qtype)) return packed_dequantize(w.index_select(0, ids), qtype, K);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.size(1) == row_bytes(qtype, K) &&
                  w.size(0) % TILE_ROWS == 0 && w.is_contiguous(),
              "packed_rows: a tiled w must be [N, row_bytes] uint8, contiguous, whole groups of 16 rows");
  const int64_t n = ids.size(0), N = w.size(0), G = K / GROUP;
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; i++)
    TORCH_CHECK(id[i] >= 0 && id[i] < N, "packed_rows: row ", id[i], " outside the weight's ", N, " rows");
  auto out = torch::empty({n, K}, w.options().dtype(torch::kFloat));
  const uint8_t* wd = w.data_ptr<uint8_t>();
  float* od = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(K + 2 * G);
    float *wf = buf.data(), *d = wf + K, *m = d + G;
    for (int64_t i = begin; i < end; i++) {
      unpack_tiled_row(qtype, wd, id[i], G, wf, d, m);
      for (int64_t k = 0; k < K; k++) od[i * K + k] = d[k / GROUP] * wf[k] + m[k / GROUP];
    }
  });
  return out;
}
