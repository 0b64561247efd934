# Shared steps of the example jobs (examples/quickstart.sh, examples/calculator.sh), sourced by
# them after they set `name` (the log prefix), `config`, `out` and `data_args` (the task and
# flags of `rlhf make-dataset`):
#   job_setup                 cd to the repo, install into $RLHF_VENV (default ./.venv) on first
#                             use (examples/install.sh)
#   step MESSAGE              a timestamped progress line
#   ensure_tiny_model         build the tiny model in $out/model if missing
#   dataset FILE KIND SPLIT N `rlhf make-dataset ${data_args[@]}` into FILE if missing (seed 0)
#   check_config [k=v ...]    `rlhf config show`: stops naming the key or file before any worker starts
#   warm_start [k=v ...]      `rlhf sft` unless the config's sft.output_path already holds a model
# The environment examples/install.sh installs into: RLHF_VENV, else .venv (both read from the
# repo, where job_setup runs the install).
rlhf=${RLHF_VENV:-.venv}/bin/rlhf

job_setup() {
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  bash examples/install.sh
}

step() { printf '\n[%s %s] %s\n' "$name" "$(date +%H:%M:%S)" "$*"; }

ensure_tiny_model() {
  if [ ! -f "$out/model/config.json" ]; then
    step "building the tiny model in $out/model"
    "$rlhf" make-tiny-model "$out/model"
  fi
}

dataset() {
  if [ ! -f "$1" ]; then
    step "writing $4 $3 rows ($2) to $1"
    "$rlhf" make-dataset "${data_args[0]}" "$1" "${data_args[@]:1}" --kind "$2" --split "$3" \
      --n "$4" --seed 0
  fi
}

check_config() {
  # It reads the data, so it runs once the data exists.
  step "checked and resolved job config"
  "$rlhf" config show "$config" "$@"
}

warm_start() {
  local sft_model
  sft_model=$("$rlhf" config show "$config" "$@" |
    awk '/^sft:/{s=1} s && /^  output_path:/{print $2; exit}')
  if [ ! -f "$sft_model/config.json" ]; then
    step "supervised warm start (rlhf sft) -> $sft_model"
    "$rlhf" sft "$config" "$@"
  else
    step "reusing the warm-started model in $sft_model (delete it to redo SFT)"
  fi
}
