"""Read a GGUF file as it ships: its metadata, its config, and its tensors, packed.

``GGUFFile`` parses the header itself (the gguf package's constants name the types and their block
sizes) and memory-maps the tensor data; ``weights()`` maps Hugging Face names to dense tensors
(F32) or ``PackedWeight`` rows (layers/quant.py), reading nothing until a tensor is asked for.
GGUFReader parses every metadata array into numpy views (about 4 s for a 49k-token vocabulary);
this header parse takes a fraction of that.

q/k rows: llama.cpp's converter stores the q and k projections of llama-type models with each
head's rows interleaved for its rotary layout; ``weights()`` returns them in Hugging Face's
(half-split) order, as transformers does, so every source loads through the same code.
"""
from __future__ import annotations

import mmap
import re
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from minispec.kernels.ggml import F32, PACKED_TYPES, file_type
from minispec.layers.quant import PackedWeight
from minispec.models.errors import ModelLoadError

FILE_TYPES = [t for t in PACKED_TYPES if file_type(t) == t]  # the packed formats a file holds (not the split ones)
SUPPORTED_TYPES = ", ".join(["F32", *(PACKED_TYPES[t].name for t in FILE_TYPES)])
PERMUTED_QK_ARCHS = ("llama",)  # GGUF architectures whose q/k rows the converter interleaved

# value type id -> struct format of a scalar (gguf.GGUFValueType: 8 = string, 9 = array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}

# GGUF tensor name -> Hugging Face name
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# GGUF metadata key (after "<arch>.") -> config field, as transformers maps them (tests/test_gguf.py checks
# this against transformers.integrations.ggml.GGUF_CONFIG_MAPPING); qwen2 ignores rope.dimension_count.
_LLAMA_KEYS = {
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
    "rope.dimension_count": "head_dim", "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps", "vocab_size": "vocab_size",
}
GGUF_CONFIG_KEYS = {
    "llama": _LLAMA_KEYS,
    "mistral": _LLAMA_KEYS,
    "qwen2": {k: v for k, v in _LLAMA_KEYS.items() if k != "rope.dimension_count"},
}
# transformers' defaults, per model type, for fields a GGUF may leave out
_TYPE_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "sliding_window": None, "bos_token_id": 1, "eos_token_id": 2},
    "mistral": {"max_position_embeddings": 131072, "sliding_window": 4096, "bos_token_id": 1, "eos_token_id": 2},
    "qwen2": {"max_position_embeddings": 32768, "sliding_window": None, "bos_token_id": None, "eos_token_id": None},
}


@dataclass
class GGUFConfig:
    """A GGUF model's config: the fields minispec reads, with the defaults of transformers' config for
    its model_type (building that one imports transformers' model modules, seconds of a load)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None: num_attention_heads
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int | None = None  # None here and below: transformers' default for model_type
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    use_sliding_window: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    rope_parameters: dict = field(init=False)

    def __post_init__(self):
        for name, default in _TYPE_DEFAULTS[self.model_type].items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.rope_parameters = {"rope_type": "default", "rope_theta": float(self.rope_theta)}

    def to_dict(self) -> dict:
        return asdict(self)


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for one the model does not use (e.g. rope_freqs)."""
    if name in _NAMES:
        return _NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def half_split_rope_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a q/k weight [n_heads * head_dim, ...] from llama.cpp's interleaved rotary layout to
    Hugging Face's half-split one: new row j * head_dim / 2 + i of a head = old row 2i + j."""
    return w.reshape(-1, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class _Truncated(Exception):
    pass


class StringArray:
    """A long string array of the metadata (the vocabulary): its length and where it starts."""

    def __init__(self, n: int, offset: int):
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n


class GGUFFile:
    """One GGUF file: ``metadata`` (key -> value), ``tensors`` (name -> (type id, shape [rows, cols], offset,
    bytes)), the data memory-mapped until ``close()``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                # Copy-on-write: torch tensors can view the map; pages are read from the file on touch.
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {self.path}: {e}") from None
        try:
            self._parse()
        except _Truncated:
            self.close()
            raise ModelLoadError(f"{self.path.name} is truncated or corrupt (its GGUF header runs past the end "
                                 f"of the file)") from None

    def _parse(self) -> None:
        buf = self._map
        if len(buf) < 24 or buf[:4] != b"GGUF":
            raise ModelLoadError(f"{self.path.name} is not a GGUF file (no GGUF magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ModelLoadError(f"{self.path.name}: GGUF version {version} is not supported (2 or 3)")
        if n_tensors > len(buf) // 16 or n_kv > len(buf) // 16:
            raise ModelLoadError(f"{self.path.name} is corrupt (header counts {n_tensors} tensors, {n_kv} keys)")
        self._pos = 24
        self.metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.metadata[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            if n_dims > 4:
                raise ModelLoadError(f"{self.path.name} is corrupt (tensor '{name}' has {n_dims} dimensions)")
            dims = self._unpack(f"<{n_dims}Q")
            qtype, offset = self._unpack("<IQ")
            infos.append((name, qtype, dims, offset))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // align) * align
        self.tensors: dict[str, tuple[int, tuple[int, ...], int, int]] = {}
        for name, qtype, dims, offset in infos:
            shape = tuple(int(d) for d in reversed(dims))  # GGUF lists the fastest dimension first
            nbytes = _nbytes(qtype, shape)
            start = data_start + offset
            if nbytes is not None and start + nbytes > len(buf):
                raise ModelLoadError(f"{self.path.name} is truncated or corrupt: tensor '{name}' ends at byte "
                                     f"{start + nbytes}, past the file's {len(buf)} bytes")
            self.tensors[name] = (qtype, shape, start, nbytes or 0)

    def _unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self._pos + size > len(self._map):
            raise _Truncated
        out = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += size
        return out

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        if self._pos + n > len(self._map):
            raise _Truncated
        s = self._map[self._pos : self._pos + n].decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, vtype: int):
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype])[0]
        if vtype == 8:
            return self._string()
        if vtype == 9:
            etype, n = self._unpack("<IQ")
            if etype in _NUMPY:  # a numeric array: one read
                dt = np.dtype(_NUMPY[etype])
                if self._pos + n * dt.itemsize > len(self._map):
                    raise _Truncated
                out = np.frombuffer(self._map, dtype=dt, count=n, offset=self._pos).copy()
                self._pos += n * dt.itemsize
                return out
            if etype == 8 and n > 1024:  # a vocabulary or merge list: skipped, only its length kept
                return StringArray(n, self._skip_strings(n))
            return [self._value(etype) for _ in range(n)]
        raise ModelLoadError(f"{self.path.name} is corrupt (metadata value type {vtype})")

    def _skip_strings(self, n: int) -> int:
        """Move past n strings; -> where they start."""
        start, pos, buf, end = self._pos, self._pos, self._map, len(self._map)
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(n):
            if pos + 8 > end:
                raise _Truncated
            pos += 8 + unpack(buf, pos)[0]
        if pos > end:
            raise _Truncated
        self._pos = pos
        return start

    def header_bytes(self) -> bytes:
        """The header (metadata and tensor table): a content key for what is derived from it."""
        return bytes(self._map[: self._pos])

    def close(self) -> None:
        if getattr(self, "_map", None) is not None:
            try:
                self._map.close()
            except BufferError:  # a tensor still views the map: it closes when the last view goes
                pass
            self._map = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- tensors ----------------------------------------------------------------------------

    def raw(self, name: str) -> torch.Tensor:
        """A tensor's bytes as uint8 [rows, row bytes], viewing the map (no copy)."""
        qtype, shape, start, nbytes = self.tensors[name]
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        return torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=start).view(rows, -1)

    def tensor(self, name: str) -> torch.Tensor | PackedWeight:
        """F32 -> a float32 tensor (view); the packed types -> PackedWeight (view). ModelLoadError otherwise."""
        qtype, shape, _, _ = self.tensors[name]
        if qtype == F32:
            return self.raw(name).view(torch.float32).view(shape)
        if qtype not in FILE_TYPES:
            raise ModelLoadError(f"tensor '{name}' of {self.path.name} has type {_type_label(qtype)}; minispec reads "
                                 f"GGUF tensors of type {SUPPORTED_TYPES}")
        if len(shape) != 2:
            raise ModelLoadError(f"tensor '{name}' of {self.path.name} is {_type_label(qtype)} with shape {list(shape)}; "
                                 f"packed tensors must be matrices")
        return PackedWeight(self.raw(name), qtype, shape[1])

    # ---- the model ------------------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def config(self) -> GGUFConfig:
        """The model's config from the metadata (the fields and defaults transformers' config would have)."""
        arch = self.architecture
        model_type = arch
        if arch == "llama" and "mistral" in str(self.metadata.get("general.name", "")).lower():
            model_type = "mistral"  # llama.cpp stores Mistral as llama (transformers renames it the same way)
        if model_type not in GGUF_CONFIG_KEYS:
            raise ModelLoadError(f"unsupported GGUF architecture '{arch}' in {self.path.name}")
        values: dict = {"model_type": model_type}
        for key, field in GGUF_CONFIG_KEYS[model_type].items():
            value = self.metadata.get(f"{arch}.{key}")
            if value is not None:
                values[field] = value.tolist() if isinstance(value, np.ndarray) else value
        if "vocab_size" not in values and "tokenizer.ggml.tokens" in self.metadata:
            values["vocab_size"] = len(self.metadata["tokenizer.ggml.tokens"])
        missing = [f for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if f not in values]
        if missing:
            raise ModelLoadError(f"cannot build a config for {self.path.name}: its metadata lacks {', '.join(missing)}")
        values["tie_word_embeddings"] = "output.weight" not in self.tensors
        for key in ("bos", "eos", "padding"):
            if f"tokenizer.ggml.{key}_token_id" in self.metadata:
                values[f"{'pad' if key == 'padding' else key}_token_id"] = int(self.metadata[f"tokenizer.ggml.{key}_token_id"])
        try:
            return GGUFConfig(**values)
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise ModelLoadError(f"cannot build a config for {self.path.name}: {e}") from None

    def weights(self, config, dense: bool = False) -> GGUFWeights:
        return GGUFWeights(self, config, dense)


class GGUFWeights(Mapping):
    """Hugging Face name -> tensor or PackedWeight (dense: dequantised float32) of a GGUFFile, q/k
    rows in Hugging Face order."""

    def __init__(self, file: GGUFFile, config, dense: bool = False):
        self.file = file
        self.dense = dense
        self._gguf_name = {hf: name for name in file.tensors if (hf := hf_name(name)) is not None}
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self._head_dim = head_dim if file.architecture in PERMUTED_QK_ARCHS else None

    def __getitem__(self, name: str):
        w = self.file.tensor(self._gguf_name[name])
        if self._head_dim is not None and (".q_proj." in name or ".k_proj." in name):
            fn = lambda t: half_split_rope_rows(t, self._head_dim)  # noqa: E731
            w = w.permute_rows(fn) if isinstance(w, PackedWeight) else fn(w)
        return w.dequantize() if self.dense and isinstance(w, PackedWeight) else w

    def __contains__(self, name) -> bool:
        return name in self._gguf_name

    def __iter__(self):
        return iter(self._gguf_name)

    def __len__(self) -> int:
        return len(self._gguf_name)


def _type_label(qtype: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(qtype).name
    except ValueError:
        return f"unknown ({qtype})"


def _nbytes(qtype: int, shape: tuple[int, ...]) -> int | None:
    """Bytes of a tensor (gguf's block sizes), or None for a type gguf does not know."""
    import gguf

    try:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    except (ValueError, KeyError):
        return None
    n = int(np.prod(shape)) if shape else 1
    if shape and shape[-1] % block:
        return None
    return n // block * size


__all__ = ["GGUF_CONFIG_KEYS", "GGUFConfig", "GGUFFile", "GGUFWeights", "SUPPORTED_TYPES", "half_split_rope_rows", "hf_name"]
