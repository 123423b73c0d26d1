"""Distillation data: the target's own responses to the train prompts, then its top-k next-token
log-probabilities at every response position, cached per prompt in DIR/data.pt."""
from __future__ import annotations

import time
import zlib
from pathlib import Path

import torch

from minispec.data import load_prompts
from minispec.utils import parse_dtype

from .config import DistillConfig

DATA_VERSION = 3


def use_chat(cfg: DistillConfig, tokenizer) -> bool:
    """Whether prompts go through the chat template ("auto": when the tokenizer has one)."""
    if cfg.chat == "auto":
        return bool(getattr(tokenizer, "chat_template", None))
    return cfg.chat == "true"


def split_prompts(cfg: DistillConfig) -> tuple[list[str], list[str]]:
    """(train prompts, held-out eval prompts) as configured."""
    train = load_prompts("train", limit=cfg.train_prompts or None)
    if cfg.synth_prompts:
        from minispec.data.synth import synth_prompts
        train += synth_prompts(cfg.synth_prompts, seed=cfg.seed)
    evl = load_prompts("eval", limit=cfg.eval_prompts) if cfg.eval_prompts else []
    return train, evl


def generate_responses(cfg: DistillConfig, prompts: list[str], seeds: list[int],
                       device) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) per prompt, sampled from the target with minispec's batched engine."""
    from minispec.llm import LLM
    from minispec.sampling_params import SamplingParams

    llm = LLM(target=cfg.target, draft=None, max_num_seqs=cfg.gen_batch, max_model_len=cfg.max_seq_len,
              dtype=cfg.gen_dtype, seed=cfg.seed, device=device)
    params = [SamplingParams(temperature=cfg.gen_temperature, max_tokens=cfg.max_tokens, seed=s) for s in seeds]
    outputs = llm.generate(prompts, params, use_chat_template=use_chat(cfg, llm.tokenizer), use_tqdm=True)
    return [(list(o.prompt_token_ids), list(o.token_ids)) for o in outputs]


@torch.no_grad()
def teacher_topk(target, seqs: list[tuple[list[int], list[int]]], k: int, batch_size: int, device) -> list[dict]:
    """One target forward per prompt + response; keeps the top-k log-probs at each response position.

    Record: ids [L] int32 (prompt then response), start (index of the first response token; position
    t predicts token t + 1, so positions start - 1 .. L - 2 are scored), topk_ids / topk_logp
    [L - start, k] (int32 / float32, sorted, so topk_ids[:, 0] is the teacher's greedy token).
    """
    from tqdm import tqdm

    records: list[dict | None] = [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]) - len(seqs[i][1]))  # similar lengths batch
    bar = tqdm(total=len(seqs), desc="teacher top-k", unit="seq")
    for b in range(0, len(order), batch_size):
        rows = [i for i in order[b : b + batch_size] if seqs[i][1]]
        bar.update(min(batch_size, len(order) - b))
        if not rows:
            continue
        lens = [len(seqs[i][0]) + len(seqs[i][1]) for i in rows]
        ids = torch.zeros(len(rows), max(lens), dtype=torch.long)  # [B, L], right-padded
        mask = torch.zeros_like(ids)
        for r, i in enumerate(rows):
            ids[r, : lens[r]] = torch.tensor(seqs[i][0] + seqs[i][1])
            mask[r, : lens[r]] = 1
        h = target.model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state  # [B, L, H]
        for r, i in enumerate(rows):
            start = len(seqs[i][0])
            logits = target.lm_head(h[r, start - 1 : lens[r] - 1]).float()  # [n, V]
            logp, idx = logits.log_softmax(-1).topk(k, dim=-1)  # [n, k] each
            records[i] = {"ids": ids[r, : lens[r]].to(torch.int32), "start": start,
                          "topk_ids": idx.to(torch.int32).cpu(), "topk_logp": logp.cpu()}
    bar.close()
    return [r for r in records if r is not None]


def record_key(prompt: str, sample: int) -> str:
    """The cache key of one response: the prompt text and its sample index."""
    return f"{sample}\t{prompt}"


def response_seed(cfg: DistillConfig, key: str) -> int:
    """A sampling seed per response that depends on its prompt, not on its place in the prompt list."""
    return (cfg.seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63)


def build_data(cfg: DistillConfig, path: Path, device,
               log=lambda *a: print(*a, flush=True)) -> tuple[dict, object, object]:
    """The train / eval records for cfg, generating only the responses DIR/data.pt does not hold yet.

    data.pt caches records by prompt (and sample index) under the settings that decide them
    (cfg.data_key()), so asking for more prompts reuses every response already made. Returns
    ({"train", "eval", "stats"}, target or None, tokenizer or None); the target is returned when it
    was loaded here, so the caller can initialise the draft without loading it again.
    """
    from .draft import load_hf_target

    cache = {"version": DATA_VERSION, "key": cfg.data_key(), "records": {}, "stats": {}}
    if path.is_file():
        cache = torch.load(path, weights_only=False)
        if cache.get("version") != DATA_VERSION or cache.get("key") != cfg.data_key():
            raise ValueError(f"{path} was built with other settings ({cache.get('key')}); "
                             f"delete it or use another --out to rebuild")
    records: dict = cache["records"]  # key -> record, None for an empty response
    train_prompts, eval_prompts = split_prompts(cfg)
    train_of = {record_key(p, s): p for p in train_prompts for s in range(cfg.samples_per_prompt)}
    eval_of = {record_key(p, 0): p for p in eval_prompts}
    train_keys, eval_keys = list(train_of), list(eval_of)
    prompt_of = train_of | eval_of  # key -> prompt text
    missing = [k for k in prompt_of if k not in records]
    target = tokenizer = None
    gen_s = teacher_s = 0.0
    if missing:
        log(f"data: generating {len(missing)} responses (max {cfg.max_tokens} tokens, T={cfg.gen_temperature}) "
            f"with minispec's engine; {len(records)} cached in {path if path.is_file() else 'no file yet'}")
        t0 = time.perf_counter()
        seqs = generate_responses(cfg, [prompt_of[k] for k in missing], [response_seed(cfg, k) for k in missing],
                                  device)
        gen_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        target, tokenizer = load_hf_target(cfg.target, dtype=parse_dtype(cfg.teacher_dtype))
        target.to(device)
        made = teacher_topk(target, seqs, cfg.top_k, cfg.teacher_batch, device)
        teacher_s = time.perf_counter() - t0
        made_iter = iter(made)  # teacher_topk drops empty responses
        for k, s in zip(missing, seqs):
            records[k] = next(made_iter) if s[1] else None
        for name, secs in (("generate_s", gen_s), ("teacher_s", teacher_s)):
            cache["stats"][name] = cache["stats"].get(name, 0.0) + secs
        tmp = path.with_suffix(".tmp")
        torch.save(cache, tmp)
        tmp.replace(path)
    else:
        log(f"data: reusing {path} ({len(records)} cached responses)")
    train = [records[k] for k in train_keys if records[k] is not None]
    evl = [records[k] for k in eval_keys if records[k] is not None]
    n_tokens = sum(len(r["topk_ids"]) for r in train)
    mass = torch.cat([r["topk_logp"] for r in train + evl]).exp().sum(-1).mean() if train + evl else torch.nan
    stats = {"generate_s": gen_s, "teacher_s": teacher_s, "train_tokens": n_tokens,
             "eval_tokens": sum(len(r["topk_ids"]) for r in evl), "topk_mass": float(mass),
             "cache_generate_s": cache["stats"].get("generate_s", 0.0),
             "cache_teacher_s": cache["stats"].get("teacher_s", 0.0)}
    log(f"data: {len(train)} train ({n_tokens} response tokens) / {len(evl)} eval sequences"
        + (f"; generate {gen_s:.0f} s, teacher {teacher_s:.0f} s -> {path}" if missing else ""))
    return {"train": train, "eval": evl, "stats": stats}, target, tokenizer
