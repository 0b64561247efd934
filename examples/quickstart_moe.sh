#!/usr/bin/env bash
# The quickstart on a tiny Qwen3-MoE (configs/quickstart_moe.yaml): builds the "max of two
# numbers" data under outputs/quickstart_moe/ if missing, validates the job config, runs the
# format-only supervised warm start (rlhf sft, which builds the model from model.tiny) and
# then GRPO (rlhf train), which prints the held-out accuracy before and after.
#
#   bash examples/quickstart_moe.sh [section.key=value ...]    # overrides go to the job config
set -euo pipefail
name=quickstart_moe
config=configs/quickstart_moe.yaml
out=outputs/quickstart_moe
data_args=(arith --form max --max-value 99)
source "$(dirname "${BASH_SOURCE[0]}")/job.sh"
job_setup
dataset "$out/data/train.jsonl" rl train 2000
dataset "$out/data/val.jsonl" rl val 200
dataset "$out/data/sft_train.jsonl" format train 2000

check_config "$@"
warm_start "$@"

step "GRPO (rlhf train)"
"$rlhf" train "$config" "$@"
step "done: metrics in $out/run/metrics.jsonl"
