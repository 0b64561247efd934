"""CheckpointManager: complete-or-absent step folders, resume resolution, pruning."""

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import rlhf.trainer.checkpoint as checkpoint_module
from rlhf.controller.errors import WorkerError
from rlhf.errors import RLHFError
from rlhf.trainer.checkpoint import (
    MANIFEST,
    STATE_FILE,
    CheckpointManager,
    read_manifest,
    rng_state,
    run_fingerprint,
    set_rng_state,
    verify_checkpoint,
)


def write_shard(folder):
    (folder / "actor").mkdir()
    (folder / "actor" / "engine.pt").write_text("weights")


def test_save_publishes_a_complete_folder_and_latest_finds_it(tmp_path):
    ckpt = CheckpointManager(tmp_path)
    assert ckpt.latest() is None and ckpt.resolve("auto") is None
    ckpt.save(2, write_roles=write_shard, state={"step": 2})
    path = ckpt.save(4, write_roles=write_shard, state={"step": 4})
    assert path == tmp_path / "checkpoints" / "step_4"
    assert ckpt.resolve("auto") == path and ckpt.resolve("never") is None
    assert ckpt.load_state(path) == {"step": 4}
    assert (path / "actor" / "engine.pt").read_text() == "weights"
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] != []
    assert not list((tmp_path / "checkpoints").glob(".step_*"))


def test_a_crash_while_saving_leaves_the_last_checkpoint_untouched(tmp_path):
    ckpt = CheckpointManager(tmp_path)
    good = ckpt.save(1, write_roles=write_shard, state={"step": 1})

    def crash(folder):
        write_shard(folder)
        raise RuntimeError("killed while writing shards")

    with pytest.raises(RuntimeError, match="killed"):
        ckpt.save(2, write_roles=crash, state={"step": 2})
    assert ckpt.latest() == good and ckpt.load_state(good) == {"step": 1}
    assert not (tmp_path / "checkpoints" / "step_2").exists()
    assert not list((tmp_path / "checkpoints").glob(".step_*"))


def test_a_folder_without_manifest_is_skipped_with_a_message(tmp_path):
    ckpt = CheckpointManager(tmp_path)
    ckpt.save(1, write_roles=write_shard, state={"step": 1})
    (tmp_path / "checkpoints" / "step_9").mkdir()  # e.g. copied by hand, half done
    (tmp_path / "checkpoints" / ".step_3.tmp-dead").mkdir()
    assert ckpt.latest() == tmp_path / "checkpoints" / "step_1"
    ckpt.remove_stale()
    assert not (tmp_path / "checkpoints" / ".step_3.tmp-dead").exists()
    said = []
    assert ckpt.resolve("auto", report=said.append) == tmp_path / "checkpoints" / "step_1"
    assert said == [said[0]] and said[0].startswith("checkpoint step_9 is damaged: no manifest")
    with pytest.raises(RLHFError, match=r"step_9 is damaged: no manifest.json.*resume from "
                                        r"step_1 with trainer.resume=.*step_1$"):
        ckpt.resolve(str(tmp_path / "checkpoints" / "step_9"))
    with pytest.raises(RLHFError, match="not a checkpoint folder"):
        ckpt.resolve(str(tmp_path))


def test_resaving_a_step_replaces_it_and_max_keep_prunes(tmp_path):
    ckpt = CheckpointManager(tmp_path, max_keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, write_roles=write_shard, state={"step": step})
    ckpt.save(3, write_roles=write_shard, state={"step": 3, "again": True})
    assert [s for s, _ in ckpt.checkpoints()] == [2, 3]
    assert ckpt.load_state(tmp_path / "checkpoints" / "step_3")["again"] is True


def test_rng_state_round_trips():
    state = rng_state()
    want = (torch.rand(3), np.random.rand(2), random.random())
    set_rng_state(state)
    got = (torch.rand(3), np.random.rand(2), random.random())
    torch.testing.assert_close(got[0], want[0])
    assert np.array_equal(got[1], want[1]) and got[2] == want[2]
    assert STATE_FILE == "trainer_state.pt"


# ---- manifests: every damage is found and named ----------------------------------------------

def write_big_shard(folder):
    (folder / "actor").mkdir()
    torch.save({"w": torch.arange(4096, dtype=torch.float32)}, folder / "actor" / "model_rank0.pt")


def zero_bytes_inside(path, start=200, length=64):
    """Corrupt a file in place, keeping its size (a bad disk block, a botched copy)."""
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(b"\0" * length)


def truncate(path, keep=100):
    with open(path, "r+b") as f:
        f.truncate(keep)


DAMAGE = {
    "zeroed bytes in a shard": (lambda d: zero_bytes_inside(d / "actor" / "model_rank0.pt"),
                                "actor/model_rank0.pt hash mismatch"),
    "truncated shard": (lambda d: truncate(d / "actor" / "model_rank0.pt"),
                        "actor/model_rank0.pt has 100 bytes, the manifest says"),
    "truncated state file": (lambda d: truncate(d / STATE_FILE),
                             f"{STATE_FILE} has 100 bytes, the manifest says"),
    "missing state file": (lambda d: (d / STATE_FILE).unlink(), f"{STATE_FILE} is missing"),
    "missing manifest": (lambda d: (d / MANIFEST).unlink(), "no manifest.json"),
    "garbled manifest": (lambda d: (d / MANIFEST).write_text("{"), "manifest.json is unreadable"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_resume_auto_skips_a_damaged_checkpoint_naming_the_file(case, tmp_path):
    damage, want = DAMAGE[case]
    ckpt = CheckpointManager(tmp_path)
    for step in (3, 4):
        ckpt.save(step, write_roles=write_big_shard, state={"step": step, "config": {}})
    assert verify_checkpoint(tmp_path / "checkpoints" / "step_4") is None
    damage(tmp_path / "checkpoints" / "step_4")
    said = []
    assert ckpt.resolve("auto", report=said.append) == tmp_path / "checkpoints" / "step_3"
    assert len(said) == 1 and said[0].startswith(f"checkpoint step_4 is damaged: {want}")
    with pytest.raises(RLHFError) as info:
        ckpt.resolve(str(tmp_path / "checkpoints" / "step_4"))
    assert str(info.value).startswith(f"checkpoint step_4 is damaged: {want}")
    assert str(info.value).endswith(f"resume from step_3 with trainer.resume="
                                    f"{tmp_path / 'checkpoints' / 'step_3'}")


def test_when_no_checkpoint_verifies_resume_auto_stops(tmp_path):
    ckpt = CheckpointManager(tmp_path)
    ckpt.save(1, write_roles=write_big_shard, state={"step": 1})
    zero_bytes_inside(tmp_path / "checkpoints" / "step_1" / "actor" / "model_rank0.pt")
    with pytest.raises(RLHFError, match=r"no checkpoint in .* verifies \(checkpoint step_1 is "
                                        r"damaged: actor/model_rank0.pt hash mismatch"):
        ckpt.resolve("auto", report=lambda line: None)


def test_the_manifest_lists_every_file_the_step_and_the_run_fingerprint(tmp_path):
    ckpt = CheckpointManager(tmp_path)
    config = {"model": {"path": str(tmp_path / "nowhere")}, "algorithm": {"adv_estimator": "gae"}}
    folder = ckpt.save(7, write_roles=write_big_shard, state={"step": 7, "config": config})
    manifest = read_manifest(folder)
    assert manifest["step"] == 7 and manifest["config"] == config
    assert sorted(manifest["files"]) == ["actor/model_rank0.pt", STATE_FILE]
    shard = folder / "actor" / "model_rank0.pt"
    data = shard.read_bytes()
    assert manifest["files"]["actor/model_rank0.pt"] == {
        "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
        # a file this small is read whole by the quick digest, after its size
        "quick": hashlib.sha256(len(data).to_bytes(8, "little") + data).hexdigest()}
    assert manifest["config_fingerprint"] == run_fingerprint(config)
    other = {**config, "algorithm": {"adv_estimator": "grpo"}}
    assert run_fingerprint(other) != run_fingerprint(config)
    assert run_fingerprint({**config, "trainer": {"total_steps": 5}}) == run_fingerprint(config)


def test_the_quick_check_reads_sampled_blocks_and_the_full_hash_every_byte(tmp_path, monkeypatch):
    # 4 blocks of 16 bytes over a 16 KiB shard: its first and last 16 bytes and two between.
    monkeypatch.setattr(checkpoint_module, "QUICK_BLOCK", 16)
    monkeypatch.setattr(checkpoint_module, "QUICK_BLOCKS", 4)
    ckpt = CheckpointManager(tmp_path)
    folder = ckpt.save(1, write_roles=write_big_shard, state={"step": 1})
    shard = folder / "actor" / "model_rank0.pt"
    last = shard.stat().st_size - 16
    zero_bytes_inside(shard, start=last // 3 + 4, length=4)  # inside a sampled block
    assert verify_checkpoint(folder) == "actor/model_rank0.pt hash mismatch (its bytes changed " \
                                        "after the save)"
    folder = ckpt.save(1, write_roles=write_big_shard, state={"step": 1})
    zero_bytes_inside(shard, start=last // 6, length=64)  # between two sampled blocks
    assert verify_checkpoint(folder) is None  # what the quick check gives up for its speed
    assert str(verify_checkpoint(folder, full_hash=True)).startswith("actor/model_rank0.pt hash")
    with pytest.raises(RLHFError, match="actor/model_rank0.pt hash mismatch"):
        CheckpointManager(tmp_path, full_hash=True).resolve(str(folder))


def test_a_manifest_without_quick_digests_is_checked_by_sha256(tmp_path):
    ckpt = CheckpointManager(tmp_path)
    folder = ckpt.save(1, write_roles=write_big_shard, state={"step": 1})
    manifest = read_manifest(folder)
    for entry in manifest["files"].values():
        del entry["quick"]  # as written before quick digests
    (folder / MANIFEST).write_text(json.dumps(manifest))
    assert verify_checkpoint(folder) is None
    zero_bytes_inside(folder / "actor" / "model_rank0.pt")
    assert verify_checkpoint(folder) == "actor/model_rank0.pt hash mismatch (its bytes changed " \
                                        "after the save)"


def test_an_unreadable_state_file_names_the_checkpoint(tmp_path):
    ckpt = CheckpointManager(tmp_path)
    folder = ckpt.save(2, write_roles=write_big_shard, state={"step": 2})
    truncate(folder / STATE_FILE, keep=10)
    with pytest.raises(RLHFError, match=f"checkpoint step_2 is damaged: {STATE_FILE} cannot be "
                                        "read"):
        ckpt.load_state(folder)


# A driver that saves step_1 and step_2, then is killed (SIGKILL, below) while writing step_3:
# in the save itself, or (background) while a thread writes the engine files and training goes on.
DRIVER = """
import sys, threading, time
from pathlib import Path
import torch
from rlhf.trainer.checkpoint import CheckpointManager

def shards(slow):
    def write(folder):
        (folder / "actor").mkdir()
        for rank in range(2):
            shard = folder / "actor" / f"model_rank{rank}.pt"
            torch.save({"w": torch.full((4096,), float(rank))}, shard)
            if slow:
                print("writing", flush=True)
                time.sleep(600)
    return write

class BackgroundRole:
    def save_checkpoint(self, folder, background=False):
        threading.Thread(target=shards(True), args=(Path(folder).parent,), daemon=True).start()
        return [None]

    def checkpoint_written(self):
        return [False]

background = sys.argv[2] == "background"
ckpt = CheckpointManager(sys.argv[1], background=background)
for step in (1, 2):
    ckpt.save(step, write_roles=shards(False), state={"step": step, "config": {}})
if background:
    ckpt.save(3, roles={"actor": BackgroundRole()}, state={"step": 3, "config": {}})
    while True:  # training goes on
        ckpt.poll()
        time.sleep(0.01)
ckpt.save(3, write_roles=shards(True), state={"step": 3, "config": {}})
"""


@pytest.mark.parametrize("mode", ["sync", "background"])
def test_a_driver_killed_while_saving_and_a_corrupted_shard_resume_from_the_last_good(mode,
                                                                                      tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path), mode],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "writing\n"  # in step_3's save
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == \
        ["step_1", "step_2"]
    assert list(root.glob(".step_3*"))  # the partial save, left where the kill found it
    zero_bytes_inside(root / "step_2" / "actor" / "model_rank1.pt")
    ckpt = CheckpointManager(tmp_path)
    ckpt.remove_stale()
    said = []
    folder = ckpt.resolve("auto", report=said.append)
    assert folder == root / "step_1" and ckpt.load_state(root / "step_1")["step"] == 1
    assert said == ["checkpoint step_2 is damaged: actor/model_rank1.pt hash mismatch (its bytes "
                    "changed after the save); skipped"]
    assert not list(root.glob(".step_*"))


def test_a_crash_between_the_renames_of_a_re_save_gets_the_previous_folder_back(tmp_path):
    ckpt = CheckpointManager(tmp_path)
    good = ckpt.save(3, write_roles=write_shard, state={"step": 3})
    good.rename(good.with_name(".step_3.old-1234abcd"))  # SIGKILL after the first rename
    (tmp_path / "checkpoints" / ".step_3.tmp-99-deadbeef").mkdir()  # the new one, unpublished
    ckpt.remove_stale()
    assert ckpt.latest() == good and verify_checkpoint(good) is None
    assert not list((tmp_path / "checkpoints").glob(".step_*"))


# ---- background saves: training goes on while the engine files are written ---------------------

class SlowRole:
    """One rank of an engine role (the worker group view's methods) whose background write
    waits for `gate`, then writes a data file and reports it hashed as written, or fails."""

    def __init__(self, gate, *, fail=False):
        self.gate, self.fail, self.thread, self.result = gate, fail, None, None
        self.cancelled = False

    def _write(self, folder):
        self.gate.wait()
        if self.cancelled:  # a dead rank: it writes nothing
            return
        folder.mkdir()
        data = b"weights" * 1000
        (folder / "__0_0.distcp").write_bytes(data)
        self.result = {"files": {"__0_0.distcp": {"size": len(data),
                                                  "sha256": hashlib.sha256(data).hexdigest()}},
                       "write_s": 0.5}

    def save_checkpoint(self, folder, background=False):
        if not background:
            self._write(Path(folder))
            return [self.result]
        self.thread = threading.Thread(target=self._write, args=(Path(folder),))
        self.thread.start()
        return [None]

    def checkpoint_written(self):
        return [self.thread is None or not self.thread.is_alive()]

    def finish_checkpoint(self):
        assert self.thread is not None
        self.thread.join()
        if self.fail:
            raise RLHFError("writing the engine checkpoint failed (mesh rank 0: OSError)")
        return [self.result]


def test_a_background_save_is_published_once_written_with_its_step_state(tmp_path):
    lines = []
    ckpt = CheckpointManager(tmp_path, background=True, report=lines.append)
    gate = threading.Event()
    state = {"step": 2, "config": {}, "loader": [1, 2]}
    path = ckpt.save(2, roles={"actor": SlowRole(gate)}, state=state)
    state["loader"].append(3)  # training goes on: the saved state is the one of step 2
    assert not path.exists() and ckpt.poll() == {} and not path.exists()
    gate.set()
    deadline, metrics = time.monotonic() + 30, {}
    while not path.exists() and time.monotonic() < deadline:
        metrics = ckpt.poll()
    assert path.is_dir() and set(metrics) == {"checkpoint/blocked_s", "checkpoint/write_s"}
    assert metrics["checkpoint/write_s"] >= 0.5 > metrics["checkpoint/blocked_s"]
    assert ckpt.poll() == {}  # each save's figures once
    assert lines == [f"checkpoint step_2 written in the background in "
                     f"{metrics['checkpoint/write_s']:.2f} s; training was blocked "
                     f"{metrics['checkpoint/blocked_s']:.2f} s"]
    assert ckpt.load_state(path)["loader"] == [1, 2]
    files = read_manifest(path)["files"]
    assert sorted(files) == ["actor/__0_0.distcp", STATE_FILE]
    assert verify_checkpoint(path, full_hash=True) is None
    assert not list((tmp_path / "checkpoints").glob(".step_*"))


def test_the_next_save_and_wait_finish_a_pending_one_and_raise_its_error(tmp_path):
    ckpt = CheckpointManager(tmp_path, background=True, report=lambda line: None)
    opened = threading.Event()
    threading.Timer(0.2, opened.set).start()
    first = ckpt.save(1, roles={"actor": SlowRole(opened)}, state={"step": 1})
    second = ckpt.save(2, roles={"actor": SlowRole(opened, fail=True)}, state={"step": 2})
    assert first.is_dir() and verify_checkpoint(first) is None  # the save waited for it
    with pytest.raises(RLHFError, match=r"checkpoint step_2 could not be written \(writing the "
                                        r"engine checkpoint failed .*\); the previous "
                                        "checkpoints are as they were"):
        ckpt.wait()
    assert not second.exists() and ckpt.latest() == first
    assert not list((tmp_path / "checkpoints").glob(".step_*"))
    assert ckpt.wait() is None  # nothing pending any more


def test_a_run_stopped_by_an_error_publishes_its_pending_save_unless_a_worker_failed(tmp_path):
    lines = []
    ckpt = CheckpointManager(tmp_path, background=True, report=lines.append)
    opened = threading.Event()
    opened.set()
    first = ckpt.save(1, roles={"actor": SlowRole(opened)}, state={"step": 1})
    ckpt.settle(RLHFError("the reward function raised"))  # the workers are sound
    assert verify_checkpoint(first) is None and lines[-1].startswith("checkpoint step_1 written")
    held = threading.Event()  # the failed run's rank never gets to write
    dead = SlowRole(held)
    second = ckpt.save(2, roles={"actor": dead}, state={"step": 2})
    died = WorkerError("rank 1 died", job="j", role="actor", rank=1, method="update_actor")
    ckpt.settle(died)  # the other ranks may be stuck in a collective: no call to them
    assert not second.exists() and ckpt.wait() is None
    assert lines[-1] == ("checkpoint step_2 was not completed (a worker failed); the previous "
                         "checkpoint stays the newest")
    dead.cancelled = True  # end the stand-in's thread without writing, so none outlives the test
    held.set()
    dead.thread.join()
