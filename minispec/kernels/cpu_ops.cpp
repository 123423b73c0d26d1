// Every decoder layer of a Llama-family model in one call, for the short forwards of decode and
// verification on CPU (tp = 1, float32); an EAGLE-3 head's forward in one call; and the bindings of all CPU kernels. The layer is the one
// models/llama.py runs op by op (LlamaDecoderLayer.forward): the same kernels in the same order, so
// the results are the same floats; only the Python between the ops is gone.
#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

// x [T, K] @ weight i ^T (+ bias i), as layers/quant.py's linear computes it: qtype F32 = a dense
// float32 [N, K] weight (dense_linear), else GGUF-packed rows; then the bias.
torch::Tensor layer_linear(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                           const std::vector<int64_t>& qtypes, const std::vector<torch::Tensor>& biases, size_t i) {
  const bool has_bias = biases[i].numel() > 0;
  if (qtypes[i] == F32) return dense_linear(x, weights[i], has_bias ? c10::optional<torch::Tensor>(biases[i]) : c10::nullopt);
  torch::Tensor y = packed_linear(x, weights[i], qtypes[i], x.size(1));
  return has_bias ? y.add_(biases[i]) : y;
}

// Rows [begin, end) of [0, n) that thread tid of nt takes, as at::parallel_for shares n with this grain.
std::pair<int64_t, int64_t> share(int64_t n, int64_t grain, int tid, int nt) {
  const int64_t used = std::max<int64_t>(1, std::min<int64_t>(nt, (n + grain - 1) / grain));
  const int64_t chunk = (n + used - 1) / used, begin = std::min(n, tid * chunk);
  return {begin, std::min(n, begin + chunk)};
}

void barrier() {
#pragma omp barrier
}

int64_t region_runs = 0;  // decode_layers calls that ran in one region (tests read it: the region did run)

// decode_layers in one parallel region: every thread runs every layer, taking its share of each matrix's rows, of the
// attention's units and of silu's columns, with a barrier where the next op reads what all wrote (7 a layer: after
// qkv, the rotation, the attention, o, gate|up, silu and down), where op by op each op forks and joins its own threads
// and allocates its output. Each thread keeps its own copy of the residual stream and the normed input (the same
// floats in every thread). Only the splits differ from op by op, and no value depends on them: the same floats.
// Returns an undefined tensor where it does not apply (a weight that the range kernels do not take at T rows, or
// MINISPEC_LAYERS_OP_BY_OP=1 to compare the two); decode_layers then runs op by op.
torch::Tensor layers_in_one_region(torch::Tensor h, const std::vector<torch::Tensor>& weights,
                                   const std::vector<int64_t>& qtypes, const std::vector<torch::Tensor>& biases,
                                   const std::vector<torch::Tensor>& norms, const std::vector<torch::Tensor>& k_caches,
                                   const std::vector<torch::Tensor>& v_caches, const Attention& a, double eps,
                                   const std::vector<int64_t>& capture, torch::Tensor captured) {
  const char* off = std::getenv("MINISPEC_LAYERS_OP_BY_OP");
  if (off && *off && std::strcmp(off, "0") != 0) return {};
  const size_t layers = k_caches.size();
  const int64_t T = h.size(0), H = h.size(1), A = a.n_heads * a.hd, I = weights[2].size(0) / 2;
  const int64_t Ks[4] = {H, A, H, I}, Ns[4] = {a.width, H, 2 * I, H};  // qkv, o, gate|up, down
  auto f32 = [](const torch::Tensor& t) { return t.scalar_type() == torch::kFloat && t.is_contiguous() && t.device().is_cpu(); };
  if (!f32(h) || a.T != T || (!capture.empty() && !f32(captured))) return {};
  for (size_t i = 0; i < weights.size(); i++) {
    const torch::Tensor& w = weights[i];
    const int64_t K = Ks[i % 4], N = Ns[i % 4];
    const BlockFormat f = block_format(qtypes[i]);
    const bool ok = qtypes[i] == F32 ? dense_range_takes(T) && f32(w) && w.dim() == 2 && w.size(0) == N && w.size(1) == K
                                     : packed_range_takes(qtypes[i], T, K) && w.scalar_type() == torch::kUInt8 &&
                                           w.is_contiguous() && w.dim() == 2 && w.size(0) == N &&
                                           w.size(1) == K / f.values * f.bytes;
    if (!ok || (biases[i].numel() > 0 && !(f32(biases[i]) && biases[i].numel() == N))) return {};
  }
  for (const torch::Tensor& n : norms)
    if (!f32(n) || n.numel() != H) return {};
  for (size_t l = 0; l < layers; l++)
    if (!f32(k_caches[l]) || !f32(v_caches[l]) || k_caches[l].sizes() != k_caches[0].sizes() ||
        v_caches[l].sizes() != k_caches[0].sizes())
      return {};
  std::vector<const void*> wp;
  std::vector<const float*> bp, np;
  std::vector<float*> kc, vc;
  for (size_t i = 0; i < weights.size(); i++) {
    wp.push_back(weights[i].data_ptr());
    bp.push_back(biases[i].numel() > 0 ? biases[i].data_ptr<float>() : nullptr);
  }
  for (const torch::Tensor& n : norms) np.push_back(n.data_ptr<float>());
  for (size_t l = 0; l < layers; l++) {
    kc.push_back(k_caches[l].data_ptr<float>());
    vc.push_back(v_caches[l].data_ptr<float>());
  }
  // What the threads share: each op's output, [T, width] qkv, [T, A] attention, [T, H] o, [T, 2 I] gate|up, [T, I]
  // silu, [T, H] down; and the result.
  // Each starts 64-byte aligned (whole cache lines apart: the kernels' loads then never cross one).
  auto lines = [](int64_t floats) { return (floats + 15) / 16 * 16; };
  const int64_t sizes[6] = {T * a.width, T * A, T * H, T * 2 * I, T * I, T * H};
  int64_t total = 0;
  for (int64_t n : sizes) total += lines(n);
  torch::Tensor shared = torch::empty({total}, h.options());
  float* qkv = shared.data_ptr<float>();
  float* attn = qkv + lines(sizes[0]);
  float* o = attn + lines(sizes[1]);
  float* gu = o + lines(sizes[2]);
  float* act = gu + lines(sizes[3]);
  float* mlp = act + lines(sizes[4]);
  torch::Tensor out = torch::empty({T, H}, h.options());
  float *op = out.data_ptr<float>(), *hp = h.data_ptr<float>();
  float* cap = capture.empty() ? nullptr : captured.data_ptr<float>();
  const int64_t C = capture.size();
  auto run = [&](int tid, int nt) {
    float* res = thread_scratch<float>(2 * lines(T * H));  // this thread's residual stream, then its normed input
    float* x = res + lines(T * H);
    std::memcpy(res, hp, T * H * sizeof(float));
    PackedInput in;
    auto sync = [&] {
      if (nt > 1) barrier();
    };
    auto keep = [&](size_t l, const float* stream) {
      if (tid != 0) return;
      for (int64_t c = 0; c < C; c++)
        if (capture[c] == static_cast<int64_t>(l))
          for (int64_t t = 0; t < T; t++) std::memcpy(cap + (t * C + c) * H, stream + t * H, H * sizeof(float));
    };
    auto linear = [&](size_t i, const float* xi, float* y) {  // this thread's rows of y [T, N] = xi [T, K] W_i^T + b_i
      const int64_t K = Ks[i % 4], N = Ns[i % 4];
      const auto [begin, end] = share(N, 16, tid, nt);
      if (begin >= end) return;
      if (qtypes[i] == F32) {
        dense_range(xi, T, K, static_cast<const float*>(wp[i]), begin, end, y, N);
      } else {
        prepare_packed(in, xi, T, K, qtypes[i]);
        packed_range(in, static_cast<const uint8_t*>(wp[i]), weights[i].stride(0), qtypes[i], K, begin, end, y, N);
      }
      if (bp[i])
        for (int64_t t = 0; t < T; t++)
          for (int64_t n = begin; n < end; n++) y[t * N + n] += bp[i][n];
    };
    keep(0, hp);
    rms_norm_rows(res, nullptr, np[0], eps, x, 0, T, H);
    for (size_t l = 0; l < layers; l++) {
      if (l > 0) {
        rms_norm_rows(mlp, res, np[2 * l], eps, x, 0, T, H);
        keep(l, res);
      }
      linear(4 * l, x, qkv);
      sync();
      if (tid == 0) a.rope(qkv, kc[l], vc[l]);
      sync();
      const auto [u0, u1] = share(a.units(), a.grain(), tid, nt);
      if (u0 < u1) a.attend(qkv, kc[l], vc[l], u0, u1, attn);
      sync();
      linear(4 * l + 1, attn, o);
      sync();
      rms_norm_rows(o, res, np[2 * l + 1], eps, x, 0, T, H);
      linear(4 * l + 2, x, gu);
      sync();
      const auto [c0, c1] = share(I, 256, tid, nt);
      if (c0 < c1) silu_mul_rows(gu, I, 0, T, c0, c1, act);
      sync();
      linear(4 * l + 3, act, mlp);
      sync();
    }
    if (tid == 0) {
      rms_norm_rows(mlp, res, np[2 * layers], eps, op, 0, T, H);
      keep(layers, op);
      std::memcpy(hp, res, T * H * sizeof(float));  // h ends as op by op leaves it: the residual stream
    }
  };
#ifdef _OPENMP
  if (at::get_num_threads() > 1 && !at::in_parallel_region()) {
#pragma omp parallel
    run(omp_get_thread_num(), omp_get_num_threads());
    region_runs++;
    return out;
  }
#endif
  run(0, 1);
  region_runs++;
  return out;
}

}  // namespace

// h [T, H]: the tokens' embeddings, consumed as the residual stream. Per layer l: weights and
// biases 4l..4l+3 are qkv, o, gate|up, down (an empty bias tensor: none), norms 2l and 2l + 1 the
// input and post-attention RMSNorm weights; norms[2 * layers] is the final norm. The attention
// arguments are rope_cache_attend's. captured [T, C * H] (or empty) receives the residual stream entering each
// layer capture[c] (capture[c] == layers: the final normed output) in columns c * H ..; models/llama.py
// LlamaForCausalLM.forward captures the same floats. Returns the final normed hidden states [T, H].
torch::Tensor decode_layers(torch::Tensor h, const std::vector<torch::Tensor>& weights,
                            const std::vector<int64_t>& qtypes, const std::vector<torch::Tensor>& biases,
                            const std::vector<torch::Tensor>& norms, const std::vector<torch::Tensor>& k_caches,
                            const std::vector<torch::Tensor>& v_caches, torch::Tensor cos_sin,
                            torch::Tensor write_index, torch::Tensor positions, torch::Tensor read_slots,
                            int64_t n_heads, int64_t n_kv_heads, double scale, double eps,
                            const std::vector<int64_t>& capture, torch::Tensor captured) {
  const size_t layers = k_caches.size();
  TORCH_CHECK(layers > 0 && v_caches.size() == layers && weights.size() == 4 * layers &&
                  qtypes.size() == weights.size() && biases.size() == weights.size() && norms.size() == 2 * layers + 1,
              "decode_layers: 4 weights, 4 biases, 2 norms and 2 caches per layer, and a final norm");
  TORCH_CHECK(h.dim() == 2, "decode_layers: h must be [T, H]");
  const int64_t H = h.size(1);
  TORCH_CHECK(capture.empty() || (captured.dim() == 2 && captured.size(0) == h.size(0) &&
                                  captured.size(1) == H * static_cast<int64_t>(capture.size())),
              "decode_layers: captured must be [T, len(capture) * H]");
  auto keep = [&](size_t l, const torch::Tensor& stream) {
    for (size_t c = 0; c < capture.size(); c++)
      if (capture[c] == static_cast<int64_t>(l)) captured.narrow(1, c * H, H).copy_(stream);
  };
  const Attention a = attention_args(cos_sin, k_caches[0], v_caches[0], write_index, positions, read_slots, n_heads,
                                     n_kv_heads, scale);
  torch::Tensor one = layers_in_one_region(h, weights, qtypes, biases, norms, k_caches, v_caches, a, eps, capture,
                                           captured);
  if (one.defined()) return one;
  keep(0, h);
  torch::Tensor residual = h;
  torch::Tensor x = add_rms_norm(h, c10::nullopt, norms[0], eps), mlp;
  for (size_t l = 0; l < layers; l++) {
    if (l > 0) {
      x = add_rms_norm(mlp, residual, norms[2 * l], eps);
      keep(l, residual);
    }
    const torch::Tensor qkv = layer_linear(x, weights, qtypes, biases, 4 * l);
    const torch::Tensor attn = rope_cache_attend(qkv, cos_sin, k_caches[l], v_caches[l], write_index, positions,
                                                 read_slots, n_heads, n_kv_heads, scale);
    x = add_rms_norm(layer_linear(attn, weights, qtypes, biases, 4 * l + 1), residual, norms[2 * l + 1], eps);
    mlp = layer_linear(silu_mul(layer_linear(x, weights, qtypes, biases, 4 * l + 2)), weights, qtypes, biases,
                       4 * l + 3);
  }
  torch::Tensor out = add_rms_norm(mlp, residual, norms[2 * layers], eps);
  keep(layers, out);
  return out;
}

// One EAGLE-3 head forward over a short batch, in one call: the steps models/eagle.py's InferenceWeights runs op by
// op (fuse, attention_input, the attention, layer_output, logits) with the same kernels as decode_layers. Token t
// feeds ids[t] (its embedding: row ids[t] of embed, packed as embed_qtype or dense float32 for F32) and
// feature [T, F]: the target's captured states when fuse (fc maps them to [T, H]), else the head's own output
// [T, H]. Weights 0..5 are fc, qkv, o, gate|up, down and the draft LM head (qtype F32: dense float32; an empty
// bias tensor: none); norms 0..3 the input, hidden, post-attention and final RMSNorm weights; the attention
// arguments are rope_cache_attend's. Only the tokens `last` [B] (int64 indices into T) go past the attention.
// Returns (draft-vocabulary logits [B, V_draft], pre-norm output [B, H]).
std::vector<torch::Tensor> head_layer(torch::Tensor ids, torch::Tensor feature, bool fuse, torch::Tensor embed,
                                      int64_t embed_qtype, const std::vector<torch::Tensor>& weights,
                                      const std::vector<int64_t>& qtypes, const std::vector<torch::Tensor>& biases,
                                      const std::vector<torch::Tensor>& norms, torch::Tensor k_cache,
                                      torch::Tensor v_cache, torch::Tensor cos_sin, torch::Tensor write_index,
                                      torch::Tensor positions, torch::Tensor read_slots, torch::Tensor last,
                                      int64_t n_heads, int64_t n_kv_heads, double scale, double eps) {
  TORCH_CHECK(weights.size() == 6 && qtypes.size() == 6 && biases.size() == 6 && norms.size() == 4,
              "head_layer: 6 weights and biases (fc, qkv, o, gate|up, down, lm_head) and 4 norms (input, hidden, "
              "post-attention, final)");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.dim() == 1 && feature.dim() == 2 &&
                  feature.size(0) == ids.size(0), "head_layer: ids must be [T] int64 and feature [T, F]");
  TORCH_CHECK(last.scalar_type() == torch::kInt64 && last.dim() == 1, "head_layer: last must be [B] int64");
  const int64_t H = norms[0].numel();
  const torch::Tensor emb = embed_qtype == F32 ? embed.index_select(0, ids) : packed_rows(embed, embed_qtype, H, ids);
  const torch::Tensor hidden = fuse ? layer_linear(feature, weights, qtypes, biases, 0) : feature;  // [T, H]
  const torch::Tensor x = torch::cat({add_rms_norm(emb, c10::nullopt, norms[0], eps),
                                      add_rms_norm(hidden, c10::nullopt, norms[1], eps)}, 1);  // [T, 2H]
  const torch::Tensor qkv = layer_linear(x, weights, qtypes, biases, 1);
  const torch::Tensor attn = rope_cache_attend(qkv, cos_sin, k_cache, v_cache, write_index, positions, read_slots,
                                               n_heads, n_kv_heads, scale).index_select(0, last);  // [B, nh * hd]
  torch::Tensor residual = hidden.index_select(0, last);  // [B, H], a copy: the adds below go into it
  const torch::Tensor h = add_rms_norm(layer_linear(attn, weights, qtypes, biases, 2), residual, norms[2], eps);
  const torch::Tensor mlp = layer_linear(silu_mul(layer_linear(h, weights, qtypes, biases, 3)), weights, qtypes,
                                         biases, 4);
  const torch::Tensor normed = add_rms_norm(mlp, residual, norms[3], eps);  // residual is now the pre-norm output
  return {layer_linear(normed, weights, qtypes, biases, 5), residual};
}

// An EAGLE-3 head's drafting steps in one call, what head_greedy and head_sampled share: step 0 is head_layer over the
// batch given (fuse on); step j >= 1 feeds request b, at one position each, the target id its step j - 1 drew, with
// the head's own output, at step_positions / step_write_index / step_cos_sin [B, steps - 1, ...] (the caller's:
// rope_cache_attend's arguments per step). draw(j, logits [B, V_draft]) gives (what step j reports per request [B],
// the target ids drawn [B], each draw's draft-vocabulary row [B] for the gate, or an undefined tensor where the draw
// is the argmax, whose probability is the largest), or an empty vector to give up (then so does this: the caller's
// loop runs).
// Request b stops drafting at step j unless (the product of its draws' probabilities before step j, in float64, as
// HeadProposer's loop multiplies them) times the head's largest probability at step j (torch's float32 softmax) is at
// least min_confidence; the steps end once every request has stopped. Returns (logits [S, B, V_draft], reports
// [S, B], drafting [S, B] bool) for the S <= steps steps run.
template <class Draw>
std::vector<torch::Tensor> head_steps(torch::Tensor ids, torch::Tensor feature, torch::Tensor embed,
                                      int64_t embed_qtype, const std::vector<torch::Tensor>& weights,
                                      const std::vector<int64_t>& qtypes, const std::vector<torch::Tensor>& biases,
                                      const std::vector<torch::Tensor>& norms, torch::Tensor k_cache,
                                      torch::Tensor v_cache, torch::Tensor cos_sin, torch::Tensor write_index,
                                      torch::Tensor positions, torch::Tensor read_slots, torch::Tensor last,
                                      int64_t n_heads, int64_t n_kv_heads, double scale, double eps, int64_t steps,
                                      double min_confidence, torch::Tensor step_cos_sin, torch::Tensor step_positions,
                                      torch::Tensor step_write_index, Draw&& draw) {
  const int64_t B = last.numel();
  TORCH_CHECK(steps >= 1, "head drafting: steps >= 1");
  TORCH_CHECK(step_positions.scalar_type() == torch::kInt64 && step_write_index.scalar_type() == torch::kInt64 &&
                  step_positions.dim() == 2 && step_positions.size(0) == B && step_positions.size(1) == steps - 1 &&
                  step_write_index.sizes() == step_positions.sizes() && step_cos_sin.size(0) == B &&
                  step_cos_sin.size(1) == steps - 1,
              "head drafting: step_positions, step_write_index and step_cos_sin must be [B, steps - 1, ...]");
  const torch::Tensor all_rows = torch::arange(B, last.options());
  std::vector<torch::Tensor> logits, reports, drafting;
  std::vector<double> confidence(B, 1.0);
  auto keep = torch::ones({B}, last.options().dtype(torch::kBool));
  bool* kp = keep.data_ptr<bool>();
  std::vector<torch::Tensor> r = head_layer(ids, feature, true, embed, embed_qtype, weights, qtypes, biases, norms,
                                            k_cache, v_cache, cos_sin, write_index, positions, read_slots, last,
                                            n_heads, n_kv_heads, scale, eps);
  for (int64_t j = 0;; j++) {
    const torch::Tensor lj = r[0];  // [B, V_draft]
    const std::vector<torch::Tensor> drawn = draw(j, lj);  // report, target ids, draft-vocabulary rows
    if (drawn.empty()) return {};
    logits.push_back(lj);
    reports.push_back(drawn[0]);
    if (min_confidence > 0) {
      const torch::Tensor probs = torch::softmax(lj, 1);  // [B, V_draft]
      const torch::Tensor top = probs.amax(1);  // [B] the law's largest probability, not the draw's
      const torch::Tensor own = drawn[2].defined() ? probs.index({all_rows, drawn[2]}).contiguous() : top;  // [B]
      const float* tp = top.data_ptr<float>();
      const float* op = own.data_ptr<float>();
      for (int64_t b = 0; b < B; b++) {
        kp[b] = kp[b] && confidence[b] * tp[b] >= min_confidence;
        confidence[b] *= op[b];
      }
    }
    drafting.push_back(keep.clone());
    if (j + 1 == steps || !keep.any().item<bool>()) break;
    r = head_layer(drawn[1], r[1], false, embed, embed_qtype, weights, qtypes, biases, norms, k_cache, v_cache,
                   step_cos_sin.select(1, j).contiguous(), step_write_index.select(1, j).contiguous(),
                   step_positions.select(1, j).contiguous(), read_slots, all_rows, n_heads, n_kv_heads, scale, eps);
  }
  return {torch::stack(logits), torch::stack(reports), torch::stack(drafting)};
}

// Greedy drafting with an EAGLE-3 head, every step in one call (head_steps): step j's draw is each request's argmax
// row (reported), fed as the target id draft_ids[row]. Returns (logits [S, B, V_draft], argmax rows [S, B] int64,
// drafting [S, B] bool).
std::vector<torch::Tensor> head_greedy(torch::Tensor ids, torch::Tensor feature, torch::Tensor embed,
                                       int64_t embed_qtype, const std::vector<torch::Tensor>& weights,
                                       const std::vector<int64_t>& qtypes, const std::vector<torch::Tensor>& biases,
                                       const std::vector<torch::Tensor>& norms, torch::Tensor k_cache,
                                       torch::Tensor v_cache, torch::Tensor cos_sin, torch::Tensor write_index,
                                       torch::Tensor positions, torch::Tensor read_slots, torch::Tensor last,
                                       int64_t n_heads, int64_t n_kv_heads, double scale, double eps, int64_t steps,
                                       torch::Tensor draft_ids, double min_confidence, torch::Tensor step_cos_sin,
                                       torch::Tensor step_positions, torch::Tensor step_write_index) {
  TORCH_CHECK(draft_ids.scalar_type() == torch::kInt64 && draft_ids.dim() == 1, "head_greedy: draft_ids [V_draft] int64");
  auto draw = [&](int64_t, const torch::Tensor& lj) -> std::vector<torch::Tensor> {
    const torch::Tensor row = greedy_argmax(lj)[0];  // [B]
    return {row, draft_ids.index_select(0, row), torch::Tensor()};
  };
  return head_steps(ids, feature, embed, embed_qtype, weights, qtypes, biases, norms, k_cache, v_cache, cos_sin,
                    write_index, positions, read_slots, last, n_heads, n_kv_heads, scale, eps, steps, min_confidence,
                    step_cos_sin, step_positions, step_write_index, draw);
}

// Sampled drafting with an EAGLE-3 head, every step in one call (head_steps), each step drawing its tokens as
// HeadProposer's loop does (proposer.draw_drafts over the draft logits put in the full vocabulary, -inf elsewhere;
// the plain-temperature case only): q = temperature_softmax(full, temperature); request b draws by inverse CDF with
// u[b, j] (torch's float32 cumsum and searchsorted, as sampler.sample_inverse_cdf), or, where it is one of the coupled
// rows, by exponential race with noise[j, i] (exp_race, as sampler.sample); the gate reads the drawn token's own
// probability (row draft_rows[token]); identity: the draft vocabulary is the full one, in order. Returns (logits
// [S, B, V_draft], tokens [S, B] target ids, drafting [S, B] bool), or nothing where a row of q is not a plain
// softmax (temperature_softmax's ok false: the loop takes it).
std::vector<torch::Tensor> head_sampled(torch::Tensor ids, torch::Tensor feature, torch::Tensor embed,
                                        int64_t embed_qtype, const std::vector<torch::Tensor>& weights,
                                        const std::vector<int64_t>& qtypes, const std::vector<torch::Tensor>& biases,
                                        const std::vector<torch::Tensor>& norms, torch::Tensor k_cache,
                                        torch::Tensor v_cache, torch::Tensor cos_sin, torch::Tensor write_index,
                                        torch::Tensor positions, torch::Tensor read_slots, torch::Tensor last,
                                        int64_t n_heads, int64_t n_kv_heads, double scale, double eps, int64_t steps,
                                        torch::Tensor draft_ids, bool identity, torch::Tensor draft_rows,
                                        int64_t vocab,
                                        double min_confidence, torch::Tensor step_cos_sin, torch::Tensor step_positions,
                                        torch::Tensor step_write_index, torch::Tensor temperature, torch::Tensor u,
                                        torch::Tensor coupled_rows, torch::Tensor noise, double noise_min,
                                        double noise_max) {
  const int64_t B = last.numel();
  TORCH_CHECK(draft_ids.scalar_type() == torch::kInt64 && draft_ids.dim() == 1 &&
                  draft_rows.scalar_type() == torch::kInt64 && draft_rows.numel() == vocab,
              "head_sampled: draft_ids [V_draft] and draft_rows [vocab] int64");
  TORCH_CHECK(temperature.numel() == B && u.dim() == 2 && u.size(0) == B && u.size(1) >= steps,
              "head_sampled: temperature [B] and u [B, >= steps]");
  TORCH_CHECK(coupled_rows.scalar_type() == torch::kInt64 && coupled_rows.dim() == 1 && noise.dim() == 3 &&
                  noise.size(1) == coupled_rows.numel() && (coupled_rows.numel() == 0 || noise.size(0) >= steps),
              "head_sampled: coupled_rows [m] int64 and noise [>= steps, m, vocab]");
  const int64_t m = coupled_rows.numel();
  torch::Tensor rest = torch::ones({B}, last.options().dtype(torch::kBool));  // the rows drawn by inverse CDF
  if (m) rest.index_fill_(0, coupled_rows, false);
  const torch::Tensor rest_rows = rest.nonzero().squeeze(1);  // [B - m]
  auto draw = [&](int64_t j, const torch::Tensor& lj) -> std::vector<torch::Tensor> {
    torch::Tensor full = lj;  // [B, vocab], -inf outside the draft vocabulary (HeadRunner.full_vocab)
    if (!identity) {
      full = torch::full({B, vocab}, -std::numeric_limits<float>::infinity(), lj.options());
      full.index_copy_(1, draft_ids, lj);
    }
    const std::vector<torch::Tensor> soft = temperature_softmax(full, temperature);
    if (!soft[1].all().item<bool>()) return {};
    const torch::Tensor& q = soft[0];  // [B, vocab]
    torch::Tensor tok = torch::empty({B}, last.options());
    if (rest_rows.numel()) {
      const torch::Tensor cdf = q.index_select(0, rest_rows).cumsum(1);
      const torch::Tensor ur = u.select(1, j).index_select(0, rest_rows);
      const torch::Tensor drawn = torch::searchsorted(cdf, (ur * cdf.select(1, vocab - 1)).unsqueeze(1), false, true)
                                      .squeeze(1).clamp_max_(vocab - 1);
      tok.index_copy_(0, rest_rows, drawn);
    }
    if (m) tok.index_copy_(0, coupled_rows, exp_race(q.index_select(0, coupled_rows).contiguous(),
                                                     noise.select(0, j).contiguous(), noise_min, noise_max));
    return {tok, tok, draft_rows.index_select(0, tok)};
  };
  return head_steps(ids, feature, embed, embed_qtype, weights, qtypes, biases, norms, k_cache, v_cache, cos_sin,
                    write_index, positions, read_slots, last, n_heads, n_kv_heads, scale, eps, steps, min_confidence,
                    step_cos_sin, step_positions, step_write_index, draw);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("PACKED_ISA") = PACKED_ISA;
  m.attr("PACKED_MAX_ROWS") = PACKED_MAX_ROWS;
  m.attr("PACKED_SPLIT") = PACKED_SPLIT;
  m.def("packed_rows", &packed_rows, "rows ids of a packed weight (any layout, tiled included), dequantised");
  m.def("packed_amx", &packed_amx, "whether packed_linear takes the AMX tiles (the tiled layout; 9+ rows of x in others)");
  m.def("packed_linear", &packed_linear, "x [M, K] f32 @ packed w [N, K]^T -> [M, N] f32");
  m.def("dense_linear", &dense_linear, py::arg("x"), py::arg("w"), py::arg("bias") = py::none(), "x [M, K] f32 @ w [N, K]^T f32 (+ bias) -> [M, N] f32 (each weight row read once for up to 16 rows)");
  m.def("block_formats", &block_formats, "[[GGML type id, bytes per block, values per block], ...]");
  m.def("packed_dequantize", &packed_dequantize, "packed w [N, K] -> f32 [N, K]");
  m.def("add_rms_norm", &add_rms_norm, "residual += x; RMSNorm(residual) (or RMSNorm(x) without a residual)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up over [.., gate | up]");
  m.def("greedy_argmax", &greedy_argmax, "(argmax, finite) of each row: NaN as -inf, +inf as the largest float");
  m.def("temperature_softmax", &temperature_softmax, "(softmax(logits / t) of each row, ok): ok false where a row is not finite");
  m.def("exp_noise", &exp_noise, "Exp(1) noise [N, V] float32 from one SplitMix64 state per row (counter-based)");
  m.def("exp_race", &exp_race, "argmax(probs / clamp(noise)) of each row, the first on ties: sampler.sample");
  m.def("rejection_sample_probs", &rejection_sample_probs,
        "rejection_sample_ref on probabilities: (tokens [num_reqs, K + 1], num_sampled [num_reqs])");
  m.def("rope_cache_attend", &rope_cache_attend, "RoPE, KV cache write and attention for short queries");
  m.def("decode_layers", &decode_layers, "every decoder layer over a short forward, in one call");
  m.def("region_runs", [] { return region_runs; }, "decode_layers calls so far that ran in one parallel region");
  m.def("head_layer", &head_layer, "an EAGLE-3 head's forward over a short batch, in one call");
  m.def("head_greedy", &head_greedy, "an EAGLE-3 head's greedy drafting steps, in one call");
  m.def("head_sampled", &head_sampled, "an EAGLE-3 head's sampled drafting steps, in one call");
}
