"""End-to-end engine tests on tiny random models: greedy equals transformers, batching, skips, seeds."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from minispec import LLM, SamplingParams
from tests.utils import DEVICES

PROMPTS = [[5, 17, 99, 3], [200, 1, 42, 42, 7, 8, 9, 10, 11, 12, 13], [77], list(range(30, 52))]


@pytest.fixture(scope="module")
def hf_greedy(target_dir):
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()

    def run(prompt, n):
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    return run


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("device", DEVICES)
def test_target_only_greedy_equals_transformers(target_dir, hf_greedy, device):
    """Greedy tokens on device equal transformers' greedy generate (float32, on CPU)."""
    llm = LLM(target=target_dir, max_num_seqs=4, device=device)
    outs = llm.generate(PROMPTS, GREEDY)
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == hf_greedy(p, 24)
        assert o.finish_reason == "length"
        assert o.metrics["accepted_per_position"] == []


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_speculative_greedy_equals_transformers(target_dir, draft_dir, hf_greedy, k, device):
    llm = LLM(target=target_dir, draft=draft_dir, num_speculative_tokens=k, max_num_seqs=4, device=device)
    outs = llm.generate(PROMPTS, GREEDY)
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == hf_greedy(p, 24)
        m = o.metrics
        assert len(m["accepted_per_position"]) == k
        assert m["num_accepted_tokens"] <= m["num_draft_tokens"] == m["num_spec_verifications"] * k
        n = m["num_spec_verifications"]
        assert m["num_accepted_tokens"] <= m["num_emitted_tokens"] <= m["num_accepted_tokens"] + n
        assert m["mean_accepted_length"] == pytest.approx(m["num_emitted_tokens"] / m["num_spec_verifications"])


def test_target_as_own_draft_accepts_everything(target_dir, hf_greedy):
    llm = LLM(target=target_dir, draft=target_dir, num_speculative_tokens=3, max_num_seqs=4)
    outs = llm.generate(PROMPTS, GREEDY)
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == hf_greedy(p, 24)
        assert o.metrics["acceptance_rate"] == 1.0


def test_metrics_count_what_was_emitted(target_dir, hf_greedy):
    """The target as its own draft accepts all 4 drafts of the first verification, but max_tokens = 3, or a
    stop token at the 3rd token, keeps 2 of them: the metrics count 2 accepted drafts and 2 tokens emitted
    by that verification, and nothing follows the stop token."""
    llm = LLM(target=target_dir, draft=target_dir, num_speculative_tokens=4, max_num_seqs=2)
    prompt = next(p for p in PROMPTS if hf_greedy(p, 3)[2] not in hf_greedy(p, 3)[:2])
    free = hf_greedy(prompt, 3)
    for params in (SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[free[2]], ignore_eos=True)):
        out = llm.generate([prompt], params)[0]
        assert out.token_ids == free
        m = out.metrics
        counts = (m["num_spec_verifications"], m["num_draft_tokens"], m["num_accepted_tokens"], m["num_emitted_tokens"])
        assert counts == (1, 4, 2, 2)
        assert m["accepted_per_position"] == [1, 1, 0, 0]
        assert m["mean_accepted_length"] == 2.0 and m["acceptance_rate"] == 0.5


@pytest.fixture(scope="module")
def spec_llm(target_dir, draft_dir):
    return LLM(target=target_dir, draft=draft_dir, num_speculative_tokens=2, max_num_seqs=4)


@pytest.mark.parametrize("top_k", [0, 5])
@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-8])
def test_tiny_temperatures_are_greedy(spec_llm, hf_greedy, temperature, top_k):
    """logits / T overflowed at T = 1e-40 (every token above 3.4e-2 tied at the largest float): now the argmax."""
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=12, seed=0, ignore_eos=True)
    for p, o in zip(PROMPTS, spec_llm.generate(PROMPTS, params)):
        assert o.token_ids == hf_greedy(p, 12)


def test_draft_logits_are_the_draft_models_on_the_accepted_context(target_dir, draft_dir):
    """Every cached draft step is transformers' draft logits on the request's tokens and the drafts before it,
    so the draft's KV cache was rolled back past every rejected draft (float32, atol 1e-4)."""
    hf = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    llm = LLM(target=target_dir, draft=draft_dir, num_speculative_tokens=3, max_num_seqs=4)
    proposer = llm.engine.proposer
    propose = proposer.propose
    checked = []

    def spy(reqs, cache, num_steps=None):
        drafts = propose(reqs, cache, num_steps)  # [num_reqs, num_steps]
        rows = cache.rows_of(torch.tensor([r.slot for r in reqs])).long()
        for r, row, d in zip(reqs, rows, drafts):
            with torch.no_grad():
                want = hf(torch.tensor([r.token_ids + d[:-1].tolist()])).logits[0, -len(d):]
            torch.testing.assert_close(cache.values[row, : len(d)], want, atol=1e-4, rtol=0)
            checked.append(r.req_id)
        return drafts

    proposer.propose = spy
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=16, seed=3, ignore_eos=True))
    assert len(checked) >= 4 * 4
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) < sum(o.metrics["num_draft_tokens"] for o in outs)


def test_mixed_batch_equals_each_alone_and_tight_budget(target_dir, draft_dir):
    llm = LLM(target=target_dir, draft=draft_dir, num_speculative_tokens=2, max_num_seqs=4)
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == alone
    # A budget of 5 tokens a step: prompts are chunked, decodes (3 tokens) are skipped in turn.
    tight = LLM(target=target_dir, draft=draft_dir, num_speculative_tokens=2, max_num_seqs=4,
                max_num_batched_tokens=5)
    outs = tight.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert all(o.finish_reason == "length" for o in outs)


def test_stale_drafts_are_rejected_and_counted(target_dir, hf_greedy):
    # The target as its own draft accepts every fresh draft; a budget of one decode per step
    # (1 + k tokens) makes requests take turns, so each takes the row of the one skipped before.
    k = 3
    llm = LLM(target=target_dir, draft=target_dir, num_speculative_tokens=k, max_num_seqs=2,
              max_num_batched_tokens=k + 1, shard_draft_logits=True)
    prompts = PROMPTS[:2]
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(p, 24)
    stale = sum(o.metrics["num_stale_drafts"] for o in outs)
    assert stale > 0
    # A stale draft is never accepted: every draft that was not stale was accepted (own draft).
    for o in outs:
        m = o.metrics
        assert m["num_accepted_tokens"] <= m["num_draft_tokens"] - m["num_stale_drafts"]
    # The same run with a replicated cache has no stale drafts and accepts everything.
    rep = LLM(target=target_dir, draft=target_dir, num_speculative_tokens=k, max_num_seqs=2,
              max_num_batched_tokens=k + 1, shard_draft_logits=False)
    outs_rep = rep.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs_rep] == [o.token_ids for o in outs]
    assert all(o.metrics["num_stale_drafts"] == 0 and o.metrics["acceptance_rate"] == 1.0 for o in outs_rep)


@pytest.mark.parametrize("draft", [False, True])
def test_seeded_sampling_independent_of_batch(target_dir, draft_dir, draft):
    kw = dict(draft=draft_dir, num_speculative_tokens=3) if draft else {}
    llm = LLM(target=target_dir, max_num_seqs=4, **kw)
    sp = [SamplingParams(temperature=0.9, top_k=50, top_p=0.95, max_tokens=20, seed=1000 + i, ignore_eos=True)
          for i in range(len(PROMPTS))]
    together = [o.token_ids for o in llm.generate(PROMPTS, sp)]
    alone = [llm.generate([p], s)[0].token_ids for p, s in zip(PROMPTS, sp)]
    assert together == alone
    again = [o.token_ids for o in llm.generate(PROMPTS[::-1], sp[::-1])][::-1]
    assert again == together
    other_seed = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.9, max_tokens=20, seed=7, ignore_eos=True))
    assert other_seed[0].token_ids != together[0]


def test_seeded_requests_reproducible_under_adaptive_k(target_dir, draft_dir):
    """Adaptive k: a seeded request shares the batch's k, yet its tokens are the same in a fresh LLM, alone or beside
    unseeded requests, when the costs measured for the batch (here: drafting pays alone, not at batch size 4)
    give it another k, and they are target-only's tokens for that seed (SamplingParams.coupled)."""
    def build():
        llm = LLM(target=target_dir, draft=draft_dir, num_speculative_tokens=3, max_num_seqs=4, adaptive_k=True)
        llm.engine.k_policy.cost_model = lambda b: (0.0, None) if b == 1 else (2.0, [1.0, 3.0, 4.0, 5.0])
        return llm

    seeded = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=1234, ignore_eos=True)
    unseeded = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, ignore_eos=True)
    llm = build()
    alone = llm.generate([PROMPTS[0]], seeded)[0]
    batch = llm.generate(PROMPTS, [seeded, unseeded, unseeded, unseeded])
    assert batch[0].token_ids == alone.token_ids
    assert batch[0].metrics["num_draft_tokens"] < alone.metrics["num_draft_tokens"]  # another k at some steps
    assert build().generate([PROMPTS[0]], seeded)[0].token_ids == alone.token_ids
    assert build().generate(PROMPTS[::-1], [unseeded] * 3 + [seeded])[3].token_ids == alone.token_ids
    assert LLM(target=target_dir).generate([PROMPTS[0]], seeded)[0].token_ids == alone.token_ids


@pytest.mark.parametrize("draft", ["model", "head", "ngram"])
def test_coupled_tokens_are_target_only_tokens(target_dir, draft_dir, draft):
    """A seeded sampled request's tokens equal target-only's for its seed at every k, with any proposer, and its
    drafts are accepted at times (the draft draws with the target's position-keyed noise)."""
    from minispec.models.loader import load_model
    from minispec.tools.tiny import make_tiny_head

    target = load_model(target_dir, dtype=torch.float32, device=torch.device("cpu"))
    proposer = {"model": draft_dir, "ngram": "ngram",
                "head": make_tiny_head(target.config, version=3, draft_vocab_size=40, seed=7) if draft == "head" else None}
    sp = [SamplingParams(temperature=t, top_k=tk, top_p=tp, max_tokens=20, seed=50 + i, ignore_eos=True)
          for i, (t, tk, tp) in enumerate([(1.0, 0, 1.0), (0.7, 20, 0.9), (0.3, 0, 0.8), (1.3, 5, 1.0)])]
    ref = [o.token_ids for o in LLM(target=target).generate(PROMPTS, sp)]
    accepted = 0
    for k in (1, 2, 3):
        outs = LLM(target=target, draft=proposer[draft], num_speculative_tokens=k, max_num_seqs=4).generate(PROMPTS, sp)
        assert [o.token_ids for o in outs] == ref, f"k={k}"
        accepted += sum(o.metrics["num_accepted_tokens"] for o in outs)
    assert accepted > 0


def test_abort_frees_slot(target_dir, draft_dir):
    llm = LLM(target=target_dir, draft=draft_dir, num_speculative_tokens=2, max_num_seqs=2)
    gen = llm.stream(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    next(gen)
    gen.close()  # cancelling the stream aborts both requests
    assert not llm.engine.has_unfinished()
    assert len(llm.engine.scheduler.free_slots) == 2
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)]


def test_a_bare_prompt_is_one_prompt(target_dir):
    """generate() and stream() both take a bare token-id list (or string) as one prompt, not a prompt per item."""
    llm = LLM(target=target_dir, max_num_seqs=2)
    want = llm.generate([PROMPTS[0]], GREEDY)[0].token_ids
    assert [o.token_ids for o in llm.generate(PROMPTS[0], GREEDY)] == [want]
    streamed = [(i, done) for i, _, done in llm.stream(PROMPTS[0], GREEDY)]
    assert {i for i, _ in streamed} == {0} and streamed[-1][1].token_ids == want


def test_stop_tokens_and_max_tokens(target_dir):
    llm = LLM(target=target_dir, max_num_seqs=2)
    free = llm.generate([PROMPTS[0]], GREEDY)[0].token_ids
    stop_at = free[5]
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at],
                                                    ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free[: free.index(stop_at) + 1]


def test_bad_requests(target_dir):
    llm = LLM(target=target_dir, max_num_seqs=2, max_model_len=64)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10_000]], GREEDY)
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="context"):
        llm.generate([list(range(64))], GREEDY)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["hello"], GREEDY)
    # prompt + max_tokens beyond the context stops with "length"
    out = llm.generate([list(range(60))], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(max_tokens=0), dict(top_k=-1)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_ngram_draft_through_llm(target_dir, hf_greedy):
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    llm = LLM(target=target_dir, draft="ngram", num_speculative_tokens=3, max_num_seqs=2, ngram_n=(1, 2))
    out = llm.generate([prompt], GREEDY)[0]
    assert out.token_ids == hf_greedy(prompt, 24)
    assert out.metrics["num_draft_tokens"] > 0


@pytest.mark.parametrize("with_draft", [True, False], ids=["draft", "target-only"])
def test_nan_logits_end_one_request_others_continue(target_dir, draft_dir, hf_greedy, with_draft):
    """A request whose target logits turn NaN ends with an error; with the draft, or target-only (greedy
    requests without drafts take verify's argmax shortcut)."""
    llm = LLM(target=target_dir, draft=draft_dir if with_draft else None, num_speculative_tokens=2, max_num_seqs=4)
    runner = llm.engine.target
    forward = runner.forward
    poisoned = {}

    def poisoning_forward(slots, starts, queries, num_logits, gather=True):
        logits = forward(slots, starts, queries, num_logits, gather).clone()
        row = 0
        for slot, n in zip(slots, num_logits):
            if slot == poisoned.get("slot") and n:
                logits[row : row + n, 3] = float("nan")
            row += n
        return logits

    runner.forward = poisoning_forward
    req = llm.add_request(PROMPTS[1], GREEDY)
    poisoned["slot"] = req.slot if req.slot >= 0 else 0
    outs = llm.generate([PROMPTS[0], PROMPTS[2]], GREEDY)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert req.finish_reason == "error" and "NaN" in req.error
    for p, o in zip([PROMPTS[0], PROMPTS[2]], outs):
        assert o.token_ids == hf_greedy(p, 24) and o.finish_reason == "length"
    assert len(llm.engine.scheduler.free_slots) == 4


def test_adaptive_k_turns_a_useless_draft_off(target_dir, draft_dir, hf_greedy):
    llm = LLM(target=target_dir, draft=draft_dir, num_speculative_tokens=4, max_num_seqs=4, adaptive_k=True)
    fixed = LLM(target=target_dir, draft=draft_dir, num_speculative_tokens=4, max_num_seqs=4)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(PROMPTS, sp)
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == hf_greedy(p, 40)
    # A random draft is rarely right: the policy drafts less than fixed k = 4 does.
    drafted = sum(o.metrics["num_draft_tokens"] for o in outs)
    drafted_fixed = sum(o.metrics["num_draft_tokens"] for o in fixed.generate(PROMPTS, sp))
    assert drafted < drafted_fixed


def test_observer_sees_each_steps_ks_and_every_beta(target_dir, draft_dir):
    """LLM(observer=...): on_step gets the k given at every draft opportunity, on_verify (record_beta) one beta
    per verified draft; neither changes the tokens."""
    from minispec.engine.observer import Observer

    class Recorder(Observer):
        record_beta = True

        def __init__(self):
            self.steps, self.betas = [], []

        def on_step(self, step):
            self.steps.append(step)

        def on_verify(self, reqs, betas):
            assert len(reqs) == len(betas)
            self.betas += [b for bs in betas for b in bs]

    sp = SamplingParams(temperature=0.8, max_tokens=12, seed=3, ignore_eos=True)
    rec = Recorder()
    outs = LLM(target=target_dir, draft=draft_dir, num_speculative_tokens=3, max_num_seqs=4, observer=rec
               ).generate(PROMPTS, sp)
    plain = LLM(target=target_dir, draft=draft_dir, num_speculative_tokens=3, max_num_seqs=4).generate(PROMPTS, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(k == 3 for s in rec.steps for k in s.ks)
    assert sum(len(s.ks) for s in rec.steps) == sum(o.metrics["num_spec_verifications"] for o in outs)
    assert len(rec.betas) == sum(o.metrics["num_draft_tokens"] for o in outs)
    assert all(0.0 <= b <= 1.0 + 1e-5 for b in rec.betas)
    assert all(s.step_s >= s.forward_s > 0 for s in rec.steps)
