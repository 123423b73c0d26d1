"""Mutation check: deliberate bugs in the sampler, the draft-logits cache and the engine that the tests must catch.

    python scripts/mutants.py            # every mutant
    python scripts/mutants.py NAME ...   # some of them (--list names them)

Each mutant is one exact source edit (old text -> new text in one file) and the few tests that should catch it
(the kernel mutants are for the AVX-512 build; the AMX ones are listed only on a CPU with AMX).
The repository (tracked and untracked, not ignored files) is copied once to a temporary directory; each mutant
is applied there, its tests run (pytest -x -q, TRITON_INTERPRET=1), and the file is restored. The working
tree is never modified. A mutant is killed when its tests fail. Before anything runs, every edit must apply
exactly once: when the code has moved, the script stops with "mutation NAME no longer applies: ...", and the
mutant's old text (and its tests) must be re-pointed. The tests are first run on the unmutated copy, which
must pass. Prints one line per mutant, then "N/N mutants killed"; exits 0 only when every mutant is killed.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLER = "minispec/spec_decode/rejection_sampler.py"
ENGINE = "minispec/engine/engine.py"
REQUEST = "minispec/engine/request.py"

EXACT = ["tests/test_rejection_sampler.py", "-k", "exact_law and torch"]
EXACT_CPP = ("tests/test_rejection_sampler.py", "-k", "exact_law and cpp")
FUSED = "minispec/kernels/fused_cpu.cpp"
TRITON = ["tests/test_rejection_sampler.py", "-k", "probes_triton"]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest arguments: files, node ids, -k expressions


MUTANTS = [
    # ---- the rejection sampler: torch reference
    Mutant("ref: bonus token drawn from the residual norm(max(0, p - q))", SAMPLER,
           "    final_ok = ok.gather(1, num_accepted.unsqueeze(1))",
           "    final_ok = (ok | ~is_draft).gather(1, num_accepted.unsqueeze(1))", tuple(EXACT)),
    Mutant("ref: stale / -1 drafts replaced by a residual draw instead of a draw from p", SAMPLER,
           "    final_ok = ok.gather(1, num_accepted.unsqueeze(1))",
           "    final_ok = (ok | is_draft).gather(1, num_accepted.unsqueeze(1))", tuple(EXACT)),
    Mutant("ref: bonus token drawn from q", SAMPLER,
           "    pf = p[final_pos]  # [num_reqs, V]",
           "    pf = torch.where((num_accepted == num_pos - 1).unsqueeze(1), q[final_pos], p[final_pos])",
           tuple(EXACT)),
    Mutant("ref: accept when u * q <= 1.05 * p", SAMPLER,
           "    accepted = ok & (u * qd < pd)", "    accepted = ok & (u * qd <= 1.05 * pd)", tuple(EXACT)),
    Mutant("no-drafts shortcut: top-p left out of the target's law", SAMPLER,
           "    p = probs_from_logits(target_logits, temperature, top_k, top_p)  # [num_reqs, V]",
           "    p = probs_from_logits(target_logits, temperature, top_k, torch.ones_like(top_p))  # [num_reqs, V]",
           ("tests/test_lossless.py", "-k", "target_only_sampling and top_p")),
    # ---- the rejection sampler: Triton kernel (under TRITON_INTERPRET=1)
    Mutant("triton: bonus token drawn from the residual", SAMPLER,
           "    final_ok = tl.zeros([], dtype=tl.int32)", "    final_ok = tl.full([], 1, tl.int32)", tuple(TRITON)),
    Mutant("triton: stale / -1 drafts replaced by a residual draw", SAMPLER,
           "final_ok = tl.where(live & ~acc, ok.to(tl.int32), final_ok)",
           "final_ok = tl.where(live & ~acc, 1, final_ok)", tuple(TRITON)),
    Mutant("triton: bonus token drawn from q", SAMPLER,
           "        qv = tl.load(q_ptr + final_pos * V + cols, mask=m, other=0.0)\n",
           "        qv = tl.load(q_ptr + final_pos * V + cols, mask=m, other=0.0)\n"
           "        pv = tl.where(num_accepted == num_drafts, qv, pv)\n", tuple(TRITON)),
    Mutant("triton: accept when u * q <= 1.05 * p", SAMPLER,
           "acc = ok & (u * qd < pd)", "acc = ok & (u * qd <= 1.05 * pd)", tuple(TRITON)),
    # ---- the rejection sampler: C++ kernel (what runs on CPU; each mutant rebuilds the extension)
    Mutant("cpp: accept when u * q <= 1.05 * p", FUSED, "if (ok && up[r * K + n] * qp[j * V + d] < pp[j * V + d]) {",
           "if (ok && up[r * K + n] * qp[j * V + d] <= 1.05f * pp[j * V + d]) {", EXACT_CPP),
    Mutant("cpp: stale / -1 drafts replaced by a residual draw", FUSED, "        final_ok = ok;\n",
           "        final_ok = true;\n", EXACT_CPP),
    Mutant("cpp: every row's Exp(1) noise from the first row's seed", FUSED,
           "const uint64_t seed = static_cast<uint64_t>(sp[n]);", "const uint64_t seed = static_cast<uint64_t>(sp[0]);",
           ("tests/test_sampling.py", "-k", "exp_noise")),
    Mutant("cpp: attention's query group scored with its neighbour's query", FUSED,
           "qc[g] = _mm256_loadu_ps(q + g * hd + c);", "qc[g] = _mm256_loadu_ps(q + ((g + 1) % G) * hd + c);",
           ("tests/test_fused_cpu.py", "-k", "rope_cache_attend")),
    # ---- p and q
    Mutant("top-p applied to the target but not to q", SAMPLER,
           "probs_from_logits(draft_logits, t, k, p)", "probs_from_logits(draft_logits, t, k, torch.ones_like(p))",
           tuple(EXACT)),
    Mutant("tiny temperatures: logits / T overflows again", "minispec/sample/sampler.py",
           "    small = t < SHIFT_BELOW_T  # [N]", "    small = t < 0  # [N]",
           ("tests/test_sampling.py", "-k", "tiny")),
    # ---- the draft-logits cache
    Mutant("stale flags never set (torch)", "minispec/spec_decode/draft_logits.py",
           "    return reads_cache & ((row < 0) | (last_slot != slot))", "    return reads_cache & (row < -1)",
           ("tests/test_fuzz.py::test_stale_drafts_when_requests_take_turns[self-sharded]",)),
    Mutant("greedy acceptance does not stop at the first rejected draft", "minispec/spec_decode/rejection_sampler.py",
           "while start + n < last and drafts[start + n] >= 0 and drafts[start + n] == top[start + n]:",
           "while start + n < last and drafts[start + n] >= 0 and (drafts[start + n] == top[start + n] or n):",
           ("tests/test_rejection_sampler.py", "-k", "greedy")),
    Mutant("stale flags never set (Triton)", "minispec/spec_decode/draft_logits.py",
           "    stale = reads_cache & ((row < 0) | (last_slot != slot))", "    stale = reads_cache & (row < -1)",
           ("tests/test_draft_logits.py", "-k", "kernels_match_torch")),
    # ---- the engine
    Mutant("greedy requests: NaN logits never end them", ENGINE,
           "np.logical_or.reduceat(~finite.cpu().numpy()", "np.logical_or.reduceat(finite.cpu().numpy() & False",
           ("tests/test_engine.py::test_nan_logits_end_one_request_others_continue",)),
    Mutant("no KV rollback of the draft", REQUEST,
           "        self.num_draft_computed = min(self.num_draft_computed, self.num_computed)\n", "",
           ("tests/test_engine.py::test_draft_logits_are_the_draft_models_on_the_accepted_context",)),
    Mutant("no KV rollback of the target", REQUEST,
           "        self.num_computed = len(self.token_ids) + num_accepted",
           "        self.num_computed = len(self.token_ids) + self.num_drafts",
           ("tests/test_engine.py::test_speculative_greedy_equals_transformers",)),
    Mutant("length groups: no merging of unfused neighbours", "minispec/runner/model_runner.py",
           "            merged[-1] = both", "            merged.append(g)",
           ("tests/test_models.py::test_runner_splits_a_long_query_out_of_short_ones",)),
    # ---- prefix caching (engine/request.py's Scheduler)
    Mutant("prefix caching: the target's K/V left uncopied", ENGINE,
           "                self.target.kv.copy_prefix(c.src, c.dst, c.num_tokens)\n", "",
           ("tests/test_prefix_caching.py", "-k", "recomputed_output and None")),
    Mutant("prefix caching: the head's K/V left uncopied", "minispec/spec_decode/head.py",
           "        self.runner.kv.copy_prefix(src, dst, n)", "        pass",
           ("tests/test_prefix_caching.py", "-k", "head_drafts")),
    Mutant("prefix caching: the last shared token not fed again", REQUEST,
           "n = min(common_prefix(prompt, tokens) - 1, most, valid)",
           "n = min(common_prefix(prompt, tokens), most, valid)",
           ("tests/test_prefix_caching.py", "-k", "head_drafts")),
    Mutant("prefix caching: reused past the draft cache's length", REQUEST,
           "return min(req.num_computed, req.num_draft_computed) if self.draft_kv else req.num_computed",
           "return req.num_computed",
           ("tests/test_prefix_caching.py", "-k", "draft_cache")),
    Mutant("prefix caching: a newcomer never waits for a shared prefill", REQUEST,
           "common_prefix(prompt, r.prompt_token_ids) - 1 - n >= DEFER_MIN_TOKENS for r in self.running)",
           "common_prefix(prompt, r.prompt_token_ids) - 1 - n >= 10**9 for r in self.running)",
           ("tests/test_prefix_caching.py", "-k", "newcomers_wait")),
    Mutant("tokens emitted after a stop token (inside an accepted run)", ENGINE,
           "            if t in stops:\n", "            if t in stops and t == toks[-1]:\n",
           ("tests/test_engine.py::test_metrics_count_what_was_emitted",)),
    Mutant("metrics count accepted drafts that were never emitted", ENGINE,
           "                m.num_accepted_tokens += min(num_accepted, len(new))",
           "                m.num_accepted_tokens += num_accepted",
           ("tests/test_engine.py::test_metrics_count_what_was_emitted",)),
    Mutant("a self-draft on the target's KV cache rewrites the target's last computed position",
           "minispec/spec_decode/proposer.py",
           "                r.num_draft_computed = r.num_computed\n",
           "                r.num_draft_computed = max(r.num_computed - 1, 0)\n",
           ("tests/test_self_draft.py::test_full_self_draft_runs_on_the_target_kv_cache",
            "tests/test_self_draft.py::test_self_draft_sampling_matches_target_law")),
    Mutant("seeded sampled requests verified by the rejection sampler (k changes their tokens)",
           "minispec/sampling_params.py",
           "        return self.seed is not None and not self.greedy",
           "        return False",
           ("tests/test_engine.py::test_coupled_tokens_are_target_only_tokens",)),
    Mutant("coupled drafts drawn with the noise of the position after the one they guess",
           "minispec/spec_decode/proposer.py",
           "    rows = [reqs[i].random.position_noise(len(reqs[i].token_ids), num_steps, vocab) for i in idx]",
           "    rows = [reqs[i].random.position_noise(len(reqs[i].token_ids) + 1, num_steps, vocab) for i in idx]",
           ("tests/test_lossless.py::test_coupled_sampling_matches_target_law",)),
    Mutant("adaptive k: a probe's catch-up not priced", "minispec/spec_decode/adaptive.py",
           "        return pending * self.catch_up_cost(len(reqs)) / max(1, self.probe_every)",
           "        return 0.0 * pending", ("tests/test_playground.py", "-k", "catch_up")),
    # ---- the EAGLE head proposer
    Mutant("head: drafts drawn with mass outside the draft vocabulary, whose cached q is 0",
           "minispec/spec_decode/head.py",
           "                tok = draw_drafts(self.runner.full_vocab(logits, self.vocab_size), sampling, u[:, j], coupled[j])",
           "                tok = draw_drafts(self.runner.full_vocab(logits, self.vocab_size).nan_to_num(neginf=0.0), "
           "sampling, u[:, j], coupled[j])",
           ("tests/test_lossless.py::test_head_sampling_matches_target_law",)),
    Mutant("head: each position read with the token at it instead of the one after", "minispec/spec_decode/head.py",
           "            tokens.append(r.token_ids[start + 1 : n + 1])", "            tokens.append(r.token_ids[start : n])",
           ("tests/test_head.py::test_proposals_are_the_head_on_the_accepted_context",)),
    Mutant("head gate: a sampled draft cut for its own low probability (biases the draws)", "minispec/spec_decode/head.py",
           "                keep &= confidence * top >= self.min_confidence",
           "                keep &= confidence * probs[torch.arange(len(reqs)), torch.from_numpy(rows_j)].cpu().numpy()"
           " >= self.min_confidence",
           ("tests/test_lossless.py::test_head_sampling_matches_target_law[T=1,loop]",)),
    Mutant("head gate in C++ (head_sampled): a sampled draft cut for its own low probability (biases the draws)",
           "minispec/kernels/cpu_ops.cpp", "        kp[b] = kp[b] && confidence[b] * tp[b] >= min_confidence;",
           "        kp[b] = kp[b] && confidence[b] * op[b] >= min_confidence;",
           ("tests/test_lossless.py::test_head_sampling_matches_target_law[T=1]",)),
    Mutant("head gate: each draft judged alone, not with the drafts before it", "minispec/spec_decode/head.py",
           "                keep &= confidence * top >= self.min_confidence", "                keep = top >= self.min_confidence",
           ("tests/test_head.py", "-k", "confidence_gate")),
    Mutant("head gate in C++ (head_steps): each draft judged alone", "minispec/kernels/cpu_ops.cpp",
           "        kp[b] = kp[b] && confidence[b] * tp[b] >= min_confidence;",
           "        kp[b] = tp[b] >= min_confidence;", ("tests/test_head.py", "-k", "confidence_gate and True")),
    Mutant("head_greedy: a later step fed its draft's draft-vocabulary row, not its target id",
           "minispec/kernels/cpu_ops.cpp", "    return {row, draft_ids.index_select(0, row), torch::Tensor()};",
           "    return {row, row, torch::Tensor()};",
           ("tests/test_head.py", "-k", "accepted_context")),
    Mutant("gated adaptive k: a lone request drafts k_max even where drafting cannot pay",
           "minispec/spec_decode/adaptive.py",
           "            k = self.k_max if self.can_pay(costs, self.catch_up(reqs)) else 0", "            k = self.k_max",
           ("tests/test_playground.py", "-k", "gated_policy")),
    # ---- draft="auto" (llm.py)
    Mutant("auto: the head taken whatever its predicted speedup", "minispec/llm.py",
           "        pays = pred >= AUTO_MIN_SPEEDUP", "        pays = True",
           ("tests/test_head.py", "-k", "auto_takes_the_head")),
    Mutant("head_sampled: every step drawn with the first step's uniform", "minispec/kernels/cpu_ops.cpp",
           "const torch::Tensor ur = u.select(1, j)", "const torch::Tensor ur = u.select(1, 0)",
           ("tests/test_head.py", "-k", "sampled_steps")),
    Mutant("head_sampled: the coupled rows raced with the first step's noise at every step",
           "minispec/kernels/cpu_ops.cpp", "noise.select(0, j).contiguous()", "noise.select(0, 0).contiguous()",
           ("tests/test_head.py", "-k", "sampled_steps")),
    Mutant("head_sampled: drafts drawn with mass outside the draft vocabulary, whose cached q is 0",
           "minispec/kernels/cpu_ops.cpp", "full = torch::full({B, vocab}, -std::numeric_limits<float>::infinity(), "
           "lj.options());", "full = torch::zeros({B, vocab}, lj.options());",
           ("tests/test_lossless.py::test_head_sampling_matches_target_law",)),
    Mutant("the draft logits of greedy batches left unwritten even when beta is recorded", "minispec/engine/engine.py",
           "cache.greedy_rows_read = self.observer.record_beta", "cache.greedy_rows_read = False",
           ("tests/test_head.py", "-k", "unwritten")),
    # ---- the unfused forward on the real tokens' rows alone (layers/attention.py, models/llama.py)
    Mutant("real rows: each request's first padded row taken as real", "minispec/layers/attention.py",
           "keep = torch.arange(L, device=lens.device) < lens.unsqueeze(1)",
           "keep = torch.arange(L, device=lens.device) <= lens.unsqueeze(1)",
           ("tests/test_models.py", "-k", "padded_batch")),
    Mutant("real rows: the captured states written to the first N rows, not the real tokens'",
           "minispec/models/llama.py", "captured.view(B * L, -1)[rows, c * H : (c + 1) * H] = stream",
           "captured.view(B * L, -1)[: len(rows), c * H : (c + 1) * H] = stream",
           ("tests/test_models.py", "-k", "padded_batch")),
    # ---- decode_layers in one parallel region (kernels/cpu_ops.cpp; each mutant rebuilds the C++ extension)
    Mutant("one region: each thread's share of silu's columns one short", "minispec/kernels/cpu_ops.cpp",
           "if (c0 < c1) silu_mul_rows(gu, I, 0, T, c0, c1, act);",
           "if (c0 < c1) silu_mul_rows(gu, I, 0, T, c0, c1 - 1, act);", ("tests/test_models.py", "-k", "one_region")),
    Mutant("one region: the bias added to the first thread's rows only", "minispec/kernels/cpu_ops.cpp",
           "      if (bp[i])\n", "      if (bp[i] && tid == 0)\n", ("tests/test_models.py", "-k", "one_region")),
    # ---- the split rows' kernels (kernels/packed_cpu.cpp; each mutant rebuilds the C++ extension): the build's own,
    # AVX-512's tile_dot_split where the CPU has AVX-512, else AVX2's split_dot_256
    *(Mutant(name, "minispec/kernels/packed_cpu.cpp", old, new,
             ("tests/test_quant.py", "-k", "split_kernel_every_run_and_tail"))
      for name, old, new in [
          ("split kernel: x reordered with the low and high nibbles swapped",
           "4 * (l % 4) + p / 2 + 16 * (p % 2)]", "4 * (l % 4) + p / 2 + 16 * (1 - p % 2)]"),
          *([("split kernel: the second row of x read from the first row's reordered x",
              "        const __m512 xv = _mm512_load_ps(xp + r * ldxp + 128 * c + 16 * P);",
              "        const __m512 xv = _mm512_load_ps(xp + 128 * c + 16 * P);"),
             ("split kernel: the blocks past the last run of 4 left out",
              "    for (int64_t g = 4 * runs; g < G; g++) {  // lane l: code l (low nibble), code l + 16 (high)",
              "    for (int64_t g = G; g < G; g++) {  // lane l: code l (low nibble), code l + 16 (high)"),
             ("split kernel: 3 rows of x run as 2 (the third row's outputs never written)",
              "      else pass(std::integral_constant<int, 3>{});",
              "      else pass(std::integral_constant<int, 2>{});")]
            if "avx512f" in open("/proc/cpuinfo").read() else
            [("AVX2 split kernel: the second row of x read from the first row's reordered x",
              "          const __m256 xv = _mm256_load_ps(xp + r * ldxp + 64 * c + 8 * P);",
              "          const __m256 xv = _mm256_load_ps(xp + 64 * c + 8 * P);"),
             ("AVX2 split kernel: an odd G's last block left out",
              "    if (G % 2) {  // byte l of the block: code l (low nibble), code l + 16 (high)",
              "    if (false) {  // byte l of the block: code l (low nibble), code l + 16 (high)"),
             ("AVX2 split kernel: the minima past the last 8 blocks left out",
              "      for (int r = 0; r < RT; r++) mtail[r] += half_to_float(mins + 2 * g) * sx[r * G + g];",
              "      for (int r = 0; r < RT; r++) mtail[r] += 0.0f;")])
      ]),
    # ---- AVX2's dequantised panels (9+ rows of x): only where the build is the AVX2 one (AVX-512 machines test them
    # through the narrower build)
    *([Mutant("AVX2 panel: an odd row of x past the last pair left out", "minispec/kernels/packed_cpu.cpp",
              "    for (; r < M; r++) panel_dot<NT, 1>", "    for (; r < M - 1; r++) panel_dot<NT, 1>",
              ("tests/test_quant.py", "-k", "packed_linear_equals_float32_layer and 17")),
       Mutant("AVX2 panel: the weight rows past the last whole panel left out", "minispec/kernels/packed_cpu.cpp",
              "  for (; n < end; n++) {\n    dequant_panel<QT>", "  for (; n < begin; n++) {\n    dequant_panel<QT>",
              ("tests/test_quant.py", "-k", "packed_linear_equals_float32_layer and 16")),
       Mutant("AVX2 panel: each part of k summed from zero (the parts before it dropped)",
              "minispec/kernels/packed_cpu.cpp", "acc[j][r] = k0 == 0 ? _mm256_setzero_ps()",
              "acc[j][r] = k0 >= 0 ? _mm256_setzero_ps()",
              ("tests/test_quant.py", "-k", "packed_linear_equals_float32_layer and 1056"))]
      if "avx512f" not in open("/proc/cpuinfo").read() else []),
    # ---- the AMX tiles (packed_cpu.cpp: the tiled layout, others at 9+ rows of x): only where the CPU has them,
    # else their tests skip (the tiled layout's tile_rows mutant runs everywhere)
    *([Mutant("AMX: x's last bf16 limb dropped", "minispec/kernels/packed_cpu.cpp",
              "  l[2] = _mm512_castps_si512(_mm512_sub_ps(r, _mm512_castsi512_ps(l[1])));  // exact, 8 significant bits",
              "  l[2] = _mm512_setzero_si512();",
              ("tests/test_quant.py", "-k", "amx_tiles_equal")),
       Mutant("AMX: x below 2^-100 (subnormal limbs) not refused", "minispec/kernels/packed_cpu.cpp",
              "_mm512_set1_ps(0x1p-100f)", "_mm512_set1_ps(0x1p-149f)",
              ("tests/test_quant.py", "-k", "amx_refuses")),
       Mutant("AMX tiled: a chunk's third nibble looked up as its second", "minispec/kernels/packed_cpu.cpp",
              "_mm512_srli_epi16(w, 8), table", "_mm512_srli_epi16(w, 4), table",
              ("tests/test_quant.py", "-k", "amx_tiles_equal and tiles")),
       Mutant("AMX tiled: the middle limb's row of C left out of x's sum", "minispec/kernels/packed_cpu.cpp",
              "_mm512_load_ps(c + 16 * (3 * i + 1))", "_mm512_setzero_ps()",
              ("tests/test_quant.py", "-k", "amx_tiles_equal and tiles"))]
      if "amx_bf16" in open("/proc/cpuinfo").read() else []),
    Mutant("tiled layout: a word's two bytes swapped by tile_rows", "minispec/layers/quant.py",
           "reshape(t, g, 256)  # [T, G, c, word 2 j + h, byte]", "flip(-1).reshape(t, g, 256)",
           ("tests/test_quant.py", "-k", "tiled_rows_hold")),
    # ---- the head's training data (distill/head_data.py)
    Mutant("head data rebuild: the last answer token fed too (states one position long, top-k shifted)",
           "minispec/distill/head_data.py", "[0] * len(group), [x[:-1].tolist() for x in ids], n_logits)",
           "[0] * len(group), [x.tolist() for x in ids], n_logits)",
           ("tests/test_head_training.py", "-k", "rebuild")),
    Mutant("head data branch: the answer not restarted after the second choice", "minispec/distill/head_data.py",
           'a["start"], a["branch"], a["topk_ids"], a["topk_logp"] = len(a["ids"]), -1, [], []',
           'a["branch"] = -1', ("tests/test_head_training.py", "-k", "branched")),
]


def copy_repo(dest: str) -> None:
    """Copy the tracked and untracked, not ignored, files of the repository into dest."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                         capture_output=True).stdout
    for rel in filter(None, out.decode().split("\0")):
        src = os.path.join(ROOT, rel)
        if not os.path.isfile(src):  # deleted but still tracked
            continue
        os.makedirs(os.path.dirname(os.path.join(dest, rel)) or dest, exist_ok=True)
        shutil.copy2(src, os.path.join(dest, rel))


def check_applies(mutants: list[Mutant]) -> list[str]:
    """The mutants whose old text does not occur exactly once (a loud message each)."""
    errors = []
    for m in mutants:
        with open(os.path.join(ROOT, m.path)) as f:
            n = f.read().count(m.old)
        if n != 1:
            why = "pattern not found" if n == 0 else f"pattern found {n} times"
            errors.append(f"mutation {m.name!r} no longer applies: {why} in {m.path}: {m.old.strip()!r}")
    return errors


def run_tests(copy: str, args: tuple[str, ...]) -> tuple[int, str]:
    """pytest -x -q on the copy; (exit code, output)."""
    env = dict(os.environ, PYTHONPATH=copy, TRITON_INTERPRET="1", HF_HUB_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1",
               MINISPEC_FUZZ_SHRINK="0")  # a killed mutant needs no minimal example
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rf", *args]
    r = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def failed_test(output: str) -> str:
    """The first failing test named in pytest's summary."""
    found = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
    return found.group(1) if found else "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="run only mutants whose name contains one of these")
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests")
    args = parser.parse_args()
    mutants = [m for m in MUTANTS if not args.names or any(n in m.name for n in args.names)]
    if args.list:
        for m in mutants:
            print(f"{m.name}  [{m.path}]  tests: {' '.join(m.tests)}")
        return 0
    errors = check_applies(mutants)
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    copy = tempfile.mkdtemp(prefix="minispec-mutants-")
    try:
        copy_repo(copy)
        rc, out = run_tests(copy, baseline_args(mutants))
        if rc != 0:
            print(f"the tests fail without any mutant ({failed_test(out)}):\n{out[-3000:]}", file=sys.stderr)
            return 2
        print(f"baseline: the mutants' tests pass unmutated ({time.perf_counter() - t_start:.0f} s)")
        killed = 0
        for m in mutants:
            path = os.path.join(copy, m.path)
            with open(path) as f:
                original = f.read()
            t0 = time.perf_counter()
            try:
                with open(path, "w") as f:
                    f.write(original.replace(m.old, m.new, 1))
                rc, out = run_tests(copy, m.tests)
            finally:
                with open(path, "w") as f:
                    f.write(original)
            dt = time.perf_counter() - t0
            if rc == 1:
                killed += 1
                print(f"killed    {m.name}  by {failed_test(out)}  ({dt:.0f} s)", flush=True)
            elif rc == 0:
                print(f"SURVIVED  {m.name}  ({' '.join(m.tests)} passed, {dt:.0f} s)", flush=True)
            else:
                print(f"ERROR     {m.name}  (pytest exit {rc}: {failed_test(out)}, {dt:.0f} s)\n{out[-2000:]}",
                      flush=True)
        print(f"{killed}/{len(mutants)} mutants killed ({time.perf_counter() - t_start:.0f} s)")
        return 0 if killed == len(mutants) else 1
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def baseline_args(mutants: list[Mutant]) -> tuple[str, ...]:
    """One pytest selection covering every mutant's tests: their files and node ids, and a -k that ORs the
    mutants' -k expressions with the names of the tests given by node id."""
    paths, keywords = [], []
    for m in mutants:
        args = list(m.tests)
        if "-k" in args:
            i = args.index("-k")
            keywords.append(f"({args[i + 1]})")
            del args[i : i + 2]
        for a in args:
            paths.append(a)
            if "::" in a:
                keywords.append(a.split("::")[1].split("[")[0])
    return (*dict.fromkeys(paths), "-k", " or ".join(dict.fromkeys(keywords)))


if __name__ == "__main__":
    sys.exit(main())
