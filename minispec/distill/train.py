"""Train the draft on the cached teacher top-k: the loop, checkpoints, evaluation and the final export."""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from minispec.tools.metrics import aggregate, per_token_agreement, tau_from_agreement
from minispec.utils import parse_dtype

from .config import DistillConfig
from .data import build_data, use_chat
from .draft import build_draft, clean_config, export_draft, load_hf_target, set_trainable


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# ---- batches and the loss --------------------------------------------------------------------


@dataclass
class Batch:
    """B sequences right-padded to L, and the N scored positions with their teacher top-k."""

    ids: torch.Tensor  # [B, L] int64
    mask: torch.Tensor  # [B, L] int64, 1 on real tokens
    rows: torch.Tensor  # [N] int64, sequence of each scored position
    cols: torch.Tensor  # [N] int64, position within it (predicts the token at cols + 1)
    topk_ids: torch.Tensor  # [N, k] int64
    topk_logp: torch.Tensor  # [N, k] float32, teacher log-probs (not renormalised)


def num_scored(rec: dict, max_seq_len: int) -> int:
    """Scored positions of a record once cut to max_seq_len tokens."""
    return min(len(rec["ids"]), max_seq_len) - rec["start"]


def make_batch(records: list[dict], max_seq_len: int, device) -> Batch:
    """Pad the records (cut to max_seq_len tokens) into one batch."""
    lens = [min(len(r["ids"]), max_seq_len) for r in records]
    ids = torch.zeros(len(records), max(lens), dtype=torch.long)  # [B, L]
    mask = torch.zeros_like(ids)
    rows, cols, topk_ids, topk_logp = [], [], [], []
    for b, (r, n) in enumerate(zip(records, lens)):
        ids[b, :n] = r["ids"][:n].long()
        mask[b, :n] = 1
        m = n - r["start"]  # scored positions start - 1 .. n - 2
        rows.append(torch.full((m,), b, dtype=torch.long))
        cols.append(torch.arange(r["start"] - 1, n - 1))
        topk_ids.append(r["topk_ids"][:m].long())
        topk_logp.append(r["topk_logp"][:m].float())
    return Batch(ids.to(device), mask.to(device), torch.cat(rows).to(device), torch.cat(cols).to(device),
                 torch.cat(topk_ids).to(device), torch.cat(topk_logp).to(device))


def draft_logits(draft, batch: Batch, bf16: bool) -> torch.Tensor:
    """The draft's float32 logits at the batch's scored positions: [N, V]."""
    with torch.autocast(batch.ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        h = draft.model(input_ids=batch.ids, attention_mask=batch.mask).last_hidden_state  # [B, L, H]
        logits = draft.lm_head(h[batch.rows, batch.cols])  # [N, V]
    return logits.float()


def distill_loss(logits: torch.Tensor, topk_ids: torch.Tensor, topk_logp: torch.Tensor):
    """Cross-entropy of the draft to the renormalised teacher top-k; returns (ce [N], kl [N]).

    kl = ce - H(p) is the same objective minus the teacher's (constant) entropy: 0 at a perfect match.
    """
    logq = logits.log_softmax(-1)  # [N, V]
    logp = topk_logp.log_softmax(-1)  # [N, k], renormalised over the top k
    p = logp.exp()
    ce = -(p * logq.gather(1, topk_ids)).sum(-1)  # [N]
    kl = ce + (p * logp).sum(-1)
    return ce, kl


# ---- evaluation ------------------------------------------------------------------------------


@torch.no_grad()
def evaluate_teacher_forced(draft, records: list[dict], cfg: DistillConfig, device) -> dict:
    """Greedy agreement of draft and teacher on held-out cached data (teacher-forced).

    agreement_tf: per_token_agreement, the fraction of positions where the draft's argmax is the
    teacher's, on the target's own text. mean_accepted_length_tf: tau_from_agreement, 1 + the run of
    agreements starting at each position, capped at engine_k (an estimate of tokens per verify).
    Runs in float32 (no autocast), like the float32 draft minispec loads.
    """
    draft.eval()
    agree, kls = [], []
    for b in range(0, len(records), cfg.batch_size):
        recs = records[b : b + cfg.batch_size]
        batch = make_batch(recs, cfg.max_seq_len, device)
        logits = draft_logits(draft, batch, bf16=False)
        _, kl = distill_loss(logits, batch.topk_ids, batch.topk_logp)
        kls.append(kl.cpu())
        hit = (logits.argmax(-1) == batch.topk_ids[:, 0]).cpu()  # [N]
        ends = np.cumsum([num_scored(r, cfg.max_seq_len) for r in recs])
        agree += np.split(hit.numpy(), ends[:-1])
    draft.train()
    if not agree:
        return {}
    return {"agreement_tf": per_token_agreement(agree),
            "mean_accepted_length_tf": tau_from_agreement(agree, cfg.engine_k),
            "eval_kl": float(torch.cat(kls).mean())}


class EngineEval:
    """Greedy speculative decoding with minispec's engine, the draft as exported to out_dir."""

    def __init__(self, cfg: DistillConfig, device):
        from minispec.data import load_prompts

        self.cfg = cfg
        self.device = device
        self.prompts = load_prompts("eval", limit=cfg.engine_prompts)
        self.llm = None

    def __call__(self, draft, out_dir: Path) -> dict:
        from minispec.llm import LLM
        from minispec.sampling_params import SamplingParams

        cfg = self.cfg
        if self.llm is None:
            self.llm = LLM(target=cfg.target, draft=str(out_dir), num_speculative_tokens=cfg.engine_k,
                           max_num_seqs=max(1, len(self.prompts)), max_model_len=cfg.max_seq_len, seed=cfg.seed,
                           device=self.device)
        else:  # same LLM, fresh draft weights (the HF state dict is what minispec's loader reads)
            self.llm.draft.model.load_weights({k: v.detach() for k, v in draft.state_dict().items()})
        params = SamplingParams(temperature=0.0, max_tokens=cfg.engine_max_tokens)
        outputs = self.llm.generate(self.prompts, params, use_chat_template=use_chat(cfg, self.llm.tokenizer))
        m = aggregate(outputs)
        return {"first_position_rate_engine": m["first_position_rate"], "alpha_mle_engine": m["alpha"],
                "mean_accepted_length_engine": m["mean_accepted_length"], "acceptance_rate_engine": m["acceptance_rate"],
                "accepted_per_position_engine": [a / max(1, m["num_spec_verifications"])
                                                 for a in m["accepted_per_position"]]}


# ---- checkpoints -----------------------------------------------------------------------------


def save_checkpoint(path: Path, draft, optimizer, step: int, train_s: float, history: list, cfg: DistillConfig):
    """DIR/ckpt/state.pt: weights, optimizer, step, training seconds, metric history (atomic write)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"step": step, "train_s": train_s, "draft_config": draft.config.to_dict(), "model": draft.state_dict(),
             "optimizer": optimizer.state_dict(), "history": history, "cfg": cfg.as_dict()}
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def draft_from_checkpoint(state: dict, device):
    """Rebuild the draft (transformers model) from a checkpoint's config and weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = dict(state["draft_config"])
    config = clean_config(type(AutoConfig.for_model(d["model_type"])).from_dict(d))
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    draft.load_state_dict(state["model"])
    return draft.to(device)


def lr_at(cfg: DistillConfig, step: int, steps: int, progress_time: float) -> float:
    """Linear warmup, then cosine to lr * min_lr_ratio over whichever runs out first: steps or time budget."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, steps - cfg.warmup_steps)
    progress = min(1.0, max(progress, progress_time))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# ---- the run ---------------------------------------------------------------------------------


def log_line(*args) -> None:
    """print, flushed (progress lines must show up in a redirected log as they happen)."""
    print(*args, flush=True)


def run_distill(cfg: DistillConfig, out_dir: str | Path, resume: bool = False, progress: bool = True,
                log=log_line) -> dict:
    """Data (cached), draft (built or resumed), training to cfg.steps / cfg.time_budget_min, export, eval.

    Returns {"step", "history", "final", "phases"}; everything also lands in out_dir
    (config.json, model.safetensors, tokenizer files, metrics.json, README.md, data.pt, ckpt/state.pt).
    """
    from tqdm import tqdm

    cfg.validate()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    phases: dict[str, float] = {}
    save_dtype = parse_dtype(cfg.save_dtype)

    t0 = time.perf_counter()
    data, target, tokenizer = build_data(cfg, out_dir / "data.pt", device, log)
    if target is not None:  # responses were made in this run; all of data.pt's times are in metrics["data"]
        phases.update({k: data["stats"][k] for k in ("generate_s", "teacher_s")})
    train = [r for r in data["train"] if num_scored(r, cfg.max_seq_len) > 0]
    held_out = [r for r in data["eval"] if num_scored(r, cfg.max_seq_len) > 0]
    if not train:
        raise ValueError("no training positions: the responses are empty or max_seq_len cuts them off")

    ckpt_path = out_dir / "ckpt" / "state.pt"
    state = None
    if resume:
        if not ckpt_path.is_file():
            raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path}")
        state = torch.load(ckpt_path, weights_only=False, map_location="cpu")
        draft = draft_from_checkpoint(state, device)
        log(f"resume: step {state['step']} from {ckpt_path}")
    else:
        if target is None:
            target, tokenizer = load_hf_target(cfg.target)
        draft = build_draft(target, cfg, device, records=train)
        export_draft(draft, out_dir, tokenizer, save_dtype)  # the tokenizer once; later exports rewrite the weights only
        layer_ids = cfg.init_layers or list(range(cfg.num_layers))
        what = f"target layers {layer_ids}" if cfg.init == "target" else "random layers"
        log(f"draft: {cfg.num_layers} layers ({what}), hidden {draft.config.hidden_size}, "
            f"vocab {draft.config.vocab_size}, embeddings {'frozen' if cfg.freeze_embeddings else 'trained'}")
    del target
    phases["setup_s"] = time.perf_counter() - t0 - phases.get("generate_s", 0) - phases.get("teacher_s", 0)

    params = set_trainable(draft, cfg.freeze_embeddings)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    step, train_s, history = 0, 0.0, []
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        step, train_s, history = state["step"], state["train_s"], list(state["history"])
    n_trainable = sum(p.numel() for p in params)
    log(f"train: {len(train)} sequences ({sum(num_scored(r, cfg.max_seq_len) for r in train)} positions), "
        f"{n_trainable / 1e6:.2f} M trainable parameters, steps {step} -> {cfg.steps}"
        + (f", budget {cfg.time_budget_min:g} min" if cfg.time_budget_min else ""))

    engine_eval = EngineEval(cfg, device) if cfg.engine_prompts else None
    engine_s = 0.0

    def record(entry: dict) -> None:
        nonlocal engine_s
        entry.update(evaluate_teacher_forced(draft, held_out, cfg, device))
        if entry.pop("_engine", False) and engine_eval is not None:
            t = time.perf_counter()
            export_draft(draft, out_dir, dtype=save_dtype)
            entry.update(engine_eval(draft, out_dir))
            engine_s += time.perf_counter() - t
        history.append(entry)

    draft.train()
    budget_s = cfg.time_budget_min * 60
    run_start = time.perf_counter()
    bar = tqdm(total=cfg.steps, initial=step, desc="distill", unit="step", disable=not progress)
    recent: list[tuple[float, float]] = []
    stop = "steps"
    while step < cfg.steps:
        run_s = time.perf_counter() - run_start - engine_s
        if budget_s and run_s >= budget_s:
            stop = "time budget"
            break
        rng = np.random.default_rng([cfg.seed, step])  # batch of a step depends on (seed, step) only: resumable
        idx = rng.choice(len(train), size=min(cfg.batch_size, len(train)), replace=False)
        batch = make_batch([train[i] for i in idx], cfg.max_seq_len, device)
        lr = lr_at(cfg, step, cfg.steps, run_s / budget_s if budget_s else 0.0)
        for g in optimizer.param_groups:
            g["lr"] = lr
        ce, kl = distill_loss(draft_logits(draft, batch, cfg.bf16), batch.topk_ids, batch.topk_logp)
        loss = ce.mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        step += 1
        recent = (recent + [(loss.item(), kl.mean().item())])[-50:]
        bar.update(1)
        step_train_s = train_s + time.perf_counter() - run_start - engine_s
        if step % cfg.eval_every == 0 or step == cfg.steps:
            entry = {"step": step, "train_s": round(step_train_s, 1), "lr": lr,
                     "loss": float(np.mean([r[0] for r in recent])), "kl": float(np.mean([r[1] for r in recent])),
                     "_engine": bool(cfg.engine_every) and step % cfg.engine_every == 0 and step != cfg.steps}
            record(entry)
            bar.set_postfix(kl=f"{entry['kl']:.3f}", agreement_tf=f"{entry.get('agreement_tf', float('nan')):.3f}")
            log(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()}))
        if step % cfg.ckpt_every == 0:
            save_checkpoint(ckpt_path, draft, optimizer, step, step_train_s, history, cfg)
    bar.close()
    train_s += time.perf_counter() - run_start - engine_s
    phases["train_s"] = time.perf_counter() - run_start - engine_s

    # Final: checkpoint, export, one last evaluation (teacher-forced + engine).
    save_checkpoint(ckpt_path, draft, optimizer, step, train_s, history, cfg)
    export_draft(draft, out_dir, dtype=save_dtype)
    t = time.perf_counter()
    final = {"step": step, "train_s": round(train_s, 1), "stopped_by": stop}
    final.update(evaluate_teacher_forced(draft, held_out, cfg, device))
    if engine_eval is not None:
        final.update(engine_eval(draft, out_dir))
    engine_s += time.perf_counter() - t
    phases["eval_s"] = engine_s
    log("final: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in final.items()}))
    embed, head = draft.model.embed_tokens.weight, draft.lm_head.weight
    size = {"params": sum(p.numel() for p in draft.parameters()),  # a tied head counts once
            "embedding_params": embed.numel() + (0 if head is embed else head.numel()),
            "file_bytes": (out_dir / "model.safetensors").stat().st_size}
    result = {"step": step, "history": history, "final": final, "phases": phases, "data": data["stats"],
              "size": size, "config": cfg.as_dict()}
    (out_dir / "metrics.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / "README.md").write_text(render_readme(result, out_dir))
    return result


WHY_FULL_WIDTH = """\
Why this recipe (full width: the target's hidden size, embedding and first layers):

- Same tokenizer and vocabulary by construction: the draft reuses the target's embedding matrix (and
  its tied LM head), so draft and target ids agree and minispec can verify the draft's tokens.
- Starting from the target's first layers puts the draft's residual stream in the target's basis, so the
  target's final norm and LM head are a sensible read-out from step 0.
- The cost: the full-width LM head is a large share of a small target's forward, and the checkpoint is as
  wide as the target's embedding. Narrow drafts (hidden_size) avoid both.
"""

WHY_NARROW = """\
Why this recipe (narrow: hidden_size below the target's, tied embedding from the target's read-out):

- Same tokenizer and vocabulary by construction; the LM head is where a small draft's bytes go
  (vocabulary rows x hidden), so hidden sets both the file size and the draft's cost per token.
- The tied embedding starts as the target's LM head projected on the top-d singular directions of the
  target's final hidden states on the training text, and the final norm's scale matches those states:
  the draft's logits start as a rank-d reading of the target's.
- Training data are the target's own responses, scored once by the teacher (top-k cached), so a
  training step never runs the target. Cross-entropy to the renormalised top-k is KL to the truncated
  teacher up to a constant.
"""


def render_readme(result: dict, out_dir: Path) -> str:
    """DIR/README.md: what was built, how, and what it reached."""
    cfg, final, phases, stats = result["config"], result["final"], result["phases"], result["data"]
    init = f"target layers {cfg['init_layers'] or list(range(cfg['num_layers']))}" if cfg["init"] == "target" \
        else "randomly initialised layers"
    if cfg.get("hidden_size"):
        shape = (f"A {cfg['num_layers']}-layer Llama-family draft with the target's tokenizer and vocabulary, hidden "
                 f"size {cfg['hidden_size']}: a tied embedding initialised from the target's LM head projected on its "
                 f"top-{cfg['hidden_size']} hidden directions (trained), {init}")
    else:
        shape = (f"A {cfg['num_layers']}-layer Llama-family draft with the target's tokenizer, vocabulary and hidden "
                 f"size: the target's token embedding and tied LM head "
                 f"({'frozen' if cfg['freeze_embeddings'] else 'trained'}), {init}, the target's final norm")
    responses = "greedy responses" if cfg["gen_temperature"] == 0 else f"responses (T={cfg['gen_temperature']})"
    lines = [
        f"# Draft for {cfg['target']} (minispec.distill)",
        "",
        f"{shape}; distilled on the target's own {responses}, up to {cfg['max_tokens']} tokens, to its cached "
        f"top-{cfg['top_k']} next-token probabilities.",
        "",
        "Load it:",
        "",
        "```python",
        "from minispec.llm import LLM",
        f"llm = LLM(target={cfg['target']!r}, draft={str(out_dir)!r}, num_speculative_tokens={cfg['engine_k']})",
        "# or transformers: AutoModelForCausalLM.from_pretrained(dir) as assistant_model=",
        "```",
        "",
        WHY_NARROW if cfg.get("hidden_size") else WHY_FULL_WIDTH,
        "## Result",
        "",
        f"- steps: {final['step']} ({final['stopped_by']}), training time {final['train_s'] / 60:.1f} min",
    ]
    size = result.get("size")
    if size:
        lines.append(f"- parameters: {size['params'] / 1e6:.1f} M, of which the embedding / LM head "
                     f"{size['embedding_params'] / 1e6:.1f} M; model.safetensors {size['file_bytes'] / 1e6:.1f} MB "
                     f"({cfg['save_dtype']})")
    if "agreement_tf" in final:
        lines.append(f"- held-out teacher-forced greedy agreement (agreement_tf): {final['agreement_tf']:.3f}; estimated "
                     f"mean accepted length at k={cfg['engine_k']}: {final['mean_accepted_length_tf']:.2f}; "
                     f"KL to the top-{cfg['top_k']} teacher: {final['eval_kl']:.3f}")
    if "first_position_rate_engine" in final:
        per_position = [round(a, 3) for a in final["accepted_per_position_engine"]]
        lines.append(f"- minispec greedy speculative decoding, k={cfg['engine_k']}, {cfg['engine_prompts']} eval "
                     f"prompts x {cfg['engine_max_tokens']} tokens: first-position acceptance "
                     f"{final['first_position_rate_engine']:.3f}, i.i.d. alpha (MLE) {final['alpha_mle_engine']:.3f}, "
                     f"mean accepted length "
                     f"{final['mean_accepted_length_engine']:.2f}, acceptance per position {per_position}")
    mass = stats.get("topk_mass", float("nan"))
    lines.append(f"- data: {stats.get('train_tokens', '?')} train / {stats.get('eval_tokens', '?')} held-out "
                 f"response tokens; mean teacher probability mass in the top {cfg['top_k']}: {mass:.3f}")
    lines.append("- data phases, all responses in data.pt (s): generate {:.0f}, teacher {:.0f}".format(
        stats.get("cache_generate_s", float("nan")), stats.get("cache_teacher_s", float("nan"))))
    lines.append("- wall time per phase (s): " + ", ".join(f"{k[:-2]} {v:.0f}" for k, v in phases.items()))
    lines += ["", "## History", "", "| step | train min | train KL | held-out KL | agreement_tf | mean acc. len (tf) |",
              "|---|---|---|---|---|---|"]
    nan = float("nan")
    for h in result["history"]:
        lines.append(f"| {h['step']} | {h['train_s'] / 60:.1f} | {h['kl']:.3f} | {h.get('eval_kl', nan):.3f} | "
                     f"{h.get('agreement_tf', nan):.3f} | "
                     f"{h.get('mean_accepted_length_tf', nan):.2f} |")
    lines += ["", "## Config", "", "```toml"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in cfg.items()]
    lines += ["```", ""]
    return "\n".join(lines)
