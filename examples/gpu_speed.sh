#!/usr/bin/env bash
# Training-step speed on one GPU, before and after the engine-speed work (issue 40). Needs
# torch and transformers only (no Ray, vLLM or flash-attn); about 6 minutes on an H200.
#
#   bash examples/gpu_speed.sh [OUT] [BEFORE]    # defaults: ./speed-<time>, f9232e0
#
# BEFORE: a commit (unpacked with `git archive`, so run from a clone that has it) or a folder
# holding that tree already (a machine without the git history).
# 1. pytest -m gpu on the fused bodies, the grouped-GEMM experts and the host-sync count;
# 2. rlhf bench engine at 1.24B bf16 (4 x 8,192 tokens, the 2026-11-25 bring-up's shape),
#    with one profiled step (--profile 25: the costliest kernels and the roofline split) for
#    the before tree, this tree eager (--compile off) and this tree compiled (--compile on;
#    with the bf16 log-prob agreement against transformers);
# 3. rlhf bench experts at Qwen3-30B-A3B's expert shape (128 experts of 768, top-8, hidden
#    2,048): our grouped GEMMs and our loop against transformers' grouped_mm and eager.
# Writes OUT/*.jsonl and OUT/*.log; a step that fails or runs past its limit is logged and
# the next one runs.
set -uo pipefail
out="$(realpath -m "${1:-${OUT:-speed-$(date +%Y%m%d-%H%M%S)}}")"
before="${2:-f9232e0}"
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
mkdir -p "$out"
if [ -d "$before" ]; then
    before_dir="$(realpath "$before")"
else
    before_dir="$out/before"
    mkdir -p "$before_dir"
    git archive "$before" | tar -x -C "$before_dir"
fi
export PYTHONUNBUFFERED=1
bench=(bench engine --size 1b --steps 3 --tokens 8192 --seq-len 1024 --micro-batches 4
       --no-offload --profile 25)
step() {  # name, seconds, command...: run it with a limit, log it, go on whatever happens
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date +%T))"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    echo "== $name: exit ${PIPESTATUS[0]}"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
step pytest_gpu 150 env PYTHONPATH="$PWD" "$python" -m pytest -q -p no:cacheprovider -m gpu \
    tests/unit/models/test_fused.py tests/unit/models/test_moe.py \
    tests/unit/engine/test_host_syncs.py
step engine_before 120 env -C "$before_dir" PYTHONPATH="$before_dir" "$python" -m rlhf.cli "${bench[@]}" \
    --no-logprobs
step engine_eager 120 env PYTHONPATH="$PWD" "$python" -m rlhf.cli "${bench[@]}" --no-logprobs \
    --compile off
step engine_compiled 180 env PYTHONPATH="$PWD" "$python" -m rlhf.cli "${bench[@]}" \
    --compile on
step experts 90 env PYTHONPATH="$PWD" "$python" -m rlhf.cli bench experts --experts 128 \
    --top-k 8 --hidden 2048 --intermediate 768 --tokens 8192
for name in engine_before engine_eager engine_compiled experts; do
    grep -h '^{' "$out/$name.log" > "$out/$name.jsonl" || true
done
