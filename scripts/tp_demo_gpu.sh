#!/usr/bin/env bash
# Tensor-parallel demo on N GPUs (nccl): scripts/tp_demo_gpu.sh [N] [TARGET] [DRAFT]
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-3}
TARGET=${2:-smollm2-135m-instruct}
DRAFT=${3:-$TARGET}
PY=${PY:-.venv/bin/python}
"$PY" -m torch.distributed.run --standalone --nproc-per-node "$N" -m minispec.generate \
  --tp "$N" --target "$TARGET" --draft "$DRAFT" -k 4 --max-tokens 64 --dtype bfloat16 \
  --prompt "Explain speculative decoding in two sentences." --prompt "Write a limerick about GPUs."
