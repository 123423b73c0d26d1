"""The LLM facade: build the engine from model names, generate(), stream(), abort()."""
from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from minispec.distributed import TPGroup, get_tp_group, init_distributed, job_world_size
from minispec.engine.engine import Engine, EngineConfig
from minispec.kernels import cpu
from minispec.engine.observer import Observer
from minispec.engine.request import Request
from minispec.layers.quant import packed_weights_of
from minispec.models.eagle import SHIPPED_HEADS, EagleHead, is_head_checkpoint, load_head
from minispec.models.loader import LoadedModel, load_model
from minispec.models.quantize import check_quantization, has_packed, is_self_draft, quantize_model, self_draft, \
    shallow_copy
from minispec.runner.model_runner import ModelRunner
from minispec.sampling_params import SamplingParams
from minispec.spec_decode.adaptive import AdaptiveK, predicted_speedup
from minispec.spec_decode.costs import MeasuredCosts, measure_costs
from minispec.spec_decode.head import HeadProposer, HeadRunner
from minispec.spec_decode.ngram import NgramProposer
from minispec.spec_decode.proposer import DraftModelProposer
from minispec.utils import parse_dtype

# The defaults: LLM(), the CLI, serve and `make demo` run DEFAULT_TARGET (packed, exact) with draft="auto": the
# proposer DRAFT_FOR_TARGET names for it, with adaptive k, where it is predicted to pay on this machine, else the
# target alone. The prediction (LLM._auto_pays) times a 1-token and a 2-token target forward and one head step at
# batch 1 at init and takes the head when (1 + its recorded acceptance) / (2-token ratio + c) reaches
# AUTO_MIN_SPEEDUP. Measured (docs/experiments.md, "An EAGLE-3 head for SmolLM2"): on the 2-core Zen 4 and Zen 5
# kinds a 2-token verification costs 1.25-1.5 one-token forwards, and the shipped head (acceptance 0.59) ran
# 0.96-1.07x target-only with adaptive k; on the Intel AMX kind (1.02) the same figures predict about 1.4x.
DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_DRAFT = "auto"  # the proposer DRAFT_FOR_TARGET names for the target where it is predicted to pay, else none
AUTO_MIN_SPEEDUP = 1.15  # the predicted batch-1 speedup at k = 1 from which "auto" speculates (above 1: the Zen 4
# measured 0.91-0.95 of the bench's prediction, docs/experiments.md, fourteenth session)
AUTO_MIN_CONFIDENCE = 0.1  # the "auto" head's gate (draft_min_confidence); at batch 1 with adaptive k's k_max it
# led the estimate alone by 1-15 % over three runs on the Intel AMX kind, parity at 4 and 16 (docs/experiments.md)
HEAD_WITH_LOOKUP = "+ngram"  # draft="HEAD+ngram": prompt lookup (matches of 2+ tokens) where it finds one, else the head
# target alias -> (an EAGLE head that ships for it, its quantisation): what "auto" measures
DRAFT_FOR_TARGET: dict[str, tuple[str, str | None]] = {
    "smollm2-135m-instruct": ("smollm2-135m-instruct-eagle3", "int8"),
}


@dataclass(slots=True)
class RequestOutput:
    """A finished (or, while streaming, running) request."""

    request_id: str
    prompt: str | list[int]
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "length" | "stop" | "abort" | "error"
    metrics: dict = field(default_factory=dict)
    error: str | None = None  # why a request ended with finish_reason "error"
    # SamplingParams.logprobs / prompt_logprobs (else None): per token (its logprob, [(id, logprob)] of the most
    # likely tokens), the raw log-softmax of the target's logits; the first prompt token's entry is None
    logprobs: list | None = None
    prompt_logprobs: list | None = None

    def as_dict(self) -> dict:
        d = {"prompt": self.prompt, "text": self.text, "token_ids": self.token_ids,
             "finish_reason": self.finish_reason, "metrics": self.metrics}
        if self.error:
            d["error"] = self.error
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        return d


def _loaded(model: str | LoadedModel, dtype: torch.dtype, device: torch.device, packed: bool | None,
            quantization: str | None = None) -> LoadedModel:
    """A model spec loaded onto device, or an already-loaded model as given; quantised (a copy) if asked."""
    loaded = model if isinstance(model, LoadedModel) else load_model(model, dtype=dtype, device=device, packed=packed)
    if quantization is None:
        return loaded
    if has_packed(loaded.model):
        raise ValueError(f"quantization='{quantization}' applies to float checkpoints; {loaded.name} is already "
                         f"packed (its weights run as stored); load it with packed=False to re-quantise them")
    quantized = shallow_copy(loaded.model)  # a LoadedModel handed in stays as it was
    quantize_model(quantized, quantization)
    return dataclasses.replace(loaded, model=quantized)


def has_chat_template(tokenizer) -> bool:
    """Whether a tokenizer (None: a model without one) has a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def encode_text(tokenizer, text: str, use_chat_template: bool, name: str) -> list[int]:
    """Token ids of a string prompt, as the user's turn of a chat when use_chat_template; name: the model's."""
    if tokenizer is None:
        raise ValueError(f"{name} has no tokenizer: give prompts as lists of token ids")
    if not use_chat_template:
        return list(tokenizer.encode(text, add_special_tokens=False))
    return encode_chat(tokenizer, [{"role": "user", "content": text}], name)


def encode_chat(tokenizer, messages: list[dict], name: str) -> list[int]:
    """Token ids of a conversation ([{"role", "content"}]) in the model's chat template, ending with the
    assistant's generation prompt; name: the model's."""
    if not has_chat_template(tokenizer):
        raise ValueError(f"{name} has no chat template; use use_chat_template=False")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


class LLM:
    """A target model, an optional proposer, and the engine that runs them.

    target: a model spec (alias, HF directory, .gguf file, hub id) or an already-loaded model
    (models.loader.load_model's LoadedModel, on this LLM's device and in its dtype: tools that build many
    engines over the same weights load them once).
    draft: "auto" (default: the head DRAFT_FOR_TARGET names for this target where it is predicted to pay on this
    machine, measured at init; auto_draft says what was measured and chosen), None (target only), "ngram" (prompt
    lookup with n-gram sizes ngram_n = (min_n, max_n)), a head checkpoint, or a draft model (spec or LoadedModel,
    in draft_dtype) sharing the target's vocabulary.
    draft_dtype: the draft model's dtype (default: dtype); e.g. "bfloat16" for a float32 target.
    adaptive_k: each step chooses one speculation length for the batch from its requests' running acceptance and
    turns speculation off when it does not pay (spec_decode/adaptive.py); seeded requests stay reproducible
    (SamplingParams.seed).
    None (default): on with the "auto" draft, off (fixed k, as sweeps need) with a named one. Adaptive k
    measures the draft and verify costs at every power-of-two batch size up to max_num_seqs here, before
    serving (spec_decode/costs.py).
    k_policy: a speculation-length policy of your own (Engine.k_policy: reqs -> each one's k), instead of
    adaptive_k; e.g. an AdaptiveK with costs a tool measured.
    observer: instrumentation hooks (engine/observer.py: per-step k, timings, beta), e.g. for sweeps.
    enable_prefix_caching: a new request starts from the K/V of the longest prefix of its prompt that a running
    request or a freed slot holds (a shared system prompt is computed once; engine/request.py's Scheduler);
    reset_prefix_cache() forgets the freed slots'. The reused K/V are the ones a recomputation gives, up to float
    summation order (they were computed in another batch).
    packed (GGUF models; None = True): keep the file's 4/8-bit weights packed and compute exactly on them in
    float32 (the float32 model the file describes, at the file's size); False dequantises them to dtype.
    quantization: "int8" (Q8_0) or "int4" (Q4_1 layers, Q8_0 embedding): weight-only quantisation of a float
    target at load (models/quantize.py), run by the exact packed kernels; another model than the float one. A
    GGUF loaded packed is already quantised: ValueError (load it with packed=False to re-quantise).
    draft_quantization: the same for a draft model or head ("auto" picks the shipped head's; see DRAFT_FOR_TARGET).
    draft_min_confidence: a head's gate (HeadProposer.min_confidence, lossless): a request keeps drafting while the
    head's probability of its drafts stays at least this; 0: every request drafts its k. None (default):
    AUTO_MIN_CONFIDENCE for the "auto" head, else 0. With the gate, adaptive k gives a lone request k_max and lets the
    gate set the length (AdaptiveK's gated).
    Self-drafts: draft="self-int8" | "self-int4" | "self-int4:N" | "self:N" is the target's own copy with its
    dense weights quantised and / or only N layers, derived from the loaded target (no second load, the same
    tokenizer); lossless like any draft.
    """

    def __init__(
        self,
        target: str | LoadedModel = DEFAULT_TARGET,
        draft: str | LoadedModel | None = DEFAULT_DRAFT,
        num_speculative_tokens: int = 4,
        tensor_parallel_size: int = 1,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 2048,
        dtype: str | torch.dtype = "float32",
        max_model_len: int | None = None,
        seed: int | None = None,
        device: str | None = None,
        shard_draft_logits: bool | None = None,
        ngram_n: tuple[int, int] = (1, 3),
        adaptive_k: bool | None = None,
        draft_dtype: str | torch.dtype | None = None,
        packed: bool | None = None,
        quantization: str | None = None,
        draft_quantization: str | None = None,
        draft_min_confidence: float | None = None,
        k_policy=None,
        observer: Observer | None = None,
        enable_prefix_caching: bool = True,
    ):
        auto = isinstance(draft, str) and draft == "auto"
        draft, draft_quantization, adaptive_k = resolve_draft(target, draft, draft_quantization, adaptive_k, k_policy)
        if draft_min_confidence is None:
            draft_min_confidence = AUTO_MIN_CONFIDENCE if auto else 0.0
        check_options(draft, num_speculative_tokens, max_num_seqs, draft_dtype, quantization, draft_quantization)
        if not 0.0 <= draft_min_confidence < 1.0:
            raise ValueError(f"draft_min_confidence must be in [0, 1), got {draft_min_confidence}")
        tp = start_tp(tensor_parallel_size)
        torch_dtype = parse_dtype(dtype)
        draft_torch_dtype = torch_dtype if draft_dtype is None else parse_dtype(draft_dtype)
        self.device = torch.device(device) if device else tp.device
        if self.device.type == "cpu":
            cpu.ops()  # build (once, cached) the C++ kernels now, not inside the first generation's timing
        self.target = _loaded(target, torch_dtype, self.device, packed, quantization)
        self.tokenizer = self.target.tokenizer
        lookup = isinstance(draft, str) and draft.endswith(HEAD_WITH_LOOKUP)  # prompt lookup first, then the head
        self.head, self.draft = self._load_draft(draft.removesuffix(HEAD_WITH_LOOKUP) if lookup else draft, lookup,
                                                 draft_dtype, draft_torch_dtype, packed, draft_quantization)
        k = num_speculative_tokens if draft is not None else 0
        max_len = min(max_model_len or 2048, self.target.max_model_len)
        if self.draft is not None:
            max_len = min(max_len, self.draft.max_model_len)
        config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              max_model_len=max_len, shard_draft_logits=shard_draft_logits,
                              enable_prefix_caching=enable_prefix_caching)
        kv_len = max_len + k + 1  # room for k drafts (and the draft's k - 1 fed drafts) past the last real position
        target_runner = ModelRunner(self.target.model, max_num_seqs, kv_len, dtype=torch_dtype, device=self.device)
        self.auto_draft: str | None = None  # with draft="auto": what it measured and chose (_auto_pays)
        proposer = self._proposer(draft, lookup, auto, target_runner, k, max_num_seqs, kv_len, ngram_n, torch_dtype,
                                  draft_torch_dtype, draft_quantization, draft_min_confidence)
        if draft_min_confidence and not isinstance(proposer, HeadProposer) and proposer is not None:
            raise ValueError("draft_min_confidence gates a head's drafts; this draft is not a head")
        if adaptive_k and proposer is not None:
            k_policy = self._adaptive_k(proposer, max_num_seqs, torch_dtype)
        self.engine = Engine(target_runner, proposer, config, self.target.eos_token_ids, self.target.vocab_size,
                             k_policy=k_policy if proposer is not None else None, observer=observer)
        self._rng = np.random.default_rng(shared_seed(seed, tp))
        self._next_id = 0

    # ---- the steps of __init__ ------------------------------------------------------------
    def _load_draft(self, draft, lookup: bool, draft_dtype, draft_torch_dtype, packed, draft_quantization
                    ) -> tuple[EagleHead | None, LoadedModel | None]:
        """(the EAGLE head, the draft model) that `draft` names: at most one of them, neither for "ngram" or None."""
        head = _head(draft, self.target)
        if lookup and head is None:
            raise ValueError(f"draft '{draft}{HEAD_WITH_LOOKUP}': '{HEAD_WITH_LOOKUP}' combines prompt lookup with an "
                             f"EAGLE head, and '{draft}' is not one")
        if head is not None:
            if draft_dtype is not None:
                raise ValueError("a draft head runs in float32 (packed with draft_quantization); drop draft_dtype")
            return head, None
        if is_self_draft(draft):
            return None, self_draft(self.target, draft)
        if draft is None or draft == "ngram":
            return None, None
        loaded = _loaded(draft, draft_torch_dtype, self.device, packed, draft_quantization)
        if loaded.vocab_size != self.target.vocab_size:
            raise ValueError(
                f"draft vocabulary ({loaded.vocab_size} tokens, {loaded.name}) differs from the "
                f"target's ({self.target.vocab_size}, {self.target.name}); they must share a tokenizer"
            )
        return None, loaded

    def _proposer(self, draft, lookup: bool, auto: bool, target_runner: ModelRunner, k: int, num_slots: int,
                  kv_len: int, ngram_n, torch_dtype, draft_torch_dtype, draft_quantization, min_confidence: float):
        """The proposer over the loaded head or draft model, prompt lookup, or None (target only; also "auto"'s head
        where it is not predicted to pay here)."""
        if self.head is not None:
            runner = HeadRunner(self.head, self.target.model, num_slots, kv_len, self.device, draft_quantization)
            if auto and not self._auto_pays(runner, torch_dtype, f"{draft}@{draft_quantization}" if draft_quantization
                                                                   else draft):
                self.head = None
                return None
            return HeadProposer(runner, target_runner, k,
                                lookup=(max(2, ngram_n[0]), max(2, ngram_n[1])) if lookup else None,
                                min_confidence=min_confidence)
        if draft == "ngram":
            return NgramProposer(k, *ngram_n, device=self.device)
        if self.draft is None:
            return None
        # A self-draft with every layer reads and extends the target's KV cache: no draft prefill.
        shared = is_self_draft(draft) and self.draft.model.num_layers == self.target.model.num_layers
        runner = ModelRunner(self.draft.model, num_slots, kv_len, dtype=draft_torch_dtype, device=self.device,
                             kv=target_runner.kv if shared else None)
        return DraftModelProposer(runner, k, shares_target_kv=shared)

    def _auto_pays(self, runner: HeadRunner, torch_dtype, name: str) -> bool:
        """Whether "auto"'s head is predicted to reach AUTO_MIN_SPEEDUP at batch 1 and k = 1 here: its recorded
        acceptance against a 2-token target forward and one head step, both timed now over one 1-token forward in 30
        rounds (about a second on a 2-core CPU), each ratio the median of the rounds' (CostBench.measure; on a Zen 3
        the 2-token ratio read 1.28-1.35 in 8 inits, 1.23-1.35 with 10 rounds; rank 0's figures under TP). Sets
        auto_draft to what it measured and chose."""
        costs = measure_costs(self.target.model, {"head": runner}, k_max=1, batch_size=1, context=128, repeats=30,
                              vocab_size=self.target.vocab_size, dtype=torch_dtype, device=self.device)
        alpha = self.head.acceptance or 0.0  # a head without a recorded acceptance is not predicted to pay
        figures = torch.tensor([costs["verify_ratio"][1], costs["c"]["head"]], dtype=torch.float64)
        tp = get_tp_group()
        if tp.world_size > 1:  # every rank must choose alike
            figures = tp.broadcast(figures.to(tp.device)).cpu()
        verify, c = figures.tolist()
        pred = predicted_speedup(alpha, 1, c, verify)
        pays = pred >= AUTO_MIN_SPEEDUP
        self.auto_draft = (f"{name}: predicted {pred:.2f}x at batch 1 (acceptance {alpha:.2f}, 2-token "
                           f"verification {verify:.2f}, c {c:.3f}; needs {AUTO_MIN_SPEEDUP:.2f}x): "
                           + ("speculating with adaptive k" if pays else "the target runs alone"))
        return pays

    def _adaptive_k(self, proposer, max_num_seqs: int, torch_dtype) -> AdaptiveK:
        """AdaptiveK over draft and verify costs measured on these models at each batch-size bucket, now (before
        serving)."""
        if self.head is not None:
            measured = proposer.runner
        elif self.draft is None:  # prompt lookup
            measured = "ngram"
        else:
            measured = self.draft.model
        costs = MeasuredCosts(self.target.model, measured, proposer.k, max_num_seqs, self.target.vocab_size,
                              torch_dtype, self.device, repeats=1)
        return AdaptiveK(proposer.k, cost_model=costs, catch_up_cost=costs.catch_up,
                         gated=getattr(proposer, "min_confidence", 0.0) > 0)

    @property
    def num_speculative_tokens(self) -> int:
        return self.engine.k

    # ---- inputs ---------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int], use_chat_template: bool) -> list[int]:
        """Token ids of a prompt: a string (chat-templated on request) or ids as given."""
        if isinstance(prompt, str):
            return encode_text(self.tokenizer, prompt, use_chat_template, self.target.name)
        ids = list(prompt)
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids):
            raise ValueError("a prompt must be a string or a list of integer token ids")
        return [int(t) for t in ids]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation ([{"role", "content"}]) in the target's chat template."""
        return encode_chat(self.tokenizer, messages, self.target.name)

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def add_request(self, prompt, params: SamplingParams, use_chat_template: bool = False,
                    request_id: str | None = None) -> Request:
        """Queue one prompt; returns its Request (use .req_id to abort it)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        ids = self.encode(prompt, use_chat_template)
        if request_id is None:
            request_id = str(self._next_id)
            self._next_id += 1
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**62))
        return self.engine.add_request(request_id, ids, params, seed)

    def abort(self, request_id: str) -> None:
        """Stop a request now, freeing its KV cache slot and draft-logits row."""
        self.engine.abort(request_id)

    def reset_prefix_cache(self) -> None:
        """Free slots forget the prompts they hold (prefix caching): the next requests compute theirs, as a
        benchmark's rounds over the same prompts should."""
        self.engine.scheduler.forget_prefixes()

    def _output(self, req: Request, prompt) -> RequestOutput:
        toks = req.output_token_ids
        return RequestOutput(req.req_id, prompt, list(req.prompt_token_ids), list(toks), self.decode(toks),
                             req.finish_reason, req.metrics.as_dict(len(toks)), req.error, req.logprobs,
                             req.prompt_logprobs)

    # ---- generation -----------------------------------------------------------------------
    def stream(self, prompts, sampling_params=None, use_chat_template: bool = False
               ) -> Iterator[tuple[int, list[int], RequestOutput | None]]:
        """Yield (prompt index, new token ids, output once finished else None) as tokens are accepted.

        Closing the generator early aborts the requests still running.
        """
        prompts = self._prompt_list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        reqs = []
        try:
            for p, sp in zip(prompts, params):  # a bad prompt aborts the ones queued before it
                reqs.append(self.add_request(p, sp, use_chat_template))
            index = {id(r): i for i, r in enumerate(reqs)}
            while any(not r.finished for r in reqs):
                for out in self.engine.step():
                    i = index.get(id(out.req))
                    if i is None:
                        continue
                    done = self._output(out.req, prompts[i]) if out.req.finished else None
                    yield i, out.new_token_ids, done
        finally:
            for r in reqs:
                if not r.finished:
                    self.engine.abort(r.req_id)

    def generate(self, prompts, sampling_params=None, use_chat_template: bool = False,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order."""
        prompts = self._prompt_list(prompts)
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="generating", unit="req")
        for i, _, done in self.stream(prompts, sampling_params, use_chat_template):
            if done is not None:
                outputs[i] = done
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return outputs

    @staticmethod
    def _prompt_list(prompts) -> list:
        """The prompts as a list: a bare string or list of token ids is one prompt."""
        if isinstance(prompts, str):
            return [prompts]
        prompts = list(prompts)
        return [prompts] if prompts and isinstance(prompts[0], int) else prompts

    @staticmethod
    def _params_list(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        sp = list(sampling_params)
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} sampling params for {n} prompts")
        return sp


def resolve_draft(target, draft, draft_quantization: str | None, adaptive_k: bool | None, k_policy
                  ) -> tuple[object, str | None, bool]:
    """(draft, draft_quantization, adaptive_k) with draft="auto" replaced by the head DRAFT_FOR_TARGET names for the
    target, by its alias or a LoadedModel's name (None where it names nothing; LLM then measures whether it pays),
    and adaptive_k's None by its default: on for "auto", else off."""
    if k_policy is not None and adaptive_k:
        raise ValueError("give adaptive_k=True or a k_policy, not both")
    if draft != "auto":
        return draft, draft_quantization, bool(adaptive_k)
    name = target if isinstance(target, str) else target.name  # a LoadedModel: the alias it was loaded by
    named, quantization = DRAFT_FOR_TARGET.get(name.lower(), (None, None))
    adaptive = k_policy is None if adaptive_k is None else adaptive_k
    return named, quantization if draft_quantization is None else draft_quantization, bool(adaptive)


def check_options(draft, num_speculative_tokens: int, max_num_seqs: int, draft_dtype, quantization: str | None,
                  draft_quantization: str | None) -> None:
    """One-line ValueErrors for options that do not fit together, before anything loads."""
    for q in (quantization, draft_quantization):
        if q is not None:
            check_quantization(q)
    if is_self_draft(draft) and (draft_dtype is not None or draft_quantization is not None):
        raise ValueError(f"draft='{draft}' runs in the target's dtype and names its own quantisation; "
                         f"drop draft_dtype / draft_quantization")
    if draft is not None and not 1 <= num_speculative_tokens <= 32:
        raise ValueError(f"num_speculative_tokens must be in [1, 32], got {num_speculative_tokens}")
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")


def start_tp(tensor_parallel_size: int) -> TPGroup:
    """Join torchrun's job (or a single-rank group) once it is known to have tensor_parallel_size ranks: every rank
    checks torchrun's WORLD_SIZE before connecting, so none is left connecting to one that gave up."""
    world_size = job_world_size()
    if world_size != tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} but the job has {world_size} rank(s); "
                         f"launch with torchrun --nproc-per-node {tensor_parallel_size}")
    return init_distributed()


def shared_seed(seed: int | None, tp: TPGroup) -> int:
    """The seed of the unseeded requests' seeds: `seed`, else a random one, rank 0's on every rank."""
    if seed is not None:
        return seed
    seed = secrets.randbits(62)
    if tp.world_size > 1:
        seed = int(tp.broadcast(torch.tensor([seed], dtype=torch.int64)).item())
    return seed


def _head(draft, target: LoadedModel) -> EagleHead | None:
    """The draft head that `draft` names (an EagleHead, a head checkpoint directory or a shipped head's name), else None."""
    if isinstance(draft, EagleHead):
        return draft
    if isinstance(draft, str) and draft.lower() in SHIPPED_HEADS:
        draft = str(SHIPPED_HEADS[draft.lower()])
    return load_head(draft, target.config) if is_head_checkpoint(draft) else None


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's weights, dense parameters and packed weights (what one decode step streams at batch 1)."""
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    return dense + sum(w.data.nbytes for w in packed_weights_of(model))
