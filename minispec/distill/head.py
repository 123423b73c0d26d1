"""Train an EAGLE-3 head (models/eagle.py) on the target's own answers and hidden states (distill/head_data.py).

python -m minispec.distill.head --data DIR[,DIR...] --eval-data DIR --out DIR [--max-tokens N] [--time-budget MIN] [--resume]
    [--init EARLIER_OUT]

- Draft vocabulary: the draft_vocab most frequent answer tokens of the training data (FR-Spec); the head's q is
  0 elsewhere, which stays lossless.
- Loss: at every answer position, each of `ttt_steps` chained steps (training-time test: step j reads the head's
  own output of step j - 1, as when drafting) is scored against the target's top-k law there (soft) or its
  argmax (hard), weighted 0.8 ** j.
- Eval (held-out answers, greedy ones only): acc_j, the share of positions where step j's argmax is the
  target's argmax given the j tokens before it were right: the head's greedy acceptance at draft position j + 1.
- The run writes OUT/config.json + model.safetensors (EAGLE-3's format), OUT/metrics.json (every eval),
  OUT/README.md, and OUT/ckpt.pt for --resume.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from minispec.distill.head_data import load_records, read_manifest
from minispec.kernels import native_bf16
from minispec.models.eagle import EagleHead, HeadConfig, draft_rows, load_head, save_head
from minispec.tools.config import field_help
from minispec.tools.metrics import tau_from_acceptance


@dataclass
class HeadTrainConfig:
    """One head-training run."""

    data: str = ""  # distill/head_data.py directories (train answers), comma-separated
    eval_data: str = ""  # the same for the held-out eval prompts
    out: str = ""  # the run's directory: the head (EAGLE-3 format), ckpt.pt, metrics.json, README.md
    max_tokens: int = 0  # answer tokens of the training data used (0 = all): the data curve's x
    draft_vocab: int = 8192  # rows of the head's LM head: the most frequent answer tokens of the data
    ttt_steps: int = 3  # training-time test: steps the head is fed its own outputs (1 = none)
    soft: bool = True  # the target's top-k law, else its argmax
    features: str = "fused"  # "fused": the low / middle / high layers; "high": the last captured layer alone
    epochs: float = 2.0  # passes over the data, unless --max-steps or the time budget ends the run first
    max_steps: int = 0  # optimiser steps (0 = epochs over the data): a fixed count makes runs on different data comparable
    time_budget_min: float = 0.0  # minutes of this run (0 = none); the schedule ends with it
    batch_tokens: int = 4096  # positions per optimiser step
    lr: float = 1e-3  # AdamW's peak learning rate
    warmup_steps: int = 50  # linear warm-up, then a cosine to min_lr_ratio * lr
    min_lr_ratio: float = 0.05  # the cosine's end, a fraction of lr
    weight_decay: float = 0.0  # AdamW's
    grad_clip: float = 0.5  # the gradient's largest norm
    eval_every: int = 200  # steps between held-out evals (each also saves a checkpoint)
    seed: int = 0  # initialisation and batch order
    threads: int = 0  # torch threads (0 = torch's default)
    bf16: bool = field(default_factory=native_bf16)  # bf16 autocast (weights fp32); default: AVX512-BF16 / AMX CPUs
    init: str = ""  # an earlier run's out/: start from its head (weights, draft vocabulary), with a fresh schedule


def data_settings(dirs: list[Path]) -> dict:
    """The settings the data directories share: one target and the same captured layers."""
    settings = [read_manifest(d)["settings"] for d in dirs]
    for d, st in zip(dirs, settings):
        if st is None:
            raise ValueError(f"{d} holds no head data (no {d / 'manifest.json'})")
        if (st["target"], st["capture_layers"]) != (settings[0]["target"], settings[0]["capture_layers"]):
            raise ValueError(f"{d} was made from {st['target']} layers {st['capture_layers']}; {dirs[0]} from "
                             f"{settings[0]['target']} layers {settings[0]['capture_layers']}")
    return settings[0]


def draft_vocabulary(records: list[dict], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent answer tokens (ties by id), as sorted target ids [size]."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for r in records:
        counts += torch.bincount(r["ids"][r["start"] :].long(), minlength=vocab_size)
    order = torch.argsort(-counts * vocab_size - torch.arange(vocab_size).flip(0), stable=True)  # count desc, id asc
    return order[:size].sort().values


def new_head(target, draft_ids: torch.Tensor, feature_layers: tuple[int, ...]) -> EagleHead:
    """A head in the target's layer shape; its norm and LM head start as the target's final norm and LM-head rows."""
    c = target.config
    cfg = HeadConfig(version=3, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                     num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                     head_dim=target.head_dim, rms_norm_eps=c.rms_norm_eps,
                     rope_theta=float(getattr(c, "rope_theta", 10000.0)), vocab_size=c.vocab_size,
                     draft_vocab_size=len(draft_ids), feature_layers=tuple(feature_layers))
    head = EagleHead(cfg)
    table = target_embeddings(target)
    lm = table if target.lm_head is None else dense(target.lm_head.weight)
    with torch.no_grad():
        head.norm.copy_(target.norm.weight.float())
        head.lm_head.weight.copy_(lm[draft_ids])
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
    return head


def init_head(path: Path, target, feature_layers: tuple[int, ...]) -> EagleHead:
    """An earlier run's head to train on: its float32 weights from ckpt.pt where kept, else its saved checkpoint."""
    head = load_head(path, target.config).float()
    if tuple(head.cfg.feature_layers) != tuple(feature_layers):
        raise ValueError(f"--init {path} reads target layers {list(head.cfg.feature_layers)}; this data and "
                         f"--features give {list(feature_layers)}")
    if (path / "ckpt.pt").is_file():
        head.load_state_dict(torch.load(path / "ckpt.pt", weights_only=False)["head"])
    return head


def dense(w) -> torch.Tensor:
    return w.dequantize().float() if hasattr(w, "dequantize") else w.detach().float()


def target_embeddings(target) -> torch.Tensor:
    """The target's token embedding as a dense float32 table [V, H] (frozen: the head shares it)."""
    return dense(target.embed_tokens.weight)[: target.vocab_size]


class Batches:
    """Padded training batches of whole answers, by similar length, about batch_tokens positions each."""

    def __init__(self, records: list[dict], batch_tokens: int, steps: int, t2d: torch.Tensor, feature_cols: slice,
                 seed: int):
        self.records, self.steps, self.t2d, self.cols = records, steps, t2d, feature_cols
        order = sorted(range(len(records)), key=lambda i: len(records[i]["ids"]))
        self.batches, cur = [], []
        for i in order:
            cur.append(i)
            if len(cur) * len(records[i]["ids"]) >= batch_tokens:
                self.batches.append(cur)
                cur = []
        if cur:
            self.batches.append(cur)
        self.gen = torch.Generator().manual_seed(seed)

    def epoch(self):
        for b in torch.randperm(len(self.batches), generator=self.gen).tolist():
            yield self.make(self.batches[b])

    def make(self, idx: list[int]) -> dict:
        """ids for embeddings [B, T + steps - 1], features [B, T, F], targets (topk ids in draft rows / probs
        [B, T + steps - 1, K], argmax [B, T + steps - 1], valid [B, T + steps - 1]), pad mask [B, T], greedy [B]."""
        recs = [self.records[i] for i in idx]
        T = max(len(r["ids"]) - 1 for r in recs)
        S = T + self.steps - 1
        B = len(recs)
        K = recs[0]["topk_ids"].shape[1]
        ids = torch.zeros(B, S, dtype=torch.long)
        feats = torch.zeros(B, T, self.cols.stop - self.cols.start, dtype=torch.float32)
        pad = torch.zeros(B, T, dtype=torch.bool)
        tk_ids = torch.zeros(B, S, K, dtype=torch.long)
        tk_p = torch.zeros(B, S, K)
        argmax = torch.full((B, S), -1, dtype=torch.long)
        for b, r in enumerate(recs):
            L, start = len(r["ids"]), r["start"]
            ids[b, : L - 1] = r["ids"][1:].long()
            feats[b, : L - 1] = r["states"][:, self.cols].float()
            pad[b, : L - 1] = True
            # anchor p predicts token p + 2, whose law is topk row p + 2 - start (rows: positions start - 1 ..)
            lo = max(start - 2, 0)
            rows = torch.arange(lo, L - 2) + 2 - start  # topk rows of anchors lo .. L - 3
            keep = rows >= 0
            anchors = torch.arange(lo, L - 2)[keep]
            rows = rows[keep]
            d = self.t2d[r["topk_ids"][rows].long()]  # [n, K] draft row or -1
            p = r["topk_logp"][rows].float().exp() * (d >= 0)
            tk_ids[b, anchors] = d.clamp(min=0)
            tk_p[b, anchors] = p / p.sum(-1, keepdim=True).clamp(min=1e-12)
            argmax[b, anchors] = d[:, 0]  # -1 where the target's argmax is outside the draft vocabulary
        return {"ids": ids, "features": feats, "pad": pad, "tk_ids": tk_ids, "tk_p": tk_p, "argmax": argmax,
                "has_target": tk_p.sum(-1) > 0, "greedy": torch.tensor([r.get("temperature", 0.0) == 0 for r in recs])}


def step_losses(head: EagleHead, emb_table: torch.Tensor, batch: dict, steps: int, soft: bool
                ) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """Each TTT step's mean loss over its scored positions, and (right, scored) greedy counts per step."""
    emb = F.embedding(batch["ids"], emb_table)  # [B, S, H]
    outs = head.train_steps(emb, batch["features"], steps, batch["pad"])
    T = batch["features"].shape[1]
    losses, counts = [], []
    for j, out in enumerate(outs):
        logp = torch.log_softmax(head.logits(out).float(), -1)  # [B, T, Vd]
        sl = slice(j, j + T)
        valid = batch["has_target"][:, sl] & batch["pad"]
        if soft:
            lp = logp.gather(-1, batch["tk_ids"][:, sl])  # [B, T, K]
            loss = -(lp * batch["tk_p"][:, sl]).sum(-1)
        else:
            tgt = batch["argmax"][:, sl]
            valid = valid & (tgt >= 0)
            loss = -logp.gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        losses.append((loss * valid).sum() / valid.sum().clamp(min=1))
        with torch.no_grad():
            g = valid & batch["greedy"][:, None]
            right = (logp.argmax(-1) == batch["argmax"][:, sl]) & g
            counts.append((int(right.sum()), int(g.sum())))
    return losses, counts


@torch.no_grad()
def evaluate(head: EagleHead, emb_table, batches: Batches, steps: int) -> dict:
    """acc_j (greedy acceptance at draft position j + 1 given the earlier ones right) and each step's soft loss."""
    head.eval()
    right, total, loss = [0] * steps, [0] * steps, [0.0] * steps
    n = 0
    for batch in (batches.make(b) for b in batches.batches):
        ls, cs = step_losses(head, emb_table, batch, steps, soft=True)
        for j in range(steps):
            right[j] += cs[j][0]
            total[j] += cs[j][1]
            loss[j] += float(ls[j])
        n += 1
    head.train()
    out = {f"acc_{j + 1}": right[j] / max(total[j], 1) for j in range(steps)}
    out |= {f"loss_{j + 1}": loss[j] / max(n, 1) for j in range(steps)}
    out["tau_greedy_k"] = {k: tau_from_acceptance([out[f"acc_{j + 1}"] for j in range(steps)], k) for k in range(1, steps + 1)}
    out["eval_positions"] = total[0]
    return out



def target_and_features(data_dirs: list[Path], features: str):
    """(the data's target model, the columns of a record's states the head reads, the target layers they are)."""
    from minispec.models.loader import load_model

    settings = data_settings(data_dirs)
    target = load_model(settings["target"], dtype=torch.float32, device=torch.device("cpu"), packed=None).model
    capture = tuple(settings["capture_layers"])
    H = target.hidden_size
    cols = slice(0, len(capture) * H) if features == "fused" else slice((len(capture) - 1) * H, len(capture) * H)
    return target, cols, capture if features == "fused" else capture[-1:]


def greedy_records(eval_data: Path) -> list[dict]:
    """An eval directory's greedy answers (temperature 0): the acceptance is measured on them alone."""
    data_settings([eval_data])  # a directory that holds no head data says so
    recs = [r for r in load_records(eval_data) if r.get("temperature", 0.0) == 0]
    if not recs:
        raise ValueError(f"--eval-data {eval_data} holds no greedy answers, and acceptance is measured on greedy ones "
                         f"only; make it with head_data --split eval --sampled-every 0")
    return recs


def evaluate_head(path: Path, eval_data: Path, features: str, steps: int, batch_tokens: int = 4096) -> dict:
    """A saved head's held-out acceptance over `steps` positions (evaluate's figures), whatever it was trained with."""
    recs = greedy_records(eval_data)  # before the target loads, so bad data fails at once
    target, cols, feature_layers = target_and_features([eval_data], features)
    head = init_head(path, target, feature_layers)
    t2d = draft_rows(head.draft_ids, target.vocab_size)
    return evaluate(head, target_embeddings(target), Batches(recs, batch_tokens, steps, t2d, cols, 0), steps)


def train(cfg: HeadTrainConfig, resume: bool = False, progress: bool = True, log=print) -> dict:
    """Train (or resume) one head; returns the final metrics."""
    from tqdm import tqdm

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    data_dirs = [Path(d) for d in cfg.data.split(",")]
    t0 = time.perf_counter()
    eval_recs = greedy_records(Path(cfg.eval_data))  # before the target loads, so bad data fails at once
    target, cols, feature_layers = target_and_features(data_dirs, cfg.features)
    train_recs = load_records(data_dirs, cfg.max_tokens or None)
    n_tokens = sum(len(r["topk_ids"]) for r in train_recs)
    log(f"head: {len(train_recs)} train answers ({n_tokens} tokens), {len(eval_recs)} eval answers "
        f"({sum(len(r['topk_ids']) for r in eval_recs)} tokens), loaded in {time.perf_counter() - t0:.0f} s")
    if cfg.init:
        head = init_head(Path(cfg.init), target, feature_layers)
        draft_ids = head.draft_ids
    else:
        draft_ids = draft_vocabulary(train_recs, cfg.draft_vocab, target.vocab_size)
        head = new_head(target, draft_ids, feature_layers)
    t2d = draft_rows(draft_ids, target.vocab_size)
    coverage = sum(int((t2d[r["ids"][r["start"]:].long()] >= 0).sum()) for r in eval_recs) / \
        max(1, sum(len(r["ids"]) - r["start"] for r in eval_recs))
    emb_table = target_embeddings(target)
    del target
    train_b = Batches(train_recs, cfg.batch_tokens, cfg.ttt_steps, t2d, cols, cfg.seed)
    eval_b = Batches(eval_recs, cfg.batch_tokens, cfg.ttt_steps, t2d, cols, cfg.seed)
    total_steps = cfg.max_steps or max(1, int(cfg.epochs * len(train_b.batches)))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    step, history, train_s = 0, [], 0.0
    ckpt = out / "ckpt.pt"
    if resume and ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        step, history, train_s = state["step"], state["history"], state["train_s"]
        train_b.gen.set_state(state["gen"])
        log(f"head: resumed at step {step} of {total_steps}")

    def lr_at(s: int) -> float:
        """Warm-up, then a cosine over the run: its steps or, with a time budget, its time, whichever ends first."""
        if s < cfg.warmup_steps:
            return cfg.lr * (s + 1) / cfg.warmup_steps
        t = min(1.0, (s - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        if cfg.time_budget_min:
            t = max(t, min(1.0, (time.perf_counter() - run_t0) / (60 * cfg.time_budget_min)))
        return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))

    def save_all(final: dict | None = None):
        torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "history": history,
                    "train_s": train_s, "gen": train_b.gen.get_state()}, out / "ckpt.tmp")
        (out / "ckpt.tmp").replace(ckpt)
        metrics = {"config": asdict(cfg), "train_answers": len(train_recs), "train_tokens": n_tokens,
                   "draft_vocab_coverage_eval": coverage, "total_steps": total_steps, "step": step,
                   "train_s": train_s, "history": history, "final": final}
        (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")

    bar = tqdm(total=total_steps, initial=step, desc="head train", unit="step", disable=not progress)
    run_t0 = time.perf_counter()
    done = False
    while not done and step < total_steps:
        for batch in train_b.epoch():
            t1 = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
                losses, counts = step_losses(head, emb_table, batch, cfg.ttt_steps, cfg.soft)
            loss = sum(0.8 ** j * l for j, l in enumerate(losses))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            step += 1
            train_s += time.perf_counter() - t1
            bar.update(1)
            shown = {"loss": f"{float(losses[0].detach()):.3f}"}
            if counts[0][1]:  # the batch's greedy answers' acc_1; a batch of sampled answers has none
                shown["acc1"] = f"{counts[0][0] / counts[0][1]:.2f}"
            bar.set_postfix(shown)
            if step % cfg.eval_every == 0 or step == total_steps:
                ev = evaluate(head, emb_table, eval_b, cfg.ttt_steps)
                history.append({"step": step, "train_s": round(train_s, 1), "train_loss_1": float(losses[0].detach())} | ev)
                log(f"head: step {step}: eval acc " + " ".join(f"{ev[f'acc_{j + 1}']:.3f}" for j in range(cfg.ttt_steps)))
                save_all()
            if step >= total_steps or (cfg.time_budget_min and time.perf_counter() - run_t0 > 60 * cfg.time_budget_min):
                done = True
                break
    bar.close()
    final = evaluate(head, emb_table, eval_b, cfg.ttt_steps) | {"step": step, "train_tokens": n_tokens}
    save_all(final)
    save_head(head, out, extra={"minispec": {"train_tokens": n_tokens, "step": step, "draft_vocab_coverage_eval":
                                             coverage, "eval": {k: v for k, v in final.items() if k.startswith("acc_")}}})
    write_readme(out, cfg, final, n_tokens, coverage, history)
    log(f"head: wrote {out} at step {step}: eval acc " + " ".join(f"{final[f'acc_{j + 1}']:.3f}"
                                                             for j in range(cfg.ttt_steps)))
    return final


def write_readme(out: Path, cfg: HeadTrainConfig, final: dict, n_tokens: int, coverage: float, history: list) -> None:
    lines = [
        "# EAGLE-3 draft head", "",
        "Trained by `python -m minispec.distill.head` (minispec/distill/head.py) on the target's own answers and the",
        "hidden states it computed while writing them (minispec/distill/head_data.py). EAGLE-3's checkpoint format.", "",
        f"- training answer tokens: {n_tokens}; draft vocabulary: {cfg.draft_vocab} rows "
        f"(eval answer-token coverage {coverage:.3f})",
        f"- features: {cfg.features}; loss: {'soft (top-k law)' if cfg.soft else 'hard (argmax)'}; "
        f"training-time test over {cfg.ttt_steps} steps; steps run: {final['step']}",
        "- held-out greedy acceptance (teacher-forced, given the earlier drafts right): "
        + ", ".join(f"position {j + 1}: {final[f'acc_{j + 1}']:.3f}" for j in range(cfg.ttt_steps)),
        "- predicted tokens per verification (greedy): "
        + ", ".join(f"k = {k}: {v:.2f}" for k, v in final["tau_greedy_k"].items()),
        *([f"- started from the head of an earlier run (`--init {cfg.init}`, its README.md gives its own data and "
           f"steps); this run's steps are counted from there"] if cfg.init else []), "",
        "Evals during training (metrics.json has all of them):", "",
        "| step | train s | acc 1 | acc 2 | acc 3 |", "|---|---|---|---|---|",
    ]
    for h in history[-8:]:
        lines.append(f"| {h['step']} | {h['train_s']} | " + " | ".join(f"{h.get(f'acc_{j}', float('nan')):.3f}"
                                                                   for j in (1, 2, 3)) + " |")
    (out / "README.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m minispec.distill.head", description="train an EAGLE-3 draft head")
    helps = field_help(HeadTrainConfig)
    for name, value in asdict(HeadTrainConfig()).items():
        flag = "--" + name.replace("_", "-")
        text = f"{helps.get(name, '')} (default: {value})".lstrip()
        if isinstance(value, bool):
            ap.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=value, help=text)
        else:
            ap.add_argument(flag, type=type(value), default=value, help=text)
    ap.add_argument("--evaluate", metavar="DIR", default=None,
                    help="train nothing: print the head in DIR's held-out acceptance on --eval-data over --ttt-steps "
                         "positions")
    ap.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = vars(ap.parse_args(argv))
    resume, progress, judged = a.pop("resume"), not a.pop("no_progress"), a.pop("evaluate")
    cfg = HeadTrainConfig(**a)
    if judged is not None:
        if not cfg.eval_data:
            ap.error("--evaluate needs --eval-data")
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        try:
            ev = evaluate_head(Path(judged), Path(cfg.eval_data), cfg.features, cfg.ttt_steps)
        except ValueError as e:  # bad data or a bad head
            ap.error(str(e))
        print(f"{judged}: held-out greedy acceptance over {ev['eval_positions']} positions: " +
              " / ".join(f"{ev[f'acc_{j + 1}']:.3f}" for j in range(cfg.ttt_steps)))
        return
    for name in ("data", "eval_data", "out"):
        if not getattr(cfg, name):
            ap.error(f"--{name.replace('_', '-')} is required")
    try:
        train(cfg, resume=resume, progress=progress)
    except ValueError as e:  # bad data, a bad --init head
        ap.error(str(e))


if __name__ == "__main__":
    main()
