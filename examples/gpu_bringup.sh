#!/usr/bin/env bash
# GPU bring-up kit: checks a GPU box in under ten minutes with only torch and transformers
# (no Ray, vLLM or flash-attn, no network), from this source tree.
#
#   bash examples/gpu_bringup.sh [OUT]      # OUT: default $OUT, else ./bringup-<time>
#
# Runs pytest -m gpu, rlhf verify-model --device cuda (NCCL, one process per visible GPU),
# rlhf bench attention and rlhf bench engine at ~1B in bf16; writes OUT/<step>.log,
# OUT/results.jsonl and OUT/summary.txt, prints the summary, and exits 1 if a check failed.
# PYTHON selects the interpreter (default python3). Extra arguments go to rlhf.bench.bringup
# (e.g. --only engine, --budget 300).
set -euo pipefail
out="$(realpath -m "${1:-${OUT:-bringup-$(date +%Y%m%d-%H%M%S)}}")"
[ $# -gt 0 ] && shift
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python="${PYTHON:-python3}"
mkdir -p "$out"
"$python" -m rlhf.bench.bringup --out "$out" --python "$python" "$@" 2>&1 | tee "$out/bringup.log"
exit "${PIPESTATUS[0]}"
