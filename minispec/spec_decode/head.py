"""The head proposer: an EAGLE head (models/eagle.py) drafting from the hidden states the target computed.

The target runner captures the head's feature layers in every forward it already runs (verification,
prefill chunks) and hands them here (ModelRunner.on_hidden); each request keeps the states of the
positions its head has not read yet. Drafting a request whose target has computed positions < n:
  step 0 feeds the head every position p in [num_draft_computed, n) with (token p + 1, the target's state
         at p), writing the head's KV cache there: the draft for token n + 1 comes from position n - 1;
  step j feeds position n - 1 + j with (draft j, the head's own output at step j - 1).
The head's K/V past n are rolled back by bookkeeping, as a draft model's are (num_draft_computed = n).
Logits over the draft vocabulary go to the draft-logits cache over the full vocabulary, -inf elsewhere, so
the rejection sampler, stale rows, skips, TP and adaptive k treat the head as any draft.
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import torch

from minispec.kernels import cpu
from minispec.layers.attention import AttentionMetadata, ForwardBatch, attention
from minispec.kernels.ggml import F32
from minispec.layers.quant import PackedWeight, linear
from minispec.layers.rotary import RotaryEmbedding
from minispec.models.eagle import EagleHead, InferenceWeights, draft_rows
from minispec.runner.kv_cache import KVCache
from minispec.runner.model_runner import ModelRunner
from minispec.spec_decode.draft_logits import DraftLogitsCache
from minispec.spec_decode.ngram import ngram_drafts
from minispec.sample.sampler import NOISE_MAX, NOISE_MIN, BatchSampling, greedy_tokens, plain_temperature
from minispec.spec_decode.proposer import Drafting, coupled_noise, draw_drafts, owned, proposal_uniforms


class HeadRunner:
    """The head's forwards over its own one-layer KV cache, in slot order like ModelRunner's."""

    def __init__(self, head: EagleHead | InferenceWeights, target_model, num_slots: int, max_len: int, device,
                 quant: str | None = None):
        self.weights = head if isinstance(head, InferenceWeights) else InferenceWeights(head, quant)
        cfg = self.weights.cfg
        self.cfg = cfg
        self.target = target_model  # its token embedding (and, for EAGLE-1 without a head, its LM head)
        self.device = torch.device(device)
        self.max_len = max_len
        self.kv = KVCache(1, num_slots, max_len, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.float32,
                          device=device)
        self.rotary = RotaryEmbedding(SimpleNamespace(rope_theta=cfg.rope_theta), cfg.head_dim, device=device)
        self.draft_ids = self.weights.draft_ids.to(device)  # [draft_vocab] target id of each row
        self.host_draft_ids = self.weights.draft_ids.cpu().numpy()  # [draft_vocab] the same, for host bookkeeping
        self.draft_rows = draft_rows(self.weights.draft_ids, target_model.vocab_size)  # [vocab] each id's row, -1: none
        self.host_draft_rows = self.draft_rows.numpy()  # the same, for host bookkeeping
        self.identity_vocab = bool((self.draft_ids == torch.arange(target_model.vocab_size, device=device)).all()) \
            if cfg.draft_vocab_size == target_model.vocab_size else False
        self.forward_s = 0.0
        self._no_later: dict[int, tuple] = {}  # batch size -> _steps_args' later-step arguments at num_steps = 1

    def _batch(self, slots: list[int], starts: list[int], tokens: list[list[int]], features: list[torch.Tensor]):
        """(slot order, ForwardBatch, attention metadata, features [B * L, F] in slot order) of a forward."""
        order = sorted(range(len(slots)), key=slots.__getitem__)
        batch = ForwardBatch.build([slots[i] for i in order], [starts[i] for i in order],
                                   [tokens[i] for i in order], self.kv.scratch_slot, self.device)
        if batch.max_ctx > self.max_len:
            raise ValueError(f"context of {batch.max_ctx} tokens exceeds the head's KV cache of {self.max_len}")
        B, L = batch.input_ids.shape
        lens = [len(tokens[i]) for i in order]
        if all(n == L for n in lens):  # no padding (batch 1, or every request feeding as many positions)
            feats = torch.cat([features[i] for i in order]).float()  # [B * L, F]
        else:
            feats = torch.zeros(B, L, features[0].shape[-1], dtype=torch.float32, device=self.device)  # [B, L, F]
            for b, i in enumerate(order):
                feats[b, : lens[b]] = features[i]
            feats = feats.view(B * L, -1)
        cfg = self.cfg
        meta = AttentionMetadata.build(batch, self.rotary(batch.positions, batch.max_ctx), self.kv.k[0],
                                       cfg.num_attention_heads // cfg.num_key_value_heads)
        return order, batch, meta, feats

    def _head_args(self, batch: ForwardBatch, meta: AttentionMetadata, feats: torch.Tensor, args: tuple) -> tuple:
        """head_layer's (and head_greedy's) arguments for a forward, but the fuse flag."""
        cfg = self.cfg
        return (batch.input_ids.view(-1), feats, *args, self.kv.k[0], self.kv.v[0],
                torch.view_as_real(meta.freqs_cis), meta.write_index, batch.positions, batch.read_slots, batch.last,
                cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim ** -0.5, cfg.rms_norm_eps)

    @torch.inference_mode()
    def forward(self, slots: list[int], starts: list[int], tokens: list[list[int]], features: list[torch.Tensor],
                fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Request i feeds tokens[i] (the tokens after each position) at positions starts[i].. with features[i]
        [len, C * hidden] (fused: the target's captured states, fc applied here) or [len, hidden] (the head's
        own outputs). Returns the last position's (draft-vocabulary logits [n, draft_vocab], pre-norm output
        [n, hidden]) per request, in request order."""
        t0 = time.perf_counter()
        order, batch, meta, feats = self._batch(slots, starts, tokens, features)
        B, L = batch.input_ids.shape
        w, cfg = self.weights, self.cfg
        if meta.fused and (args := self.cpu_args()):  # the steps below in one C++ call, same kernels
            ids, feats, *rest = self._head_args(batch, meta, feats, args)
            logits, out = cpu.ops().head_layer(ids, feats, fused, *rest)  # [B, draft_vocab], [B, H]
        else:
            hidden = (w.fuse(feats) if fused else feats).view(B, L, -1)  # [B, L, H]
            emb = self.target.embed_tokens(batch.input_ids).float()  # [B, L, H]
            x, residual = w.attention_input(emb, hidden)
            qkv = linear(x, w.qkv)
            attn = attention(qkv.contiguous(), meta, self.kv.k[0], self.kv.v[0], cfg.num_attention_heads)
            attn = attn.reshape(B * L, -1).index_select(0, batch.last)
            out = w.layer_output(attn, residual.reshape(B * L, -1).index_select(0, batch.last))  # [B, H]
            logits = w.logits(out, lambda h: self.target.compute_logits(h))
        logits, out = _request_order(order, 0, logits, out)
        self.forward_s += time.perf_counter() - t0
        return logits, out

    def _steps_args(self, slots: list[int], starts: list[int], tokens: list[list[int]], features: list[torch.Tensor],
                    num_steps: int) -> tuple | None:
        """(slot order, head_layer's arguments, the later steps' (cos_sin, positions, write_index)) of a proposal's
        steps in one C++ call, or None where the C++ layer does not apply (forward's other path)."""
        order, batch, meta, feats = self._batch(slots, starts, tokens, features)
        if not (meta.fused and (args := self.cpu_args())):
            return None
        B, cfg = len(order), self.cfg
        if num_steps == 1:  # no later steps (k = 1): empty arguments, built once per batch size
            if (later := self._no_later.get(B)) is None:
                later = self._no_later[B] = (torch.empty(B, 0, 1, cfg.head_dim // 2, 2, device=self.device),
                                             torch.empty(B, 0, dtype=torch.int64, device=self.device),
                                             torch.empty(B, 0, dtype=torch.int64, device=self.device))
            return order, self._head_args(batch, meta, feats, args), later
        last = np.array([starts[i] + len(tokens[i]) - 1 for i in order])  # [B] each request's last position
        pos = last[:, None] + np.arange(1, num_steps)  # [B, num_steps - 1]: the later steps' positions
        if (ctx := int(pos.max()) + 1) > self.max_len:
            raise ValueError(f"context of {ctx} tokens exceeds the head's KV cache of {self.max_len}")
        write = pos + np.array([slots[i] for i in order])[:, None] * self.kv.k[0].shape[1]  # [B, num_steps - 1]
        positions, write_index = torch.from_numpy(np.stack([pos, write])).to(self.device)
        cos_sin = torch.view_as_real(self.rotary(positions, ctx))  # [B, num_steps - 1, 1, head_dim / 2, 2]
        later = (cos_sin.contiguous(), positions.contiguous(), write_index.contiguous())
        return order, self._head_args(batch, meta, feats, args), later

    @torch.inference_mode()
    def greedy(self, slots: list[int], starts: list[int], tokens: list[list[int]], features: list[torch.Tensor],
               num_steps: int, min_confidence: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """HeadProposer's greedy steps in one C++ call (head_greedy): step 0 as forward(..., fused=True), step j feeds
        each request's step j - 1 argmax with the head's own output. Returns (logits [S, n, draft_vocab], argmax rows
        [S, n], drafting [S, n]: the confidence gate) in request order for the S <= num_steps steps run (all stopped:
        no more), or None where the C++ layer does not apply (forward's other path)."""
        t0 = time.perf_counter()
        if (steps := self._steps_args(slots, starts, tokens, features, num_steps)) is None:
            return None
        order, head_args, later = steps
        logits, rows, drafting = cpu.ops().head_greedy(*head_args, num_steps, self.draft_ids, float(min_confidence),
                                                       *later)
        out = _request_order(order, 1, logits, rows, drafting)
        self.forward_s += time.perf_counter() - t0
        return out

    @torch.inference_mode()
    def sampled(self, slots: list[int], starts: list[int], tokens: list[list[int]], features: list[torch.Tensor],
                num_steps: int, min_confidence: float, temperature: torch.Tensor, u: torch.Tensor, coupled: list
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """HeadProposer's sampled steps (sampler.plain_temperature's case) in one C++ call (head_sampled):
        the loop's draws, each request's by inverse CDF with u [n, >= num_steps] or, for the coupled rows
        (proposer.coupled_noise's per-step (indices, noise) or Nones), by exponential race. Returns (logits
        [S, n, draft_vocab], target ids [S, n], drafting [S, n]) in request order for the S <= num_steps steps run,
        or None where the C++ layer does not apply or a row's law is not a plain softmax (the loop's paths)."""
        t0 = time.perf_counter()
        if (steps := self._steps_args(slots, starts, tokens, features, num_steps)) is None:
            return None
        order, head_args, later = steps
        perm = torch.tensor(order)  # [n] position b -> its request
        at = torch.empty(len(order), dtype=torch.int64)
        at[perm] = torch.arange(len(order))  # [n] request -> its position
        vocab = len(self.host_draft_rows)
        if coupled[0] is None:
            rows, noise = torch.empty(0, dtype=torch.int64), torch.empty(0, 0, vocab)
        else:
            rows, noise = at[coupled[0][0]], torch.stack([c[1] for c in coupled])  # [m], [num_steps, m, vocab]
        out = cpu.ops().head_sampled(
            *head_args, num_steps, self.draft_ids, self.identity_vocab, self.draft_rows, vocab, float(min_confidence),
            *later, temperature[perm].float().contiguous(), u[perm].float().contiguous(), rows, noise.contiguous(),
            NOISE_MIN, NOISE_MAX)
        self.forward_s += time.perf_counter() - t0
        return _request_order(order, 1, *out) if out else None

    def cpu_args(self) -> tuple | None:
        """head_layer's arguments after the features: the target's token embedding (its packed rows or dense
        float32 weight, and qtype) and the head's weights (InferenceWeights.cpu_args); None where it does not apply
        (also under TP, where the embedding is sharded)."""
        args = self.weights.cpu_args()
        emb = self.target.embed_tokens
        if args is None or emb.tp_group.world_size > 1:
            return None
        w = emb.weight
        if isinstance(w, PackedWeight):
            return (w.data, w.qtype, *args)
        return (w, F32, *args) if cpu.applies(w) else None

    def full_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Draft-vocabulary logits [n, draft_vocab] -> [n, vocab_size], -inf outside the draft vocabulary."""
        if self.identity_vocab:
            return logits.float()
        full = torch.full((logits.shape[0], vocab_size), float("-inf"), dtype=torch.float32, device=logits.device)
        full[:, self.draft_ids] = logits.float()
        return full

    def copy(self, num_slots: int, max_len: int) -> "HeadRunner":
        """A runner over the same weights with a KV cache of its own."""
        return HeadRunner(self.weights, self.target, num_slots, max_len, self.device)

    def cost_catch_up(self, positions: int):
        """A timer for the head reading `positions` new positions of one request (slot 0, from position 0) in one
        forward, fc applied: what a probe after a pause costs it per request (spec_decode/costs.py)."""
        feat = torch.zeros(positions, len(self.cfg.feature_layers) * self.cfg.hidden_size)

        def step():
            self.forward([0], [0], [[0] * positions], [feat], fused=True)
        return step

    def cost_step(self, batch_size: int, context: int):
        """A timer for one draft step of batch_size requests after `context` positions (spec_decode/costs.py): the
        first of a proposal, on the target's captured states (fc applied; later steps skip it)."""
        feat = torch.zeros(1, len(self.cfg.feature_layers) * self.cfg.hidden_size)
        slots = list(range(batch_size))

        def step():
            self.forward(slots, [context] * batch_size, [[0]] * batch_size, [feat] * batch_size, fused=True)
        return step


class HeadProposer:
    """Drafts with an EAGLE head from the target's captured hidden states (see the module docstring)."""

    def __init__(self, runner: HeadRunner, target_runner: ModelRunner, k: int, lookup: tuple[int, int] | None = None,
                 min_confidence: float = 0.0):
        """lookup: (min_n, max_n) of a prompt lookup tried first (a request with a match drafts from it this step, and
        its head catches up later), or None. min_confidence: a request keeps draft j only while the head's
        probability of drafts 1 .. j - 1 times the largest probability of its law for draft j (each under the
        head's softmax) is at least this; that draft and the rest are -1 (greedy: the head's probability of drafts
        1 .. j). Lossless: whether a draft is kept depends on the drafts before it and on its law, never on its own
        value (cutting a sampled draft for its own low q would bias the draws the rejection sampler checks)."""
        self.runner = runner
        self.k = k
        self.has_kv_cache = True
        self.lookup = lookup
        self.min_confidence = min_confidence
        self.fused_greedy = True  # greedy batches draft every step in one C++ call where it applies (HeadRunner.greedy)
        self.fused_sampled = True  # and plain-temperature sampled ones (HeadRunner.sampled)
        self.vocab_size = runner.target.vocab_size
        # slot -> (first position p0, buffer [capacity, C * H], n): the states of positions p0 .. p0 + n - 1 are
        # buffer[:n]; the buffer doubles when full, so a head kept off by adaptive k costs O(1) a step, not O(n)
        self.pending: dict[int, tuple[int, torch.Tensor, int]] = {}
        target_runner.model.capture_layers = runner.cfg.feature_layers
        target_runner.on_hidden = self.take_hidden

    @property
    def forward_s(self) -> float:
        return self.runner.forward_s

    def take_hidden(self, slots: list[int], starts: list[int], lens: list[int], states: torch.Tensor) -> None:
        """Keep the target's captured states of each fed position; a forward from position s replaces those >= s."""
        at = 0
        for slot, s, n in zip(slots, starts, lens):
            rows = states[at : at + n]
            at += n
            old = self.pending.get(slot)
            if old is None:
                self.pending[slot] = (s, rows.clone(), n)
                continue
            p0, buf, kept = old
            if s < p0:
                rows = rows[p0 - s :]
                s = p0
            if s > p0 + kept:
                raise RuntimeError(f"slot {slot}: target states from position {s} leave a gap after {p0 + kept}")
            end = s - p0 + len(rows)
            if end > buf.shape[0]:
                grown = buf.new_empty(max(end, 2 * buf.shape[0]), buf.shape[1])
                grown[: s - p0] = buf[: s - p0]
                buf = grown
            buf[s - p0 : end] = rows
            self.pending[slot] = (p0, buf, end)

    def propose(self, reqs: list[Drafting], cache: DraftLogitsCache, num_steps: int | None = None) -> np.ndarray:
        """[num_reqs, num_steps] drafts (num_steps defaults to k): prompt lookup's where `lookup` is set and a match of
        at least lookup[0] tokens exists (one-hot logits, as NgramProposer), the head's for the others."""
        num_steps = self.k if num_steps is None else num_steps
        u = proposal_uniforms(reqs, self.k).to(self.runner.device)  # [num_reqs, k] every sampled request draws its k
        drafts = np.full((len(reqs), num_steps), -1, dtype=np.int64)  # [num_reqs, num_steps]
        use_head = np.ones(len(reqs), dtype=bool)
        if self.lookup is not None:
            found = ngram_drafts([r.token_ids for r in reqs], num_steps, *self.lookup)  # [num_reqs, num_steps]
            use_head = found[:, 0] < 0
            looked = np.flatnonzero(~use_head)
            if len(looked):
                slots = torch.tensor([reqs[i].slot for i in looked], dtype=torch.int64, device=cache.device)
                cache.write_one_hot(cache.rows_of(slots).long(), torch.from_numpy(found[looked]).to(cache.device))
                drafts[looked] = found[looked]
        idx = np.flatnonzero(use_head)
        if len(idx):
            drafts[idx] = self._head_drafts([reqs[i] for i in idx], cache, num_steps, u[torch.from_numpy(idx)])
        return drafts

    def _head_drafts(self, reqs: list[Drafting], cache: DraftLogitsCache, num_steps: int, u: torch.Tensor
                     ) -> np.ndarray:
        """num_steps head steps for every request; each rank runs them all (the head is small and replicated),
        writes the rows of the requests it owns and draws every request's tokens alike (u [num_reqs, k])."""
        _, mine, rows = owned(reqs, cache)
        mine = None if mine.all() else torch.from_numpy(mine).to(self.runner.device)  # None: every request is ours
        greedy = all(r.params.greedy for r in reqs)
        sampling = None if greedy else BatchSampling([r.params for r in reqs], self.runner.device)
        coupled = [None] * num_steps if greedy else coupled_noise(reqs, num_steps, self.vocab_size)
        drafts = np.full((len(reqs), num_steps), -1, dtype=np.int64)  # [num_reqs, num_steps]
        confidence = np.ones(len(reqs))  # [num_reqs] the head's probability of each request's drafts so far
        keep = np.ones(len(reqs), dtype=bool)  # [num_reqs] still drafting (min_confidence)
        slots = [r.slot for r in reqs]
        starts, tokens, feats = [], [], []
        for r in reqs:
            n = r.num_computed  # the target's states exist for positions < n; token n is the last sampled
            p0, states, _ = self.pending[r.slot]
            start = r.num_draft_computed
            if start < p0:
                raise RuntimeError(f"slot {r.slot}: the head needs states from position {start}, held from {p0}")
            starts.append(start)
            tokens.append(r.token_ids[start + 1 : n + 1])
            feats.append(states[start - p0 : n - p0])
            self.pending[r.slot] = (n, states, 0)  # the buffer is reused: feats are read before the next forward
            r.num_draft_computed = n  # the proposal below writes entries < n; drafts are overwritten next time

        def write(j: int, logits: torch.Tensor) -> None:  # logits [num_reqs, (S,) draft_vocab] of steps j.. in our rows
            if greedy and not cache.greedy_rows_read:  # nothing reads them: greedy verification compares tokens
                return
            ours = logits if mine is None else logits[mine]
            if self.runner.identity_vocab:
                cache.write(rows, j, ours)
            else:
                cache.write_subset(rows, j, ours, self.runner.draft_ids)

        if greedy and self.fused_greedy and \
                (steps := self.runner.greedy(slots, starts, tokens, feats, num_steps, self.min_confidence)) is not None:
            logits, rows_run, drafting = steps  # [S, num_reqs, draft_vocab], [S, num_reqs], [S, num_reqs]
            write(0, logits.transpose(0, 1))
            drafted = self.runner.host_draft_ids[rows_run.numpy().T]  # [num_reqs, S] target ids
            drafts[:, : logits.shape[0]] = np.where(drafting.numpy().T, drafted, -1)
            return drafts
        plain = not greedy and plain_temperature(sampling.temperature, sampling.top_k, sampling.top_p, self.vocab_size)
        if plain and self.fused_sampled and \
                (steps := self.runner.sampled(slots, starts, tokens, feats, num_steps, self.min_confidence,
                                              sampling.temperature, u, coupled)) is not None:
            logits, drawn, drafting = steps  # [S, num_reqs, draft_vocab], [S, num_reqs], [S, num_reqs]
            write(0, logits.transpose(0, 1))
            drafts[:, : logits.shape[0]] = np.where(drafting.numpy().T, drawn.numpy().T, -1)
            return drafts
        fused = True
        for j in range(num_steps):
            logits, hidden = self.runner.forward(slots, starts, tokens, feats, fused)
            write(j, logits)
            if greedy:  # the argmax over the draft vocabulary's rows: a sixth of the full row's work
                rows_j = greedy_tokens(logits)[0].cpu().numpy()  # [num_reqs] draft-vocabulary rows
                tok = self.runner.host_draft_ids[rows_j]
            else:  # drawn from the full row, as the rejection sampler recomputes q from the cache
                tok = draw_drafts(self.runner.full_vocab(logits, self.vocab_size), sampling, u[:, j], coupled[j])
                tok = tok.cpu().numpy()
                rows_j = None  # looked up only where the gate reads them
            drafts[:, j] = tok
            if self.min_confidence > 0:
                if rows_j is None:
                    rows_j = self.runner.host_draft_rows[tok]  # q is 0 outside the draft vocabulary: never drawn there
                probs = torch.softmax(logits.float(), -1)  # [num_reqs, draft_vocab]
                top = probs.amax(-1).cpu().numpy()  # [num_reqs] the law's largest probability, not the draw's
                keep &= confidence * top >= self.min_confidence
                confidence *= probs[torch.arange(len(reqs)), torch.from_numpy(rows_j)].cpu().numpy()
                drafts[~keep, j] = -1
                if not keep.any():
                    break
            starts = [s + len(t) for s, t in zip(starts, tokens)]
            tokens = [[int(t)] for t in tok]  # a stopped request's row still feeds its drawn token: a valid id
            feats = hidden.split(1)  # [1, H] each
            fused = False
        return drafts

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self.runner.kv.copy_prefix(src, dst, n)

    def free(self, req: Drafting) -> None:
        self.pending.pop(req.slot, None)
        req.num_draft_computed = 0


def _request_order(order: list[int], dim: int, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Tensors whose dim `dim` runs in slot order (order[b]: the request at position b) back in request order."""
    if order == list(range(len(order))):
        return ts
    inv = torch.empty(len(order), dtype=torch.long)
    inv[torch.tensor(order)] = torch.arange(len(order))
    return tuple(t.index_select(dim, inv.to(t.device)) for t in ts)
