"""`rlhf train` killed (SIGKILL) while it saves a checkpoint, then a shard of the newest
complete checkpoint corrupted in place (same size): the next `rlhf train` skips that
checkpoint with a message naming the file and continues from the previous good one."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf.config import format_config
from rlhf.trainer.checkpoint import CheckpointManager, verify_checkpoint
from rlhf.trainer.metrics import read_metrics
from tests.unit.trainer.jobs import job_config, make_assets

pytestmark = pytest.mark.timeout(900)


def start_train(config: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env.pop("RAY_ADDRESS", None)  # a local Ray of its own, like a user's first run
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "rlhf.cli", "train", str(config),
                                 "--no-progress"], stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)


def kill_when_saving(proc: subprocess.Popen, root: Path, step: int, timeout_s: float) -> None:
    """SIGKILL the driver as soon as the temporary folder of step_`step` appears."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if root.is_dir() and any(p.name.startswith(f".step_{step}.") for p in root.iterdir()):
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.002)
    proc.wait()


def test_kill_during_save_then_a_corrupted_shard_resumes_from_the_last_good(tmp_path):
    assets = make_assets(tmp_path)
    cfg = job_config(assets, tmp_path / "run",
                     algorithm={"adv_estimator": "grpo", "kl_in_reward": False},
                     trainer={"total_steps": 4, "save_every": 1, "val_every": 0},
                     ray={"num_cpus": 2})
    config = tmp_path / "job.yaml"
    config.write_text(format_config(cfg))
    root = tmp_path / "run" / "checkpoints"
    proc = start_train(config, tmp_path / "first.log")
    try:
        kill_when_saving(proc, root, step=3, timeout_s=600)
    finally:
        _kill_group(proc)
    log = (tmp_path / "first.log").read_text()
    assert proc.returncode == -signal.SIGKILL, log
    ckpt = CheckpointManager(tmp_path / "run")
    assert [s for s, _ in ckpt.step_folders()] == [1, 2], log  # step_3 never published
    assert all(verify_checkpoint(folder) is None for _, folder in ckpt.step_folders())

    shard = max((p for p in (root / "step_2" / "actor").rglob("*") if p.is_file()),
                key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    with open(shard, "r+b") as f:  # a bad block: same size, other bytes (inverted, as zeros
        f.seek(size // 2)          # might land on zeros and change nothing)
        block = f.read(256)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in block))
    assert shard.stat().st_size == size

    proc = start_train(config, tmp_path / "second.log")
    try:
        proc.wait(timeout=600)
    finally:
        _kill_group(proc)
    log = (tmp_path / "second.log").read_text()
    assert proc.returncode == 0, log
    name = shard.relative_to(root / "step_2").as_posix()
    assert f"checkpoint step_2 is damaged: {name} hash mismatch" in log
    assert f"resumed from {root / 'step_1'} (step 1)" in log
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4]
    assert [s for s, _ in ckpt.step_folders()] == [1, 2, 3, 4]
    assert all(verify_checkpoint(folder) is None for _, folder in ckpt.step_folders())
    assert not list(root.glob(".step_*"))


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop what is left of the process group this test started (its local Ray)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
