#!/usr/bin/env bash
# The README's main command. Installs into ./.venv on first use, builds the tiny model and the
# "max of two numbers" data under outputs/quickstart/ if they are missing, validates the job
# config, runs a short format-only supervised warm start (rlhf sft: answer with a number, then
# stop; the number it imitates is one of the two at random) and then PPO (rlhf train), which
# prints the held-out accuracy before and after: the skill comes from RL.
#
#   bash examples/quickstart.sh [section.key=value ...]    # overrides go to the job config
set -euo pipefail
name=quickstart
config=configs/quickstart.yaml
out=outputs/quickstart
data_args=(arith --form max --max-value 99)
source "$(dirname "${BASH_SOURCE[0]}")/job.sh"
job_setup
ensure_tiny_model
dataset "$out/data/train.jsonl" rl train 2000
dataset "$out/data/val.jsonl" rl val 200
dataset "$out/data/sft_train.jsonl" format train 2000

check_config "$@"
warm_start "$@"

step "PPO (rlhf train)"
"$rlhf" train "$config" "$@"
step "done: metrics in $out/run/metrics.jsonl, policy in $out/run/hf_model"
