// Fused float32 CPU kernels for the small ops of a decode step (layers/norm.py, layers/attention.py,
// models/llama.py): each replaces several torch ops and their dispatch. Float32 in, float32
// accumulation; only the rounding order differs from the torch references beside their callers.
#include "cpu_ops.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MS_AVX2 1
#endif

namespace {

constexpr int64_t LANES = 16;  // independent partial sums: the compiler vectorises these loops

// exp(x) for x <= 0 (softmax) or any x (SiLU), about 1 ulp: Cody-Waite reduction and a degree-6
// polynomial, written so that loops over it vectorise (no libm call).
inline float exp_f32(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(n, -0.693359375f, x);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  const float y = std::fma(p, r * r, r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int64_t u = 0; u < LANES; ++u) acc[u] += a[i + u] * b[i + u];
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int64_t u = 0; u < LANES; ++u) s += acc[u];
  return s;
}

inline float sum_f32(const float* a, int64_t n) {
  float acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int64_t u = 0; u < LANES; ++u) acc[u] += a[i + u];
  float s = 0.f;
  for (; i < n; ++i) s += a[i];
  for (int64_t u = 0; u < LANES; ++u) s += acc[u];
  return s;
}

// One query head's attention, the portable path (no AVX2, or hd % 8 != 0; attend_group otherwise): p[s] = q . k_s *
// scale for keys s < n_keys (rows at stride ld floats), softmax over p, o = sum_s p[s] v_s / sum_s p[s]. p has room for
// n_keys scores; o has hd floats.
void attend_head(const float* q, const float* k, const float* v, int64_t ld, int64_t n_keys, int64_t hd,
                 float scale, float* p, float* o) {
  int64_t s = 0;
  for (; s < n_keys; ++s) p[s] = dot(q, k + s * ld, hd) * scale;
  float m = -INFINITY;
  for (s = 0; s < n_keys; ++s) m = std::max(m, p[s]);
  for (s = 0; s < n_keys; ++s) p[s] = exp_f32(p[s] - m);
  const float inv = 1.0f / sum_f32(p, n_keys);
  std::fill(o, o + hd, 0.f);
  for (s = 0; s < n_keys; ++s) {
    const float* vs = v + s * ld;
    const float w = p[s];
    for (int64_t d = 0; d < hd; ++d) o[d] += w * vs[d];
  }
  for (int64_t d = 0; d < hd; ++d) o[d] *= inv;
}

#ifdef MS_AVX2
// o_g[0 .. 8 NC) = inv[g] * sum_s p_g[s] v_s[0 .. 8 NC) over keys s < n_keys (value rows at stride ld floats) for the
// G query heads g of one KV head (p_g = p + g * ps, o_g = o + g * hd): every value row loaded once for the G.
template <int G, int NC>
inline void weighted_sum_group(const float* p, int64_t ps, const float* v, int64_t ld, int64_t n_keys, const float* inv,
                               float* o, int64_t hd) {
  __m256 acc[G][NC];
  for (int g = 0; g < G; g++)
    for (int c = 0; c < NC; c++) acc[g][c] = _mm256_setzero_ps();
  for (int64_t s = 0; s < n_keys; ++s) {
    __m256 w[G];
    for (int g = 0; g < G; g++) w[g] = _mm256_set1_ps(p[g * ps + s]);
    for (int c = 0; c < NC; c++) {
      const __m256 vc = _mm256_loadu_ps(v + s * ld + 8 * c);
      for (int g = 0; g < G; g++) acc[g][c] = _mm256_fmadd_ps(w[g], vc, acc[g][c]);
    }
  }
  for (int g = 0; g < G; g++)
    for (int c = 0; c < NC; c++) _mm256_storeu_ps(o + g * hd + 8 * c, _mm256_mul_ps(acc[g][c], _mm256_set1_ps(inv[g])));
}

// Attention of the G query heads q_g = q + g * hd of one KV head (GQA) at once: p_g[s] = q_g . k_s * scale, softmax,
// o_g = sum_s p_g[s] v_s / sum_s p_g[s]; every key and value row is read once for the G heads. hd % 8 == 0; p has
// room for G * n_keys scores; o_g = o + g * hd.
template <int G>
void attend_group(const float* q, const float* k, const float* v, int64_t ld, int64_t n_keys, int64_t hd, float scale,
                  float* p, float* o) {
  int64_t s = 0;
  for (; s + 4 <= n_keys; s += 4) {  // 4 keys at a time, 4 chains a head; the G queries share each key load
    __m256 a[G][4];
    for (int g = 0; g < G; g++)
      for (int j = 0; j < 4; j++) a[g][j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < hd; c += 8) {
      __m256 qc[G];
      for (int g = 0; g < G; g++) qc[g] = _mm256_loadu_ps(q + g * hd + c);
      for (int j = 0; j < 4; j++) {
        const __m256 kj = _mm256_loadu_ps(k + (s + j) * ld + c);
        for (int g = 0; g < G; g++) a[g][j] = _mm256_fmadd_ps(qc[g], kj, a[g][j]);
      }
    }
    for (int g = 0; g < G; g++) {
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]), _mm256_hadd_ps(a[g][2], a[g][3]));
      const __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      _mm_storeu_ps(p + g * n_keys + s, _mm_mul_ps(r, _mm_set1_ps(scale)));
    }
  }
  for (; s < n_keys; ++s)
    for (int g = 0; g < G; g++) p[g * n_keys + s] = dot(q + g * hd, k + s * ld, hd) * scale;
  float inv[G];
  for (int g = 0; g < G; g++) {
    float* pg = p + g * n_keys;
    float m = -INFINITY;
    for (s = 0; s < n_keys; ++s) m = std::max(m, pg[s]);
    for (s = 0; s < n_keys; ++s) pg[s] = exp_f32(pg[s] - m);
    inv[g] = 1.0f / sum_f32(pg, n_keys);
  }
  int64_t c0 = 0;
  for (; c0 + 32 <= hd; c0 += 32) weighted_sum_group<G, 4>(p, n_keys, v + c0, ld, n_keys, inv, o + c0, hd);
  for (; c0 < hd; c0 += 8) weighted_sum_group<G, 1>(p, n_keys, v + c0, ld, n_keys, inv, o + c0, hd);
}
#endif

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous(), name,
              " must be a contiguous float32 CPU tensor");
}

// Rows per parallel chunk so that each chunk has at least ~32k values of work.
inline int64_t grain(int64_t row_size) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_size, 1)); }

}  // namespace

// residual += x (when residual is given); out = residual / rms(residual) * weight. x, residual
// [N, H] contiguous; returns out [N, H]. Without a residual: out = x / rms(x) * weight.
torch::Tensor add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps) {
  check_f32(x, "x");
  check_f32(weight, "weight");
  const int64_t H = x.size(-1), N = x.numel() / H;
  TORCH_CHECK(weight.numel() == H, "weight has ", weight.numel(), " values, rows have ", H);
  float* res = nullptr;
  if (residual.has_value()) {
    check_f32(*residual, "residual");
    TORCH_CHECK(residual->numel() == x.numel(), "residual and x differ in size");
    res = residual->data_ptr<float>();
  }
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, grain(H), [&](int64_t begin, int64_t end) { rms_norm_rows(xp, res, w, eps, op, begin, end, H); });
  return out;
}

void rms_norm_rows(const float* x, float* residual, const float* weight, double eps, float* out, int64_t begin,
                   int64_t end, int64_t H) {
  for (int64_t n = begin; n < end; ++n) {
    const float* src = x + n * H;
    if (residual) {
      float* r = residual + n * H;
      for (int64_t i = 0; i < H; ++i) r[i] += src[i];
      src = r;
    }
    const float inv = 1.0f / std::sqrt(dot(src, src, H) / static_cast<float>(H) + static_cast<float>(eps));
    float* o = out + n * H;
    for (int64_t i = 0; i < H; ++i) o[i] = src[i] * inv * weight[i];
  }
}

// logits [N, V] -> (tokens [N] int64, finite [N] bool): each row's argmax, the first index on ties, NaN
// counting as -inf and +inf as the largest float32 (sampler.py's greedy_tokens); finite: the row holds no NaN
// or +inf and some value above -inf. One pass over the row; torch's argmax takes about 10x as long here.
std::vector<torch::Tensor> greedy_argmax(torch::Tensor logits) {
  check_f32(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits must be [N, V] with V > 0");
  const int64_t N = logits.size(0), V = logits.size(1);
  auto tokens = torch::empty({N}, logits.options().dtype(torch::kInt64));
  auto finite = torch::empty({N}, logits.options().dtype(torch::kBool));
  const float* lp = logits.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  bool* fp = finite.data_ptr<bool>();
  const float big = std::numeric_limits<float>::max(), ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / V), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* row = lp + n * V;
      float best = ninf;
      int64_t at = 0, i = 0;
      bool nan = false, pinf = false;
#ifdef MS_AVX2
      // 8 lanes: lane l keeps the first maximum among elements i = l (mod 8), then the lanes are merged.
      __m256 bv = _mm256_set1_ps(ninf), flags_nan = _mm256_setzero_ps(), flags_inf = _mm256_setzero_ps();
      __m256i bi = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256 vbig = _mm256_set1_ps(big), vninf = _mm256_set1_ps(ninf), vpinf = _mm256_set1_ps(-ninf);
      const __m256i step = _mm256_set1_epi32(8);
      if (V < (int64_t(1) << 31)) {
        for (; i + 8 <= V; i += 8) {
          const __m256 v = _mm256_loadu_ps(row + i);
          const __m256 isnan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q), isinf = _mm256_cmp_ps(v, vpinf, _CMP_EQ_OQ);
          flags_nan = _mm256_or_ps(flags_nan, isnan);
          flags_inf = _mm256_or_ps(flags_inf, isinf);
          const __m256 sv = _mm256_blendv_ps(_mm256_min_ps(v, vbig), vninf, isnan);  // NaN -> -inf, +inf -> max
          const __m256 gt = _mm256_cmp_ps(sv, bv, _CMP_GT_OQ);
          bv = _mm256_blendv_ps(bv, sv, gt);
          bi = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(bi), _mm256_castsi256_ps(idx), gt));
          idx = _mm256_add_epi32(idx, step);
        }
        alignas(32) float lv[8];
        alignas(32) int32_t li[8];
        _mm256_store_ps(lv, bv);
        _mm256_store_si256(reinterpret_cast<__m256i*>(li), bi);
        for (int l = 0; l < 8; l++)
          if (lv[l] > best || (lv[l] == best && li[l] < at && lv[l] > ninf)) { best = lv[l]; at = li[l]; }
        nan = _mm256_movemask_ps(flags_nan) != 0;
        pinf = _mm256_movemask_ps(flags_inf) != 0;
      }
#endif
      for (; i < V; ++i) {
        const float v = row[i];
        if (std::isnan(v)) { nan = true; continue; }
        if (v == -ninf) pinf = true;
        const float sv = std::min(v, big);
        if (sv > best) { best = sv; at = i; }
      }
      tp[n] = at;
      fp[n] = !nan && !pinf && best > ninf;
    }
  });
  return {tokens, finite};
}

namespace {

// The exponential race of sample(): the first i maximising value(i) / clamp(noise[i], lo, hi) over [0, V), value(i)
// >= 0. The same floats as torch (an IEEE division each) and torch.argmax's first index on ties: each of LANES lanes
// keeps the first maximum of its residue class (vectorised), then the lanes merge, the lower index on ties.
template <class Value>
int64_t race(Value value, const float* noise, int64_t V, float lo, float hi) {
  float bv[LANES];
  int32_t bi[LANES];
  for (int32_t l = 0; l < LANES; ++l) {
    bv[l] = -1.0f;
    bi[l] = l;
  }
  int64_t i = 0;
  for (; i + LANES <= V; i += LANES)
    for (int32_t l = 0; l < LANES; ++l) {
      const float s = value(i + l) / std::min(std::max(noise[i + l], lo), hi);
      const bool gt = s > bv[l];
      bv[l] = gt ? s : bv[l];
      bi[l] = gt ? static_cast<int32_t>(i) + l : bi[l];
    }
  float best = -1.0f;
  int64_t at = 0;
  for (int32_t l = 0; l < LANES && l < V; ++l)
    if (bv[l] > best || (bv[l] == best && bi[l] < at)) {
      best = bv[l];
      at = bi[l];
    }
  for (; i < V; ++i) {  // past every lane's indices: a strict > keeps the first maximum
    const float s = value(i) / std::min(std::max(noise[i], lo), hi);
    if (s > best) {
      best = s;
      at = i;
    }
  }
  return at;
}

}  // namespace

namespace {

// Output j of SplitMix64 started at state `seed` (Steele et al., 2014): a counter-based generator, so a row's draws
// vectorise and depend on (seed, j) alone.
inline uint64_t splitmix64(uint64_t seed, uint64_t j) {
  uint64_t z = seed + (j + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// -log(u) for u in (0, 1], relative error below 1e-12 (far under float32's): u = m 2^e with m in [sqrt(1/2),
// sqrt(2)), log m = 2 atanh(s), s = (m - 1) / (m + 1), by its series to s^13. No libm call, so loops vectorise.
inline double neg_log(double u) {
  uint64_t bits;
  std::memcpy(&bits, &u, sizeof(bits));
  double e = static_cast<double>(static_cast<int64_t>(bits >> 52)) - 1023.0;
  bits = (bits & 0x000FFFFFFFFFFFFFull) | 0x3FF0000000000000ull;
  double m;
  std::memcpy(&m, &bits, sizeof(m));
  const bool high = m > 1.4142135623730951;
  m = high ? 0.5 * m : m;
  e = high ? e + 1.0 : e;
  const double s = (m - 1.0) / (m + 1.0), z = s * s;
  double p = 1.0 / 13;
  p = p * z + 1.0 / 11;
  p = p * z + 1.0 / 9;
  p = p * z + 1.0 / 7;
  p = p * z + 1.0 / 5;
  p = p * z + 1.0 / 3;
  p = p * z + 1.0;
  return -(e * 0.6931471805599453 + 2.0 * s * p);
}

}  // namespace

// Exp(1) noise [N, V] float32: row n, entry j is -log(u) with u = (k + 1) 2^-53, k the top 53 bits of SplitMix64
// output j from state seeds[n] (int64, read as uint64). u = 1 (an Exp draw of 0, which wins any exponential race)
// has probability 2^-53. sample/random.py's exp_noise_numpy is the same computation in numpy.
torch::Tensor exp_noise(torch::Tensor seeds, int64_t vocab) {
  TORCH_CHECK(seeds.scalar_type() == torch::kInt64 && seeds.dim() == 1 && seeds.is_contiguous() && vocab > 0,
              "exp_noise: seeds must be [N] int64 and vocab > 0");
  const int64_t N = seeds.size(0);
  auto out = torch::empty({N, vocab}, seeds.options().dtype(torch::kFloat32));
  const int64_t* sp = seeds.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  constexpr int64_t CHUNK = 4096;  // entries per unit of work: a row's draws depend on (seed, j) alone, so they split
  const int64_t chunks = (vocab + CHUNK - 1) / CHUNK;
  at::parallel_for(0, N * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t n = c / chunks, j0 = (c % chunks) * CHUNK, j1 = std::min(vocab, j0 + CHUNK);
      const uint64_t seed = static_cast<uint64_t>(sp[n]);
      float* row = op + n * vocab;
      for (int64_t j = j0; j < j1; ++j) {
        const uint64_t k = splitmix64(seed, static_cast<uint64_t>(j)) >> 11;
        row[j] = static_cast<float>(neg_log(static_cast<double>(static_cast<int64_t>(k + 1)) * 0x1.0p-53));
      }
    }
  });
  return out;
}

// softmax(logits[n] / temperature[n]) of each row [N, V] (temperature > 0), and ok [N]: false for a row holding NaN
// or +inf or nothing above -inf, whose probabilities are left unwritten (sampler.probs_from_logits takes those).
// The division is torch's (IEEE), and so is d = l / t - max in float32; exp is exp_f32 (about 1 ulp), 0 where
// d < -87 (-inf logits get exactly 0); the sum runs in LANES float64 partial sums. Within a few float32 ulps of the
// float64 softmax of those float32 d (torch's own float32 sums drift from it by up to 6e-6 over a 49k row on AVX2).
std::vector<torch::Tensor> temperature_softmax(torch::Tensor logits, torch::Tensor temperature) {
  check_f32(logits, "logits");
  check_f32(temperature, "temperature");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && temperature.dim() == 1 &&
                  temperature.size(0) == logits.size(0), "temperature_softmax: logits [N, V] and temperature [N]");
  const int64_t N = logits.size(0), V = logits.size(1);
  auto probs = torch::empty_like(logits);
  auto ok = torch::empty({N}, logits.options().dtype(torch::kBool));
  const float *lp = logits.data_ptr<float>(), *tp = temperature.data_ptr<float>();
  float* pp = probs.data_ptr<float>();
  bool* okp = ok.data_ptr<bool>();
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / V), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* row = lp + n * V;
      float* out = pp + n * V;
      const float t = tp[n];
      float mx[LANES], bad[LANES];
      for (int64_t l = 0; l < LANES; ++l) mx[l] = ninf, bad[l] = 0.0f;
      int64_t i = 0;
      for (; i + LANES <= V; i += LANES)
        for (int64_t l = 0; l < LANES; ++l) {
          const float v = row[i + l];
          bad[l] = (v != v || v == -ninf) ? 1.0f : bad[l];
          mx[l] = v > mx[l] ? v : mx[l];
        }
      float m = ninf;
      bool is_bad = false;
      for (int64_t l = 0; l < LANES; ++l) m = std::max(m, mx[l]), is_bad |= bad[l] != 0.0f;
      for (; i < V; ++i) {
        const float v = row[i];
        is_bad |= v != v || v == -ninf;
        m = std::max(m, v);
      }
      const float mt = m / t;  // max(l / t) = max(l) / t: a correctly rounded division by t > 0 is monotonic
      okp[n] = !is_bad && m > ninf && t > 0.0f && std::isfinite(mt);
      if (!okp[n]) continue;
      double acc[LANES] = {0};  // float64 sums: a float32 lane summing 3k terms of a 49k row drifts by 1e-6
      i = 0;
      for (; i + LANES <= V; i += LANES)
        for (int64_t l = 0; l < LANES; ++l) {
          const float d = row[i + l] / t - mt;
          const float e = d < -87.0f ? 0.0f : exp_f32(d);
          out[i + l] = e;
          acc[l] += e;
        }
      double sum = 0.0;
      for (; i < V; ++i) {
        const float d = row[i] / t - mt;
        out[i] = d < -87.0f ? 0.0f : exp_f32(d);
        sum += out[i];
      }
      for (int64_t l = 0; l < LANES; ++l) sum += acc[l];
      const float inv = static_cast<float>(1.0 / sum);
      for (i = 0; i < V; ++i) out[i] *= inv;
    }
  });
  return {probs, ok};
}

// probs [N, V], noise [N, V] (Exp(1) draws) -> tokens [N] int64: sampler.sample's argmax(probs / clamp(noise)).
torch::Tensor exp_race(torch::Tensor probs, torch::Tensor noise, double noise_min, double noise_max) {
  check_f32(probs, "probs");
  check_f32(noise, "noise");
  TORCH_CHECK(probs.dim() == 2 && probs.sizes() == noise.sizes() && probs.size(1) > 0 && probs.size(1) < (int64_t(1) << 31),
              "exp_race: probs and noise must both be [N, V] with 0 < V < 2^31");
  const int64_t N = probs.size(0), V = probs.size(1);
  auto tokens = torch::empty({N}, probs.options().dtype(torch::kInt64));
  const float *pp = probs.data_ptr<float>(), *np = noise.data_ptr<float>();
  const float lo = static_cast<float>(noise_min), hi = static_cast<float>(noise_max);
  int64_t* tp = tokens.data_ptr<int64_t>();
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / V), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* row = pp + n * V;
      tp[n] = race([row](int64_t i) { return row[i]; }, np + n * V, V, lo, hi);
    }
  });
  return tokens;
}

// spec_decode/rejection_sampler.py's rejection_sample_ref on probabilities, one request at a time (its Triton kernel's
// walk): p, q [num_logits, V]; draft_tokens [num_logits] int64; stale [num_logits] bool or empty (none stale);
// cu_num_logits [num_reqs + 1] int64; uniforms [num_reqs, K] float32; noise [num_reqs, V]. Returns tokens
// [num_reqs, K + 1] (-1 padded) and num_sampled [num_reqs], equal to the reference's: the same float32 products,
// differences and divisions.
std::vector<torch::Tensor> rejection_sample_probs(torch::Tensor p, torch::Tensor q, torch::Tensor draft_tokens,
                                                  torch::Tensor stale, torch::Tensor cu_num_logits,
                                                  torch::Tensor uniforms, torch::Tensor noise, double noise_min,
                                                  double noise_max) {
  check_f32(p, "p");
  check_f32(q, "q");
  check_f32(uniforms, "uniforms");
  check_f32(noise, "noise");
  TORCH_CHECK(p.dim() == 2 && q.sizes() == p.sizes() && p.size(1) > 0 && p.size(1) < (int64_t(1) << 31),
              "rejection_sample_probs: p and q must both be [num_logits, V] with 0 < V < 2^31");
  const int64_t num_logits = p.size(0), V = p.size(1);
  TORCH_CHECK(uniforms.dim() == 2 && noise.dim() == 2 && noise.size(0) == uniforms.size(0) && noise.size(1) == V,
              "rejection_sample_probs: uniforms must be [num_reqs, K] and noise [num_reqs, V]");
  const int64_t num_reqs = uniforms.size(0), K = uniforms.size(1);
  TORCH_CHECK(cu_num_logits.scalar_type() == torch::kInt64 && cu_num_logits.is_contiguous() &&
                  cu_num_logits.numel() == num_reqs + 1 && draft_tokens.scalar_type() == torch::kInt64 &&
                  draft_tokens.is_contiguous() && draft_tokens.numel() == num_logits,
              "rejection_sample_probs: cu_num_logits [num_reqs + 1] and draft_tokens [num_logits] must be int64");
  const bool has_stale = stale.numel() > 0;
  TORCH_CHECK(!has_stale || (stale.scalar_type() == torch::kBool && stale.is_contiguous() &&
                             stale.numel() == num_logits), "rejection_sample_probs: stale must be [num_logits] bool");
  const int64_t* cu = cu_num_logits.data_ptr<int64_t>();
  TORCH_CHECK(cu[0] == 0 && cu[num_reqs] == num_logits, "rejection_sample_probs: cu_num_logits must run 0 .. num_logits");
  for (int64_t r = 0; r < num_reqs; ++r)
    TORCH_CHECK(cu[r + 1] > cu[r] && cu[r + 1] - cu[r] - 1 <= K,
                "rejection_sample_probs: every request needs 1 to K + 1 logits positions");
  auto tokens = torch::full({num_reqs, K + 1}, -1, p.options().dtype(torch::kInt64));
  auto num_sampled = torch::empty({num_reqs}, p.options().dtype(torch::kInt64));
  const float *pp = p.data_ptr<float>(), *qp = q.data_ptr<float>(), *up = uniforms.data_ptr<float>(),
              *np = noise.data_ptr<float>();
  const int64_t* dp = draft_tokens.data_ptr<int64_t>();
  const bool* sp = has_stale ? stale.data_ptr<bool>() : nullptr;
  int64_t *tp = tokens.data_ptr<int64_t>(), *ns = num_sampled.data_ptr<int64_t>();
  const float lo = static_cast<float>(noise_min), hi = static_cast<float>(noise_max);
  at::parallel_for(0, num_reqs, std::max<int64_t>(1, 65536 / V), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t start = cu[r], num_drafts = cu[r + 1] - start - 1;
      int64_t n = 0;
      bool final_ok = false;  // the first rejected draft was valid: draw from the residual
      for (; n < num_drafts; ++n) {
        const int64_t j = start + n, d = dp[j];
        const bool ok = d >= 0 && d < V && !(sp != nullptr && sp[j]);
        if (ok && up[r * K + n] * qp[j * V + d] < pp[j * V + d]) {
          tp[r * (K + 1) + n] = d;
          continue;
        }
        final_ok = ok;
        break;
      }
      const float* pf = pp + (start + n) * V;
      const float* qf = qp + (start + n) * V;
      bool has_resid = false;
      if (final_ok)
        for (int64_t i = 0; i < V && !has_resid; ++i) has_resid = pf[i] - qf[i] > 0.0f;
      const int64_t token = has_resid ? race([pf, qf](int64_t i) { return std::max(pf[i] - qf[i], 0.0f); }, np + r * V, V, lo, hi)
                                      : race([pf](int64_t i) { return pf[i]; }, np + r * V, V, lo, hi);
      tp[r * (K + 1) + n] = token;
      ns[r] = n + 1;
    }
  });
  return {tokens, num_sampled};
}

// gate_up [N, 2 I] (gate | up) -> silu(gate) * up [N, I].
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_f32(gate_up, "gate_up");
  const int64_t I2 = gate_up.size(-1), N = gate_up.numel() / I2, I = I2 / 2;
  TORCH_CHECK(I2 % 2 == 0, "gate_up's last dim must be even");
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, gate_up.options());
  const float* gu = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, grain(I2), [&](int64_t begin, int64_t end) { silu_mul_rows(gu, I, begin, end, 0, I, op); });
  return out;
}

void silu_mul_rows(const float* gate_up, int64_t I, int64_t begin, int64_t end, int64_t c0, int64_t c1, float* out) {
  for (int64_t n = begin; n < end; ++n) {
    const float* g = gate_up + n * 2 * I;
    const float* u = g + I;
    float* o = out + n * I;
    for (int64_t i = c0; i < c1; ++i) o[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
  }
}

// One layer's attention for short queries, in one call:
//  1. rotate q and k of every token by its (cos, sin) pairs (interleaved layout, layers/rotary.py),
//     q in place in qkv, k straight into the cache; copy v into the cache. Token t writes cache row
//     write_index[t] (= slot * max_len + position).
//  2. each token's n_heads queries attend over keys 0..positions[t] of its request's slot
//     read_slots[t / L] (key 0 always: padded tokens sit at position 0), softmax(q.k * scale) v;
//     query head h reads KV head h / (n_heads / n_kv_heads).
// qkv [T, (n_heads + 2 n_kv_heads) * head_dim], cos_sin [T, head_dim / 2, 2], caches
// [num_slots + 1, max_len, n_kv_heads, head_dim], write_index / positions [T], read_slots [T / L]
// int64. Returns [T, n_heads * head_dim].
torch::Tensor rope_cache_attend(torch::Tensor qkv, torch::Tensor cos_sin, torch::Tensor k_cache,
                                torch::Tensor v_cache, torch::Tensor write_index, torch::Tensor positions,
                                torch::Tensor read_slots, int64_t n_heads, int64_t n_kv_heads, double scale) {
  check_f32(qkv, "qkv");
  const Attention a = attention_args(cos_sin, k_cache, v_cache, write_index, positions, read_slots, n_heads,
                                     n_kv_heads, scale);
  TORCH_CHECK(qkv.numel() == a.T * a.width, "qkv has the wrong size");
  float* q = qkv.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  a.rope(q, kc, vc);
  auto out = torch::empty({a.T, n_heads * a.hd}, qkv.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, a.units(), a.grain(), [&](int64_t begin, int64_t end) { a.attend(q, kc, vc, begin, end, op); });
  return out;
}

Attention attention_args(const torch::Tensor& cos_sin, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                         const torch::Tensor& write_index, const torch::Tensor& positions,
                         const torch::Tensor& read_slots, int64_t n_heads, int64_t n_kv_heads, double scale) {
  check_f32(cos_sin, "cos_sin");
  check_f32(k_cache, "k_cache");
  check_f32(v_cache, "v_cache");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && k_cache.dim() == 4, "k_cache and v_cache must be the same [S, L, h, d]");
  for (const auto* t : {&write_index, &positions, &read_slots})
    TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous() && t->device().is_cpu(),
                "indices must be contiguous int64 CPU tensors");
  Attention a;
  a.hd = k_cache.size(3);
  a.max_len = k_cache.size(1);
  a.slots = k_cache.size(0);
  a.T = positions.numel();
  a.B = read_slots.numel();
  TORCH_CHECK(a.B > 0 && a.T % a.B == 0 && write_index.numel() == a.T, "T must be a multiple of B");
  TORCH_CHECK(n_kv_heads > 0 && k_cache.size(2) == n_kv_heads && n_heads % n_kv_heads == 0 && a.hd % 2 == 0,
              "bad head counts");
  TORCH_CHECK(cos_sin.numel() == a.T * a.hd, "cos_sin has the wrong size");
  a.L = a.T / a.B;
  a.n_heads = n_heads;
  a.n_kv_heads = n_kv_heads;
  a.g = n_heads / n_kv_heads;
  a.width = (n_heads + 2 * n_kv_heads) * a.hd;
  a.kv_row = n_kv_heads * a.hd;
  a.cs = cos_sin.data_ptr<float>();
  a.wi = write_index.data_ptr<int64_t>();
  a.pos = positions.data_ptr<int64_t>();
  a.rs = read_slots.data_ptr<int64_t>();
  a.scale = static_cast<float>(scale);
  const int64_t rows = a.slots * a.max_len;
  a.max_keys = 1;
  for (int64_t t = 0; t < a.T; ++t) {
    TORCH_CHECK(a.wi[t] >= 0 && a.wi[t] < rows, "write_index out of range");
    TORCH_CHECK(a.pos[t] >= 0 && a.pos[t] < a.max_len, "position out of range");
    a.max_keys = std::max(a.max_keys, a.pos[t] + 1);
  }
  for (int64_t b = 0; b < a.B; ++b) TORCH_CHECK(a.rs[b] >= 0 && a.rs[b] < a.slots, "read slot out of range");
#ifdef MS_AVX2
  a.grouped = a.hd % 8 == 0;
#else
  a.grouped = false;
#endif
  return a;
}

int64_t Attention::units() const { return grouped ? T * n_kv_heads : T * n_heads; }

int64_t Attention::grain() const {
  return std::max<int64_t>(1, 32768 / ((grouped ? g : 1) * max_keys * hd));
}

void Attention::rope(float* q, float* kc, float* vc) const {
  const int64_t half = hd / 2;
  for (int64_t t = 0; t < T; ++t) {
    float* row = q + t * width;
    const float* c = cs + t * hd;
    float* k_dst = kc + wi[t] * kv_row;
    for (int64_t h = 0; h < n_heads + n_kv_heads; ++h) {
      float* src = row + h * hd;
      float* dst = h < n_heads ? src : k_dst + (h - n_heads) * hd;
      for (int64_t i = 0; i < half; ++i) {
        const float a = src[2 * i], b = src[2 * i + 1], cos = c[2 * i], sin = c[2 * i + 1];
        dst[2 * i] = a * cos - b * sin;
        dst[2 * i + 1] = a * sin + b * cos;
      }
    }
    std::memcpy(vc + wi[t] * kv_row, row + (n_heads + n_kv_heads) * hd, kv_row * sizeof(float));
  }
}

void Attention::attend(const float* q, const float* kc, const float* vc, int64_t begin, int64_t end,
                       float* op) const {
#ifdef MS_AVX2
  if (grouped) {  // one unit = one token's KV head and its g query heads, up to 4 of them a pass
    std::vector<float> p(std::min<int64_t>(g, 4) * max_keys);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t t = u / n_kv_heads, kvh = u % n_kv_heads;
      const int64_t base = (rs[t / L] * max_len) * kv_row + kvh * hd;
      for (int64_t h0 = kvh * g; h0 < (kvh + 1) * g; h0 += 4) {
        const float* qg = q + t * width + h0 * hd;
        float* og = op + t * n_heads * hd + h0 * hd;
        switch (std::min<int64_t>(4, (kvh + 1) * g - h0)) {
          case 1: attend_group<1>(qg, kc + base, vc + base, kv_row, pos[t] + 1, hd, scale, p.data(), og); break;
          case 2: attend_group<2>(qg, kc + base, vc + base, kv_row, pos[t] + 1, hd, scale, p.data(), og); break;
          case 3: attend_group<3>(qg, kc + base, vc + base, kv_row, pos[t] + 1, hd, scale, p.data(), og); break;
          default: attend_group<4>(qg, kc + base, vc + base, kv_row, pos[t] + 1, hd, scale, p.data(), og);
        }
      }
    }
    return;
  }
#endif
  // The portable path: one unit = one token's query head (over its KV head h / g).
  std::vector<float> p(max_keys);
  for (int64_t u = begin; u < end; ++u) {
    const int64_t t = u / n_heads, h = u % n_heads, kvh = h / g;
    const int64_t base = (rs[t / L] * max_len) * kv_row + kvh * hd;
    attend_head(q + t * width + h * hd, kc + base, vc + base, kv_row, pos[t] + 1, hd, scale, p.data(),
                op + t * n_heads * hd + h * hd);
  }
}
