"""Lossless rejection sampling of draft tokens against the target (Triton kernel + torch reference).

Request r owns logits positions cu[r]:cu[r+1] (indices into the [num_logits, V] tensors): one per draft
(position j verifies draft_tokens[j]) and a last bonus position. p / q are the target / draft probabilities after the request's temperature, top-k
and top-p (greedy: one-hot argmax). Draft i is accepted iff it is valid (not stale, in [0, V)) and
u_i * q_i[d] < p_i[d], i.e. with probability min(1, p_i[d] / q_i[d]). The first rejected draft is
replaced by a draw from norm(max(0, p_i - q_i)), or from p_i when the draft was invalid or the
residual has no mass; if every draft is accepted, a bonus token is drawn from the last position's p.
Draws use the exponential race argmax(dist / noise), so the residual is never normalised.

coupled_verify is the drafter-invariant alternative for seeded sampled requests (SamplingParams.coupled): the
token at each position is the target's own race argmax(p / E) with that position's keyed noise E, the draft
drew its token with the same E (argmax(q / E)), and a draft is accepted iff the two agree. Every token is then
the one target-only decoding draws with the same noise, whatever k, draft or batch; the price is acceptance,
sum_x p_x q_x / sum_y max(p_y q_x, q_y p_x) per draft instead of sum_x min(p_x, q_x), and at least
(1 - TV) / (1 + TV) for total variation distance TV (Daliri et al., 2024, "Coupling without communication
and drafter-invariant speculative decoding").
"""
from __future__ import annotations

import numpy as np
import torch

from minispec.kernels import cpu
from minispec.sample.sampler import NOISE_MAX, NOISE_MIN, greedy_tokens, probs_from_logits, sample
from minispec.utils import load_triton
from minispec.utils import use_triton as _use_triton

triton, tl = load_triton()


def _per_position(cu_num_logits, num_logits: int, *settings):
    """Each per-request settings tensor [num_reqs] repeated over its request's logits positions: [num_logits] each."""
    num_pos = cu_num_logits[1:] - cu_num_logits[:-1]  # [num_reqs] logits positions per request
    return (torch.repeat_interleave(x, num_pos, output_size=num_logits) for x in settings)


def _probs(target_logits, draft_logits, cu_num_logits, temperature, top_k, top_p):
    """Target and draft probabilities [num_logits, V] at every logits position, under its request's settings."""
    t, k, p = _per_position(cu_num_logits, target_logits.shape[0], temperature, top_k, top_p)
    return probs_from_logits(target_logits, t, k, p), probs_from_logits(draft_logits, t, k, p)


def _valid_drafts(draft_tokens, stale, cu_num_logits, vocab):
    """[num_logits] bool: logits positions holding a verifiable draft (not bonus, not stale, id in [0, V))."""
    num_logits = draft_tokens.shape[0]
    bonus = torch.zeros(num_logits + 1, dtype=torch.bool, device=draft_tokens.device)
    bonus[cu_num_logits[1:] - 1] = True
    valid = (draft_tokens >= 0) & (draft_tokens < vocab) & ~bonus[:num_logits]
    if stale is not None:
        valid &= ~stale.bool()
    return valid


def rejection_sample_ref(p, q, draft_tokens, stale, cu_num_logits, uniforms, noise):
    """Torch reference on probabilities: tokens [num_reqs, K + 1] (-1 padded), num_sampled [num_reqs]."""
    num_logits, vocab = p.shape
    num_reqs, max_drafts = uniforms.shape
    device = p.device
    num_pos = cu_num_logits[1:] - cu_num_logits[:-1]  # [num_reqs] logits positions per request
    valid = _valid_drafts(draft_tokens, stale, cu_num_logits, vocab)  # [num_logits]
    pos = torch.arange(max_drafts + 1, device=device)
    lpos = (cu_num_logits[:-1].unsqueeze(1) + pos).clamp(max=max(num_logits - 1, 0))  # [num_reqs, K + 1]
    is_draft = pos < (num_pos - 1).unsqueeze(1)  # [num_reqs, K + 1]
    ok = valid[lpos] & is_draft
    d = torch.where(ok, draft_tokens[lpos], 0)  # [num_reqs, K + 1]
    pd, qd = p[lpos, d], q[lpos, d]
    u = torch.cat([uniforms.float(), uniforms.new_ones(num_reqs, 1, dtype=torch.float32)], dim=1)
    accepted = ok & (u * qd < pd)  # [num_reqs, K + 1]
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [num_reqs]
    final_pos = cu_num_logits[:-1] + num_accepted  # [num_reqs] logits position of the drawn token
    final_ok = ok.gather(1, num_accepted.unsqueeze(1))  # [num_reqs, 1]
    pf = p[final_pos]  # [num_reqs, V]
    resid = torch.where(final_ok, (pf - q[final_pos]).clamp_min(0), 0.0)
    dist = torch.where((resid > 0).any(dim=1, keepdim=True), resid, pf)
    final = sample(dist, noise.float())  # [num_reqs]
    tokens = torch.where(pos < num_accepted.unsqueeze(1), d, -1)  # [num_reqs, K + 1]
    tokens.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
    return tokens, num_accepted + 1


@triton.jit
def _rejection_sample_kernel(
    p_ptr, q_ptr, draft_ptr, stale_ptr, cu_ptr, u_ptr, noise_ptr, tokens_ptr, num_sampled_ptr,
    V, K, noise_min, noise_max, HAS_STALE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One program per request: walk its drafts, then a blocked exponential-race argmax for the last token."""
    r = tl.program_id(0).to(tl.int64)
    start = tl.load(cu_ptr + r)
    end = tl.load(cu_ptr + r + 1)
    num_drafts = end - start - 1
    num_accepted = tl.zeros([], dtype=tl.int64)
    rejected = tl.zeros([], dtype=tl.int32)
    final_ok = tl.zeros([], dtype=tl.int32)
    for i in range(0, num_drafts):
        j = start + i
        d = tl.load(draft_ptr + j)
        ok = (d >= 0) & (d < V)
        if HAS_STALE:
            ok = ok & (tl.load(stale_ptr + j) == 0)
        d_safe = tl.where(ok, d, 0)
        pd = tl.load(p_ptr + j * V + d_safe)
        qd = tl.load(q_ptr + j * V + d_safe)
        u = tl.load(u_ptr + r * K + i)
        acc = ok & (u * qd < pd)
        live = rejected == 0
        tl.store(tokens_ptr + r * (K + 1) + i, d, mask=live & acc)
        num_accepted += (live & acc).to(tl.int64)
        final_ok = tl.where(live & ~acc, ok.to(tl.int32), final_ok)
        rejected = tl.where(acc, rejected, 1)
    final_pos = start + num_accepted
    best_r = tl.full([], -1.0, tl.float32)
    best_p = tl.full([], -1.0, tl.float32)
    idx_r = tl.zeros([], dtype=tl.int32)
    idx_p = tl.zeros([], dtype=tl.int32)
    has_resid = tl.zeros([], dtype=tl.int32)
    for off in range(0, V, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        m = cols < V
        pv = tl.load(p_ptr + final_pos * V + cols, mask=m, other=0.0)
        qv = tl.load(q_ptr + final_pos * V + cols, mask=m, other=0.0)
        rv = tl.where(final_ok != 0, tl.maximum(pv - qv, 0.0), 0.0)
        nz = tl.load(noise_ptr + r * V + cols, mask=m, other=1.0)
        nz = tl.minimum(tl.maximum(nz, noise_min), noise_max)
        # div_rn: IEEE-rounded like torch (plain `/` is approximate on NVIDIA GPUs)
        sr = tl.where(m, tl.math.div_rn(rv, nz), -1.0)
        sp = tl.where(m, tl.math.div_rn(pv, nz), -1.0)
        has_resid = has_resid | (tl.max(rv, axis=0) > 0).to(tl.int32)
        mr = tl.max(sr, axis=0)
        ir = tl.min(tl.where(sr == mr, cols, V), axis=0)
        mp = tl.max(sp, axis=0)
        ip = tl.min(tl.where(sp == mp, cols, V), axis=0)
        idx_r = tl.where(mr > best_r, ir, idx_r)
        best_r = tl.maximum(mr, best_r)
        idx_p = tl.where(mp > best_p, ip, idx_p)
        best_p = tl.maximum(mp, best_p)
    final = tl.where(has_resid != 0, idx_r, idx_p)
    tl.store(tokens_ptr + r * (K + 1) + num_accepted, final.to(tl.int64))
    tl.store(num_sampled_ptr + r, num_accepted + 1)


def rejection_sample_triton(p, q, draft_tokens, stale, cu_num_logits, uniforms, noise, block_v: int = 1024):
    """Triton kernel on probabilities; same outputs as rejection_sample_ref."""
    num_logits, vocab = p.shape
    num_reqs, max_drafts = uniforms.shape
    tokens = torch.full((num_reqs, max_drafts + 1), -1, dtype=torch.int64, device=p.device)  # [num_reqs, K + 1]
    num_sampled = torch.empty(num_reqs, dtype=torch.int64, device=p.device)  # [num_reqs]
    if num_reqs == 0:
        return tokens, num_sampled
    stale_arg = stale.contiguous().view(torch.uint8) if stale is not None else draft_tokens
    _rejection_sample_kernel[(num_reqs,)](
        p.contiguous(), q.contiguous(), draft_tokens.contiguous().long(), stale_arg,
        cu_num_logits.contiguous().long(), uniforms.contiguous().float(), noise.contiguous().float(),
        tokens, num_sampled, vocab, max_drafts, NOISE_MIN, NOISE_MAX,
        HAS_STALE=stale is not None, BLOCK_V=min(block_v, triton.next_power_of_2(vocab)),
    )
    return tokens, num_sampled


def rejection_sample_cpu(p, q, draft_tokens, stale, cu_num_logits, uniforms, noise):
    """The C++ kernel on probabilities (kernels/fused_cpu.cpp, CPU float32 tensors): rejection_sample_ref's outputs."""
    stale = torch.empty(0, dtype=torch.bool) if stale is None else stale.bool().contiguous()
    tokens, num_sampled = cpu.ops().rejection_sample_probs(
        p, q, draft_tokens.long().contiguous(), stale, cu_num_logits.long().contiguous(),
        uniforms.float().contiguous(), noise.float().contiguous(), NOISE_MIN, NOISE_MAX)
    return tokens, num_sampled


def greedy_accept(argmax: np.ndarray, draft_tokens: np.ndarray, cu_num_logits: np.ndarray, max_drafts: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The all-greedy verdict on the host: tokens [num_reqs, K + 1] (-1 padded), num_sampled [num_reqs].

    argmax [num_logits]: the target's argmax at each logits position; draft_tokens [num_logits]: the draft
    each position verifies, -1 where it verifies none (a placeholder, a stale draft). A draft is accepted iff
    it equals the argmax and every earlier one was; the argmax at the first rejection (or the bonus) follows.
    """
    num_reqs = len(cu_num_logits) - 1
    tokens = np.full((num_reqs, max_drafts + 1), -1, dtype=np.int64)  # [num_reqs, K + 1]
    num_sampled = np.empty(num_reqs, dtype=np.int64)  # [num_reqs]
    top, drafts, cu = argmax.tolist(), draft_tokens.tolist(), cu_num_logits.tolist()
    for r in range(num_reqs):  # a loop on the host: cheaper than array operations at the batch sizes verified
        start, last = cu[r], cu[r + 1] - 1  # last: the bonus position
        n = 0
        while start + n < last and drafts[start + n] >= 0 and drafts[start + n] == top[start + n]:
            n += 1
        tokens[r, : n + 1] = top[start : start + n + 1]
        num_sampled[r] = n + 1
    return tokens, num_sampled


def greedy_verify(target_logits, draft_tokens, stale, cu_num_logits, max_drafts: int):
    """The all-greedy case of rejection_sample without building p and q: one argmax pass over the target's logits,
    then greedy_accept on the host (a draft is valid iff not stale and equal to the argmax, which is in [0, V)).

    Same tokens as the general path with one-hot p and q; also finite [num_logits], False where a position's
    logits hold NaN or +inf or nothing above -inf.
    """
    device = target_logits.device
    argmax, finite = greedy_tokens(target_logits)  # [num_logits] each
    argmax = argmax.cpu().numpy()
    drafts = draft_tokens.cpu().numpy().astype(np.int64, copy=False)  # [num_logits]
    if stale is not None:
        drafts = np.where(stale.cpu().numpy().astype(bool), -1, drafts)
    tokens, num_sampled = greedy_accept(argmax, drafts, cu_num_logits.cpu().numpy(), max_drafts)
    return torch.from_numpy(tokens).to(device), torch.from_numpy(num_sampled).to(device), finite


def coupled_verify(target_logits, draft_tokens, cu_num_logits, temperature, top_k, top_p, noise, max_drafts: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify the drafts of coupled requests: tokens [num_reqs, K + 1] (-1 padded), num_sampled [num_reqs] (host).

    target_logits [num_logits, V]; draft_tokens [num_logits] (-1 where a position verifies none: the bonus, a
    placeholder, a stale draft); temperature, top_k, top_p [num_reqs]; noise [num_logits, V]: each position's
    keyed Exp(1) noise (RequestRandom.position_noise). The target's draw at every position, then greedy_accept.
    """
    t, k, p = _per_position(cu_num_logits, target_logits.shape[0], temperature, top_k, top_p)
    drawn = sample(probs_from_logits(target_logits, t, k, p), noise.to(target_logits.device).float())  # [num_logits]
    tokens, num_sampled = greedy_accept(drawn.cpu().numpy(), draft_tokens.cpu().numpy().astype(np.int64, copy=False),
                                        cu_num_logits.cpu().numpy(), max_drafts)
    return torch.from_numpy(tokens), torch.from_numpy(num_sampled)


def sample_without_drafts(target_logits, temperature, top_k, top_p, noise, max_drafts: int):
    """The case of rejection_sample where no request verifies drafts (one logits position each): a draw from each
    request's target distribution with its noise, the token the general path gives, without building q or
    walking drafts. tokens [num_reqs, K + 1] (-1 padded), num_sampled [num_reqs] (all 1)."""
    p = probs_from_logits(target_logits, temperature, top_k, top_p)  # [num_reqs, V]
    tokens = torch.full((p.shape[0], max_drafts + 1), -1, dtype=torch.int64, device=p.device)
    tokens[:, 0] = sample(p, noise.float())
    return tokens, torch.ones(p.shape[0], dtype=torch.int64, device=p.device)


def rejection_sample(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    stale: torch.Tensor | None,
    cu_num_logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    use_triton: bool | None = None,
    return_probs: bool = False,
):
    """Verify drafts: tokens [num_reqs, K + 1] (accepted drafts then one drawn token, -1 padded), num_sampled [num_reqs].

    K = uniforms.shape[1] must be at least every request's number of drafts (logits positions - 1).
    With return_probs, also the target and draft probabilities p, q [num_logits, V] it used.
    """
    if use_triton is None:
        use_triton = _use_triton(target_logits)
    if not return_probs and bool((temperature == 0).all()):
        return greedy_verify(target_logits, draft_tokens, stale, cu_num_logits, uniforms.shape[1])[:2]
    if not return_probs and target_logits.shape[0] == cu_num_logits.shape[0] - 1:  # one position per request
        return sample_without_drafts(target_logits, temperature, top_k, top_p, noise, uniforms.shape[1])
    p, q = _probs(target_logits, draft_logits, cu_num_logits, temperature, top_k, top_p)
    if use_triton:
        fn = rejection_sample_triton
    else:  # the C++ kernel where it applies (a tenth of the reference's time at V = 49,152), else the reference
        fn = rejection_sample_cpu if cpu.applies(p, q) else rejection_sample_ref
    tokens, num_sampled = fn(p, q, draft_tokens, stale, cu_num_logits, uniforms, noise)
    return (tokens, num_sampled, p, q) if return_probs else (tokens, num_sampled)
