#!/usr/bin/env bash
# Tensor-parallel demo on CPU: N gloo ranks under torchrun, batch-sharded verification.
#   scripts/tp_demo_cpu.sh [N]   (N=3 runs SmolLM2-135M-Instruct: 9 heads / 3 KV heads divide by 3;
#                                 N=2 runs a tiny random model with 6 heads, since 2 does not divide 9)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-3}
PY=${PY:-.venv/bin/python}
if [ "$N" = 3 ]; then
  MODEL=smollm2-135m-instruct
  PROMPTS=(--prompt "Name three rivers in Europe." --prompt "Write a haiku about tea." --prompt "What is 12 * 7?" --prompt "Give one tip for sleeping well.")
else
  MODEL=$(mktemp -d)/tiny6
  "$PY" -c "from minispec.tools.tiny import make_tiny_model_dir as m; m('$MODEL', with_tokenizer=True, hidden_size=96, num_attention_heads=6, num_key_value_heads=6, intermediate_size=192)"
  PROMPTS=(--no-chat --prompt "The quick brown fox" --prompt "Once upon a time" --prompt "1 2 3 4")
fi
# The target drafts for itself here: every draft is accepted, so the summary shows the mechanism at work.
OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$N" -m minispec.generate \
  --tp "$N" --target "$MODEL" --draft "$MODEL" -k 3 --max-tokens 24 "${PROMPTS[@]}"
