"""The law of what the rejection sampler emits for one request, probed exactly on a tiny vocabulary.

The specification (Leviathan et al., 2023; Chen et al., 2023), per position m with draft d:
accept iff u < min(1, p_m(d) / q_m(d)) (q_m(d) = 0: accept iff p_m(d) > 0), where q is the cached
(pre-temperature, then warped) draft distribution; a stale or -1 draft is never accepted. On the
first rejection the token is drawn from norm(max(0, p_m - q_m)), or from p_m when the draft was
stale or -1 or the residual is empty; when every draft is accepted the bonus token is drawn from
p_k.

`probe` checks that the sampler the engine calls does exactly this, deterministically: for every
draft sequence it reaches each position by accepting the drafts before it (u = threshold / 2), then
* accepts at u = threshold * (1 - EPS) and rejects at u = threshold * (1 + EPS) (u = 0 when the
  threshold is 0, so a draft that must never be accepted is not);
* on rejection (or for the bonus token) makes each token j of the expected draw D the winner of the
  exponential race argmax(dist / noise), with noise D * (1 + EPS) everywhere but j: every probe
  succeeds iff the sampler's dist is proportional to D within a factor 1 + EPS and zero off D's
  support.
`exact_law` then composes these terms over every draft sequence, weighted by the request's own
draft distribution (which differs from the cached one on stale rows), into the exact float64 law of
the token emitted at each position after each prefix.
"""
from __future__ import annotations

import itertools
import math

import torch

from minispec.sample.sampler import probs_from_logits
from minispec.spec_decode.rejection_sampler import rejection_sample

EPS = 1e-3  # relative tolerance of the probes


def row_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """probs_from_logits with one setting for every row, float32 [N, V]."""
    n = logits.shape[0]
    return probs_from_logits(logits, torch.full((n,), float(temperature)), torch.full((n,), int(top_k)),
                             torch.full((n,), float(top_p)))


class Request:
    """One request's rows: target, cached draft and own draft logits [k + 1, V], and its settings.

    stale: draft positions whose cached logits row belongs to another request (the request drafted
    from `own` there); placeholder: positions holding a -1 draft.
    """

    def __init__(self, target, cached, own, temperature=1.0, top_k=0, top_p=1.0, stale=(), placeholder=()):
        self.target, self.cached, self.own = target, cached, own
        self.k = target.shape[0] - 1
        self.vocab = target.shape[1]
        self.settings = (temperature, top_k, top_p)
        self.stale, self.placeholder = set(stale), set(placeholder)
        self.p = row_probs(target, *self.settings).double()  # [k + 1, V]
        self.q = row_probs(cached, *self.settings).double()  # [k + 1, V] what verification reads
        self.q_own = row_probs(own, *self.settings).double()  # [k + 1, V] what the drafts came from
        # threshold[m, d] and draw[m, d] of the specification; draw[k, :] is the bonus draw p_k.
        self.threshold = torch.zeros(self.k + 1, self.vocab, dtype=torch.float64)
        self.draw = self.p.unsqueeze(1).repeat(1, self.vocab, 1)  # [k + 1, V (draft), V]
        for m in range(self.k):
            if m in self.stale or m in self.placeholder:
                continue
            p, q = self.p[m], self.q[m]
            self.threshold[m] = torch.where(q > 0, (p / q.clamp_min(1e-300)).clamp(max=1), (p > 0).double())
            resid = (p - q).clamp_min(0)
            if resid.sum() > 0:
                self.draw[m] = resid / resid.sum()

    def combos(self) -> list[tuple[int, ...]]:
        """Every draft sequence the request can hold: tokens of q_own's support, or -1 at placeholders."""
        choices = [[-1] if m in self.placeholder else self.q_own[m].nonzero().squeeze(1).tolist()
                   for m in range(self.k)]
        return list(itertools.product(*choices))

    def terms(self, combo, m) -> tuple[float, torch.Tensor]:
        """Threshold and draw at position m for this draft sequence (the bonus position k: 0 and p_k)."""
        if m == self.k or combo[m] < 0:
            return 0.0, self.draw[m, 0] if m == self.k else self.p[m]
        return float(self.threshold[m, combo[m]]), self.draw[m, combo[m]]


def probe(req: Request, combos=None, use_triton: bool = False) -> list[str]:
    """Run the probes of every draft sequence (default: all) through rejection_sample; the failures."""
    combos = req.combos() if combos is None else combos
    k, vocab = req.k, req.vocab
    drafts, us, noises, checks = [], [], [], []  # checks: (combo, m, kind, expected token or None)
    for combo in combos:
        u = [0.5] * k
        for m in range(k + 1):
            t, draw = req.terms(combo, m)
            if m < k and t > 0:  # accept just below the threshold
                u_m = list(u)
                u_m[m] = t * (1 - EPS)
                drafts.append(combo), us.append(u_m), noises.append(torch.ones(vocab)), checks.append((combo, m, "accept", None))
            if m == k or t < 1:  # reject just above it (or at 0), then each token of the draw must win once
                u_m = list(u)
                if m < k:
                    u_m[m] = t * (1 + EPS) if t * (1 + EPS) < 1 else (t + 1) / 2
                for j in draw.nonzero().squeeze(1).tolist():
                    noise = (draw * (1 + EPS)).float()
                    noise[j] = float(draw[j])
                    drafts.append(combo), us.append(u_m), noises.append(noise), checks.append((combo, m, "draw", j))
            if t <= 0:
                break  # later positions are unreachable for this sequence
            u[m] = t / 2
    n = len(drafts)
    draft_tokens = torch.cat([torch.tensor(drafts, dtype=torch.int64).view(n, k), torch.full((n, 1), -1)], 1)
    stale = torch.zeros(n, k + 1, dtype=torch.bool)
    stale[:, sorted(req.stale)] = True
    temperature, top_k, top_p = req.settings
    tokens, num_sampled = rejection_sample(
        req.target.repeat(n, 1), req.cached.repeat(n, 1), draft_tokens.view(-1),
        stale.view(-1) if req.stale else None, torch.arange(n + 1) * (k + 1), torch.full((n,), float(temperature)),
        torch.full((n,), int(top_k)), torch.full((n,), float(top_p)), torch.tensor(us, dtype=torch.float32).view(n, k),
        torch.stack(noises), use_triton=use_triton,
    )
    failures = []
    for i, (combo, m, kind, j) in enumerate(checks):
        got_n, got = int(num_sampled[i]), tokens[i].tolist()
        if got[:m] != list(combo[:m]):
            failures.append(f"drafts {combo} pos {m} {kind}: emitted {got} does not start with the accepted drafts")
        elif kind == "accept" and (got_n < m + 2 or got[m] != combo[m]):
            failures.append(f"drafts {combo} pos {m}: rejected below the threshold (emitted {got[:got_n]})")
        elif kind == "draw" and (got_n != m + 1 or got[m] != j):
            failures.append(f"drafts {combo} pos {m}: emitted {got[:got_n]}, expected token {j} to win the draw")
    return failures


def exact_law(req: Request) -> dict[tuple[int, ...], torch.Tensor]:
    """{prefix: [V] probability of emitting prefix then each token}, over every draft sequence (float64)."""
    mass: dict[tuple[int, ...], torch.Tensor] = {}
    for combo in req.combos():
        reach = math.prod(1.0 if d < 0 else float(req.q_own[m, d]) for m, d in enumerate(combo))
        for m in range(req.k + 1):
            if reach <= 0:
                break
            t, draw = req.terms(combo, m)
            emitted = (1 - t) * draw
            if t > 0:
                emitted = emitted.clone()
                emitted[combo[m]] += t
            prefix = tuple(combo[:m])
            mass[prefix] = mass.get(prefix, torch.zeros(req.vocab, dtype=torch.float64)) + reach * emitted
            reach *= t
    return mass
