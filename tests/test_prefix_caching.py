"""Prefix caching: a newcomer starts from the K/V of the longest prefix of its prompt that a running request or a
freed slot holds. Output equals recomputing the prompt (greedy tokens exactly, logprobs within float summation
order), for every proposer; the head's drafts from a reused prefix are the head on the accepted context; newcomers
wait for a shared prefill; and the scheduler's choices (in-place reuse, eviction, what is never reused)."""
import numpy as np
import pytest
import torch

from minispec import LLM, SamplingParams
from minispec.engine.request import DEFER_MIN_TOKENS, Request, Scheduler, common_prefix
from minispec.models.loader import load_model
from minispec.sample.random import RequestRandom
from minispec.tools.tiny import make_tiny_head
from tests.test_head import check_proposals_are_the_head
from tests.utils import make_tiny_model_dir

CPU = torch.device("cpu")
SHARED = list(range(40, 70))  # a 30-token "system prompt"
PROMPTS = [SHARED + [5, 6, 7, 8], SHARED + [9, 10], SHARED + [11, 12, 13], SHARED[:20] + [14, 15], [16, 17, 18],
           SHARED + [5, 6, 7, 8]]  # the last repeats the first: all but its last token reused


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = make_tiny_model_dir(str(tmp_path_factory.mktemp("prefix-target")), seed=0, num_hidden_layers=4)
    return load_model(d, dtype=torch.float32, device=CPU)


def run(llm, prompts, params):
    """(token ids, logprobs [(chosen, top)], cached tokens) of each prompt, all added at once."""
    outs = llm.generate(prompts, params)
    return ([o.token_ids for o in outs], [o.logprobs for o in outs], [o.metrics["num_cached_tokens"] for o in outs])


def assert_logprobs_close(a, b):
    for x, y in zip(a, b):
        assert len(x) == len(y)
        for (cx, tx), (cy, ty) in zip(x, y):
            assert abs(cx - cy) < 1e-4
            assert [t for t, _ in tx] == [t for t, _ in ty]
            np.testing.assert_allclose([v for _, v in tx], [v for _, v in ty], atol=1e-4)


@pytest.mark.parametrize("draft", [None, "target", "ngram", "self-int8", "head"])
@pytest.mark.parametrize("max_num_seqs", [2, 8])
def test_reused_prefixes_give_the_recomputed_output(target, draft, max_num_seqs):
    """Greedy tokens equal to the same engine without prefix caching, logprobs within 1e-4 (the reused K/V were
    computed in another batch: float summation order); the prompts that share 30 tokens with an earlier one reuse
    29 of them, the repeated prompt all but its last; a draft model that is the target accepts every draft."""
    spec = make_tiny_head(target.config, version=3, draft_vocab_size=100, seed=2) if draft == "head" else \
        target if draft == "target" else draft
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    got = {}
    for caching in (False, True):
        llm = LLM(target, draft=spec, num_speculative_tokens=3, max_num_seqs=max_num_seqs,
                  enable_prefix_caching=caching)
        got[caching] = run(llm, PROMPTS, sp)
        if draft == "target":
            outs = llm.generate(PROMPTS, sp)
            assert all(o.metrics["num_accepted_tokens"] == o.metrics["num_draft_tokens"] > 0 for o in outs)
    (ref, ref_lp, none_cached), (toks, lp, cached) = got[False], got[True]
    assert toks == ref
    assert_logprobs_close(lp, ref_lp)
    assert none_cached == [0] * len(PROMPTS)
    # with 2 slots the first prompt's slot is taken by later ones before the repeat arrives: it finds a shorter prefix
    assert cached[:5] == [0, 29, 29, 19, 0] and (cached[5] == 33 if max_num_seqs == 8 else 19 <= cached[5] <= 33)


@pytest.mark.parametrize("budget", [2048, 9])
def test_head_drafts_from_a_reused_prefix_are_the_head_on_the_context(target, budget):
    """Every proposal of a request that reused a prefix (the head's K/V copied with the target's) equals the head's
    training forward over the context: a head K/V entry left behind, or one that read the wrong token, would not;
    budget 9 chunks the prefills."""
    head = make_tiny_head(target.config, version=3, draft_vocab_size=100, seed=2)
    out = check_proposals_are_the_head(target, head, PROMPTS, SamplingParams(temperature=0, max_tokens=10,
                                                                             ignore_eos=True),
                                       max_num_batched_tokens=budget, max_num_seqs=2)
    assert sum(o.metrics["num_cached_tokens"] for o in out) >= 29 * 3


def test_newcomers_wait_for_a_shared_prefill(target):
    """Three requests sharing 30 tokens arrive together: the first prefills alone, the other two start a step later
    from its 29 tokens; a request sharing fewer than DEFER_MIN_TOKENS more does not wait."""
    llm = LLM(target, draft=None, max_num_seqs=4)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    reqs = [llm.add_request(p, sp) for p in (PROMPTS[0], PROMPTS[1], PROMPTS[2], [16, 17, 18])]
    llm.engine.step()
    assert [r.slot >= 0 for r in reqs] == [True, False, False, True]
    assert reqs[0].num_computed == len(PROMPTS[0]) and reqs[3].num_computed == 3
    llm.engine.step()
    assert [r.metrics.num_cached_tokens for r in reqs] == [0, 29, 29, 0]
    assert reqs[1].num_computed == len(PROMPTS[1]) and len(reqs[1].token_ids) == len(PROMPTS[1]) + 1


def make_request(tokens, arrival=0, **params):
    return Request(str(arrival), list(tokens), SamplingParams(**params), RequestRandom(0), arrival)


def finish(sched: Scheduler, req: Request, error: str | None = None) -> None:
    """What Engine._finish does to the scheduler: the slot keeps what both caches hold."""
    req.num_computed = len(req.token_ids)
    req.error = error
    sched.free(req)
    req.slot = -1


def test_scheduler_evicts_the_least_recently_freed_and_takes_the_source_last():
    """A newcomer copies its prefix into the least recently freed other slot, or takes the source slot itself when
    it is the only free one; forget_prefixes empties the free slots."""
    sched = Scheduler(3, 2048, reuse_prefixes=True)
    a, b, c = (make_request(p, i) for i, p in enumerate(([1] * 20 + [2], [3] * 20 + [4], [5] * 20 + [6])))
    for r in (a, b, c):
        sched.add(r)
    sched.schedule()
    slots = {r.arrival: r.slot for r in (a, b, c)}
    for r in (b, a, c):  # freed in this order: b's prefix is the least recently freed
        finish(sched, r)
    # a newcomer sharing a's prefix evicts b's (a copy); one sharing c's evicts a's, the least recently freed other
    # than its source; a third sharing c's takes c's slot itself, the only free one
    d, e, f = make_request([1] * 20 + [7], 3), make_request([5] * 20 + [8], 4), make_request([5] * 20 + [9], 5)
    for r in (d, e, f):
        sched.add(r)
    sched.schedule()
    assert [(c.src, c.dst, c.num_tokens) for c in sched.copies] == [(slots[0], slots[1], 19), (slots[2], slots[0], 19),
                                                                     (slots[2], slots[2], 19)]
    assert (d.slot, e.slot, f.slot) == (slots[1], slots[0], slots[2]) and not sched.held
    assert d.num_computed == e.num_computed == f.num_computed == f.metrics.num_cached_tokens == 19
    for r in (d, e):
        finish(sched, r)
    sched.forget_prefixes()
    g = make_request([1] * 20 + [7], 6)
    sched.add(g)
    sched.schedule()
    assert g.num_computed == 0 and g.metrics.num_cached_tokens == 0 and not sched.copies


def test_scheduler_never_reuses_an_errors_cache_nor_for_prompt_logprobs_and_stops_at_the_draft_cache():
    """A request that ended in an error leaves nothing; one asking prompt logprobs computes its whole prompt; with a
    proposer's own KV cache (draft_kv) a prefix is reused only as far as that cache holds it."""
    sched = Scheduler(4, 2048, reuse_prefixes=True, draft_kv=True)
    a, b = make_request([1] * 30, 0), make_request([2] * 30, 1)
    for r in (a, b):
        sched.add(r)
    sched.schedule()
    a.num_draft_computed, b.num_draft_computed = 10, 30
    slot_a = a.slot
    finish(sched, a)
    finish(sched, b, error="the target model produced NaN or inf logits")
    assert list(sched.held) == [slot_a]
    c = make_request([1] * 29 + [3], 2)
    d = make_request([1] * 29 + [3], 3, prompt_logprobs=1)
    e = make_request([2] * 29 + [3], 4)
    for r in (c, d, e):
        sched.add(r)
    sched.schedule()
    assert c.num_computed == c.num_draft_computed == 10  # a's draft cache held 10
    assert d.num_computed == 0 and e.num_computed == 0


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([5], [6]) == 0
    assert DEFER_MIN_TOKENS > 1
