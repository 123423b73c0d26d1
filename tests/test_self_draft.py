"""Weight-only quantisation (layers/quant.py quantize, models/quantize.py) and the self-drafts.

The quantiser against ggml's reference (gguf.quants.quantize: byte-equal), its round trip (exact on values
that are already Q8_0 / Q4_1; within half a step plus the float16 rounding of the scale and minimum on any
float32 weight); self-drafts lossless: greedy equal to target-only, and the first three sampled tokens
following the target's exact laws (chi-square, tests/test_lossless.py's enumeration) at T = 1 and at
T = 0.8 with top-p.
"""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from minispec.kernels.ggml import file_type
from minispec import LLM, SamplingParams
from minispec.generate import build_llm, build_parser
from minispec.layers.quant import GROUP, PackedWeight, dequantize_ref, quantize
from minispec.models.quantize import has_packed, kept_layers, parse_self_draft
from tests.test_lossless import NUM_TOKENS, PROMPT, VOCAB, ExactLaws, check_marginals, counts_of
from tests.utils import make_tiny_gguf, make_tiny_model_dir


def weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05 + torch.randn(n, 1, generator=g) * 0.02  # [n, k]
    w[0, :GROUP] = 0  # an all-zero block: d = 0
    return w


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1], ids=["Q8_0", "Q4_1"])
def test_quantize_equals_ggml_reference(qtype):
    """Byte for byte what gguf.quants.quantize (ggml's reference rounding) makes of the same float32 rows."""
    w = weights(37, 160)
    ref = np.ascontiguousarray(quants.quantize(w.numpy(), qtype)).view(np.uint8).reshape(37, -1)
    assert torch.equal(quantize(w, int(qtype)).data, torch.from_numpy(ref))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1], ids=["Q8_0", "Q4_1"])
def test_quantize_round_trip(qtype):
    w = weights(16, 96, seed=1)
    p = quantize(w, int(qtype))
    # Exact: values already on a Q8_0 / Q4_1 grid quantise back to the same bytes (the dequantised SmolLM2).
    assert torch.equal(quantize(dequantize_ref(p.data, p.qtype, 96), int(qtype)).data, p.data)
    # Any float32 weight: within half a step d plus the float16 rounding of d (times the code) and of the minimum.
    x = w.view(16, -1, GROUP)  # [N, G, 32]
    back = dequantize_ref(p.data, p.qtype, 96).view_as(x)
    if qtype == T.Q8_0:
        d = x.abs().amax(-1, keepdim=True) / 127
        bound = d / 2 + 127 * (d - d.half().float()).abs()
    else:
        lo = x.amin(-1, keepdim=True)
        d = (x.amax(-1, keepdim=True) - lo) / 15
        bound = d / 2 + 15 * (d - d.half().float()).abs() + (lo - lo.half().float()).abs()
    assert ((back - x).abs() <= bound * (1 + 1e-5) + 1e-7).all()


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="whole blocks of 32"):
        quantize(torch.zeros(2, 48), int(T.Q8_0))
    with pytest.raises(ValueError, match="Q8_0 or Q4_1"):
        quantize(torch.zeros(2, 64), int(T.F16))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("sd")), seed=3, vocab_size=VOCAB, num_hidden_layers=3)


def test_quantization_packs_the_layers_and_keeps_odd_widths_dense(target_dir, tmp_path):
    """int4: Q4_1 layers, a Q8_0 embedding; int8: Q8_0; a weight whose input width is not a multiple of 32 stays
    dense."""
    model = LLM(target_dir, None, quantization="int4").target.model
    assert file_type(model.layers[0].down_proj.weight.qtype) == int(T.Q4_1) and model.embed_tokens.weight.qtype == int(T.Q8_0)
    assert LLM(target_dir, None, quantization="int8").target.model.layers[0].gate_up_proj.weight.qtype == int(T.Q8_0)
    d = make_tiny_model_dir(str(tmp_path), hidden_size=48, num_attention_heads=4, num_key_value_heads=2)
    model = LLM(d, None, quantization="int4").target.model
    assert not isinstance(model.layers[0].qkv_proj.weight, PackedWeight)  # in_features 48
    assert not isinstance(model.embed_tokens.weight, PackedWeight)  # 48 wide
    assert file_type(model.layers[0].down_proj.weight.qtype) == int(T.Q4_1)  # in_features 128 (split where the kernels read it so)


def greedy(llm: LLM, n: int = 20) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.token_ids for o in llm.generate([PROMPT, [7, 3, 9], [1, 2, 3, 4, 5, 6, 7, 8]], sp)]


@pytest.mark.parametrize("spec", ["self-int8", "self-int4", "self-int4:2", "self:1"])
def test_self_draft_greedy_equals_target_only(target_dir, spec):
    target_only = greedy(LLM(target_dir, None))
    llm = LLM(target_dir, spec, num_speculative_tokens=3)
    assert greedy(llm) == target_only
    assert llm.draft.tokenizer is llm.target.tokenizer and not has_packed(llm.target.model)  # the target untouched
    assert llm.draft.model.num_layers == {"self-int4:2": 2, "self:1": 1}.get(spec, 3)
    # The draft shares the weights it does not change: the norms always, the layers of self:N.
    assert llm.draft.model.norm.weight is llm.target.model.norm.weight


@pytest.mark.parametrize("name, settings", [("T=1", dict(temperature=1.0)),
                                            ("T=0.8,top_p=0.9", dict(temperature=0.8, top_p=0.9))])
def test_self_draft_sampling_matches_target_law(target_dir, name, settings):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    llm = LLM(target_dir, "self-int4", num_speculative_tokens=2, max_num_seqs=256, max_num_batched_tokens=4096)
    params = [SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, seed=7_000_000 + i, **settings) for i in range(3000)]
    outs = llm.generate([PROMPT] * 3000, params)
    counts = counts_of([o.token_ids for o in outs])  # [3, V]: the 1st (prefill), 2nd and 3rd (verified) tokens
    check_marginals(f"self-int4 k=2 {name}", counts, ExactLaws(hf, hf, SamplingParams(**settings)).target())
    drafted = sum(o.metrics["num_draft_tokens"] for o in outs)
    accepted = sum(o.metrics["num_accepted_tokens"] for o in outs)
    assert 0 < accepted < drafted  # the draft is another model: the test exercises rejections


def test_kept_layers():
    assert kept_layers(30, 20) == [*range(19), 29]
    assert kept_layers(3, 3) == [0, 1, 2]


@pytest.mark.parametrize("spec, match", [
    ("self-int3", "no quantization 'int3'"), ("self", "the target itself"), ("self-int4:9", r"N must be in \[1, 3\]"),
    ("self:", "unknown self-draft"), ("self-int4:x", "unknown self-draft")])
def test_bad_self_draft_is_one_line_error(target_dir, spec, match):
    with pytest.raises(ValueError, match=match) as e:
        LLM(target_dir, spec)
    assert "\n" not in str(e.value)
    assert parse_self_draft("self-int4:2", 3) == ("int4", 2)


def test_bad_quantization_is_one_line_error(target_dir, tmp_path):
    with pytest.raises(ValueError, match="unknown quantization 'int2'; choose from: int8, int4"):
        LLM(target_dir, None, quantization="int2")
    with pytest.raises(ValueError, match="draft_dtype"):
        LLM(target_dir, "self-int8", draft_dtype="bfloat16")
    gguf = make_tiny_gguf(tmp_path / "t.gguf", "Q8_0")
    with pytest.raises(ValueError, match="already packed .* packed=False"):
        LLM(gguf, None, quantization="int4")
    # Loaded dequantised, the GGUF quantises; its Q8_0 weights re-quantise to the file's own bytes.
    packed = LLM(gguf, None).target.model.layers[0].down_proj.weight
    again = LLM(gguf, None, packed=False, quantization="int8").target.model.layers[0].down_proj.weight
    assert torch.equal(again.data, packed.data)
    # A packed GGUF has nothing dense to quantise: self-int8 would be the target itself; self:N applies.
    with pytest.raises(ValueError, match="already packed.*self:N"):
        LLM(gguf, "self-int8")
    assert LLM(gguf, "self:1").draft.model.num_layers == 1


def test_cli_flags_reach_the_llm(target_dir):
    args = build_parser().parse_args(["--target", target_dir, "--draft", "self-int4:2", "--quantization", "int8",
                                      "-k", "2"])
    llm = build_llm(args)
    assert llm.target.model.layers[0].down_proj.weight.qtype == int(T.Q8_0)
    assert llm.draft.model.num_layers == 2 and llm.num_speculative_tokens == 2
    args = build_parser().parse_args(["--target", target_dir, "--draft", "none", "--quantization", "int5"])
    with pytest.raises(ValueError, match="unknown quantization 'int5'"):
        build_llm(args)


def test_bench_rows_and_greedy_agreement():
    from types import SimpleNamespace

    from minispec import bench

    cfg = bench.BenchConfig(drafts=["self-int4", "ngram"], quantizations=["int4"], batch_sizes=[1], temperatures=[0.0])
    model = SimpleNamespace(device=torch.device("cpu"))
    rows = bench.build_rows(cfg, model, {}, {None: None, "ngram": None, "self-int4": None, "int4": None}, 0)
    assert [(r.system, r.method, r.draft) for r in rows] == [
        ("transformers", "target-only", None), ("transformers", "prompt-lookup", "ngram"),
        ("minispec", "target-only", None), ("minispec", "target-only int4", None),
        ("minispec", "speculative", "self-int4"), ("minispec", "speculative", "ngram")]
    out = lambda *ids: SimpleNamespace(token_ids=list(ids))  # noqa: E731
    got = bench.greedy_agreement([out(1, 2, 3), out(4, 5, 6)], [out(1, 2, 3), out(4, 0, 6)], 2)
    assert got == dict(first_divergence=[-1, 1], tokens_agreeing=4, tokens=6)
    with pytest.raises(ValueError, match="unknown quantization"):
        bench.check_config(bench.BenchConfig(quantizations=["int3"]))


def test_playground_sweeps_self_drafts(target_dir, tmp_path):
    from minispec.playground.config import PlaygroundConfig
    from minispec.playground.sweep import ModelCache, _Sweep

    cfg = PlaygroundConfig(target=target_dir, draft=["self-int4", "self:1"])
    sweep = _Sweep(cfg, ModelCache(tmp_path, cfg.dtype), {})
    assert file_type(sweep.drafts["self-int4"].model.layers[0].down_proj.weight.qtype) == int(T.Q4_1)
    last = sweep.target.model.layers[-1].down_proj.weight
    assert sweep.drafts["self:1"].model.layers[0].down_proj.weight is last  # shared, not copied


def test_self_draft_of_a_target_that_already_ran(target_dir):
    """A draft derived after the target's forwards runs its own weights, not the target's cached decode_layers
    arguments (tools hand LLM loaded targets that other engines have run)."""
    from minispec.models.quantize import self_draft

    base = LLM(target_dir, None)
    greedy(base)  # builds the target's decode_layers arguments (where the C++ path applies)
    draft = self_draft(base.target, "self-int4:2").model
    layers = draft.cpu_layers()
    if layers is not None:
        assert len(layers[0]) == 2 * 4 and all(file_type(q) == int(T.Q4_1) for q in layers[1])
    assert greedy(LLM(base.target, "self-int4:2", num_speculative_tokens=3)) == greedy(base)


def test_full_self_draft_runs_on_the_target_kv_cache(target_dir):
    """A self-draft with every layer drafts on the target's KV cache: it never prefills (every draft forward
    feeds one token) and never writes below the target's num_computed, so target-only greedy output holds."""
    llm = LLM(target_dir, "self-int4", num_speculative_tokens=3)
    proposer = llm.engine.proposer
    assert proposer.shares_target_kv and proposer.runner.kv is llm.engine.target.kv
    assert not LLM(target_dir, "self-int4:2", num_speculative_tokens=3).engine.proposer.shares_target_kv
    forward, offsets, lengths = proposer.runner.forward, [], []

    def checked(slots, starts, queries, *args, **kwargs):
        computed = {r.slot: r.num_computed for r in llm.engine.scheduler.running}
        offsets.extend(start - computed[slot] for slot, start in zip(slots, starts))
        lengths.extend(len(q) for q in queries)
        return forward(slots, starts, queries, *args, **kwargs)

    proposer.runner.forward = checked
    assert greedy(llm) == greedy(LLM(target_dir, None))
    assert offsets and min(offsets) == 0 and set(lengths) == {1}
