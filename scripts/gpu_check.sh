#!/usr/bin/env bash
# The CUDA path in one run:   scripts/gpu_check.sh [--dry-run | --prepare-wheels]
#
# On a CUDA machine, within 8 minutes (each stage has a time budget, all of them GPU_CHECK_BUDGET_S = 460 s
# at most), writes one log per stage and summary.txt to $OUT if it is set, else to ./gpu-check-out (under $OUT,
# where at most 8 files come back, the stage logs end as one all-logs.txt):
#   env        versions, the device, whether the Triton kernels are compiled (JITFunction) or interpreted
#   compile    (dry run only) every Triton kernel compiled for sm_90 with the engine's launch signatures
#   prepare    an early-exit draft for the target: its first layer with its own embedding, norm and head
#   tests      pytest -m cuda with TRITON_INTERPRET=0 (compiled kernels): rejection-sampler and draft-logits
#              kernels vs their torch references, the sampler's chi-square, the engine's greedy == transformers
#              and chi-square (lossless) tests, on cuda
#   e2e        the target (the shipped 30 MB draft checkpoint: a 3-layer Llama with the SmolLM2 tokenizer) in
#              float32 and bfloat16: greedy vs transformers; speculative with the early-exit draft (also with a
#              sharded draft-logits cache, whose kernels idle at tp=1 otherwise), the target itself and n-gram
#              lookup, acceptance printed; T=0.8 runs the rejection-sampler kernel inside the engine
#   tp-demo    scripts/tp_demo_gpu.sh at tp=1 (torchrun, bfloat16)
#   torchrun   torchrun --nproc-per-node 1: minispec at tp=1 vs transformers, then nccl's collectives
#   bench      python -m minispec.bench: target-only and speculative vs transformers generate and assisted
#              generation, batch 1 and 16, tok/s and ratios (bench.json)
#   overheads  per engine step: time, host syncs, kernels launched, CUDA graph replay vs eager forwards
# A failed or timed-out stage is logged and the script goes on; the summary table comes last. Exit status 0
# iff every stage passed. Without CUDA it says so and exits 0, running nothing.
#
# --dry-run (or GPU_CHECK_DEVICE=cpu): every stage's Python on CPU at tiny sizes (the tests stage runs the
# CPU twins of the cuda tests, Triton interpreted; torchrun uses gloo), to prove each piece runs.
#
# The GPU machine has no network and no gguf package. gguf is only needed for .gguf models, and none travels
# (the 98 MB SmolLM2 GGUF is over the 64 MiB limit), but wheels in .whl/ are installed offline into a
# scratch directory on PYTHONPATH. Prepare them on a machine with network, then carry .whl (git-ignored):
#   scripts/gpu_check.sh --prepare-wheels   # pip download gguf (pure Python) for Python 3.12 into .whl/
# minispec itself is used from this checkout through PYTHONPATH (nothing installed).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi

MODE=gpu
[ "${GPU_CHECK_DEVICE:-cuda}" = cpu ] && MODE=dry
case "${1:-}" in
  "") ;;
  --dry-run) MODE=dry ;;
  --prepare-wheels)
    exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --abi cp312 --platform manylinux2014_x86_64 -d .whl "gguf>=0.10" ;;
  *) echo "usage: scripts/gpu_check.sh [--dry-run | --prepare-wheels]" >&2; exit 2 ;;
esac

if [ "$MODE" = gpu ] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: needs a CUDA GPU (torch.cuda.is_available() is False with $PY); nothing was run."
  echo "gpu_check: scripts/gpu_check.sh --dry-run runs every stage on CPU at tiny sizes."
  exit 0
fi

OUT_DIR=${OUT:-$REPO/gpu-check-out}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}  # Triton's default until 3.10, set to silence its warning
if [ "$MODE" = gpu ] && compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --target "$WORK/site" .whl/*.whl >"$OUT_DIR/pip.log" 2>&1 \
    && export PYTHONPATH=$PYTHONPATH:$WORK/site || echo "gpu_check: installing .whl/ failed (see pip.log)"
fi

TARGET=$REPO/minispec/drafts/smollm2-135m-instruct-draft
DRAFT=$WORK/early-exit
CHECK=(scripts/gpu_check.py)
if [ "$MODE" = gpu ]; then
  DEV=cuda
  export TRITON_INTERPRET=0  # compiled kernels (tests/conftest.py only sets it when unset)
  E2E=(--num-prompts 4 --max-tokens 64)
  TP=(--num-prompts 4 --max-tokens 64 --reps 50)
  BENCH=(--batch-sizes 1,16 --max-tokens 64 --num-prompts 16 --cost-reps 10)
  OVER=(--batch-sizes 1,16 --steps 20 --reps 50 --graph-ctx 256)
else
  DEV=cpu
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
  E2E=(--num-prompts 2 --max-tokens 8)
  TP=(--num-prompts 2 --max-tokens 8 --reps 5)
  BENCH=(--batch-sizes 1,2 --max-tokens 4 --num-prompts 2 --cost-reps 2 --bandwidth-mib 16)
  OVER=(--batch-sizes 1,2 --steps 3 --reps 3 --graph-ctx 32)
fi

run_tests() {
  if [ "$MODE" = gpu ]; then
    "$PY" -m pytest -q -rs -p no:cacheprovider -m cuda tests
  else  # the CPU twin of every cuda test (same test, device "cpu"), Triton interpreted
    local ids
    mapfile -t ids < <("$PY" -m pytest -q --collect-only -p no:cacheprovider -m cuda tests 2>/dev/null \
      | grep '::' | sed -E 's/([[-])cuda([]-])/\1cpu\2/')
    echo "${#ids[@]} cpu twins of the cuda tests"
    ((${#ids[@]} > 0)) || return 1
    TRITON_INTERPRET=1 "$PY" -m pytest -q -rs -p no:cacheprovider "${ids[@]}"
  fi
}

# The dry run proves that every piece runs, not the timing: a 2-core CPU gets 4x the budgets.
SCALE=1
[ "$MODE" = dry ] && SCALE=4
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-$((460 * SCALE))}
ROWS=()
FAILED=0
# stage NAME BUDGET_S COMMAND...: run under a timeout (capped by what is left of BUDGET), log to OUT_DIR/NAME.log.
stage() {
  local name=$1 budget=$(($2 * SCALE))
  shift 2
  local log=$OUT_DIR/$name.log
  local left=$((BUDGET - ($(date +%s) - START)))
  if ((left < 15)); then
    ROWS+=("$name|skipped (time budget spent)|0|-")
    FAILED=1
    return
  fi
  ((budget > left)) && budget=$left
  echo "[gpu_check] $name (at most ${budget}s) ..."
  local t0=$(date +%s) rc
  # timeout signals its whole process group: pytest's and torchrun's children end with it.
  timeout -k 10 "$budget" "$@" >"$log" 2>&1
  rc=$?
  local dt=$(($(date +%s) - t0)) status=ok
  if ((rc == 124 || rc == 137)); then status="TIMEOUT after ${budget}s"; elif ((rc != 0)); then status="FAILED (exit $rc)"; fi
  [ "$status" = ok ] || FAILED=1
  ROWS+=("$name|$status|$dt|$log")
  echo "[gpu_check] $name: $status in ${dt}s"
}

export MODE PY
export -f run_tests
stage env 30 "$PY" "${CHECK[@]}" env --device "$DEV"
[ "$MODE" = dry ] && stage compile 60 "$PY" "${CHECK[@]}" compile  # on a GPU the tests compile them for real
stage prepare 60 "$PY" "${CHECK[@]}" prepare --target "$TARGET" --out "$DRAFT"
stage tests 170 bash -c run_tests
stage e2e 100 "$PY" "${CHECK[@]}" e2e --device "$DEV" --target "$TARGET" --draft "$DRAFT" "${E2E[@]}"
stage tp-demo 45 env PY="$PY" scripts/tp_demo_gpu.sh 1 "$TARGET" "$DRAFT"
stage torchrun 60 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 "${CHECK[@]}" tp --device "$DEV" \
  --target "$TARGET" --draft "$DRAFT" "${TP[@]}"
stage bench 120 "$PY" -m minispec.bench --target "$TARGET" --draft "$DRAFT" --draft ngram -k 4 --temperatures 0 \
  --rounds 1 --no-adaptive --device "$DEV" --no-progress --out "$OUT_DIR/bench.json" "${BENCH[@]}"
stage overheads 80 "$PY" "${CHECK[@]}" overheads --device "$DEV" --target "$TARGET" --draft "$DRAFT" "${OVER[@]}"

SUMMARY=$OUT_DIR/summary.txt
{
  echo "gpu_check ($MODE, device $DEV) $(date -u +%Y-%m-%dT%H:%M:%SZ), $(($(date +%s) - START)) s in all"
  printf '%-10s %-28s %6s  %s\n' stage status seconds log
  for row in "${ROWS[@]}"; do
    IFS='|' read -r name status dt log <<<"$row"
    printf '%-10s %-28s %6s  %s\n' "$name" "$status" "$dt" "$(basename "$log")"
  done
  for row in "${ROWS[@]}"; do
    IFS='|' read -r name status dt log <<<"$row"
    [ -f "$log" ] || continue
    echo
    echo "== $name"
    grep -E '^## |^\[minispec\]|passed|failed|error' "$log" | sed 's/^## /  /' | tail -n 60
    [ "$name" = bench ] && sed -n '/^minispec bench:/,/^n\/a:/p' "$log"
    [ "$status" = ok ] || { echo "  -- last lines of $name.log:"; tail -n 15 "$log" | sed 's/^/  | /'; }
  done
} >"$SUMMARY"
if [ -n "${OUT:-}" ]; then  # the device tool returns at most 8 files: one file of every log
  for log in "$OUT_DIR"/*.log; do echo "==== $(basename "$log")"; cat "$log"; done >"$OUT_DIR/all-logs.txt"
  rm -f "$OUT_DIR"/*.log
fi
echo
cat "$SUMMARY"
exit "$FAILED"
