#!/usr/bin/env bash
# Submit the quickstart's PPO job to a running Ray cluster with `ray job submit`.
#
#   bash examples/ray_job_submit/submit.sh [section.key=value ...]
#
# RAY_API_SERVER_ADDRESS (or RAY_ADDRESS; default http://127.0.0.1:8265) is the cluster's
# dashboard address. Without a
# cluster, the script starts a local one (`ray start --head`) and stops it at the end. The
# driver (`rlhf train`) runs on the head node and joins the cluster through the RAY_ADDRESS
# that `ray job submit` sets for it, so the config's ray.num_cpus is not used.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
venv=${RLHF_VENV:-.venv}  # the environment examples/install.sh installed into
ray=$venv/bin/ray
rlhf=$venv/bin/rlhf
config=configs/quickstart.yaml
out=outputs/quickstart

# The job needs the SFT-warm-started model and the data the quickstart builds.
if [ ! -f "$out/sft_model/config.json" ]; then
  echo "building the quickstart's model and data first"
  bash examples/quickstart.sh trainer.total_steps=1 trainer.val_every=0
fi

# `ray job submit` talks to the dashboard's job server. Ray 2.60 clusters require a token: the
# CLI sends ~/.ray/auth_token (written by `ray start` on this machine; copy it, or set
# RAY_AUTH_TOKEN, to submit from elsewhere) only when RAY_AUTH_MODE=token.
export RAY_API_SERVER_ADDRESS=${RAY_API_SERVER_ADDRESS:-${RAY_ADDRESS:-http://127.0.0.1:8265}}
unset RAY_ADDRESS  # inside the job, Ray sets it to the cluster the driver must join
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
started=0
if ! "$ray" job list >/dev/null 2>&1; then
  echo "no Ray cluster at $RAY_API_SERVER_ADDRESS: starting a local one"
  "$ray" start --head --num-cpus=2 --include-dashboard=true --dashboard-port=8265 >/dev/null
  started=1
fi
cleanup() { if [ "$started" = 1 ]; then "$ray" stop >/dev/null; fi; }
trap cleanup EXIT

# --working-dir ships this checkout to the cluster; its outputs/ folder is excluded, so the
# job reads and writes outputs through absolute paths of the (shared) file system.
"$ray" job submit --working-dir . \
  --runtime-env-json '{"excludes": [".venv", "outputs", ".git"]}' \
  -- "$repo/$rlhf" train --no-progress "$config" \
     "model.path=$repo/$out/sft_model" \
     "data.train_files=[$repo/$out/data/train.jsonl]" \
     "data.val_files=[$repo/$out/data/val.jsonl]" \
     "trainer.output_dir=$repo/outputs/ray_job_submit" \
     trainer.experiment_name=ray_job_submit "$@"
