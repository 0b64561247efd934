"""The SLURM and KubeRay recipes of docs/guides/operations.md: the script and the YAML parse,
they requeue or retry on a failed attempt, and their `rlhf train` commands are accepted by the
command line and load as configs."""

import re
import shlex
import subprocess
from pathlib import Path

import yaml

from rlhf.cli import build_parser
from rlhf.config import load_config
from rlhf.trainer.preemption import EXIT_PREEMPTED

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "examples" / "slurm" / "rlhf_train.sbatch"
RAYJOB = REPO / "examples" / "kuberay" / "rayjob.yaml"


def check_train_command(argv: list[str]) -> None:
    """argv after `rlhf` parses as `rlhf train`, and its config and overrides load."""
    args = build_parser().parse_args(argv)
    assert args.command == "train"
    load_config(REPO / args.config, args.overrides)


def test_the_slurm_script_requeues_on_exit_75_and_its_command_parses():
    text = SLURM.read_text()
    assert subprocess.run(["bash", "-n", str(SLURM)], capture_output=True).returncode == 0
    assert "#SBATCH --requeue" in text and re.search(r"#SBATCH --signal=B:TERM@\d+", text)
    assert f'if [ "$status" -eq {EXIT_PREEMPTED} ]' in text and 'scontrol requeue' in text
    config = re.search(r"CONFIG=\$\{CONFIG:-(\S+)\}", text)[1]
    line = re.search(r'"\$VENV/bin/rlhf" (train .*?)&\n', text, re.S)[1]
    line = line.replace('"$CONFIG"', config).replace('"$SLURM_NNODES"', "2").replace("\\\n", " ")
    check_train_command(shlex.split(line))


def test_the_rayjob_retries_and_its_entrypoint_parses():
    job = yaml.safe_load(RAYJOB.read_text())
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    spec = job["spec"]
    assert spec["backoffLimit"] > 0 and spec["shutdownAfterJobFinishes"] is True
    entry = shlex.split(spec["entrypoint"])
    assert entry[0] == "rlhf"
    check_train_command(entry[1:])
    cluster = spec["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [
        group["template"]["spec"] for group in cluster["workerGroupSpecs"]]
    nnodes = next(a for a in entry if a.startswith("trainer.nnodes="))
    assert len(pods) == int(nnodes.split("=")[1])  # one 8-GPU pod per node of the job
    for pod in pods:
        assert pod["terminationGracePeriodSeconds"] >= 300  # a step and a save after SIGTERM
        (container,) = pod["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/shared", "/dev/shm"}
    head_env = pods[0]["containers"][0]["env"]  # the driver runs in the head pod
    assert any(e["name"] == "WANDB_API_KEY" and "secretKeyRef" in e["valueFrom"]
               for e in head_env)
