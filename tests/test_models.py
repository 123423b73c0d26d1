"""The native Llama family against transformers' own models, and over the KV cache."""
from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from minispec.kernels import cpu
from minispec.runner.kv_cache import KVCache
from minispec.layers.attention import ForwardBatch, fused_max_tokens
from minispec.models.loader import load_model
from tests.utils import (decode_layers_both_ways, make_tiny_gguf, make_tiny_model_dir, requires_smollm2,
                         smollm2_gguf_path)

CASES = {
    "llama-untied": ("llama", dict(tie_word_embeddings=False)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-mha": ("llama", dict(num_key_value_heads=4)),
    "llama-mqa": ("llama", dict(num_key_value_heads=1)),
    "llama-bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama-head-dim": ("llama", dict(head_dim=32)),
    "llama-rope-llama3": ("llama", dict(rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16, rope_theta=10000.0))),
    "llama-rope-linear": ("llama", dict(rope_scaling=dict(rope_type="linear", factor=4.0, rope_theta=10000.0))),
    "llama-rope-yarn": ("llama", dict(rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=64, rope_theta=10000.0))),
    "qwen2": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "mistral": ("mistral", dict()),
}


def run(model, kv, slots, starts, queries):
    """Feed queries[i] at positions starts[i].. into slot slots[i]; -> per request logits [len, vocab]."""
    B, L = len(queries), max(len(q) for q in queries)
    batch = ForwardBatch.build(slots, starts, queries, kv.scratch_slot, "cpu")
    with torch.inference_mode():
        hidden = model(batch, kv)  # [B, L, hidden]
        logits = model.compute_logits(hidden.reshape(B * L, -1)).view(B, L, -1)
    assert torch.isfinite(logits).all(), "padded rows must stay finite"
    return [logits[i, : len(q)] for i, q in enumerate(queries)]


def new_kv(model, num_slots=4, max_len=64):
    return KVCache(model.num_layers, num_slots, max_len, model.num_kv_heads, model.head_dim,
                   dtype=torch.float32, device="cpu")


def hf_logits(path, ids, **kwargs):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny GQA llama with attention and MLP biases, loaded natively."""
    path = make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), attention_bias=True, mlp_bias=True, seed=3)
    return path, load_model(path, dtype=torch.float32, device="cpu").model


def prompt(n, seed=0, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    model_type, overrides = CASES[case]
    path = make_tiny_model_dir(tmp_path, model_type=model_type, seed=1, **overrides)
    model = load_model(path, dtype=torch.float32, device="cpu").model
    ids = prompt(40, seed=7)
    ours = run(model, new_kv(model), [0], [0], [ids])[0]
    ref = hf_logits(path, ids)
    assert ref.std() > 0.1  # the random weights give logits worth comparing
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("lens", [(7, 3, 12), (150, 90, 200)], ids=["fused", "unfused"])
def test_padded_batch_equals_each_alone(tiny, lens):
    """A padded batch's logits and captured states (EAGLE's features) equal each request's alone (atol 1e-5). At
    (150, 90, 200) the forward is past fused_max_tokens(): the layers run on the real tokens' rows alone
    (AttentionMetadata.rows), so the padded rows' outputs and captured states come back zero."""
    _, model = tiny
    queries = [prompt(n, i + 1) for i, n in enumerate(lens)]
    slots = [2, 0, 1]
    model.capture_layers = (0, 1, model.num_layers)
    try:
        batched = run(model, new_kv(model, max_len=256), slots, [0, 0, 0], queries)
        captured = model.captured  # [B, L, 3 * hidden]
        if len(lens) * max(lens) > fused_max_tokens():
            batch = ForwardBatch.build(slots, [0, 0, 0], queries, 4, "cpu")
            with torch.inference_mode():
                hidden = model(batch, new_kv(model, max_len=256))  # [B, L, hidden]
            assert (hidden[1, lens[1]:] == 0).all() and (hidden[1, : lens[1]] != 0).any()
            assert (model.captured[1, lens[1]:] == 0).all()  # so are the captured states' (no uninitialised rows)
        for b, (slot, q, got) in enumerate(zip(slots, queries, batched)):
            alone = run(model, new_kv(model, max_len=256), [slot], [0], [q])[0]
            torch.testing.assert_close(got, alone, atol=1e-5, rtol=0)
            torch.testing.assert_close(captured[b, : len(q)], model.captured[0], atol=1e-5, rtol=0)
    finally:
        model.capture_layers = ()


def test_runner_splits_a_long_query_out_of_short_ones(tiny):
    """A prefill among decodes runs as its own forward; the logits rows come back in request order."""
    from minispec.runner.model_runner import ModelRunner, length_groups

    assert length_groups([5] * 10 + [400]) == [list(range(10)), [10]]
    assert length_groups([3, 1, 2]) == [[1, 2, 0]] and length_groups([]) == []
    assert all(len(length_groups(lens)) == 1 for lens in ([1] * 64, [5] * 16, [30, 40, 50], [1, 2, 2, 6]))
    assert length_groups([1, 1, 1, 44]) == [[0, 1, 2], [3]]  # a prompt beside decodes: not 129 padded positions
    # groups both padded past unpadded_past merge while padding at most doubles the positions (attention's cost alone)
    lens = [17, 21, 25, 29, 34] * 3  # 15 prompts' rests after a shared prefix: 510 positions for 378 real
    assert len(length_groups(lens)) > 1 and length_groups(lens, unpadded_past=96) == [sorted(range(15), key=lens.__getitem__)]
    assert length_groups(lens, unpadded_past=600) == length_groups(lens)  # never padded past it: as before
    lens = [40] * 15 + [57]  # the 57 alone fits a fused forward: kept apart
    assert length_groups(lens, unpadded_past=96) == length_groups(lens) == [list(range(15)), [15]]
    assert length_groups([1] * 150 + [2000], unpadded_past=96) == [list(range(150)), [150]]  # 302000 for 2150
    _, model = tiny
    queries = [prompt(300, 6), prompt(1, 7), prompt(2, 8), prompt(290, 9)]
    runner = ModelRunner(model, 4, 320, dtype=torch.float32, device="cpu")
    got = runner.forward([0, 1, 2, 3], [0] * 4, queries, [2, 1, 2, 1])  # [6, vocab]
    want = [run(model, new_kv(model, max_len=320), [0], [0], [q])[0][-n:] for q, n in zip(queries, [2, 1, 2, 1])]
    torch.testing.assert_close(got, torch.cat(want), atol=1e-5, rtol=0)


def test_runner_reads_consecutive_slots_in_place_in_any_request_order(tiny):
    """Requests on slots 2, 0, 1 run as one forward in slot order (a consecutive range: the KV cache is read
    as a view); requests on slots 3, 0 take the copying path. Logits come back in request order either way."""
    from minispec.runner.model_runner import ModelRunner
    from minispec.layers.attention import ForwardBatch

    assert ForwardBatch.build([1, 2, 3], [0] * 3, [[1]] * 3, 9, "cpu").first_slot == 1
    assert ForwardBatch.build([2, 0, 1], [0] * 3, [[1]] * 3, 9, "cpu").first_slot == -1
    assert ForwardBatch.build([3, 0], [0] * 2, [[1]] * 2, 9, "cpu").first_slot == -1
    _, model = tiny
    queries = [prompt(9, 11), prompt(7, 12), prompt(8, 13)]
    want = [run(model, new_kv(model, max_len=32), [0], [0], [q])[0] for q in queries]
    for slots in ([2, 0, 1], [3, 0, 1]):
        runner = ModelRunner(model, 4, 32, dtype=torch.float32, device="cpu")
        got = runner.forward(slots, [0] * 3, [q[:-1] for q in queries], [2, 1, 3])
        torch.testing.assert_close(got, torch.cat([want[0][-3:-1], want[1][-2:-1], want[2][-4:-1]]), atol=1e-5, rtol=0)
        got = runner.forward(slots, [len(q) - 1 for q in queries], [q[-1:] for q in queries], [1, 1, 1])  # decode
        torch.testing.assert_close(got, torch.stack([w[-1] for w in want]), atol=1e-5, rtol=0)


def test_decode_and_chunks_match_full_forward(tiny):
    """Prefill, token-by-token decode of two requests at different positions, then a 3-token chunk."""
    _, model = tiny
    seqs = [prompt(20, 4), prompt(14, 5)]
    full = [run(model, new_kv(model), [0], [0], [s])[0] for s in seqs]
    kv = new_kv(model)
    slots = [3, 1]
    lens = [9, 4]
    outs = run(model, kv, slots, [0, 0], [s[:n] for s, n in zip(seqs, lens)])
    for f, o, n in zip(full, outs, lens):
        torch.testing.assert_close(o, f[:n], atol=1e-5, rtol=0)
    for _ in range(6):  # decode: one token each, queries start mid-sequence
        outs = run(model, kv, slots, lens, [[s[n]] for s, n in zip(seqs, lens)])
        for f, o, n in zip(full, outs, lens):
            torch.testing.assert_close(o[0], f[n], atol=1e-5, rtol=0)
        lens = [n + 1 for n in lens]
    chunks = [s[n : n + 3] for s, n in zip(seqs, lens)]  # verify / chunked prefill: several tokens mid-sequence
    outs = run(model, kv, slots, lens, chunks)
    for f, o, n in zip(full, outs, lens):
        torch.testing.assert_close(o, f[n : n + 3], atol=1e-5, rtol=0)


def test_rollback_rewrites_rejected_drafts(tiny):
    """Junk drafts past the accepted prefix, and stale keys of a longer earlier request, stay invisible."""
    _, model = tiny
    seq_a, seq_b = prompt(16, 6), prompt(10, 8)
    full_a = run(model, new_kv(model), [0], [0], [seq_a])[0]
    full_b = run(model, new_kv(model), [0], [0], [seq_b])[0]
    kv = new_kv(model)
    run(model, kv, [2], [0], [prompt(30, 9)])  # an earlier, longer request left keys in slot 2
    run(model, kv, [0, 2], [0, 0], [seq_a[:6], seq_b[:3]])
    run(model, kv, [0, 2], [6, 3], [prompt(5, 10), prompt(5, 11)])  # drafts, all rejected
    # Both rejected every draft: rewrite from there. b's keys 5..11 (< max_ctx 12) stay stale and must be hidden.
    outs = run(model, kv, [0, 2], [6, 3], [seq_a[6:12], seq_b[3:5]])
    torch.testing.assert_close(outs[0], full_a[6:12], atol=1e-5, rtol=0)
    torch.testing.assert_close(outs[1], full_b[3:5], atol=1e-5, rtol=0)


def test_rotary_table_equals_the_rotation_computed_per_position():
    """RotaryEmbedding's table rows, grown past their first size, against polar(scaling, p * inv_freq) computed
    for the positions alone (exact: the same float32 products and the same polar)."""
    from types import SimpleNamespace

    from minispec.layers.rotary import RotaryEmbedding
    rotary = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), 16)
    for positions, max_ctx in [(torch.tensor([[0, 1, 2], [7, 0, 0]]), 8), (torch.tensor([[300, 301]]), None),
                               (torch.tensor([[4095, 5]]), 4096)]:
        angles = positions.unsqueeze(-1).float() * rotary.inv_freq
        want = torch.polar(torch.ones_like(angles), angles).unsqueeze(2)  # [B, L, 1, 8]
        got = rotary(positions, max_ctx)
        assert got.shape == want.shape and torch.equal(got, want)
    assert rotary.table.shape == (4096, 8)


def test_compute_logits_shapes(tiny):
    _, model = tiny
    h = torch.randn(5, model.hidden_size)
    assert model.compute_logits(h).shape == (5, model.vocab_size)
    assert model.compute_logits(h, gather=False).shape == (5, model.vocab_size)  # tp=1: the whole vocab
    assert model.compute_logits(h).dtype == torch.float32


def test_bfloat16_close_to_float32(tiny):
    path, model32 = tiny
    model16 = load_model(path, dtype=torch.bfloat16, device="cpu").model
    ids = prompt(12, 12)
    ref = run(model32, new_kv(model32), [0], [0], [ids])[0]
    kv = KVCache(model16.num_layers, 2, 32, model16.num_kv_heads, model16.head_dim, dtype=torch.bfloat16, device="cpu")
    got = run(model16, kv, [0], [0], [ids])[0]
    assert got.dtype == torch.float32
    assert (got - ref).abs().max().item() < 0.1 * ref.abs().max().item()


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct through its alias: the GGUF read directly, weights packed."""
    return load_model("smollm2-135m-instruct", dtype=torch.float32, device="cpu")


@pytest.mark.smollm2
@pytest.mark.slow
@requires_smollm2
def test_smollm2_alias_matches_transformers(smollm2):
    loaded = smollm2
    assert loaded.vocab_size == 49152 and loaded.max_model_len == 8192
    assert loaded.tokenizer is not None and loaded.tokenizer.eos_token_id in loaded.eos_token_ids
    model = loaded.model
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    path = smollm2_gguf_path()
    ref = hf_logits(os.path.dirname(path), ids, gguf_file=os.path.basename(path))
    kv = KVCache(model.num_layers, 1, len(ids), model.num_kv_heads, model.head_dim, dtype=torch.float32, device="cpu")
    ours = run(model, kv, [0], [0], [ids])[0]
    # Packed weights, exact float32 math: only the summation order differs from transformers' GEMMs
    # (logits up to ~30 here; measured 1.1e-4 absolute, 4e-6 relative).
    assert (ours - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    assert ours[-1].argmax().item() == ref[-1].argmax().item()


def tiny_fused_model(kind: str, tmp_path):
    """A tiny model (dense with biases, or a GGUF of qtype kind) whose layers decode_layers takes; skips without
    the C++ kernels."""
    if kind == "dense":
        path = make_tiny_model_dir(tmp_path, attention_bias=True, mlp_bias=True, seed=4)
    else:
        path = make_tiny_gguf(tmp_path / "tiny.gguf", qtype=kind, seed=4)
    model = load_model(path, dtype=torch.float32, device="cpu").model
    if model.cpu_layers() is None:
        pytest.skip("the C++ CPU kernels could not be built")
    return model


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("kind", ["dense", "Q4_0", "Q4_1"])
def test_decode_layers_one_region_equals_op_by_op(kind, threads, tmp_path, monkeypatch):
    """decode_layers runs every layer in one parallel region (each thread a share of every op, barriers between):
    torch.equal to its op-by-op path (each op its own threads) at 1, 2, 3 and 5 tokens of one request and 2 x 8, at
    1, 2 and 3 threads: the output, the captured states, the residual stream left in h and the K / V caches."""
    model = tiny_fused_model(kind, tmp_path)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pairs = decode_layers_both_ways(cpu.ops(), model, monkeypatch)
    finally:
        torch.set_num_threads(before)
    for one, op_by_op in pairs:
        assert all(torch.equal(a, b) for a, b in zip(one, op_by_op))
    assert pairs[0][0][0].abs().sum() > 0


@pytest.mark.parametrize("fused_limit", [16, None])
@pytest.mark.parametrize("kind", ["dense", "Q4_1", "Q8_0"])
def test_decode_layers_equals_layer_by_layer(kind, fused_limit, tmp_path, monkeypatch):
    """kernels/cpu_ops.cpp's decode_layers (every layer in one C++ call) gives the same floats as the
    op-by-op Python path (torch.equal): a prefill of 2 x 20 tokens (SDPA's path under a limit of 16 fused tokens, the
    fused one under the default), decode (1 token), verify (5), a padded batch (2 x 3) and 2 x 8; and so do the
    hidden states a draft head reads (capture_layers: the embedding, a middle layer's input, the final output)."""
    import minispec.layers.attention as attention_mod
    if fused_limit is not None:
        monkeypatch.setattr(attention_mod, "FUSED_MAX_TOKENS", fused_limit)
    model = tiny_fused_model(kind, tmp_path)
    runs = []
    model.capture_layers = (0, 1, model.num_layers)
    for one_call in (True, False):
        layers = model.cpu_layers()
        model.cpu_layers = (lambda: layers) if one_call else (lambda: None)
        kv = new_kv(model)
        out = []

        def step(*args):
            out.extend(run(model, kv, *args))
            out.append(model.captured.clone())
        step([0, 1], [0, 0], [prompt(12, 1), prompt(20, 2)])  # prefill: 40 tokens
        step([0], [12], [prompt(1, 3)])
        step([1], [20], [prompt(5, 4)])
        step([0, 1], [13, 25], [prompt(3, 5), prompt(2, 6)])
        step([0, 1], [16, 27], [prompt(8, 7), prompt(8, 8)])  # 16 tokens
        runs.append(out)
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert torch.equal(runs[0][-1][..., : model.hidden_size],
                       model.embed_tokens(torch.tensor([prompt(8, 7), prompt(8, 8)])))
