"""Weight-only quantisation of a loaded model, and the target's own cheaper copy as its draft.

``quantize_model(model, "int8" | "int4")`` packs a float model's dense weights in place (layers/quant.py
QUANTIZATIONS: Q8_0, or Q4_1 layers with a Q8_0 embedding / LM head), so the exact packed kernels run it.
A layer whose (per-rank) input width is not a multiple of 32 stays dense; norms and biases stay dense.
The quantised model is another model: its tokens are not the float model's.

``self_draft(target, spec)`` derives a draft from a loaded target, no training and no second load:

    self-int8, self-int4      the target with its dense weights quantised
    self-int4:N, self:N       ... and only N of its layers (the first N - 1 and the last)

Every weight the draft does not change is the target's own tensor (shared, not copied); the draft has its
own module objects, so quantising it leaves the target untouched. A variant that would give the target itself
(a quantisation of a target with nothing dense left, e.g. a packed GGUF, without a layer count) is an error.
"""
from __future__ import annotations

import copy
import dataclasses
import re

from torch import nn

from minispec.layers.linear import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, replace_weight
from minispec.layers.quant import GROUP, QUANTIZATIONS, PackedWeight, kernel_layout, packed_weights_of, quantize
from minispec.models.llama import LlamaForCausalLM
from minispec.models.loader import LoadedModel

SELF_DRAFT = re.compile(r"self(?:-(?P<quant>[a-z0-9]+))?(?::(?P<layers>\d+))?")
SELF_DRAFT_FORMS = "self-int8, self-int4, self-int4:N or self:N (N of the target's layers)"


def check_quantization(name: str) -> None:
    """ValueError (one line) unless name is a known quantisation."""
    if name not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization '{name}'; choose from: {', '.join(QUANTIZATIONS)}")


def has_packed(model: nn.Module) -> bool:
    """Whether any of the model's weights is packed (a GGUF loaded packed, or a quantised model)."""
    return bool(packed_weights_of(model))


def quantize_model(model: LlamaForCausalLM, quantization: str) -> int:
    """Quantise the model's dense linear and embedding weights in place; returns how many it quantised."""
    check_quantization(quantization)
    linear_type, embedding_type = QUANTIZATIONS[quantization]
    count = 0
    for m in model.modules():
        if not isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            continue
        w = m.weight
        if isinstance(w, PackedWeight) or w.shape[1] % GROUP:
            continue
        qtype = embedding_type if isinstance(m, VocabParallelEmbedding) else linear_type
        replace_weight(m, kernel_layout(quantize(w.data, qtype)))
        count += 1
    model.weights_changed()
    return count


def is_self_draft(spec) -> bool:
    return isinstance(spec, str) and (spec == "self" or spec.startswith(("self-", "self:")))


def parse_self_draft(spec: str, num_layers: int) -> tuple[str | None, int | None]:
    """(quantisation or None, layers kept or None) of a self-draft spec; ValueError (one line) on a bad one."""
    found = SELF_DRAFT.fullmatch(spec)
    if found is None:
        raise ValueError(f"unknown self-draft '{spec}'; the forms are {SELF_DRAFT_FORMS}")
    quant, layers = found["quant"], found["layers"]
    if quant is not None and quant not in QUANTIZATIONS:
        raise ValueError(f"unknown self-draft '{spec}': no quantization '{quant}'; the forms are {SELF_DRAFT_FORMS}")
    if layers is not None and not 1 <= int(layers) <= num_layers:
        raise ValueError(f"self-draft '{spec}': the target has {num_layers} layers; N must be in [1, {num_layers}]")
    if quant is None and layers is None:
        raise ValueError(f"self-draft 'self' alone is the target itself; the forms are {SELF_DRAFT_FORMS}")
    return quant, None if layers is None else int(layers)


def kept_layers(num_layers: int, n: int) -> list[int]:
    """The layers a self-draft of n layers keeps: the first n - 1 and the last (which feeds the final norm)."""
    return list(range(n - 1)) + [num_layers - 1] if n < num_layers else list(range(num_layers))


def shallow_copy(model: nn.Module) -> nn.Module:
    """A copy of the model's modules sharing every tensor and packed weight (and the TP group, the config)."""
    memo = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    memo.update({id(w): w for w in packed_weights_of(model)})
    for m in model.modules():
        for attr in ("tp_group", "config"):
            if hasattr(m, attr):
                memo[id(getattr(m, attr))] = getattr(m, attr)
    return copy.deepcopy(model, memo)


def self_draft(target: LoadedModel, spec: str) -> LoadedModel:
    """The target's own cheaper copy as a LoadedModel (same tokenizer, vocabulary, context); see the module."""
    model = target.model
    quant, layers = parse_self_draft(spec, model.num_layers)
    draft = shallow_copy(model)
    draft.weights_changed()  # the copy may hold the target's decode_layers arguments, built before
    if layers is not None and layers < model.num_layers:
        draft.layers = nn.ModuleList([draft.layers[i] for i in kept_layers(model.num_layers, layers)])
        draft.num_layers = layers
    if quant is not None and quantize_model(draft, quant) == 0 and layers is None:
        raise ValueError(f"self-draft '{spec}': {target.name} has no dense weights left to quantise (already "
                         f"packed), so the draft would be the target itself; use self:N (N of its "
                         f"{model.num_layers} layers), or load the target with packed=False")
    draft.name = f"{target.name}:{spec}"
    return dataclasses.replace(target, model=draft, name=draft.name)
