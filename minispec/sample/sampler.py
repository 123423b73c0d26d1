"""Per-distribution logit warping (temperature, top-k, top-p), probabilities and exact sampling."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from minispec.kernels import cpu
from minispec.sampling_params import SamplingParams

# Exp(1) noise is clamped into this range so probs / noise never divides by 0 or by inf.
NOISE_MIN = 1e-30
NOISE_MAX = 1e30
# Distributions with a temperature below this are shifted by their maximum before the division by T: the same
# softmax, but logits / T cannot overflow to inf (at T = 1e-40 every logit above 3.4e-2 would).
SHIFT_BELOW_T = 1e-4


class BatchSampling:
    """A batch's sampling settings as device tensors, built once per step (one entry per request)."""

    __slots__ = ("temperature", "top_k", "top_p", "greedy")

    def __init__(self, params: Sequence[SamplingParams], device: torch.device):
        self.temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        self.top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
        self.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        self.greedy = all(p.greedy for p in params)


def plain_temperature(temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, vocab: int) -> bool:
    """Whether every request of a batch (settings [N]) samples at a temperature >= SHIFT_BELOW_T without top-k or
    top-p: its law is softmax(logits / temperature) alone (the C++ kernel temperature_softmax's case)."""
    plain = (temperature >= SHIFT_BELOW_T) & ((top_k <= 0) | (top_k >= vocab)) & (top_p >= 1)  # [N]
    return bool(plain.all())


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Exact draw from each distribution probs[i] with one uniform u[i]: first token whose CDF exceeds u."""
    cdf = probs.cumsum(dim=-1)  # [N, V]
    tok = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return tok.clamp_(max=probs.shape[-1] - 1)


def _sanitize(logits: torch.Tensor) -> torch.Tensor:
    """float32 copy with NaN -> -inf and +inf -> the largest float32 (so softmax never sees inf - inf)."""
    return torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=torch.finfo(torch.float32).max,
                            neginf=float("-inf"))


def greedy_tokens(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax [N] of logits [N, V] (the first on ties; NaN counting as -inf, +inf as the largest
    float32), and whether the row is finite [N] (no NaN or +inf, some value above -inf): one pass of the C++
    kernel on CPU (torch's argmax alone takes 10x as long over a 49k vocabulary)."""
    if logits.dim() == 2 and cpu.applies(logits):
        tokens, finite = cpu.ops().greedy_argmax(logits)
        return tokens, finite
    return _sanitize(logits).argmax(dim=-1), torch.isfinite(logits.amax(dim=-1))


def _divide(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x[i] / t[i]; where t[i] < SHIFT_BELOW_T, sanitised x[i] minus its maximum instead."""
    small = t < SHIFT_BELOW_T  # [N]
    if bool(small.any()):
        s = _sanitize(x)
        max_logit = s.amax(dim=-1, keepdim=True)  # [N, 1]; -inf for a distribution without a finite logit
        x = torch.where(small.unsqueeze(1), s - torch.where(torch.isfinite(max_logit), max_logit, 0.0), x)
    return x / t.unsqueeze(1)


def warp_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Temperature, then top-k, then top-p per distribution (transformers' warpers); masked entries are -inf.

    temperature 0 (greedy) logits are not divided; those below SHIFT_BELOW_T are shifted by their maximum
    first (the same probabilities, and no overflow); top_k <= 0 or >= V is off (ties with the k-th value
    are kept); top_p >= 1 is off (at least one token is always kept). NaN logits become -inf and +inf the
    largest float32, so the result never holds NaN or +inf.
    """
    vocab = logits.shape[-1]
    x = logits.float()
    greedy = temperature == 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    x = _sanitize(_divide(x, t))  # [N, V]
    top_k = top_k.to(device=x.device, dtype=torch.int64)
    top_p = top_p.to(device=x.device, dtype=torch.float32)
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1
    sel = (use_k | use_p).nonzero().squeeze(1)  # [M]
    if sel.numel() == 0:
        return x
    sub = x[sel]  # [M, V]
    k = top_k[sel]
    sorted_vals, sorted_idx = torch.sort(sub, dim=-1, stable=True)  # ascending, [M, V]
    # top-k: drop everything below the k-th largest value (its ties stay).
    kth = sorted_vals.gather(1, (vocab - k.clamp(1, vocab)).unsqueeze(1))  # [M, 1]
    kth = torch.where(use_k[sel].unsqueeze(1), kth, torch.full_like(kth, float("-inf")))
    sorted_vals = sorted_vals.masked_fill(sorted_vals < kth, float("-inf"))
    # top-p: drop the low tail whose cumulative probability stays <= 1 - top_p; keep the largest token.
    cum = sorted_vals.softmax(dim=-1).cumsum(dim=-1)  # [M, V]
    threshold = (1 - top_p[sel].double()).float()  # as transformers: 1 - p in float64, compared in float32
    drop = (cum <= threshold.unsqueeze(1)) & use_p[sel].unsqueeze(1)
    drop[:, -1] = False
    sorted_vals = sorted_vals.masked_fill(drop, float("-inf"))
    x[sel] = sub.scatter(1, sorted_idx, sorted_vals)
    return x


def probs_from_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Softmax of the warped logits, float32 [N, V]; greedy distributions (temperature 0) are one-hot at the argmax.

    NaN logits count as -inf; a distribution without any finite logit is one-hot at token 0.
    """
    plain = _plain_softmax(logits, temperature, top_k, top_p)
    if plain is not None:
        return plain
    max_logit = logits.amax(dim=-1)  # [N]; NaN or +inf anywhere in logits[i] shows here, as does all -inf
    if bool(torch.isfinite(max_logit).all()):
        return _probs_finite(logits, temperature, top_k, top_p)
    greedy = (temperature == 0).to(logits.device)  # [N]
    # Greedy distributions skip top-k/top-p: both always keep the argmax.
    top_k = torch.where(greedy, torch.zeros_like(top_k), top_k)
    top_p = torch.where(greedy, torch.ones_like(top_p), top_p)
    x = warp_logits(logits, temperature, top_k, top_p)  # [N, V]
    probs = x.softmax(dim=-1)  # [N, V]
    finite = logits.isfinite().any(dim=-1)  # [N]
    argmax = torch.where(finite, _sanitize(logits).argmax(dim=-1), 0)  # [N]
    one_hot = (greedy | ~finite).unsqueeze(1)  # [N, 1]
    return torch.where(one_hot, torch.zeros_like(probs).scatter_(1, argmax.unsqueeze(1), 1.0), probs)


def _plain_softmax(logits, temperature, top_k, top_p) -> torch.Tensor | None:
    """probs_from_logits by one C++ pass (temperature_softmax: a few float32 ulps from float64 over its float32
    l / t) where it applies: CPU float32 [N, V] logits, every finite and sampled at temperature >= SHIFT_BELOW_T
    without top-k or top-p; else None."""
    if logits.dim() != 2 or not cpu.applies(logits) or \
            not plain_temperature(temperature, top_k, top_p, logits.shape[-1]):
        return None
    probs, ok = cpu.ops().temperature_softmax(logits, temperature.float().contiguous())
    return probs if bool(ok.all()) else None


def sample(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Exact draw from each distribution: argmax(probs / noise) with noise ~ Exp(1) (the exponential race), int64 [N]
    (the first index on ties). On CPU one pass of the C++ kernel, the same floats."""
    if probs.dim() == 2 and noise.shape == probs.shape and cpu.applies(probs, noise):
        return cpu.ops().exp_race(probs, noise, NOISE_MIN, NOISE_MAX)
    return (probs / noise.clamp(NOISE_MIN, NOISE_MAX)).argmax(dim=-1)


def _probs_finite(logits, temperature, top_k, top_p) -> torch.Tensor:
    """probs_from_logits for logits that each hold a finite maximum and no NaN or +inf (the usual case):
    the same result without the sanitising passes over the vocabulary."""
    greedy = (temperature == 0).to(logits.device)  # [N]
    if bool(greedy.all()):
        probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        return probs.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    t = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    k = torch.where(greedy, torch.zeros_like(top_k), top_k)
    p = torch.where(greedy, torch.ones_like(top_p), top_p)
    vocab = logits.shape[-1]
    if bool((((k > 0) & (k < vocab)) | (p < 1)).any()):
        x = warp_logits(logits, temperature, k, p)
    else:
        x = _divide(logits.float(), t)
    probs = x.softmax(dim=-1)  # [N, V]
    if bool(greedy.any()):
        sel = greedy.nonzero().squeeze(1)
        one_hot = torch.zeros(len(sel), vocab, dtype=torch.float32, device=logits.device)
        probs[sel] = one_hot.scatter_(1, logits[sel].argmax(dim=-1, keepdim=True), 1.0)
    return probs
