"""Property-based fuzzing of the engine on tiny models (hypothesis).

Random arrivals (requests added between steps), prompt lengths, token budgets that force skips and
chunked prefills, aborts, per-request k, sampling settings, proposer (draft model / n-gram / none) and
draft-logits cache layout (sharded / replicated). Invariants checked on every example:

* greedy outputs equal target-only greedy of the same prompt (cut at max_tokens, a stop token, the
  context); an aborted request's output is a prefix of it;
* a seeded sampled (coupled) request gives the tokens target-only decoding gives it alone, stale drafts or
  not; unseeded sampled requests go through the rejection sampler;
* no stale draft and no placeholder draft is ever accepted, and accepted tokens are the drafts (checked
  on every call of the rejection sampler, which the engine module is made to call through a wrapper);
* every draft-logits row read at verification is fresh or flagged stale, by the test's own record of
  which request last wrote each cache row (not the engine's flags): a row flagged stale was last written
  by another request, and a row not flagged equals what the proposer wrote for this request;
* no token lost or duplicated: step deltas concatenate to the final output; its length is max_tokens
  unless stopped, aborted or at the context's end;
* every request ends ("length", "stop" or "abort"); the engine then holds nothing and every slot is free;
* metrics add up: accepted <= drafted - stale, drafted <= drafts * k, sum(accepted_per_position) ==
  accepted (non-increasing), accepted <= emitted <= accepted + drafts, mean accepted length == emitted /
  drafts.

Each test checks, on its own, that its examples exercised what it is for (skips, stale drafts, aborts,
accepted and rejected drafts, ...): the check does not depend on which other tests ran.

The LLMs are built once per module and reused (the engine is reusable); the scheduler's token budget
and a per-request k (Engine.k_policy) are set per example. MINISPEC_FUZZ_SCALE scales the number of
examples; runs are derandomized so the suite is deterministic.
"""
from __future__ import annotations

import itertools
import os
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import minispec.engine.engine as engine_mod
import minispec.spec_decode.rejection_sampler as rs_mod
from minispec import LLM, SamplingParams
from tests.utils import make_tiny_model_dir

MAX_MODEL_LEN = 48
MAX_NUM_SEQS = 4
EOS = 2  # the tiny checkpoints' eos_token_id
STALE_VARIANTS = ["self-sharded", "ngram-sharded", "draft-sharded"]
SCALE = float(os.environ.get("MINISPEC_FUZZ_SCALE", "1"))  # multiplies every test's number of examples
# MINISPEC_FUZZ_SHRINK=0 reports a failing example as found, without shrinking it (scripts/mutants.py).
PHASES = tuple(p for p in Phase if os.environ.get("MINISPEC_FUZZ_SHRINK", "1") != "0" or p != Phase.shrink)


def fuzz(examples: int, body, *args) -> Counter:
    """Run body(*args, data) on `examples` (times MINISPEC_FUZZ_SCALE) derandomized hypothesis examples;
    returns what they exercised (the growth of STATS)."""
    n = max(1, round(examples * SCALE))
    before = STATS.copy()

    @given(data=st.data())
    @settings(max_examples=n, deadline=None, derandomize=True, database=None, phases=PHASES,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    def run(data):
        body(*args, data)

    run()
    exercised = STATS - before
    print(f"\nfuzz {args[-1]}:", dict(sorted(exercised.items())))
    assert exercised["examples"] >= n
    return exercised


def require(exercised: Counter, *what: str) -> None:
    """The examples exercised each of `what` at least once."""
    for w in what:
        assert exercised[w] > 0, f"the fuzz never exercised: {w}"


# name -> (draft: None / "target" (its own draft) / "draft" / "ngram", k, sharded cache)
VARIANTS = {
    "none": (None, 0, False),
    "draft-replicated": ("draft", 4, False),
    "draft-sharded": ("draft", 4, True),
    "self-sharded": ("target", 3, True),
    "self-replicated": ("target", 3, False),
    "ngram-replicated": ("ngram", 4, False),
    "ngram-sharded": ("ngram", 3, True),
}

STATS: Counter = Counter()  # what the examples exercised and how many checks they passed
_ids = itertools.count()
WRITTEN: dict[int, torch.Tensor] = {}  # id(request) -> [num_steps, V] the draft logits its last proposal wrote
LAST_WRITER: dict[tuple[int, int], object] = {}  # (id(cache), row) -> the request that last wrote the row
CURRENT: list = []  # [verifier, requests] of the verification in progress


# ---- the rejection-sampler spy --------------------------------------------------------------------


def check_rows_read(logits, draft_logits, draft_tokens, stale, cu) -> None:
    """Each verified draft's logits row is fresh (last written by its request) iff it is not flagged stale,
    and a fresh row holds what the proposer wrote for the request (when the batch reads the cache)."""
    verifier, reqs = CURRENT
    cache = verifier.draft_logits
    if cache is None:
        return
    rows = cache.rows_of(torch.tensor([r.slot for r in reqs])).tolist()
    for i, (r, row) in enumerate(zip(reqs, rows)):
        start, end = int(cu[i]), int(cu[i + 1])
        for j in range(end - start - 1):
            if int(draft_tokens[start + j]) < 0:
                continue
            fresh = LAST_WRITER.get((id(cache), row)) is r
            flagged = stale is not None and bool(stale[start + j])
            assert flagged != fresh, f"draft {j} of {r.req_id}: fresh={fresh} but flagged stale={flagged}"
            if fresh and draft_logits is not logits:  # all-greedy batches compare tokens, reading no cache
                assert torch.equal(draft_logits[start + j].cpu(), WRITTEN[id(r)][j]), "a row holds other logits"
                STATS["checks: draft-logits rows read"] += 1
            STATS["checks: stale flags vs last writer"] += 1


def check_verdict(draft_tokens, stale, cu, tokens, num_sampled) -> None:
    """No stale or placeholder draft accepted; accepted tokens are the drafts; counts in range."""
    draft_tokens, cu = draft_tokens.cpu(), cu.cpu()
    tokens, num_sampled = tokens.cpu(), num_sampled.cpu()
    stale = stale.cpu() if stale is not None else None
    for i in range(cu.shape[0] - 1):
        start, end = int(cu[i]), int(cu[i + 1])
        num_drafts = end - start - 1
        accepted = int(num_sampled[i]) - 1
        assert 0 <= accepted <= num_drafts
        drafts = draft_tokens[start : start + num_drafts]
        assert tokens[i, :accepted].tolist() == drafts[:accepted].tolist()
        assert bool((drafts[:accepted] >= 0).all()), "a placeholder draft (-1) was accepted"
        if stale is not None:
            assert not bool(stale[start : start + accepted].any()), "a stale draft was accepted"
            STATS["stale draft rows seen"] += int(stale[start : start + num_drafts].sum())
        assert int(tokens[i, accepted]) >= 0
        assert bool((tokens[i, accepted + 1 :] == -1).all())
        STATS["checks: rejection-sampler verdicts"] += 1


@pytest.fixture(scope="module", autouse=True)
def spy_rejection_sampler():
    """The engine calls the rejection sampler (and its all-greedy host path) through check_rows_read and check_verdict
    for the whole module."""
    real = engine_mod.rejection_sample
    sample_mine = engine_mod.Verifier._sample_mine

    def spy(logits, draft_logits, draft_tokens, stale, cu, *args, **kwargs):
        check_rows_read(logits, draft_logits, draft_tokens.cpu(), None if stale is None else stale.cpu(), cu.cpu())
        verdict = real(logits, draft_logits, draft_tokens, stale, cu, *args, **kwargs)
        check_verdict(draft_tokens, stale, cu, verdict[0], verdict[1])
        return verdict

    real_greedy = rs_mod.greedy_accept
    real_coupled = engine_mod.coupled_verify
    in_coupled = []  # non-empty while coupled_verify runs (its greedy_accept covers a subset of the batch)

    def greedy_spy(argmax, draft_tokens, cu, k):  # the engine's host path for all-greedy batches of a replicated cache
        if in_coupled:
            return real_greedy(argmax, draft_tokens, cu, k)
        d, c = torch.from_numpy(draft_tokens), torch.from_numpy(cu)
        check_rows_read(None, None, d, None, c)  # no cache is read: freshness of the rows only
        tokens, num_sampled = real_greedy(argmax, draft_tokens, cu, k)
        check_verdict(d, None, c, torch.from_numpy(tokens), torch.from_numpy(num_sampled))
        return tokens, num_sampled

    def coupled_spy(logits, draft_tokens, cu, *args):  # the coupled requests (stale drafts arrive as -1)
        in_coupled.append(True)
        try:
            tokens, num_sampled = real_coupled(logits, draft_tokens, cu, *args)
        finally:
            in_coupled.clear()
        check_verdict(draft_tokens, None, cu, tokens, num_sampled)
        STATS["checks: coupled verdicts"] += 1
        return tokens, num_sampled

    def current(self, reqs, *args):
        CURRENT[:] = [self, reqs]
        return sample_mine(self, reqs, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_mod, "rejection_sample", spy)
        mp.setattr(rs_mod, "greedy_accept", greedy_spy)
        mp.setattr(engine_mod, "coupled_verify", coupled_spy)
        mp.setattr(engine_mod.Verifier, "_sample_mine", current)
        yield


def spy_proposer(llm: LLM) -> None:
    """Record, after every proposal, what it wrote to each request's row and that the request wrote it last."""
    proposer = llm.engine.proposer
    if proposer is None:
        return
    propose = proposer.propose

    def recording(reqs, cache, num_steps=None):
        drafts = propose(reqs, cache, num_steps)  # [num_reqs, num_steps]
        rows = cache.rows_of(torch.tensor([r.slot for r in reqs])).tolist()
        for r, row in zip(reqs, rows):
            LAST_WRITER[(id(cache), row)] = r
            WRITTEN[id(r)] = cache.values[row, : drafts.shape[1]].cpu().clone()
        return drafts

    proposer.propose = recording


# ---- models and references ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    """name -> LLM of that variant, each built on first use (a test of one variant builds two)."""
    target = make_tiny_model_dir(str(tmp_path_factory.mktemp("fz_target")), seed=0)
    draft = make_tiny_model_dir(str(tmp_path_factory.mktemp("fz_draft")), seed=1, num_hidden_layers=1)

    class Variants(dict):
        def __missing__(self, name):
            kind, k, sharded = VARIANTS[name]
            spec = {"draft": draft, "target": target, "ngram": "ngram", None: None}[kind]
            llm = LLM(target=target, draft=spec, num_speculative_tokens=max(k, 1), max_num_seqs=MAX_NUM_SEQS,
                      max_model_len=MAX_MODEL_LEN, shard_draft_logits=sharded, seed=0, ngram_n=(1, 3))
            spy_scheduler(llm)
            spy_proposer(llm)
            self[name] = llm
            return llm

    return Variants()


def spy_scheduler(llm: LLM) -> None:
    """Count decodes that the token budget skipped (they keep their drafts)."""
    sched = llm.engine.scheduler
    schedule = sched.schedule

    def counting_schedule():
        batch = schedule()
        picked = {id(s.req) for s in batch}
        STATS["skipped decodes"] += sum(1 for r in sched.running if r.num_drafts and id(r) not in picked)
        STATS["chunked prefills"] += sum(1 for s in batch if not s.emits)
        return batch

    sched.schedule = counting_schedule


_GREEDY_REF: dict[tuple[int, ...], list[int]] = {}


def greedy_reference(ref_llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Target-only greedy continuation of each prompt up to the context's end (cached)."""
    todo = [p for p in {tuple(p) for p in prompts} if p not in _GREEDY_REF]
    if todo:
        ref_llm.engine.scheduler.max_num_batched_tokens = 2048
        ref_llm.engine.k_policy = None
        params = [SamplingParams(temperature=0, max_tokens=MAX_MODEL_LEN - len(p), ignore_eos=True) for p in todo]
        for p, o in zip(todo, ref_llm.generate([list(p) for p in todo], params)):
            assert o.finish_reason == "length" and len(o.token_ids) == MAX_MODEL_LEN - len(p)
            _GREEDY_REF[p] = o.token_ids
    return [_GREEDY_REF[tuple(p)] for p in prompts]


def expected_greedy(ref: list[int], params: SamplingParams) -> tuple[list[int], str]:
    """What a greedy request must output given the target-only continuation ref."""
    stops = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        stops.add(EOS)
    for i, t in enumerate(ref[: params.max_tokens]):
        if t in stops:
            return ref[: i + 1], "stop"
    return ref[: params.max_tokens], "length"


# ---- driving the engine -------------------------------------------------------------------------


def run_requests(llm: LLM, specs: list[dict], budget: int) -> tuple[dict, dict]:
    """Add each spec's request at its arrival step, abort at its abort step, step until all end.

    Returns (request id -> Request, request id -> concatenated step deltas).
    """
    engine = llm.engine
    engine.scheduler.max_num_batched_tokens = budget
    k_of = {}
    engine.k_policy = lambda reqs: [k_of.get(r.req_id, engine.k) for r in reqs]
    reqs, deltas = {}, {}
    pending = sorted(specs, key=lambda s: s["arrival"])
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0]["arrival"] <= step:
            s = pending.pop(0)
            rid = f"r{next(_ids)}"
            k_of[rid] = s["k"]
            reqs[rid] = s["req"] = llm.add_request(s["prompt"], s["params"], request_id=rid)
            deltas[rid] = []
        for s in specs:
            if s.get("abort") == step and "req" in s and not s["req"].finished:
                llm.abort(s["req"].req_id)
                STATS["aborts"] += 1
        for out in engine.step():
            deltas[out.req.req_id] += out.new_token_ids
        step += 1
        assert step < 5000, "the engine made no progress (livelock or starvation)"
    engine.k_policy = None
    return reqs, deltas


def fresh(llm: LLM) -> LLM:
    """The LLM with nothing left from an earlier example (one that failed midway, while shrinking)."""
    for rid in list(llm.engine.requests):
        llm.abort(rid)
    llm.engine.k_policy = None
    return llm


def check_engine_empty(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.requests and not engine.has_unfinished()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert sorted(engine.scheduler.free_slots) == list(range(MAX_NUM_SEQS))
    STATS["checks: engine empty, slots free"] += 1


def check_request(req, delta: list[int], k: int, engine_k: int) -> None:
    """Deltas vs output, finish reason vs length, and the speculation counters."""
    out = req.output_token_ids
    p = req.params
    assert delta == out, "step deltas do not concatenate to the output"
    assert req.finish_reason in ("length", "stop", "abort"), (req.finish_reason, req.error)
    assert req.slot == -1 and req.drafts is None
    room = MAX_MODEL_LEN - req.num_prompt_tokens
    assert len(out) <= min(p.max_tokens, room)
    stops = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else {EOS})
    assert not any(t in stops for t in out[:-1]), "generation went on past a stop token"
    if req.finish_reason == "length":
        assert len(out) == min(p.max_tokens, room)
    elif req.finish_reason == "stop":
        assert out and out[-1] in stops
    STATS["checks: tokens (deltas, lengths, stops)"] += 1
    m = req.metrics
    assert len(m.accepted_per_position) == engine_k
    assert 0 <= m.num_accepted_tokens <= m.num_draft_tokens - m.num_stale_drafts
    assert m.num_draft_tokens <= m.num_spec_verifications * k
    assert sum(m.accepted_per_position) == m.num_accepted_tokens
    assert all(a >= b for a, b in zip(m.accepted_per_position, m.accepted_per_position[1:]))
    if k == 0:
        assert m.num_spec_verifications == m.num_draft_tokens == 0
    assert m.num_accepted_tokens <= m.num_emitted_tokens <= m.num_accepted_tokens + m.num_spec_verifications
    d = m.as_dict(len(out))
    if m.num_spec_verifications:
        assert d["mean_accepted_length"] == pytest.approx(m.num_emitted_tokens / m.num_spec_verifications)
        assert d["acceptance_rate"] == pytest.approx(m.num_accepted_tokens / m.num_draft_tokens)
    else:
        assert d["mean_accepted_length"] == 1.0
    STATS["checks: metrics"] += 1
    STATS["drafts verified"] += m.num_draft_tokens
    STATS["drafts accepted"] += m.num_accepted_tokens
    STATS["drafts rejected"] += m.num_draft_tokens - m.num_accepted_tokens
    STATS["stale drafts"] += m.num_stale_drafts


# ---- strategies ---------------------------------------------------------------------------------

prompts_st = st.one_of(
    st.lists(st.integers(0, 255), min_size=1, max_size=40),
    st.lists(st.integers(3, 8), min_size=1, max_size=40),  # a small alphabet: the n-gram proposer matches
)


@st.composite
def request_st(draw, engine_k: int, max_arrival: int):
    prompt = draw(prompts_st)
    greedy = draw(st.booleans())
    sampling = {} if greedy else dict(
        temperature=draw(st.sampled_from([0.3, 0.8, 1.0, 1.7])),
        top_k=draw(st.sampled_from([0, 1, 5, 50])),
        top_p=draw(st.sampled_from([1.0, 0.9, 0.3])),
        seed=draw(st.none() | st.integers(0, 2**40)),  # None: the rejection sampler; a seed: coupled
    )
    return dict(
        prompt=prompt,
        greedy=greedy,
        sampling=sampling,
        max_tokens=draw(st.integers(1, 24)),
        ignore_eos=draw(st.booleans()),
        stop_index=draw(st.none() | st.integers(0, 23)),  # greedy: stop at the reference's token there
        arrival=draw(st.integers(0, max_arrival)),
        abort=draw(st.none() | st.none() | st.integers(0, max_arrival + 12)),
        k=draw(st.integers(0, engine_k)) if engine_k else 0,
    )


def build_specs(ref_llm, raw: list[dict]) -> list[dict]:
    """SamplingParams for each drawn request (greedy stop tokens come from the greedy reference)."""
    refs = greedy_reference(ref_llm, [r["prompt"] for r in raw])
    specs = []
    for r, ref in zip(raw, refs):
        stop = None
        if r["greedy"] and r["stop_index"] is not None and r["stop_index"] < len(ref):
            stop = [ref[r["stop_index"]]]
        params = SamplingParams(temperature=0.0 if r["greedy"] else r["sampling"]["temperature"],
                                top_k=r["sampling"].get("top_k", 0), top_p=r["sampling"].get("top_p", 1.0),
                                seed=r["sampling"].get("seed"), max_tokens=r["max_tokens"],
                                ignore_eos=r["ignore_eos"], stop_token_ids=stop)
        specs.append(dict(r, params=params, ref=ref))
    return specs


# ---- the properties -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(VARIANTS))
def test_engine_invariants_under_random_arrivals(llms, name):
    exercised = fuzz(20, random_arrivals, llms, name)
    require(exercised, "chunked prefills", "aborts", "checks: coupled sample equals target-only alone")
    if VARIANTS[name][0] is not None:
        require(exercised, "skipped decodes", "drafts accepted", "drafts rejected", "checks: stale flags vs last writer",
                "checks: draft-logits rows read")


def random_arrivals(llms, name, data):
    llm = fresh(llms[name])
    engine_k = llm.engine.k
    # Budgets of about one decode (1 + k tokens) make requests take turns: skips and stale drafts.
    tight = st.sampled_from([engine_k + 1, engine_k + 2, 2 * engine_k + 2])
    budget = data.draw(tight | st.integers(engine_k + 1, 48) | st.just(2048), label="budget")
    max_arrival = data.draw(st.integers(0, 8), label="max_arrival")
    raw = data.draw(st.lists(request_st(engine_k, max_arrival), min_size=1, max_size=7), label="requests")
    specs = build_specs(llms["none"], raw)
    STATS["examples"] += 1
    STATS["requests"] += len(specs)

    _, deltas = run_requests(llm, specs, budget)
    check_engine_empty(llm)
    check_outputs(name, specs, deltas, engine_k)

    # Coupled requests give the tokens target-only decoding gives each alone, unhurried.
    again = [dict(s, arrival=0, abort=None) for s in specs if s["params"].coupled and s["req"].finish_reason != "abort"]
    if again:
        batched = [s["req"].output_token_ids for s in again]  # run_requests sets each copy's "req" anew
        alone, _ = run_requests(fresh(llms["none"]), again, 2048)
        check_engine_empty(llms["none"])
        for got, req in zip(batched, alone.values()):
            assert req.output_token_ids == got, name
            STATS["checks: coupled sample equals target-only alone"] += 1


def check_outputs(name: str, specs: list[dict], deltas: dict, engine_k: int) -> None:
    """Per-request checks, and greedy outputs against the target-only greedy reference."""
    for s in specs:
        req = s["req"]
        check_request(req, deltas[req.req_id], s["k"], engine_k)
        if s["greedy"]:
            want, reason = expected_greedy(s["ref"], s["params"])
            if req.finish_reason == "abort":
                assert req.output_token_ids == want[: len(req.output_token_ids)]
            else:
                assert (req.output_token_ids, req.finish_reason) == (want, reason), name
            STATS["checks: greedy equals target-only greedy"] += 1


@pytest.mark.parametrize("name", STALE_VARIANTS)
def test_stale_drafts_when_requests_take_turns(llms, name):
    # the random draft model's fresh drafts are rarely accepted (about 0.3 %): more examples to see some
    exercised = fuzz(25 if name.startswith("draft") else 15, requests_take_turns, llms, name)
    require(exercised, "stale drafts", "stale draft rows seen", "drafts accepted", "checks: draft-logits rows read")


def requests_take_turns(llms, name, data):
    # A budget of one decode (1 + k tokens) a step, with a sharded cache, makes the requests take turns
    # and each take the row of the one skipped before it: its drafts go stale and must be rejected.
    # The target as its own draft (or n-gram drafts on repetitive prompts) would accept them otherwise.
    llm = fresh(llms[name])
    engine_k = llm.engine.k
    raw = data.draw(st.lists(request_st(engine_k, 2), min_size=2, max_size=4), label="requests")
    raw = [dict(r, k=engine_k, abort=None if r["abort"] is None or r["abort"] % 3 else r["abort"]) for r in raw]
    specs = build_specs(llms["none"], raw)
    STATS["examples"] += 1
    STATS["requests"] += len(specs)
    _, deltas = run_requests(llm, specs, engine_k + 1)
    check_engine_empty(llm)
    check_outputs(name, specs, deltas, engine_k)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_stream_deltas_and_closing_midway(llms, name):
    require(fuzz(8, stream_and_close, llms, name), "streams closed midway", "checks: stream")


def stream_and_close(llms, name, data):
    llm = fresh(llms[name])
    STATS["examples"] += 1
    llm.engine.scheduler.max_num_batched_tokens = data.draw(st.integers(llm.engine.k + 1, 64), label="budget")
    prompts = data.draw(st.lists(prompts_st, min_size=1, max_size=6), label="prompts")
    params = [SamplingParams(temperature=data.draw(st.sampled_from([0.0, 1.0])),
                             max_tokens=data.draw(st.integers(1, 16)), seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    close_after = data.draw(st.none() | st.integers(0, 20), label="close_after")
    got = [[] for _ in prompts]
    finals = [None] * len(prompts)
    gen = llm.stream(prompts, params)
    for n, (i, new, done) in enumerate(gen):
        assert finals[i] is None, "a token arrived after its request finished"
        got[i] += new
        if done is not None:
            finals[i] = done
            assert done.token_ids == got[i], "streamed deltas do not concatenate to the final tokens"
        if close_after is not None and n >= close_after:
            gen.close()
            STATS["streams closed midway"] += 1
            break
    check_engine_empty(llm)
    refs = greedy_reference(llms["none"], prompts)
    for p, sp, toks, final, ref in zip(prompts, params, got, finals, refs):
        if final is None:
            assert close_after is not None
        else:
            assert len(toks) == min(sp.max_tokens, MAX_MODEL_LEN - len(p))
        if sp.greedy:
            assert toks == ref[: len(toks)]
        STATS["checks: stream"] += 1
