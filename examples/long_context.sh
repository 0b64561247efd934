#!/usr/bin/env bash
# Context parallelism on a job that does not fit one rank without it (configs/long_context.yaml):
# builds the prompts under outputs/long_context/ if missing, shows `rlhf plan` at cp=1 (does not
# fit the stated 1 GiB; cp=2 among the changes that do) and at cp=2, then trains GRPO at cp=2
# on responses of 4096 tokens. A few minutes on two CPU cores.
#
#   bash examples/long_context.sh [section.key=value ...]    # overrides go to the job config
set -euo pipefail
name=long_context
config=configs/long_context.yaml
out=outputs/long_context
data_args=(arith --form max --max-value 99)
source "$(dirname "${BASH_SOURCE[0]}")/job.sh"
job_setup
dataset "$out/data/train.jsonl" rl train 200

check_config "$@"
step "memory plan at cp=1 (expected: does not fit)"
"$rlhf" plan "$config" actor.parallel.cp=1 ref.parallel.cp=1 "$@" || true
step "memory plan at cp=2"
"$rlhf" plan "$config" "$@"

step "GRPO at cp=2 (rlhf train)"
"$rlhf" train "$config" "$@"
step "done: metrics in $out/run/metrics.jsonl"
