"""Training data for a draft head: the target's own answers, with the hidden states it computed while
writing them (captured in the same forwards) and its top-k next-token log-probabilities.

The data lives in a directory of shards (shard-00000.pt, ...) and a manifest.json: a later run with more
prompts or a larger time budget makes only the answers the directory does not hold yet.
The answers are the expensive part (one decode step a token); the states and top-k are one teacher-forced
forward away. `export_answers` keeps a directory's answers alone as a small .npz (token ids, 2 bytes a token),
and `rebuild` makes the directory again from such a file, on another machine.
One record per answer:
  ids [L] int32: prompt then answer;  start: index of the first answer token
  states [L - 1, C * hidden] float16: the captured hidden states of positions 0 .. L - 2 (the last token is
      never fed); C = len(capture_layers), the residual stream entering each of those layers
  topk_ids [L - start, K] int32 / topk_logp [L - start, K] float16: the target's top-K log-probs at positions
      start - 1 .. L - 2 (the law each answer token was drawn from; sorted, so topk_ids[:, 0] is its argmax)
"""
from __future__ import annotations

import argparse
import json
import time
import zlib
from pathlib import Path

import numpy as np
import torch

from minispec.data import load_prompts
from minispec.data.synth import synth_count, synth_prompts

MANIFEST = "manifest.json"


def default_capture_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high features: the streams entering layers 2, L // 2 and L - 3."""
    return (2, num_layers // 2, num_layers - 3)


def train_prompts(n: int, seed: int = 0) -> list[str]:
    """The first n train prompts: prompts.json's train split, then synthetic ones (never an eval prompt)."""
    base = load_prompts("train")
    extra = max(0, n - len(base))
    if extra > synth_count():
        raise ValueError(f"asked for {n} train prompts; {len(base) + synth_count()} are available")
    return (base + synth_prompts(extra, seed=seed))[:n]


def file_prompts(path: Path) -> list[str]:
    """Train prompts from a JSON list of strings; an eval prompt among them is refused, so eval stays held out."""
    try:
        prompts = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--prompts {path}: cannot read a JSON list of prompts ({e})") from None
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p.strip() for p in prompts):
        raise ValueError(f"--prompts {path}: expected a non-empty JSON list of non-empty strings")
    held_out = set(load_prompts("eval")).intersection(prompts)
    if held_out:
        raise ValueError(f"--prompts {path}: {len(held_out)} eval prompts, which must stay held out, e.g. {min(held_out)!r}")
    return prompts


def answer_temperature(index: int, sampled_every: int) -> float:
    """Answer i is sampled at T = 0.8 when sampled_every divides i + 1, else greedy (0 = always greedy)."""
    return 0.8 if sampled_every and (index + 1) % sampled_every == 0 else 0.0


def read_manifest(out: Path) -> dict:
    path = out / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {"settings": None, "shards": [], "done": []}


def write_shard(out: Path, manifest: dict, prompts: list[str], records: list[dict]) -> None:
    """Save records (one per prompt) as the next shard of out/ and the manifest after it (nothing when empty)."""
    if not records:
        return
    name = f"shard-{len(manifest['shards']):05d}.pt"
    torch.save(records, out / name)
    manifest["shards"].append(name)
    manifest["done"] += prompts
    (out / (MANIFEST + ".tmp")).write_text(json.dumps(manifest))
    (out / (MANIFEST + ".tmp")).replace(out / MANIFEST)


def _load_capturing(target_spec: str):
    """The target on the CPU in float32 (packed where it can be), capturing EAGLE-3's three feature layers."""
    from minispec.models.loader import load_model

    loaded = load_model(target_spec, dtype=torch.float32, device=torch.device("cpu"), packed=None)
    loaded.model.capture_layers = default_capture_layers(loaded.model.num_layers)
    return loaded


def load_records(out: Path | list[Path], max_tokens: int | None = None) -> list[dict]:
    """Every record of one data directory or several, in the order made; max_tokens: stop once that many answer
    tokens."""
    records, n = [], 0
    dirs = [out] if isinstance(out, Path) else out
    for shard in (d / s for d in dirs for s in read_manifest(d)["shards"]):
        for r in torch.load(shard, weights_only=False):
            records.append(r)
            n += len(r["topk_ids"])
            if max_tokens is not None and n >= max_tokens:
                return records
    return records


@torch.inference_mode()
def generate(target_spec: str, out: Path, num_prompts: int, *, max_tokens: int = 256, batch: int = 16,
             sampled_every: int = 2, top_k: int = 20, seed: int = 0, time_budget_min: float = 0.0,
             shard_size: int = 256, split: str = "train", prompt_file: Path | None = None, branch_within: int = 0,
             log=print) -> dict:
    """Answer the first num_prompts prompts of a split (train: prompts.json's and synthetic ones, or prompt_file's;
    eval: the held-out prompts) that out/ lacks with the target, capturing its hidden states.

    Continuous batching over one ModelRunner: a finished answer's slot takes the next prompt, whose prefill
    runs as its own padded forward beside the decodes. Stops at time_budget_min (0 = none), saving what is
    done; a later call resumes. Returns the manifest.
    branch_within > 0: a greedy answer takes the target's second choice once, at an answer position drawn below
    branch_within, and its record's answer is the greedy continuation after that token (a greedy answer to a new
    context; the answer before it is context); one that ends first stays a plain greedy answer.
    """
    from tqdm import tqdm

    from minispec.llm import encode_text
    from minispec.runner.model_runner import ModelRunner

    if prompt_file is not None and split != "train":
        raise ValueError("--prompts gives train prompts; it does not go with --split eval")
    if branch_within < 0:
        raise ValueError(f"--branch-within {branch_within}: give an answer position above 0, or 0 for no branching")
    if prompt_file is not None:  # a bad file is refused before the target loads
        prompts = file_prompts(prompt_file)[:num_prompts]
    else:
        prompts = train_prompts(num_prompts, seed) if split == "train" else load_prompts("eval")[:num_prompts]
    out.mkdir(parents=True, exist_ok=True)
    loaded = _load_capturing(target_spec)
    model = loaded.model
    settings = {"target": loaded.name, "max_tokens": max_tokens, "sampled_every": sampled_every, "top_k": top_k,
                "seed": seed, "capture_layers": list(model.capture_layers), "chat": True}
    if split != "train":
        settings["split"] = split
    if branch_within:
        settings["branch_within"] = branch_within
    if prompt_file is not None:
        settings["prompt_file"] = Path(prompt_file).name
    manifest = read_manifest(out)
    if manifest["settings"] not in (None, settings):
        raise ValueError(f"{out} holds data made with other settings ({manifest['settings']}); use another directory")
    manifest["settings"] = settings
    done = set(manifest["done"])
    todo = [(i, p) for i, p in enumerate(prompts) if p not in done]
    log(f"head data: {len(done)} answers in {out}, {len(todo)} to make (batch {batch}, max {max_tokens} tokens)")
    if not todo:
        return manifest
    max_len = min(loaded.max_model_len, 1024)
    runner = ModelRunner(model, batch, max_len, dtype=torch.float32, device=torch.device("cpu"))
    states_of: dict[int, list[torch.Tensor]] = {}

    def on_hidden(slots, starts, lens, states):
        at = 0
        for s, n in zip(slots, lens):
            states_of[s].append(states[at : at + n].to(torch.float16))
            at += n
    runner.on_hidden = on_hidden

    active: dict[int, dict] = {}  # slot -> the answer being written
    finished: list[dict] = []
    queue = list(todo)
    t0 = time.perf_counter()
    bar = tqdm(total=len(todo), desc="head data", unit="answer")
    made_tokens = 0

    def flush():
        nonlocal finished
        write_shard(out, manifest, [r["prompt"] for r in finished], [r["record"] for r in finished])
        finished = []

    eos = loaded.eos_token_ids
    while queue or active:
        if time_budget_min and time.perf_counter() - t0 > 60 * time_budget_min:
            log(f"head data: time budget of {time_budget_min} min reached")
            break
        for slot in range(batch):
            if slot not in active and queue:
                i, p = queue.pop(0)
                ids = encode_text(loaded.tokenizer, p, True, loaded.name)[: max_len // 2]
                g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(p.encode())) % 2**63)
                T = answer_temperature(i, sampled_every)
                branch = int(torch.randint(branch_within, (1,), generator=g)) if branch_within and T == 0 else -1
                active[slot] = {"prompt": p, "ids": ids, "start": len(ids), "fed": 0, "T": T, "branch": branch,
                                "gen": g, "topk_ids": [], "topk_logp": []}
                states_of[slot] = []
        slots = sorted(active)
        starts = [active[s]["fed"] for s in slots]
        queries = [active[s]["ids"][active[s]["fed"] :] for s in slots]
        logits = runner.forward(slots, starts, queries, [1] * len(slots))  # [n, V]
        logp = torch.log_softmax(logits.float(), dim=-1)
        top_logp, top_ids = logp.topk(top_k, dim=-1)  # [n, K]
        for j, s in enumerate(slots):
            a = active[s]
            a["fed"] = len(a["ids"])
            a["topk_ids"].append(top_ids[j].to(torch.int32))
            a["topk_logp"].append(top_logp[j].to(torch.float16))
            branch = a["branch"] == len(a["ids"]) - a["start"] and int(top_ids[j, 1]) not in eos
            if a["T"] == 0:
                tok = int(top_ids[j, 1 if branch else 0])
            else:
                tok = int(torch.multinomial(torch.softmax(logits[j] / a["T"], -1), 1, generator=a["gen"]))
            a["ids"].append(tok)
            if branch:  # the answer restarts after the second choice (a second choice that ends it waits a token)
                a["start"], a["branch"], a["topk_ids"], a["topk_logp"] = len(a["ids"]), -1, [], []
            elif a["branch"] == len(a["ids"]) - 1 - a["start"]:
                a["branch"] += 1
            n_answer = len(a["ids"]) - a["start"]
            if tok in eos or n_answer >= max_tokens or len(a["ids"]) >= max_len:
                states = torch.cat(states_of.pop(s))  # [L - 1, C * H]
                if not torch.isfinite(states).all():
                    raise ValueError("captured hidden states overflow float16")
                rec = {"ids": torch.tensor(a["ids"], dtype=torch.int32), "start": a["start"], "states": states,
                       "topk_ids": torch.stack(a["topk_ids"]), "topk_logp": torch.stack(a["topk_logp"]),
                       "temperature": a["T"]}
                finished.append({"prompt": a["prompt"], "record": rec})
                made_tokens += n_answer
                del active[s]
                bar.update(1)
                bar.set_postfix(tok_s=f"{made_tokens / (time.perf_counter() - t0):.0f}")
                if len(finished) >= shard_size:
                    flush()
    flush()
    bar.close()
    log(f"head data: {made_tokens} answer tokens in {time.perf_counter() - t0:.0f} s -> {out}")
    return manifest


def export_answers(out: Path, path: Path) -> int:
    """Write the answers of data directory out/ to path (.npz): each record's token ids, answer start and temperature,
    its prompt, and the directory's settings, in the order made. Returns the number of answer tokens."""
    manifest = read_manifest(out)
    if not manifest["shards"]:
        raise ValueError(f"{out} holds no head data (no {MANIFEST} with shards)")
    ids, starts, temps = [], [], []
    for shard in manifest["shards"]:
        for r in torch.load(out / shard, weights_only=False):
            ids.append(r["ids"].numpy())
            starts.append(r["start"])
            temps.append(r["temperature"])
    if len(ids) != len(manifest["done"]):
        raise ValueError(f"{out}: {len(ids)} records but {len(manifest['done'])} prompts in {MANIFEST}")
    flat = np.concatenate(ids)
    with open(path, "wb") as fh:  # the name as given (np.savez would add .npz)
        np.savez_compressed(fh, settings=np.array(json.dumps(manifest["settings"])),
                            prompts=np.array(json.dumps(manifest["done"])),
                            ids=flat.astype(np.uint16 if flat.max() < 2**16 else np.int32),
                            offsets=np.cumsum([0] + [len(x) for x in ids]), starts=np.array(starts, dtype=np.int32),
                            temperatures=np.array(temps, dtype=np.float64))
    return int(sum(len(x) for x in ids) - sum(starts))


def read_answers(path: Path) -> dict:
    """An exported answers file: settings (dict), prompts, and per answer its ids (list of int32 tensors), start and
    temperature."""
    try:
        f = np.load(path, allow_pickle=False)
        settings = json.loads(str(f["settings"]))
        offsets, flat = f["offsets"], f["ids"].astype(np.int32)
        answers = {"settings": settings, "prompts": json.loads(str(f["prompts"])),
                   "ids": [torch.from_numpy(flat[a:b].copy()) for a, b in zip(offsets[:-1], offsets[1:])],
                   "starts": [int(x) for x in f["starts"]], "temperatures": [float(x) for x in f["temperatures"]]}
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"{path}: not an answers file written by --export ({e})") from None
    n = len(answers["prompts"])
    if not len(answers["ids"]) == len(answers["starts"]) == len(answers["temperatures"]) == n:
        raise ValueError(f"{path}: {n} prompts but {len(answers['ids'])} answers")
    return answers


@torch.inference_mode()
def rebuild(target_spec: str, answers_path: Path, out: Path, *, batch_tokens: int = 2048, max_rows: int = 16,
            shard_size: int = 50, time_budget_min: float = 0.0, log=print) -> dict:
    """Make data directory out/ again from an answers file: one teacher-forced forward over each record's prompt and
    answer gives the states and top-k that generate() captured token by token (equal up to float summation order).
    Resumes like generate(); forwards take up to max_rows records and batch_tokens positions. Returns the manifest."""
    from tqdm import tqdm

    from minispec.runner.model_runner import ModelRunner

    answers = read_answers(answers_path)
    settings = answers["settings"]
    out.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(out)
    if manifest["settings"] not in (None, settings):
        raise ValueError(f"{out} holds data made with other settings ({manifest['settings']}); use another directory")
    loaded = _load_capturing(target_spec)
    model = loaded.model
    if loaded.name != settings["target"] or list(model.capture_layers) != settings["capture_layers"]:
        raise ValueError(f"{answers_path} holds answers of {settings['target']} (layers {settings['capture_layers']}), "
                         f"not of {loaded.name} (layers {list(model.capture_layers)})")
    vocab = model.vocab_size
    if any(int(x.max()) >= vocab or int(x.min()) < 0 for x in answers["ids"]):
        raise ValueError(f"{answers_path}: token ids outside {loaded.name}'s vocabulary of {vocab}")
    manifest["settings"] = settings
    done = set(manifest["done"])
    todo = [i for i, p in enumerate(answers["prompts"]) if p not in done]
    log(f"head data: {len(done)} answers in {out}, {len(todo)} to rebuild from {answers_path}")
    if not todo:
        return manifest
    top_k = settings["top_k"]
    max_len = max(len(answers["ids"][i]) for i in todo)
    runner = ModelRunner(model, max_rows, max_len, dtype=torch.float32, device=torch.device("cpu"))
    states_of: dict[int, torch.Tensor] = {}

    def on_hidden(slots, starts, lens, states):
        at = 0
        for s, n in zip(slots, lens):
            states_of[s] = states[at : at + n].to(torch.float16)
            at += n
    runner.on_hidden = on_hidden

    t0, made, disagree = time.perf_counter(), 0, 0
    bar = tqdm(total=len(todo), desc="head data (rebuild)", unit="answer")
    for w in range(0, len(todo), shard_size):
        if time_budget_min and time.perf_counter() - t0 > 60 * time_budget_min:
            log(f"head data: time budget of {time_budget_min} min reached")
            break
        window = todo[w : w + shard_size]
        records: dict[int, dict] = {}
        by_len = sorted(window, key=lambda i: len(answers["ids"][i]))
        while by_len:  # forwards of similar lengths, up to max_rows records and batch_tokens positions
            group = [by_len.pop(0)]
            while by_len and len(group) < max_rows and (len(group) + 1) * len(answers["ids"][by_len[0]]) <= batch_tokens:
                group.append(by_len.pop(0))
            ids = [answers["ids"][i] for i in group]
            starts = [answers["starts"][i] for i in group]
            n_logits = [len(x) - s for x, s in zip(ids, starts)]
            logits = runner.forward(list(range(len(group))), [0] * len(group), [x[:-1].tolist() for x in ids], n_logits)
            top_logp, top_ids = torch.log_softmax(logits, dim=-1).topk(top_k, dim=-1)  # [sum(n_logits), K]
            at = 0
            for slot, (i, x, s, n) in enumerate(zip(group, ids, starts, n_logits)):
                states = states_of.pop(slot)  # [L - 1, C * H]
                if not torch.isfinite(states).all():
                    raise ValueError("captured hidden states overflow float16")
                rec = {"ids": x, "start": s, "states": states, "topk_ids": top_ids[at : at + n].to(torch.int32),
                       "topk_logp": top_logp[at : at + n].to(torch.float16), "temperature": answers["temperatures"][i]}
                if rec["temperature"] == 0:  # a greedy answer is the target's argmax, near-ties aside
                    disagree += int((rec["topk_ids"][:, 0] != x[s:]).sum())
                records[i] = rec
                made += n
                at += n
        write_shard(out, manifest, [answers["prompts"][i] for i in window], [records[i] for i in window])
        bar.update(len(window))
        bar.set_postfix(tok_s=f"{made / (time.perf_counter() - t0):.0f}")
    bar.close()
    log(f"head data: {made} answer tokens rebuilt in {time.perf_counter() - t0:.0f} s -> {out}; {disagree} greedy "
        f"answer tokens are not the rebuilt argmax (float near-ties; many would mean another target)")
    return manifest


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="make a draft head's training data from the target's own answers")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--split", choices=("train", "eval"), default="train")
    ap.add_argument("--prompts", type=Path, default=None,
                    help="a JSON list of train prompts to answer instead of the built-in train split")
    ap.add_argument("--num-prompts", type=int, default=8000)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--sampled-every", type=int, default=2, help="every Nth answer sampled at T = 0.8 (0: all greedy)")
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--branch-within", type=int, default=0, metavar="N",
                    help="greedy answers take the target's second choice once, below answer position N, and keep the "
                         "greedy continuation after it as the answer (0: off)")
    ap.add_argument("--seed", type=int, default=0,
                    help="the sampled answers' seed: another seed, with --sampled-every 1, makes new answers to the same prompts")
    ap.add_argument("--time-budget-min", type=float, default=0.0)
    ap.add_argument("--shard-size", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--export", type=Path, default=None, metavar="FILE",
                    help="write --out's answers alone (token ids, prompts, settings) to FILE (.npz) and stop")
    ap.add_argument("--from-answers", type=Path, default=None, metavar="FILE",
                    help="make --out from an --export file by teacher forcing, instead of generating")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        if a.export is not None and a.from_answers is not None:
            raise ValueError("--export writes --out's answers and --from-answers reads them: give one")
        if a.export is not None:
            n = export_answers(a.out, a.export)
            print(f"head data: {n} answer tokens of {a.out} -> {a.export} ({a.export.stat().st_size / 1e6:.2f} MB)")
            return
        if a.from_answers is not None:
            rebuild(a.target, a.from_answers, a.out, shard_size=a.shard_size, time_budget_min=a.time_budget_min)
            return
        generate(a.target, a.out, a.num_prompts, max_tokens=a.max_tokens, batch=a.batch, sampled_every=a.sampled_every,
                 top_k=a.top_k, seed=a.seed, time_budget_min=a.time_budget_min, shard_size=a.shard_size, split=a.split,
                 prompt_file=a.prompts, branch_within=a.branch_within)
    except ValueError as e:  # a bad prompt file or answers file, too many prompts asked for, other settings
        ap.error(str(e))


if __name__ == "__main__":
    main()
