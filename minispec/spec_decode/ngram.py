"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of a request's last n tokens.

No draft model: the draft "logits" are one-hot (0 at the proposed token, -inf elsewhere), so after any
temperature, top-k or top-p the draft distribution q is one-hot at the draft d. The rejection sampler
then accepts d with probability p(d) and on rejection draws from norm(max(0, p - onehot_d)), which is
p without d: the output is distributed exactly as p.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from minispec.spec_decode.draft_logits import DraftLogitsCache
from minispec.spec_decode.proposer import Drafting


def ngram_drafts(histories: Sequence[Sequence[int]], k: int, min_n: int = 1, max_n: int = 3) -> np.ndarray:
    """Up to k drafts per history: the tokens that followed the latest earlier occurrence of its last n
    tokens, for the largest n in [min_n, max_n] that occurs earlier; -1 where there is no draft.

    An earlier occurrence ends before the history's last token (it may overlap the suffix itself);
    drafts stop at the end of the history, so a match near the end gives fewer than k (rest -1).
    Vectorised over requests and positions: the only Python loops run over requests (copying the
    histories in) and over n.

    Returns: [num_histories, k] int64.
    """
    num_reqs = len(histories)
    drafts = np.full((num_reqs, k), -1, dtype=np.int64)  # [num_reqs, k]
    if num_reqs == 0:
        return drafts
    lens = np.fromiter((len(h) for h in histories), dtype=np.int64, count=num_reqs)  # [num_reqs]
    max_len = int(lens.max())
    if max_len < 2:
        return drafts
    # History b sits at columns max_n .. max_n + lens[b] of hist; the -1 padding on both sides never
    # equals a suffix token (a real id, or -2 where the history is shorter than the suffix).
    hist = np.full((num_reqs, max_n + max_len), -1, dtype=np.int64)  # [num_reqs, max_n + max_len]
    for b, h in enumerate(histories):
        hist[b, max_n : max_n + lens[b]] = h
    back = lens[:, None] - 1 - np.arange(max_n)  # [num_reqs, max_n] position of the m-th last token
    suffix = np.where(back >= 0, hist[np.arange(num_reqs)[:, None], max_n + back.clip(min=0)], -2)
    # match[b, e]: an occurrence of the last m + 1 tokens of history b ends at position e < lens[b] - 1.
    ends = np.arange(max_len - 1)  # [max_len - 1]
    match = ends[None, :] < (lens - 1)[:, None]  # [num_reqs, max_len - 1]
    best_end = np.full(num_reqs, -1, dtype=np.int64)  # [num_reqs] end of the chosen occurrence, -1 if none
    for m in range(max_n):
        match &= hist[:, max_n - m : max_n - m + max_len - 1] == suffix[:, m : m + 1]
        if m + 1 < min_n:
            continue
        found = match.any(axis=1)  # [num_reqs]
        if not found.any():
            break  # no longer n can match either
        latest = max_len - 2 - np.argmax(match[:, ::-1], axis=1)  # [num_reqs]
        best_end = np.where(found, latest, best_end)  # a longer n overrides a shorter one
    pos = best_end[:, None] + 1 + np.arange(k)  # [num_reqs, k] history positions of the drafts
    valid = (best_end[:, None] >= 0) & (pos < lens[:, None])
    taken = hist[np.arange(num_reqs)[:, None], max_n + np.minimum(pos, max_len - 1)]  # [num_reqs, k]
    drafts[valid] = taken[valid]
    return drafts


class NgramProposer:
    """Prompt-lookup drafts (n-gram match over prompt + output) with one-hot draft logits."""

    def __init__(self, k: int, min_n: int = 1, max_n: int = 3, device: torch.device | str | None = None):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.k = k
        self.min_n = min_n
        self.max_n = max_n
        self.device = torch.device(device) if device is not None else None  # None: the cache's device
        self.forward_s = 0.0  # no model forwards
        self.has_kv_cache = False

    def propose(self, reqs: list[Drafting], cache: DraftLogitsCache, num_steps: int | None = None) -> np.ndarray:
        """Drafts [num_reqs, k] int64 (-1 = none); writes their one-hot logits to this rank's rows.

        Deterministic in the requests' tokens, so every TP rank proposes the same drafts. Leaves
        req.num_draft_computed alone (there is no draft KV cache).
        """
        k = self.k if num_steps is None else num_steps
        drafts = ngram_drafts([r.token_ids for r in reqs], k, self.min_n, self.max_n)  # [num_reqs, k]
        device = self.device if self.device is not None else cache.device
        slots = torch.tensor([r.slot for r in reqs], dtype=torch.int64, device=device)  # [num_reqs]
        cache.write_one_hot(cache.rows_of(slots).long(), torch.from_numpy(drafts).to(device))
        return drafts

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Nothing to copy: no draft KV cache."""

    def free(self, req: Drafting) -> None:
        """Nothing to free: the proposer keeps no per-request state."""
