"""The ways a cluster stops and restarts `rlhf train`, one job through all of them, each time
re-run with the same command (the scheduler gives the first and last attempts one rank, the
second two: trainer.ranks_per_node is not part of the run's identity):

1. on one rank, SIGKILLed while it writes its first checkpoint: an attempt with no complete
   checkpoint, whose metrics.jsonl (steps 1..4, sampled and trained without interruption at
   dp=1) is the reference for the rest;
2. re-run on two ranks: it recognises its own earlier attempt (run.json), moves the leftovers
   aside, starts from step 1 and is sent SIGTERM once step 1 is logged: it finishes the step
   it is in (before the last), saves a checkpoint (in the background, trainer.async_checkpoint:
   the exit waits for it to be published) and exits with EXIT_PREEMPTED; its steps match the
   dp=1 reference;
3. re-run on one rank (dp 2 -> 1, ZeRO-1 shards resharded): it resumes there and finishes;
   every step is in metrics.jsonl once, with the reference's losses, gradient norms and
   rewards, the loader read as many batches as an uninterrupted run, and hf_model is written.
   The prompts are an indexed folder (`rlhf preprocess-data`), read by memory map.
One rank in the first attempt spares a rank start (torch, vLLM and its engine). Four steps
(each a fraction of a second on an idle machine) leave room for a late SIGTERM: it must land
before the last.

A damaged newest checkpoint is skipped for the previous good one: tests/unit/trainer/
test_checkpoint.py kills a saving driver and corrupts a shard without the cost of Ray.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf.config import format_config
from rlhf.data.preprocess import Job, preprocess
from rlhf.trainer.checkpoint import CheckpointManager, verify_checkpoint
from rlhf.trainer.metrics import read_metrics
from rlhf.trainer.preemption import EXIT_PREEMPTED
from tests.unit.trainer.jobs import job_config, make_assets

pytestmark = pytest.mark.timeout(900)

# Every sample scores by its length, so GRPO's advantages (and the updates) are not all zero.
LENGTH_REWARD = ("def score(*, prompt, response, ground_truth, extra):\n"
                 "    return float(len(response) % 3)\n")
COMPARED = ("actor/grad_norm", "actor/pg_loss", "actor/entropy", "reward/mean",
            "response_length/mean")


def start_train(config: Path, log: Path, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env.pop("RAY_ADDRESS", None)  # a local Ray of its own, like a user's first run
    # Ray's system config for that local Ray: no idle worker prestarted per CPU for the first
    # driver; `rlhf train` passes a runtime_env, so its ranks never use them.
    env["RAY_prestart_worker_first_driver"] = "0"
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "rlhf.cli", "train", str(config),
                                 *overrides, "--no-progress"], stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)


def kill_when_saving(proc: subprocess.Popen, root: Path, step: int, timeout_s: float) -> None:
    """SIGKILL the driver as soon as the temporary folder of step_`step` appears."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if root.is_dir() and any(p.name.startswith(f".step_{step}.") for p in root.iterdir()):
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.002)
    proc.wait()


def terminate_after_step(proc: subprocess.Popen, out: Path, step: int, timeout_s: float) -> None:
    """SIGTERM the driver (as a scheduler would) once this attempt's metrics.jsonl has step
    `step`: only after the earlier attempt's was moved into old_runs/<time>/ (the folder is
    made first, then the files move into it one by one)."""
    deadline = time.monotonic() + timeout_s
    path = out / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        ready = any(out.glob("old_runs/*/metrics.jsonl")) and path.is_file()
        lines = path.read_text().split("\n")[:-1] if ready else []  # whole lines only
        if any(json.loads(line).get("step") == step for line in lines if line):
            os.kill(proc.pid, signal.SIGTERM)
            break
        time.sleep(0.01)
    proc.wait(timeout=timeout_s)


def test_killed_in_its_first_save_then_preempted_then_resized_ends_as_if_uninterrupted(
        tmp_path):
    assets = make_assets(tmp_path)
    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)
    out = tmp_path / "run"
    prompts = tmp_path / "train_idx"
    preprocess([assets["train"]], prompts, Job(kind="prompts", tokenizer_path=assets["model"]),
               workers=1, progress=False)
    cfg = job_config(assets, out, algorithm={"adv_estimator": "grpo", "kl_in_reward": False},
                     data={"train_files": [str(prompts)]},
                     reward={"functions": [{"path": f"{tmp_path / 'length_reward.py'}:score"}]},
                     trainer={"total_steps": 4, "save_every": 0, "val_every": 0},
                     ray={"num_cpus": 2})
    config = tmp_path / "job.yaml"
    config.write_text(format_config(cfg))
    root, ckpt = out / "checkpoints", CheckpointManager(out)

    # 1. one rank; SIGKILL in the first save (save_every=0: the final one), after all 4 steps
    proc = start_train(config, tmp_path / "first.log", "trainer.ranks_per_node=1")
    try:
        kill_when_saving(proc, root, step=4, timeout_s=600)
    finally:
        _kill_group(proc)
    log = (tmp_path / "first.log").read_text()
    assert proc.returncode == -signal.SIGKILL, log
    assert (out / "run.json").is_file() and ckpt.step_folders() == [], log
    uninterrupted = read_metrics(out)
    assert [r["step"] for r in uninterrupted] == [1, 2, 3, 4], log
    assert any(r["actor/grad_norm"] > 0 for r in uninterrupted)  # the updates do something

    # 2. two ranks: restarts from scratch; SIGTERM after step 1 -> checkpoint, status 75 (the
    # checkpoint written in the background: the exit waits for it)
    proc = start_train(config, tmp_path / "second.log", "trainer.async_checkpoint=true")
    try:
        terminate_after_step(proc, out, step=1, timeout_s=600)
    finally:
        _kill_group(proc)
    log = (tmp_path / "second.log").read_text()
    assert proc.returncode == EXIT_PREEMPTED, log
    assert "holds an earlier attempt of this run that completed no checkpoint" in log
    assert "SIGTERM received: finishing the current step" in log and "preempted: " in log
    assert "written in the background in" in log
    [(saved, folder)] = ckpt.step_folders()
    assert 1 <= saved < 4 and verify_checkpoint(folder) is None, log
    assert [r["step"] for r in read_metrics(out)] == list(range(1, saved + 1))
    [first_attempt] = (out / "old_runs").iterdir()
    assert [r["step"] for r in read_metrics(first_attempt)] == [1, 2, 3, 4]
    assert list((first_attempt / "checkpoints").glob(".step_4.tmp-*"))

    # 3. the same command on one rank (data parallel 2 -> 1): resumes and finishes
    proc = start_train(config, tmp_path / "third.log", "trainer.ranks_per_node=1")
    try:
        proc.wait(timeout=600)
    finally:
        _kill_group(proc)
    log = (tmp_path / "third.log").read_text()
    assert proc.returncode == 0, log
    assert f"resumed from {root / f'step_{saved}'} (step {saved})" in log
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for got, want in zip(records, uninterrupted):
        for key in COMPARED:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (got["step"], key)
    assert (out / "hf_model" / "config.json").is_file()
    assert [s for s, _ in ckpt.step_folders()] == [saved, 4]
    loader = ckpt.load_state(ckpt.step_folders()[-1][1])["loader"]
    assert (loader["epoch"], loader["position"]) == (0, 4)  # 4 of the 16 batches: none read twice
    assert not list(root.glob(".step_*"))


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop what is left of the process group this test started (its local Ray)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
