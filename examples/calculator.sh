#!/usr/bin/env bash
# The README's multi-turn example: multi-digit arithmetic ("372*48=") with a calculator tool.
# Installs into ./.venv on first use, builds the tiny model and the data under
# outputs/calculator/ if they are missing, validates the job config, runs a format-only
# supervised warm start (rlhf sft on whole tool-use episodes whose call uses the prompt's
# numbers with an operator drawn at random) and then GRPO with the CalculatorEnv (rlhf train),
# which prints the held-out accuracy before and after: calling with the right expression
# comes from RL.
#
#   bash examples/calculator.sh [section.key=value ...]    # overrides go to the job config
set -euo pipefail
name=calculator
config=configs/calculator.yaml
out=outputs/calculator
# --model: the traces' tool-result turns are rendered by this model's chat template.
data_args=(calc --model "$out/model")
source "$(dirname "${BASH_SOURCE[0]}")/job.sh"
job_setup
ensure_tiny_model
dataset "$out/data/train.jsonl" rl train 2000
dataset "$out/data/val.jsonl" rl val 200
dataset "$out/data/sft_train.jsonl" format train 2000

check_config "$@"
warm_start "$@"

step "GRPO with the calculator tool (rlhf train)"
"$rlhf" train "$config" "$@"
step "done: metrics in $out/run/metrics.jsonl, policy in $out/run/hf_model"
