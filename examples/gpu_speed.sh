#!/usr/bin/env bash
# Training-step speed on one GPU, before and after the engine-speed work (issue 40), for the
# next session with a device. Needs torch and transformers only; about 5 minutes on an H100.
#
#   bash examples/gpu_speed.sh [OUT] [BEFORE_COMMIT]    # defaults: ./speed-<time>, f9232e0
#
# 1. pytest -m gpu on the grouped-GEMM experts and the host-sync count (CUDA, bf16);
# 2. rlhf bench engine at 1.24B bf16 (4 x 8,192 tokens, the 2026-11-25 bring-up's shape),
#    the two trees taking turns 3 times (examples/engine_speed_ab.py): tokens/s, MFU,
#    forward-backward and AdamW seconds, medians;
# 3. one profiled step of each tree (--profile 25: the costliest kernels);
# 4. one MoE block (16 experts, top-2) forward and backward, before and after;
# 5. rlhf bench experts at Qwen3-30B-A3B's expert shape (128 experts of 768, top-8, hidden
#    2,048): our grouped GEMMs and our loop against transformers' grouped_mm and eager.
# Writes OUT/*.jsonl and OUT/*.log. The before tree comes from `git archive`, so run it from a
# clone that has BEFORE_COMMIT.
set -euo pipefail
out="$(realpath -m "${1:-${OUT:-speed-$(date +%Y%m%d-%H%M%S)}}")"
before_commit="${2:-f9232e0}"
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
mkdir -p "$out/before"
git archive "$before_commit" | tar -x -C "$out/before"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
bench=(--size 1b --steps 3 --tokens 8192 --seq-len 1024 --micro-batches 4 --no-logprobs
       --no-offload)
"$python" -m pytest -q -p no:cacheprovider -m gpu tests/unit/models/test_moe.py \
    tests/unit/engine/test_host_syncs.py 2>&1 | tee "$out/pytest_gpu.log" || true
"$python" examples/engine_speed_ab.py --before "$out/before" --after . --repeats 3 engine -- \
    "${bench[@]}" | tee "$out/engine_ab.jsonl"
for tree in "$out/before" .; do
    name=$([ "$tree" = . ] && echo after || echo before)
    PYTHONPATH="$(realpath "$tree")" "$python" -m rlhf.cli bench engine "${bench[@]}" \
        --profile 25 | tee "$out/engine_profile_$name.jsonl"
done
"$python" examples/engine_speed_ab.py --before "$out/before" --after . --repeats 3 moe-layer \
    | tee "$out/moe_layer_ab.jsonl"
"$python" -m rlhf.cli bench experts --experts 128 --top-k 8 --hidden 2048 --intermediate 768 \
    --tokens 8192 | tee "$out/experts.jsonl"
