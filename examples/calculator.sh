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
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
bash examples/install.sh
rlhf=.venv/bin/rlhf
config=configs/calculator.yaml
out=outputs/calculator
step() { printf '\n[calculator %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

if [ ! -f "$out/model/config.json" ]; then
  step "building the tiny model in $out/model"
  "$rlhf" make-tiny-model "$out/model"
fi
dataset() {  # FILE KIND SPLIT N
  if [ ! -f "$1" ]; then
    step "writing $4 $3 rows ($2) to $1"
    # --model: the traces' tool-result turns are rendered by this model's chat template.
    "$rlhf" make-dataset calc "$1" --kind "$2" --split "$3" --n "$4" --seed 0 --model "$out/model"
  fi
}
dataset "$out/data/train.jsonl" rl train 2000
dataset "$out/data/val.jsonl" rl val 200
dataset "$out/data/sft_train.jsonl" format train 2000

# `config show` checks everything the job reads (so it runs once the data exists): it stops
# here, naming the key or file, before any worker starts.
step "checked and resolved job config"
"$rlhf" config show "$config" "$@"

sft_model=$("$rlhf" config show "$config" "$@" | awk '/^sft:/{s=1} s && /^  output_path:/{print $2; exit}')
if [ ! -f "$sft_model/config.json" ]; then
  step "supervised warm start (rlhf sft) -> $sft_model"
  "$rlhf" sft "$config" "$@"
else
  step "reusing the warm-started model in $sft_model (delete it to redo SFT)"
fi

step "GRPO with the calculator tool (rlhf train)"
"$rlhf" train "$config" "$@"
step "done: metrics in $out/run/metrics.jsonl, policy in $out/run/hf_model"
