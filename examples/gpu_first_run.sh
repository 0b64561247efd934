#!/usr/bin/env bash
# The first run on a multi-GPU machine: two steps of a job, then a report of what to check.
#
#   bash examples/gpu_first_run.sh [CONFIG] [section.key=value ...]   # default: the 7B job
#   bash examples/gpu_first_run.sh --cpu [CONFIG] [overrides ...]     # the tiny CPU job
#
# Runs `rlhf train CONFIG trainer.total_steps=2 ...` (into <trainer.output_dir>-first-run), then
# reports every sync receipt, the log-prob gaps, each phase's memory against `rlhf plan`, vLLM's
# sleep figures, NCCL communicators, pinned memory and phase times; writes RUN/first_run.log and
# RUN/first_run_report.txt, and exits 1 naming the first thing that went wrong
# (docs/guides/first-gpu-run.md). On a cluster, run it where RAY_ADDRESS reaches the head.
# PYTHON selects the interpreter (default: the install's .venv, else python3).
# Paths (CONFIG, and the relative ones inside it) are read from the current folder.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
venv_python="${RLHF_VENV:-$repo/.venv}/bin/python"
[ -x "$venv_python" ] || venv_python=python3
exec "${PYTHON:-$venv_python}" -m rlhf.bench.first_run "$@"
