"""CheckpointManager: complete-or-absent step folders, resume resolution, pruning."""

import random

import numpy as np
import pytest
import torch

from rlhf.errors import RLHFError
from rlhf.trainer.checkpoint import STATE_FILE, CheckpointManager, rng_state, set_rng_state


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
    assert ckpt.latest().name == "step_1"
    ckpt.remove_stale()
    assert not (tmp_path / "checkpoints" / ".step_3.tmp-dead").exists()
    said = []
    assert ckpt.resolve("auto", report=said.append).name == "step_1"
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
    assert ckpt.load_state(ckpt.latest())["again"] is True


def test_rng_state_round_trips():
    state = rng_state()
    want = (torch.rand(3), np.random.rand(2), random.random())
    set_rng_state(state)
    got = (torch.rand(3), np.random.rand(2), random.random())
    torch.testing.assert_close(got[0], want[0])
    assert np.array_equal(got[1], want[1]) and got[2] == want[2]
    assert STATE_FILE == "trainer_state.pt"
