"""EAGLE heads: the engine's cached forward against the training forward, the proposer's drafts against the head run
on the accepted context, lossless greedy output, and checkpoints in EAGLE-1 / EAGLE-3's formats."""
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from minispec import LLM, SamplingParams
from minispec.models.eagle import is_head_checkpoint, load_head, save_head
from minispec.models.errors import ModelLoadError
from minispec.models.loader import load_model
from minispec.runner.model_runner import ModelRunner
from minispec.spec_decode.head import HeadProposer, HeadRunner
from minispec.tools.tiny import make_tiny_head
from tests.utils import make_tiny_model_dir

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    # 4 layers, so that EAGLE-3's default feature layers (2, 2, 1 of a 4-layer model: 2, L // 2, L - 3) are distinct
    d = make_tiny_model_dir(str(tmp_path_factory.mktemp("head-target")), seed=0, num_hidden_layers=4)
    return load_model(d, dtype=torch.float32, device=CPU)


def captured_states(target, ids: list[int], layers) -> torch.Tensor:
    """The target's captured states [len(ids), C * H] of a whole sequence, from one prefill."""
    runner = ModelRunner(target.model, 1, len(ids) + 1, dtype=torch.float32, device=CPU)
    got = []
    runner.on_hidden = lambda slots, starts, lens, states: got.append(states.clone())
    target.model.capture_layers = tuple(layers)
    try:
        runner.forward([0], [0], [ids], [1])
    finally:
        target.model.capture_layers = ()
    return got[0]


@torch.no_grad()
def reference_logits(head, target, context: list[int], drafts: list[int]) -> torch.Tensor:
    """The head's full-vocabulary logits for each draft of one proposal, from its training forward: anchor
    len(context) - 2 (the last position the target computed), steps 0 .. len(drafts) - 1."""
    n = len(context) - 1  # positions whose states the target has
    feats = captured_states(target, context[:-1], head.cfg.feature_layers).unsqueeze(0)  # [1, n, C * H]
    tokens = torch.tensor([context[1:] + drafts[:-1]])  # token p + 1 at anchor p, then the drafts fed
    emb = target.model.embed_tokens(tokens).float()
    outs = head.train_steps(emb, feats, len(drafts), torch.ones(1, n, dtype=torch.bool))
    rows = [head.logits(o[0, n - 1], target.model.compute_logits) for o in outs]  # [Vd] each
    full = torch.full((len(drafts), head.cfg.vocab_size), float("-inf"))
    full[:, head.draft_ids] = torch.stack(rows) if head.cfg.version == 3 else torch.stack(rows)[:, head.draft_ids]
    return full


@pytest.mark.parametrize("version, draft_vocab", [(3, 100), (3, None), (1, None)])
def test_cached_forward_equals_training_forward(target, version, draft_vocab):
    """HeadRunner on its KV cache (prefill, then 3 chained steps from every anchor) == EagleHead.train_steps."""
    head = make_tiny_head(target.config, version=version, draft_vocab_size=draft_vocab, seed=1)
    ids = [5, 17, 9, 3, 30, 1, 44, 12, 200, 7, 8, 9, 100]
    n = len(ids) - 1
    feats = captured_states(target, ids[:-1], head.cfg.feature_layers)  # [n, C * H]
    steps = 3
    fed = ids[1:] + [3, 4]  # fed[p + j]: the token step j reads at anchor p
    emb = target.model.embed_tokens(torch.tensor([fed])).float()
    with torch.no_grad():
        outs = head.train_steps(emb, feats.unsqueeze(0), steps, torch.ones(1, n, dtype=torch.bool))
    runner = HeadRunner(head, target.model, 2, 64, CPU)
    for p in range(n - steps + 1):
        # Prefill positions 0 .. p with the target's states (a chunk per call, as the engine's verifications feed
        # them), then chain steps from anchor p.
        logits, hidden = runner.forward([1], [0], [ids[1 : p + 2]], [feats[: p + 1]], fused=True)
        for j in range(steps):
            want = head.logits(outs[j][0, p], target.model.compute_logits)
            torch.testing.assert_close(logits[0], want, rtol=1e-4, atol=1e-4, msg=f"anchor {p} step {j}")
            logits, hidden = runner.forward([1], [p + 1 + j], [[fed[p + 1 + j]]], [hidden], fused=False)


@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_one_call_head_layer_equals_the_op_by_op_forward(target, quant):
    """The C++ head_layer (short forwards on CPU) == the op-by-op torch forward: a padded batch of two requests
    (fused target states, 3 and 1 positions), then a step on the head's own outputs, each on its own KV cache."""
    head = make_tiny_head(target.config, version=3, draft_vocab_size=100, seed=2)
    fast = HeadRunner(head, target.model, 4, 32, CPU, quant)
    slow = HeadRunner(head, target.model, 4, 32, CPU, quant)
    assert fast.weights.cpu_args() is not None
    slow.weights._cpu_args = ()  # built and empty: head_layer does not apply, the torch ops run
    g = torch.Generator().manual_seed(0)
    C = len(head.cfg.feature_layers) * head.cfg.hidden_size
    feats = [torch.randn(3, C, generator=g), torch.randn(1, C, generator=g)]
    for runner in (fast, slow):  # positions before the forwards below, so the attention reads a context
        runner.forward([2, 0], [0, 0], [[1, 2, 3, 4], [5, 6]], [torch.randn(4, C, generator=torch.Generator()
                                                                               .manual_seed(1)),
                                                                  torch.randn(2, C, generator=torch.Generator()
                                                                              .manual_seed(2))], fused=True)
    args = ([2, 0], [4, 2], [[7, 8, 9], [10]], feats, True)
    (lf, hf), (ls, hs) = fast.forward(*args), slow.forward(*args)
    torch.testing.assert_close(lf, ls, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hf, hs, rtol=1e-5, atol=1e-5)
    args = ([2, 0], [7, 3], [[11], [12]], list(hf.unsqueeze(1)), False)
    (lf, hf), (ls, hs) = fast.forward(*args), slow.forward(*args)
    torch.testing.assert_close(lf, ls, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hf, hs, rtol=1e-5, atol=1e-5)


class Recorder(HeadProposer):
    """Keeps (context, drafts, cached logits) of every proposal of request slot 0."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen = []

    def propose(self, reqs, cache, num_steps=None):
        contexts = [list(r.token_ids) for r in reqs]
        cache.greedy_rows_read = True  # this recorder reads them (a greedy batch's rows are otherwise left unwritten)
        drafts = super().propose(reqs, cache, num_steps)
        slots = torch.tensor([r.slot for r in reqs])
        for i, r in enumerate(reqs):
            steps = torch.arange(drafts.shape[1])
            got = cache.read(slots[i : i + 1].repeat(len(steps)), steps)  # [k, V]
            self.seen.append((contexts[i], drafts[i].tolist(), got.clone()))
        return drafts


def check_proposals_are_the_head(target, head, prompts: list[list[int]], sp: SamplingParams, **llm_kw) -> list:
    """Generate with the head (k = 3, a Recorder), assert greedy output equals the target's alone and every draft's
    cached logits equal the head's training forward over the context the engine had when it drafted; the outputs."""
    ref = LLM(target, draft=None, enable_prefix_caching=False).generate(prompts, sp)
    llm = LLM(target, draft=head, num_speculative_tokens=3, **llm_kw)
    eng = llm.engine
    rec = Recorder(eng.proposer.runner, eng.target, 3)
    eng.proposer = rec
    out = llm.generate(prompts, sp)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert len(rec.seen) >= 10
    for context, drafts, got in rec.seen:
        want = reference_logits(head, target, context, drafts)
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got))
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-4)
    return out


@pytest.mark.parametrize("version, draft_vocab, budget", [(3, 100, 2048), (3, 100, 9), (1, None, 2048)])
def test_proposals_are_the_head_on_the_accepted_context(target, version, draft_vocab, budget):
    """Every draft's cached logits equal the head's training forward over the context the engine had when it
    drafted (the target's states at every accepted position, the head's KV rolled back), and greedy output equals
    the target's alone; budget 9 chunks prefills and skips decodes."""
    head = make_tiny_head(target.config, version=version, draft_vocab_size=draft_vocab, seed=2)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [10, 11, 12], list(range(20, 40))]
    check_proposals_are_the_head(target, head, prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                                 max_num_batched_tokens=budget, max_num_seqs=4)


@pytest.mark.parametrize("fused", [True, False])
def test_greedy_batches_leave_the_draft_logits_unwritten_unless_beta_is_recorded(target, fused):
    """A greedy batch's verification compares tokens, so the head writes no draft logits (the cache keeps its fill)
    unless the observer records beta; then it writes them, one beta (0 or 1) per draft. Greedy output equals the
    target's alone either way."""
    from minispec.engine.observer import Observer

    class Recorder(Observer):
        record_beta = True

        def __init__(self):
            self.betas = []

        def on_verify(self, reqs, betas):
            self.betas += [b for bs in betas for b in bs]

    head = make_tiny_head(target.config, version=3, draft_vocab_size=100, seed=2)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [10, 11, 12], list(range(20, 40))]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = [o.token_ids for o in LLM(target, draft=None).generate(prompts, sp)]
    rec = Recorder()
    for observer in (None, rec):
        llm = LLM(target, draft=head, num_speculative_tokens=3, max_num_seqs=4, observer=observer)
        llm.engine.proposer.fused_greedy = fused
        outs = llm.generate(prompts, sp)
        assert [o.token_ids for o in outs] == ref
        written = bool((llm.engine.draft_logits.values != 0).any())
        assert written == (observer is not None)
    accepted = sum(o.metrics["num_accepted_tokens"] for o in outs)
    assert len(rec.betas) == sum(o.metrics["num_draft_tokens"] for o in outs) > 0
    assert set(rec.betas) <= {0.0, 1.0} and sum(b == 1.0 for b in rec.betas) >= accepted


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("min_confidence", [0.02, 0.05])
def test_confidence_gate_cuts_where_the_heads_probability_falls(target, min_confidence, fused):
    """min_confidence: a greedy proposal keeps draft j only while the product of the head's probabilities of drafts
    1 .. j (read back from the cached logits) is at least the bound, the rest are -1, the engine verifies the kept
    drafts alone, and greedy output equals the target's alone; with every step in one C++ call (fused) and without."""
    head = make_tiny_head(target.config, version=3, draft_vocab_size=100, seed=2)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [10, 11, 12], list(range(20, 40))]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = LLM(target, draft=None).generate(prompts, sp)
    llm = LLM(target, draft=head, num_speculative_tokens=3, max_num_seqs=4)
    eng = llm.engine
    rec = Recorder(eng.proposer.runner, eng.target, 3, min_confidence=min_confidence)
    rec.fused_greedy = fused
    eng.proposer = rec
    out = llm.generate(prompts, sp)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    kept = 0
    for _, drafts, got in rec.seen:
        n = next((j for j, d in enumerate(drafts) if d < 0), len(drafts))
        assert all(d < 0 for d in drafts[n:])
        p = torch.softmax(got, -1).amax(-1)  # [k] the head's probability of its greedy draft at each step
        assert float(p[:n].prod()) >= min_confidence
        if n < len(drafts):
            assert float(p[: n + 1].prod()) < min_confidence
        kept += n
    cut = sum(d < 0 for _, drafts, _ in rec.seen for d in drafts)
    assert kept > 0 and cut > 0  # the bound cut some proposals and left drafts in others
    assert sum(o.metrics["num_draft_tokens"] for o in out) <= kept


def fused_against_loop(target, prompts, params, method: str, min_confidence: float, **llm_kw) -> list[list[int]]:
    """One engine run with HeadRunner.`method` (a proposal's steps in one C++ call) and one with the proposer's loop,
    over the same tiny head: both give the same drafts and cached logits (bit for bit) in every proposal, the one call
    ran (None only where a forward outgrows fused_max_tokens: 96 under AVX2) and never where it was off, and the gate
    (if any) cut some drafts. Returns the fused run's output tokens, which must equal the loop's."""
    head = make_tiny_head(target.config, version=3, draft_vocab_size=100, seed=2)
    seen, outs, calls = {}, {}, []
    for fused in (True, False):
        llm = LLM(target, draft=head, num_speculative_tokens=3, max_num_seqs=4, seed=0, **llm_kw)
        eng = llm.engine
        rec = Recorder(eng.proposer.runner, eng.target, 3, min_confidence=min_confidence)
        setattr(rec, f"fused_{method}", fused)

        def counted(*a, run=getattr(rec.runner, method), fused=fused):
            out = run(*a)
            calls.append((fused, out is not None))
            return out

        setattr(rec.runner, method, counted)
        eng.proposer = rec
        outs[fused] = [o.token_ids for o in llm.generate(prompts, params)]
        seen[fused] = rec.seen
    assert all(f for f, _ in calls) and sum(ran for _, ran in calls) >= 10
    assert outs[True] == outs[False]
    assert len(seen[True]) == len(seen[False]) >= 10
    for (c1, d1, l1), (c2, d2, l2) in zip(seen[True], seen[False]):
        assert c1 == c2 and d1 == d2 and torch.equal(l1, l2)
    if min_confidence:
        assert any(d < 0 for _, drafts, _ in seen[True] for d in drafts)
    return outs[True]


@pytest.mark.parametrize("min_confidence, quant", [(0.0, None), (0.05, None), (0.05, "int8")])
def test_greedy_steps_in_one_call_equal_the_step_by_step_loop(target, min_confidence, quant):
    """HeadRunner.greedy (every greedy draft step in one C++ call, the gate included) == the proposer's loop of
    HeadRunner.forward calls (fused_against_loop), in an engine run with chunked prefills and several requests, and
    greedy output equal to the target's alone."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [10, 11, 12], list(range(20, 40))]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = LLM(target, draft=None).generate(prompts, sp)
    out = fused_against_loop(target, prompts, sp, "greedy", min_confidence, max_num_batched_tokens=16,
                             draft_quantization=quant)
    assert out == [o.token_ids for o in ref]


@pytest.mark.parametrize("min_confidence", [0.0, 0.05])
def test_sampled_steps_in_one_call_equal_the_step_by_step_loop(target, min_confidence):
    """HeadRunner.sampled (every sampled draft step in one C++ call: the draws and the gate) == the proposer's loop
    (fused_against_loop), for a batch mixing requests drawn by inverse CDF (unseeded: the LLM's seed) and coupled ones
    (seeded), at T = 0.8 and 1."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [10, 11, 12], list(range(20, 40)), [3, 4]]
    params = [SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=7),
              SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=8),
              SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)]
    fused_against_loop(target, prompts, params, "sampled", min_confidence)


def test_draft_min_confidence_reaches_the_head_and_its_policy(target):
    head = make_tiny_head(target.config, version=3, draft_vocab_size=100, seed=2)
    assert LLM(target, draft=head, num_speculative_tokens=3, draft_min_confidence=0.05).engine.proposer.min_confidence \
        == 0.05
    assert LLM(target, draft=head, num_speculative_tokens=3).engine.proposer.min_confidence == 0.0
    gated = LLM(target, draft=head, num_speculative_tokens=3, adaptive_k=True, draft_min_confidence=0.05)
    assert gated.engine.k_policy.gated and not LLM(target, draft=head, adaptive_k=True).engine.k_policy.gated
    with pytest.raises(ValueError, match=r"draft_min_confidence must be in \[0, 1\)"):
        LLM(target, draft=head, draft_min_confidence=1.0)
    with pytest.raises(ValueError, match="not a head"):
        LLM(target, draft="ngram", draft_min_confidence=0.1)


def test_int8_head_is_lossless_and_smaller(target):
    head = make_tiny_head(target.config, version=3, draft_vocab_size=128, seed=3)
    prompts = [[5, 6, 7], list(range(30, 50))]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = LLM(target, draft=None).generate(prompts, sp)
    llm = LLM(target, draft=head, num_speculative_tokens=2, draft_quantization="int8")
    assert [o.token_ids for o in llm.generate(prompts, sp)] == [o.token_ids for o in ref]
    dense = HeadRunner(head, target.model, 1, 8, CPU).weights.nbytes()
    assert llm.engine.proposer.runner.weights.nbytes() < 0.4 * dense


def test_eagle3_checkpoint_round_trip(target, tmp_path):
    head = make_tiny_head(target.config, version=3, draft_vocab_size=100, seed=4)
    save_head(head, tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= set(state)
    assert state["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * target.config.hidden_size
    assert int(state["t2d"].sum()) == 100
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 100
    assert is_head_checkpoint(tmp_path)
    back = load_head(tmp_path, target.config)
    for (name, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name


def write_eagle1(head, path, prefix: str = ""):
    """An EAGLE-1 checkpoint as EAGLE's repository writes it: pytorch_model.bin with layers.0.* and fc (+ bias)."""
    path.mkdir(parents=True, exist_ok=True)
    p = prefix + "layers.0."
    state = {prefix + "fc.weight": head.fc.weight, prefix + "fc.bias": torch.randn(head.cfg.hidden_size) * 0.1,
             p + "self_attn.q_proj.weight": head.q_proj.weight, p + "self_attn.k_proj.weight": head.k_proj.weight,
             p + "self_attn.v_proj.weight": head.v_proj.weight, p + "self_attn.o_proj.weight": head.o_proj.weight,
             p + "mlp.gate_proj.weight": head.gate_proj.weight, p + "mlp.up_proj.weight": head.up_proj.weight,
             p + "mlp.down_proj.weight": head.down_proj.weight,
             p + "post_attention_layernorm.weight": head.post_attention_layernorm}
    torch.save({k: v.detach().clone() for k, v in state.items()}, path / "pytorch_model.bin")
    c = head.cfg
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "vocab_size": c.vocab_size}))
    return state


@pytest.mark.parametrize("prefix", ["", "model."])
def test_eagle1_checkpoint_loads_and_is_lossless(target, tmp_path, prefix):
    head = make_tiny_head(target.config, version=1, seed=5)
    state = write_eagle1(head, tmp_path / "e1", prefix)
    assert is_head_checkpoint(tmp_path / "e1")
    back = load_head(tmp_path / "e1", target.config)
    assert back.cfg.version == 1 and back.cfg.fc_bias and back.cfg.feature_layers == (target.config.num_hidden_layers,)
    assert torch.equal(back.fc.bias, state[prefix + "fc.bias"])
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = LLM(target, draft=None).generate([[4, 5, 6]], sp)
    assert LLM(target, draft=str(tmp_path / "e1")).generate([[4, 5, 6]], sp)[0].token_ids == ref[0].token_ids


def test_bad_checkpoints_get_one_line_errors(target, tmp_path):
    head = make_tiny_head(target.config, version=3, draft_vocab_size=50, seed=6)
    save_head(head, tmp_path / "ok")
    state = load_file(tmp_path / "ok" / "model.safetensors")
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())

    def variant(name, state_fn=lambda s: s, cfg_fn=lambda c: c):
        d = tmp_path / name
        d.mkdir()
        save_file(state_fn(dict(state)), str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(cfg_fn(dict(cfg))))
        return d

    cases = [
        (variant("hidden", cfg_fn=lambda c: c | {"hidden_size": 32}), "hidden_size 32; the target's is 64"),
        (variant("missing", state_fn=lambda s: {k: v for k, v in s.items() if k != "midlayer.mlp.up_proj.weight"}),
         "lacks tensor 'midlayer.mlp.up_proj.weight'"),
        (variant("d2t", state_fn=lambda s: s | {"d2t": s["d2t"] + 1000}), "outside the vocabulary [0, 256)"),
        (variant("layers", cfg_fn=lambda c: c | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 9]}}),
         "reads target layers [1, 9]; the target has 4"),
        (variant("shape", state_fn=lambda s: s | {"fc.weight": s["fc.weight"][:, :10].contiguous()}),
         "'fc.weight' has shape"),
        (tmp_path, "cannot read its config.json"),  # a directory that holds no head
    ]
    for path, message in cases:
        with pytest.raises(ModelLoadError, match=re.escape(message)) as e:
            load_head(path, target.config)
        assert "\n" not in str(e.value)


def test_head_with_prompt_lookup_drafts_matches_by_lookup_and_stays_lossless(target, tmp_path):
    """draft="HEAD+ngram": a request whose last 2+ tokens occurred before drafts what followed them (one-hot q), the
    others the head's; greedy output equals the target's alone, and a repeating prompt accepts more."""
    head = make_tiny_head(target.config, version=3, draft_vocab_size=100, seed=8)
    save_head(head, tmp_path / "h")
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12]]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = LLM(target, draft=None).generate(prompts, sp)
    llm = LLM(target, draft=str(tmp_path / "h") + "+ngram", num_speculative_tokens=3)
    assert llm.engine.proposer.lookup == (2, 3)
    cache, looked = llm.engine.draft_logits, []
    write_one_hot = cache.write_one_hot
    cache.write_one_hot = lambda rows, drafts: (looked.append(drafts.clone()), write_one_hot(rows, drafts))
    out = llm.generate(prompts, sp)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert looked  # some proposals came from the lookup (ngram_drafts has its own tests)
    with pytest.raises(ValueError, match="is not one"):
        LLM(target, draft="ngram+ngram")


@pytest.mark.parametrize("verify,c,acceptance,pays", [(1.1, 0.05, 0.6, True), (1.4, 0.15, 0.6, False),
                                                       (1.1, 0.05, None, False)])
def test_auto_takes_the_head_where_it_is_predicted_to_pay(tmp_path, monkeypatch, verify, c, acceptance, pays):
    """draft="auto" takes DRAFT_FOR_TARGET's head, with adaptive k, where (1 + its recorded acceptance) / (2-token
    verification + c) at the costs measured at init reaches AUTO_MIN_SPEEDUP (1.45x, 1.03x, a head without a
    recorded acceptance); else the target runs alone. Greedy output is the target's either way."""
    import minispec.llm as llm_mod
    from minispec.spec_decode.adaptive import AdaptiveK

    d = make_tiny_model_dir(str(tmp_path / "target"), seed=0, num_hidden_layers=4)
    target = load_model(d, dtype=torch.float32, device=CPU)
    save_head(make_tiny_head(target.config, version=3, draft_vocab_size=128, seed=3), tmp_path / "head",
              extra={"minispec": {"eval": {"acc_1": acceptance}}} if acceptance else None)
    monkeypatch.setitem(llm_mod.DRAFT_FOR_TARGET, d.lower(), (str(tmp_path / "head"), None))
    monkeypatch.setattr(llm_mod, "measure_costs", lambda *a, **kw: {"verify_ratio": {1: verify}, "c": {"head": c}})
    llm = LLM(d, max_num_seqs=2)
    assert isinstance(llm.engine.proposer, HeadProposer) == pays
    assert isinstance(llm.engine.k_policy, AdaptiveK) == pays
    if pays:  # a head's catch-up is measured and priced into the probes
        costs = llm.engine.k_policy.cost_model
        assert llm.engine.k_policy.catch_up_cost == costs.catch_up and 0 < costs.catch_up(2) < 1
    assert ("speculating" if pays else "the target runs alone") in llm.auto_draft
    loaded = LLM(target, max_num_seqs=2)  # an already-loaded target: "auto" looks up its name, as for the spec
    assert isinstance(loaded.engine.proposer, HeadProposer) == pays and loaded.auto_draft == llm.auto_draft
    prompts = [[5, 6, 7], list(range(30, 50))]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = LLM(target, draft=None).generate(prompts, sp)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == [o.token_ids for o in ref]
    assert LLM(d, draft=None).auto_draft is None  # nothing measured where "auto" was not asked
