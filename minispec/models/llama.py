"""The Llama family (Llama, Mistral, Qwen2, SmolLM2) over the per-slot KV cache, tensor-parallel ready.

Per layer: RMSNorm -> fused q|k|v (column-parallel, heads split across ranks) -> RoPE -> attention
over the KV cache -> o_proj (row-parallel, one all_reduce) -> residual; RMSNorm -> fused gate|up
(column-parallel) -> SiLU(gate) * up -> down_proj (row-parallel, one all_reduce) -> residual.
At tp=1 every collective is skipped.

Sliding-window attention (Mistral v0.1, Qwen2 with use_sliding_window) is not implemented: the
loader caps max_model_len at the window, where full attention and the window agree.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from minispec.distributed import TPGroup, get_tp_group
from minispec.kernels import cpu
from minispec.kernels.ggml import F32
from minispec.layers.activation import silu_mul
from minispec.layers.attention import AttentionMetadata, ForwardBatch, attention
from minispec.layers.linear import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from minispec.layers.norm import RMSNorm
from minispec.layers.quant import PackedWeight, linear
from minispec.layers.rotary import RotaryEmbedding, interleave_rope_rows
from minispec.models.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config) -> int | None:
    """The attention window if the checkpoint uses one, else None."""
    window = getattr(config, "sliding_window", None)
    if config.model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
        return None
    return window


def check_architecture(model_type: str | None) -> None:
    """ModelLoadError unless minispec runs this model_type."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported architecture '{model_type}' (model_type); "
            f"minispec supports: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def check_tp(config, tp: int, name: str) -> None:
    """ModelLoadError unless tp divides the head counts and the MLP width."""
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
    }
    g = math.gcd(*sizes.values())
    valid = ", ".join(str(d) for d in range(1, g + 1) if g % d == 0)
    for attr, n in sizes.items():
        if n % tp:
            raise ModelLoadError(f"tp={tp} does not divide {attr}={n} of {name}; choose tp from {{{valid}}}")


class LlamaDecoderLayer(nn.Module):
    """One pre-norm transformer block; weights are this rank's shards."""

    def __init__(self, config, *, tp_group: TPGroup, dtype: torch.dtype, device, packed: bool = False):
        super().__init__()
        tp = tp_group.world_size
        hidden = config.hidden_size
        self.head_dim = head_dim_of(config)
        self.num_heads = config.num_attention_heads // tp  # per rank
        self.num_kv_heads = config.num_key_value_heads // tp  # per rank
        is_qwen2 = config.model_type == "qwen2"
        attention_bias = bool(getattr(config, "attention_bias", False)) and config.model_type == "llama"
        mlp_bias = bool(getattr(config, "mlp_bias", False)) and config.model_type == "llama"
        q_size = config.num_attention_heads * self.head_dim
        kv_size = config.num_key_value_heads * self.head_dim
        inter = config.intermediate_size
        kw = dict(tp_group=tp_group, dtype=dtype, device=device, packed=packed)
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps, dtype=dtype, device=device)
        self.qkv_proj = ColumnParallelLinear(hidden, [q_size, kv_size, kv_size], attention_bias or is_qwen2, **kw)
        self.o_proj = RowParallelLinear(q_size, hidden, attention_bias, **kw)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps, dtype=dtype, device=device)
        self.gate_up_proj = ColumnParallelLinear(hidden, [inter, inter], mlp_bias, **kw)
        self.down_proj = RowParallelLinear(inter, hidden, mlp_bias, **kw)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) -> (this block's MLP output, the residual stream before it); the stream is
        h + residual (h alone at the first layer, residual None). Keeps the add beside the next norm."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm.add_forward(h, residual)
        qkv = self.qkv_proj(x)  # [B, L, (nh + 2 nkv) * hd]
        attn = attention(qkv, meta, k_cache, v_cache, self.num_heads)  # [B, L, nh * hd]
        x, residual = self.post_attention_layernorm.add_forward(self.o_proj(attn), residual)
        return self.down_proj(silu_mul(self.gate_up_proj(x))), residual


class LlamaForCausalLM(nn.Module):
    """The native model: ``model(batch, kv)`` -> final hidden states; ``compute_logits`` -> logits."""

    def __init__(
        self,
        config,
        *,
        dtype: torch.dtype,
        device,
        tp_group: TPGroup | None = None,
        name: str | None = None,
        packed: bool = False,
    ):
        """packed: layers allocate nothing until loaded and keep packed weights (GGUF) packed."""
        super().__init__()
        tp_group = tp_group if tp_group is not None else get_tp_group()
        name = name or getattr(config, "_name_or_path", "") or config.model_type
        check_architecture(config.model_type)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported activation '{config.hidden_act}' of {name}; minispec supports: silu")
        check_tp(config, tp_group.world_size, name)
        self.config = config
        self.name = name
        self.tp_group = tp_group
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_layers = config.num_hidden_layers
        self.hidden_size = config.hidden_size
        self.head_dim = head_dim_of(config)
        self.num_heads = config.num_attention_heads // tp_group.world_size  # per rank
        self.num_kv_heads = config.num_key_value_heads // tp_group.world_size  # per rank
        self.vocab_size = config.vocab_size
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        kw = dict(tp_group=tp_group, dtype=dtype, device=device, packed=packed)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, **kw)
        self.vocab_size_padded = self.embed_tokens.vocab_size_padded
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, **kw) for _ in range(self.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.lm_head = None if self.tie_word_embeddings else VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, **kw
        )
        self.rotary = RotaryEmbedding(config, self.head_dim, device=device)
        self._cpu_layers: tuple | None = None  # decode_layers' weight arguments, built at the first short forward
        # Hidden states a draft head reads (EAGLE): layer l's entry is the residual stream entering layer l
        # (l == num_layers: the final normed output). forward() leaves them in `captured` [B, L, len * hidden].
        self.capture_layers: tuple[int, ...] = ()
        self.captured: torch.Tensor | None = None

    def forward(self, batch: ForwardBatch, kv) -> torch.Tensor:
        """Run every token of the batch, writing its K/V at (write_slots, positions); -> [B, L, hidden].
        With capture_layers set, self.captured holds those layers' hidden states [B, L, len * hidden]."""
        h = self.embed_tokens(batch.input_ids)  # [B, L, hidden]
        B, L, H = h.shape
        capture = self.capture_layers
        freqs_cis = self.rotary(batch.positions, batch.max_ctx)  # [B, L, 1, head_dim / 2]
        meta = AttentionMetadata.build(batch, freqs_cis, kv.k[0], self.num_heads // self.num_kv_heads, unpadded=True)
        captured = None
        if capture:  # the padded rows stay zero where the layers run on the real rows alone
            alloc = torch.zeros if meta.rows is not None else torch.empty
            captured = alloc(B, L, len(capture) * H, dtype=h.dtype, device=h.device)
        self.captured = captured
        if meta.fused and (layers := self.cpu_layers()):  # every layer in one C++ call, same kernels
            out = cpu.ops().decode_layers(
                h.view(B * L, H), *layers, kv.k, kv.v, torch.view_as_real(freqs_cis), meta.write_index,
                batch.positions, batch.read_slots, self.num_heads, self.num_kv_heads, self.head_dim ** -0.5,
                self.norm.eps, list(capture), captured.view(B * L, -1) if capture else torch.empty(0),
            )  # [B * L, hidden]
            return out.view(B, L, H)

        rows = meta.rows  # [N] with padding: the layers run on the real tokens' rows alone
        if rows is not None:
            h = h.view(B * L, H).index_select(0, rows)  # [N, H]

        def keep(layer: int, stream: torch.Tensor) -> None:
            for c, l in enumerate(capture):
                if l == layer:
                    if rows is None:
                        captured[..., c * H : (c + 1) * H] = stream
                    else:
                        captured.view(B * L, -1)[rows, c * H : (c + 1) * H] = stream

        keep(0, h)
        residual = None
        for i, layer in enumerate(self.layers):
            if i > 0 and capture:
                keep(i, h + residual)
            h, residual = layer(h, residual, meta, kv.k[i], kv.v[i])
        out = self.norm.add_forward(h, residual)[0]
        if capture:
            keep(self.num_layers, out)
        if rows is not None:  # padded rows: zeros
            out = out.new_zeros(B * L, H).index_copy_(0, rows, out).view(B, L, H)
        return out

    def weights_changed(self) -> None:
        """Forget what was built from the weights (decode_layers' arguments); call after replacing any."""
        self._cpu_layers = None

    def cpu_layers(self) -> tuple | None:
        """(weights, qtypes, biases, norms) for kernels/cpu_ops.cpp's decode_layers, or None where it does not
        apply: tp > 1, not float32 on CPU, or a weight that is neither packed nor dense float32."""
        if self._cpu_layers is None:
            self._cpu_layers = ()
            linears = [m for layer in self.layers
                       for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
            dense = [m.weight for m in linears if not isinstance(m.weight, PackedWeight)]
            if self.tp_group.world_size == 1 and self.dtype == torch.float32 and self.device.type == "cpu" and \
                    cpu.applies(*dense) and all(m.weight is not None for m in linears):
                norms = [n.weight for layer in self.layers for n in (layer.input_layernorm,
                                                                       layer.post_attention_layernorm)]
                self._cpu_layers = (
                    [m.weight.data if isinstance(m.weight, PackedWeight) else m.weight for m in linears],
                    [m.weight.qtype if isinstance(m.weight, PackedWeight) else F32 for m in linears],  # F32: dense
                    [m.bias if m.bias is not None else torch.empty(0) for m in linears],
                    norms + [self.norm.weight],
                )
        return self._cpu_layers or None

    def compute_logits(self, h: torch.Tensor, gather: bool = True) -> torch.Tensor:
        """h [N, hidden] -> float32 logits [N, vocab_size] (gather) or this rank's shard
        [N, vocab_size_padded / tp] with padded columns at -inf (no gather)."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = linear(h, head.weight).float()  # [N, shard]
        if self.tp_group.world_size == 1:
            return logits
        if head.num_real < head.shard_size:
            logits[..., head.num_real :] = float("-inf")
        if not gather:
            return logits
        return self.tp_group.all_gather(logits, dim=-1)[..., : self.vocab_size]

    @torch.no_grad()
    def load_weights(self, state_dict) -> None:
        """Copy this rank's shards from a full (unsharded) Hugging Face state dict (name -> tensor or
        PackedWeight); a shard split that cuts a quantisation block is a ModelLoadError."""
        self._cpu_layers = None
        try:
            self._load_weights(state_dict)
        except ModelLoadError:
            raise
        except ValueError as e:  # a packed shard that cuts a block, fused parts stored differently
            raise ModelLoadError(f"cannot load {self.name}: {e}") from None

    def _load_weights(self, state_dict) -> None:
        cfg = self.config
        hd = self.head_dim
        q_size = cfg.num_attention_heads * hd
        kv_size = cfg.num_key_value_heads * hd

        def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            if name not in state_dict:
                raise ModelLoadError(f"checkpoint lacks weight '{name}'")
            t = state_dict[name]
            if tuple(t.shape) != shape:
                raise ModelLoadError(f"weight '{name}' has shape {tuple(t.shape)}, expected {shape}")
            return t

        def get_opt(name: str, shape: tuple[int, ...], needed: bool) -> torch.Tensor | None:
            return get(name, shape) if needed else None

        H, V, I = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
        self.embed_tokens.load(get("model.embed_tokens.weight", (V, H)))
        if self.lm_head is not None:
            self.lm_head.load(get("lm_head.weight", (V, H)))
        self.norm.weight.copy_(get("model.norm.weight", (H,)))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.input_layernorm.weight.copy_(get(p + "input_layernorm.weight", (H,)))
            layer.post_attention_layernorm.weight.copy_(get(p + "post_attention_layernorm.weight", (H,)))
            a = p + "self_attn."
            qkv_bias = layer.qkv_proj.bias is not None
            for j, (proj, size) in enumerate((("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size))):
                w = get(a + proj + ".weight", (size, H))
                b = get_opt(a + proj + ".bias", (size,), qkv_bias)
                if proj != "v_proj":
                    w = w.permute_rows(lambda t: interleave_rope_rows(t, hd)) if isinstance(w, PackedWeight) \
                        else interleave_rope_rows(w, hd)
                    b = None if b is None else interleave_rope_rows(b, hd)
                layer.qkv_proj.load_part(j, w, b)
            layer.o_proj.load(
                get(a + "o_proj.weight", (H, q_size)), get_opt(a + "o_proj.bias", (H,), layer.o_proj.bias is not None)
            )
            m = p + "mlp."
            mlp_bias = layer.down_proj.bias is not None
            for j, proj in enumerate(("gate_proj", "up_proj")):
                w = get(m + proj + ".weight", (I, H))
                layer.gate_up_proj.load_part(j, w, get_opt(m + proj + ".bias", (I,), mlp_bias))
            layer.down_proj.load(get(m + "down_proj.weight", (H, I)), get_opt(m + "down_proj.bias", (H,), mlp_bias))
