"""Draft heads that read the target's hidden states (EAGLE-1 and EAGLE-3), in their public checkpoint formats.

A head is one decoder layer. At each position p it takes the embedding of token p + 1 and a feature of
position p, and predicts token p + 2:
- EAGLE-3: the feature is fc(the target's hidden states entering a low, a middle and a high layer) for
  positions the target computed, and the head's own pre-norm output for the drafts after; the layer's
  attention reads cat(input_layernorm(embedding), hidden_norm(feature)) [2 * hidden]; then norm and an LM
  head over a draft vocabulary (d2t: target id = draft id + d2t[draft id]).
- EAGLE-1: the feature is the target's final normed hidden state; fc(cat(embedding, feature)) feeds a plain
  decoder layer without an input norm, whose output goes through the target's LM head.

Checkpoints: a directory with config.json and model.safetensors (or pytorch_model.bin), tensors named as
EAGLE and vLLM name them (fc, midlayer.* or layers.0.*, norm, lm_head, d2t, t2d; an optional "model." prefix).
The weights stay in Hugging Face's rotary layout; `InferenceWeights` permutes and fuses them for the engine.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from minispec.kernels import cpu
from minispec.kernels.ggml import F32
from minispec.layers.quant import GROUP, QUANTIZATIONS, PackedWeight, kernel_layout, linear, quantize
from minispec.layers.rotary import interleave_rope_rows
from minispec.models.errors import ModelLoadError
from minispec.utils import one_line

EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
EAGLE1_ARCHS = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# name -> a head shipped inside the package (minispec/drafts/)
SHIPPED_HEADS: dict[str, Path] = {
    "smollm2-135m-instruct-eagle3": Path(__file__).resolve().parent.parent / "drafts" / "smollm2-135m-instruct-eagle3",
}


@dataclass
class HeadConfig:
    """The head's shape and which target hidden states it reads."""

    version: int  # 1 (EAGLE-1) or 3 (EAGLE-3)
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's
    draft_vocab_size: int  # rows of the head's own LM head (EAGLE-3); vocab_size for EAGLE-1
    feature_layers: tuple[int, ...]  # target layers whose entering stream it reads (num_layers: the final normed output)
    fc_bias: bool = False

    def to_hf(self) -> dict:
        """config.json in EAGLE-3's format (vLLM and SGLang read it)."""
        return {
            "architectures": [EAGLE3_ARCHS[0] if self.version == 3 else EAGLE1_ARCHS[0]], "model_type": "llama",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False, "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.feature_layers)},
        }


def aux_layers_default(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high features (vLLM's default): the streams entering layers 2, L // 2, L - 3."""
    return (2, num_layers // 2, num_layers - 3)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, w.shape, w, eps)


def attention_input(cfg: HeadConfig, input_norm, hidden_norm, fc, emb: torch.Tensor, feature: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(what q/k/v read, the residual stream) of a head from the token embedding and the feature [.., hidden]:
    EAGLE-3 the two normed and concatenated, EAGLE-1 fc (a callable) of the two."""
    if cfg.version == 3:
        eps = cfg.rms_norm_eps
        x = torch.cat([rms_norm(emb, input_norm, eps), rms_norm(feature, hidden_norm, eps)], -1)
        return x, feature
    x = fc(torch.cat([emb, feature], -1))
    return x, x


def head_logits(cfg: HeadConfig, norm, lm_head, prenorm: torch.Tensor, target_head) -> torch.Tensor:
    """A head's logits of its pre-norm output: EAGLE-3 lm_head (a callable) of the normed output, EAGLE-1 its own
    lm_head or, without one, the target's (target_head)."""
    if cfg.version == 3:
        return lm_head(rms_norm(prenorm, norm, cfg.rms_norm_eps))
    return lm_head(prenorm) if lm_head is not None else target_head(prenorm)


class EagleHead(nn.Module):
    """The head's weights in Hugging Face layout, and the pieces of its forward that training and the engine share."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        H, hd = cfg.hidden_size, cfg.head_dim
        nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        v3 = cfg.version == 3
        self.fc = nn.Linear(len(cfg.feature_layers) * H if v3 else 2 * H, H, bias=cfg.fc_bias)
        attn_in = 2 * H if v3 else H
        self.q_proj = nn.Linear(attn_in, nh * hd, bias=False)
        self.k_proj = nn.Linear(attn_in, nkv * hd, bias=False)
        self.v_proj = nn.Linear(attn_in, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        self.gate_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, H, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(H))
        if v3:
            self.input_layernorm = nn.Parameter(torch.ones(H))
            self.hidden_norm = nn.Parameter(torch.ones(H))
            self.norm = nn.Parameter(torch.ones(H))
            self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        else:
            self.lm_head = None  # the target's
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))  # [draft_vocab]
        self.acceptance: float | None = None  # first-position greedy acceptance on held-out answers, if recorded

    @property
    def draft_ids(self) -> torch.Tensor:
        """[draft_vocab] the target token id of each draft-vocabulary row."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    def attention_input(self, emb: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(what q/k/v read, the residual stream) from the token embedding and the feature [.., hidden]."""
        return attention_input(self.cfg, getattr(self, "input_layernorm", None), getattr(self, "hidden_norm", None),
                               self.fc, emb, feature)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: the target's captured states [.., C * hidden] -> the feature [.., hidden]; EAGLE-1: as is."""
        return self.fc(features) if self.cfg.version == 3 else features

    def logits(self, prenorm: torch.Tensor, target_head=None) -> torch.Tensor:
        """Draft-vocabulary logits of the head's pre-norm output (EAGLE-1: the target's head, target_head(h))."""
        return head_logits(self.cfg, getattr(self, "norm", None), self.lm_head, prenorm, target_head)

    # ---- training: the forward over whole sequences, fed its own outputs for later steps ----------------
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [.., L, head_dim] in Hugging Face's half-split layout."""
        hd = self.cfg.head_dim
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=positions.device) / hd))
        ang = positions.float().unsqueeze(-1) * inv  # [.., L, hd / 2]
        ang = torch.cat([ang, ang], -1)
        return ang.cos(), ang.sin()

    def train_steps(self, emb: torch.Tensor, features: torch.Tensor, steps: int, pad_mask: torch.Tensor
                    ) -> list[torch.Tensor]:
        """Training-time test: `steps` chained forwards over sequences, each step's pre-norm output [B, T, H].

        emb [B, T + steps - 1, H]: embeddings of tokens 1 .. (emb[:, p + j] is the token step j reads at anchor p);
        features [B, T, C * H]: the target's states at positions 0 .. T - 1; pad_mask [B, T] True on real
        positions. Step 0 at anchor p is the head at position p on the target's feature; step j > 0 reads the
        token at p + 1 + j and step j - 1's output at anchor p, and attends to step 0's keys at positions <= p
        and steps 1 .. j's keys at anchor p, as the engine's KV cache holds them while drafting.
        """
        cfg = self.cfg
        B, T, _ = features.shape
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        g = nh // nkv
        pos = torch.arange(T, device=features.device)
        causal = (pos[None, :] <= pos[:, None]) & pad_mask[:, None, None, :]  # [B, 1, T, T]
        hidden = self.fuse(features)
        keys, values, outs = [], [], []
        for j in range(steps):
            x, residual = self.attention_input(emb[:, j : j + T], hidden)
            cos, sin = self.rope(pos + j)
            q = self.q_proj(x).view(B, T, nh, hd).transpose(1, 2)  # [B, nh, T, hd]
            k = self.k_proj(x).view(B, T, nkv, hd).transpose(1, 2)  # [B, nkv, T, hd]
            v = self.v_proj(x).view(B, T, nkv, hd).transpose(1, 2)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            keys.append(k.repeat_interleave(g, 1))
            values.append(v.repeat_interleave(g, 1))
            scale = hd ** -0.5
            s0 = (q @ keys[0].transpose(-1, -2)) * scale  # [B, nh, T, T]
            s0 = s0.masked_fill(~causal, float("-inf"))
            diag = [(q * keys[i]).sum(-1, keepdim=True) * scale for i in range(1, j + 1)]  # [B, nh, T, 1] each
            w = torch.softmax(torch.cat([s0] + diag, -1), -1)
            a = w[..., :T] @ values[0]
            for i in range(1, j + 1):
                a = a + w[..., T + i - 1 : T + i] * values[i]
            h = self.o_proj(a.transpose(1, 2).reshape(B, T, nh * hd)) + residual
            hn = rms_norm(h, self.post_attention_layernorm, cfg.rms_norm_eps)
            out = self.down_proj(F.silu(self.gate_proj(hn)) * self.up_proj(hn)) + h
            outs.append(out)
            hidden = out
        return outs


def draft_rows(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab_size] the draft-vocabulary row of each target id (draft_ids [draft_vocab] inverted), -1 outside it."""
    rows = torch.full((vocab_size,), -1, dtype=torch.long)
    rows[draft_ids.cpu().long()] = torch.arange(len(draft_ids))
    return rows


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


class InferenceWeights:
    """A head's weights as the engine runs them: q|k|v and gate|up fused, q/k rows in the interleaved rotary
    layout (layers/rotary.py), each matrix dense float32 or packed (quant: "int8" = Q8_0) for quant.linear."""

    def __init__(self, head: EagleHead, quant: str | None = None):
        cfg = head.cfg
        hd = cfg.head_dim
        qtype, head_qtype = QUANTIZATIONS[quant] if quant is not None else (None, None)

        def w(t: torch.Tensor, qt=qtype):
            t = t.detach().float().contiguous()
            return kernel_layout(quantize(t, qt)) if qt is not None and t.shape[1] % GROUP == 0 else t

        self.cfg = cfg
        self.quant = quant
        self.fc = w(head.fc.weight, head_qtype)
        self.fc_bias = head.fc.bias.detach().float() if head.fc.bias is not None else None
        q = interleave_rope_rows(head.q_proj.weight.detach(), hd)
        k = interleave_rope_rows(head.k_proj.weight.detach(), hd)
        self.qkv = w(torch.cat([q, k, head.v_proj.weight.detach()]))
        self.o = w(head.o_proj.weight)
        self.gate_up = w(torch.cat([head.gate_proj.weight.detach(), head.up_proj.weight.detach()]))
        self.down = w(head.down_proj.weight)
        self.lm_head = w(head.lm_head.weight, head_qtype) if head.lm_head is not None else None
        det = lambda p: p.detach().float() if p is not None else None  # noqa: E731
        self.post_attention_layernorm = det(head.post_attention_layernorm)
        self.input_layernorm = det(getattr(head, "input_layernorm", None))
        self.hidden_norm = det(getattr(head, "hidden_norm", None))
        self.norm = det(getattr(head, "norm", None))
        self.draft_ids = head.draft_ids.clone()
        self._cpu_args: tuple | None = None  # head_layer's weight arguments, built at the first short forward

    def cpu_args(self) -> tuple | None:
        """(weights, qtypes, biases, norms) for kernels/cpu_ops.cpp's head_layer, or None where it does not apply:
        EAGLE-1, or a tensor the C++ kernels do not take (not float32 on CPU)."""
        if self._cpu_args is None:
            self._cpu_args = ()
            mats = [self.fc, self.qkv, self.o, self.gate_up, self.down, self.lm_head]
            norms = [self.input_layernorm, self.hidden_norm, self.post_attention_layernorm, self.norm]
            biases = [self.fc_bias] + [None] * 5
            dense = [m for m in mats if m is not None and not isinstance(m, PackedWeight)]
            if self.cfg.version == 3 and all(t is not None for t in mats + norms) and \
                    cpu.applies(*norms, *dense, *[b for b in biases if b is not None]):
                self._cpu_args = ([m.data if isinstance(m, PackedWeight) else m for m in mats],
                                  [m.qtype if isinstance(m, PackedWeight) else F32 for m in mats],
                                  [b if b is not None else torch.empty(0) for b in biases], norms)
        return self._cpu_args or None

    def nbytes(self) -> int:
        """Bytes of weights one head step reads."""
        ts = [self.fc, self.qkv, self.o, self.gate_up, self.down, self.lm_head]
        return sum(t.data.numel() if isinstance(t, PackedWeight) else t.numel() * 4 for t in ts if t is not None)

    def fc_apply(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.fc, self.fc_bias)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc_apply(features) if self.cfg.version == 3 else features

    def attention_input(self, emb: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return attention_input(self.cfg, self.input_layernorm, self.hidden_norm, self.fc_apply, emb, feature)

    def layer_output(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The pre-norm output [N, H] from the attention output [N, nh * hd] and the residual stream."""
        h = linear(attn, self.o) + residual
        gu = linear(rms_norm(h, self.post_attention_layernorm, self.cfg.rms_norm_eps), self.gate_up)
        gate, up = gu.chunk(2, -1)
        return linear(F.silu(gate) * up, self.down) + h

    def logits(self, prenorm: torch.Tensor, target_logits) -> torch.Tensor:
        """Draft-vocabulary logits [N, draft_vocab] (EAGLE-1 without its own head: target_logits(h), full vocab)."""
        lm_head = (lambda h: linear(h, self.lm_head)) if self.lm_head is not None else None
        return head_logits(self.cfg, self.norm, lm_head, prenorm, target_logits)


# ---- checkpoints ---------------------------------------------------------------------------------------
def is_head_checkpoint(spec) -> bool:
    """Whether spec is a directory holding an EAGLE-1 or EAGLE-3 head."""
    if not isinstance(spec, (str, Path)):
        return False
    path = Path(spec)
    if not (path / "config.json").is_file():
        return False
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    archs = cfg.get("architectures") or []
    return any(a in EAGLE3_ARCHS + EAGLE1_ARCHS for a in archs) or "draft_vocab_size" in cfg or \
        (cfg.get("num_hidden_layers") == 1 and _weights_have(path, "fc.weight"))


def _weights_have(path: Path, name: str) -> bool:
    """Whether a checkpoint directory's weights hold a tensor (safetensors: read from the header alone)."""
    f = path / WEIGHT_FILES[0]
    if f.is_file():
        from safetensors import safe_open

        with safe_open(str(f), framework="pt") as st:
            return name in st.keys() or "model." + name in st.keys()
    try:
        return name in _read_weights(path)
    except ModelLoadError:
        return False


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by name, without a leading "model." (EAGLE and speculators write both)."""
    for fname in WEIGHT_FILES:
        f = path / fname
        if f.is_file():
            if fname.endswith(".safetensors"):
                from safetensors.torch import load_file
                state = load_file(str(f))
            else:
                state = torch.load(f, map_location="cpu", weights_only=True)
            return {k.removeprefix("model."): v for k, v in state.items()}
    raise ModelLoadError(f"head checkpoint {path} has no {' or '.join(WEIGHT_FILES)}")


def load_head(path: str | Path, target_config) -> EagleHead:
    """An EAGLE-1 or EAGLE-3 head from a directory, checked against the target's config (one-line errors)."""
    path = Path(path)
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"head checkpoint {path}: cannot read its config.json ({one_line(e)})") from None
    state = _read_weights(path)
    archs = raw.get("architectures") or []
    fc = state.get("fc.weight")
    if fc is None:
        raise ModelLoadError(f"head checkpoint {path} lacks tensor 'fc.weight'")
    H = raw.get("hidden_size")
    if H != target_config.hidden_size:
        raise ModelLoadError(f"head checkpoint {path} has hidden_size {H}; the target's is {target_config.hidden_size}")
    version = 3 if any(a in EAGLE3_ARCHS for a in archs) or "midlayer.hidden_norm.weight" in state \
        or "layers.0.hidden_norm.weight" in state else 1
    n_target = target_config.num_hidden_layers
    if version == 3:
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
            or raw.get("eagle_aux_hidden_state_layer_ids") or aux_layers_default(n_target)
        ids = tuple(int(i) for i in ids)
        if any(not 0 <= i < n_target for i in ids):
            raise ModelLoadError(f"head checkpoint {path} reads target layers {list(ids)}; the target has {n_target}")
    else:
        ids = (n_target,)
    heads = raw.get("num_attention_heads")
    cfg = HeadConfig(
        version=version, hidden_size=H, intermediate_size=raw["intermediate_size"], num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads", heads), head_dim=raw.get("head_dim") or H // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=raw.get("rope_theta", 10000.0),
        vocab_size=target_config.vocab_size,
        draft_vocab_size=raw.get("draft_vocab_size") or target_config.vocab_size if version == 3
        else target_config.vocab_size,
        feature_layers=ids, fc_bias="fc.bias" in state,
    )
    if raw.get("vocab_size", cfg.vocab_size) != cfg.vocab_size:
        raise ModelLoadError(f"head checkpoint {path} has vocab_size {raw.get('vocab_size')}; "
                             f"the target's is {cfg.vocab_size}")
    head = EagleHead(cfg)
    layer = "midlayer." if any(k.startswith("midlayer.") for k in state) else "layers.0."
    names = {
        "fc.weight": "fc.weight", "fc.bias": "fc.bias",
        "q_proj.weight": layer + "self_attn.q_proj.weight", "k_proj.weight": layer + "self_attn.k_proj.weight",
        "v_proj.weight": layer + "self_attn.v_proj.weight", "o_proj.weight": layer + "self_attn.o_proj.weight",
        "gate_proj.weight": layer + "mlp.gate_proj.weight", "up_proj.weight": layer + "mlp.up_proj.weight",
        "down_proj.weight": layer + "mlp.down_proj.weight",
        "post_attention_layernorm": layer + "post_attention_layernorm.weight",
    }
    if version == 3:
        names |= {"input_layernorm": layer + "input_layernorm.weight", "hidden_norm": layer + "hidden_norm.weight",
                  "norm": "norm.weight", "lm_head.weight": "lm_head.weight"}
    elif "lm_head.weight" in state:
        head.lm_head = nn.Linear(H, cfg.vocab_size, bias=False)
        names["lm_head.weight"] = "lm_head.weight"
    own = dict(head.named_parameters())
    with torch.no_grad():
        for mine, theirs in names.items():
            if mine == "fc.bias" and not cfg.fc_bias:
                continue
            if theirs not in state:
                raise ModelLoadError(f"head checkpoint {path} lacks tensor '{theirs}'")
            t = state[theirs]
            if tuple(t.shape) != tuple(own[mine].shape):
                raise ModelLoadError(f"head checkpoint {path}: '{theirs}' has shape {tuple(t.shape)}, "
                                     f"expected {tuple(own[mine].shape)}")
            own[mine].copy_(t.float())
        if version == 3:
            d2t = state.get("d2t")
            if d2t is None:
                if cfg.draft_vocab_size != cfg.vocab_size:
                    raise ModelLoadError(f"head checkpoint {path} lacks tensor 'd2t' (draft vocabulary of "
                                         f"{cfg.draft_vocab_size} rows)")
                d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
            if tuple(d2t.shape) != (cfg.draft_vocab_size,):
                raise ModelLoadError(f"head checkpoint {path}: 'd2t' has shape {tuple(d2t.shape)}, "
                                     f"expected ({cfg.draft_vocab_size},)")
            head.d2t.copy_(d2t.long())
            ids_t = head.draft_ids
            if (ids_t < 0).any() or (ids_t >= cfg.vocab_size).any():
                bad = int(((ids_t < 0) | (ids_t >= cfg.vocab_size)).nonzero()[0])
                raise ModelLoadError(f"head checkpoint {path}: d2t maps draft id {bad} to target id "
                                     f"{int(ids_t[bad])}, outside the vocabulary [0, {cfg.vocab_size})")
            if len(set(ids_t.tolist())) != cfg.draft_vocab_size:
                raise ModelLoadError(f"head checkpoint {path}: d2t maps two draft ids to one target id")
    head.acceptance = ((raw.get("minispec") or {}).get("eval") or {}).get("acc_1")  # what our training recorded
    return head.eval()


def save_head(head: EagleHead, path: str | Path, extra: dict | None = None, dtype: torch.dtype = torch.float32) -> None:
    """Write config.json and model.safetensors in EAGLE-3's format (tensors under midlayer.*, d2t and t2d); dtype:
    the floating tensors' (bfloat16 halves the file)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = head.cfg
    p = "midlayer." if cfg.version == 3 else "layers.0."
    state = {"fc.weight": head.fc.weight,
             p + "self_attn.q_proj.weight": head.q_proj.weight, p + "self_attn.k_proj.weight": head.k_proj.weight,
             p + "self_attn.v_proj.weight": head.v_proj.weight, p + "self_attn.o_proj.weight": head.o_proj.weight,
             p + "mlp.gate_proj.weight": head.gate_proj.weight, p + "mlp.up_proj.weight": head.up_proj.weight,
             p + "mlp.down_proj.weight": head.down_proj.weight,
             p + "post_attention_layernorm.weight": head.post_attention_layernorm}
    if head.fc.bias is not None:
        state["fc.bias"] = head.fc.bias
    if cfg.version == 3:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[head.draft_ids] = True
        state |= {p + "input_layernorm.weight": head.input_layernorm, p + "hidden_norm.weight": head.hidden_norm,
                  "norm.weight": head.norm, "lm_head.weight": head.lm_head.weight, "d2t": head.d2t, "t2d": t2d}
    elif head.lm_head is not None:
        state["lm_head.weight"] = head.lm_head.weight
    save_file({k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous().cpu() for k, v in state.items()},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg.to_hf() | (extra or {}), indent=2) + "\n")
