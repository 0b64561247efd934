"""A streaming run (trainer.async_mode streaming) with a multi-turn environment, through
PPOTrainer on Ray, stopped dead at a random point (seeded: the k-th segment the driver waits
for, wherever that falls: sampling, between steps or inside a save) and resumed from its
newest checkpoint. Read from the checkpoints of the run's lineage (every step saves), each
step trains train_batch_size prompts that no step before it trained, and at the end every
prompt drawn was trained exactly once or is still queued, generating or buffered. The
workers outlive the dead driver (as in test_async's resume), so the resumed run must bring
their weights back to the checkpoint's."""

import random
from typing import cast

import pytest
import torch

from rlhf.trainer.checkpoint import STATE_FILE, CheckpointManager
from rlhf.trainer.jobs import RoleGroups, job_workers
from rlhf.trainer.rollout_source import StreamingPipeline
from rlhf.trainer.stream import BUFFERED, GENERATING, QUEUED, TRAINED
from tests.ray.test_async import GRPO, SEPARATE, _fit
from tests.unit.envs.scripted_env import ECHO_SPEC
from tests.unit.trainer.jobs import job_config, make_assets

pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm]

STEPS, BATCH = 4, 4
STREAMING = {"async_mode": "streaming", "stream_segment_tokens": 3, "max_staleness": 1,
             "stream_slots": 4 * BATCH, "total_steps": STEPS, "save_every": 1,
             "ranks_per_node": 1}  # two batches of samples in flight: a buffer to lose
ROLLOUT = {**SEPARATE, "env": {"path": ECHO_SPEC, "num_workers": 0}, "max_turns": 3,
           "max_episode_tokens": 32}


class Killed(BaseException):
    """The driver's death (not an Exception: nothing on the way may handle it)."""


def _job(assets, out, **trainer):
    return job_config(assets, out, algorithm=GRPO, actor={"ppo_mini_batch_size": 4},
                      rollout=ROLLOUT, reward={"functions": []},
                      data={"train_batch_size": BATCH}, trainer={**STREAMING, **trainer})


def _lineage(*roots):
    """{step: the stream's state} of every checkpoint under `roots` (later roots win)."""
    states = {}
    for root in roots:
        for step, folder in CheckpointManager(root).checkpoints():
            state = torch.load(folder / STATE_FILE, weights_only=False)
            states[step] = state["rollouts"]["stream"]
    return states


def test_a_streaming_run_killed_at_a_random_point_trains_every_prompt_once(
        ray_cluster, tmp_path, monkeypatch):
    assets = make_assets(tmp_path)
    killed = _job(assets, tmp_path / "killed")
    roles, role_configs = job_workers(killed)
    groups = RoleGroups(killed, roles, job_name="stream-kill",
                        role_configs=cast(dict, role_configs))
    kill_at = random.Random(42).randrange(6, 16)  # the segment the driver dies waiting for
    collect, calls = StreamingPipeline._collect, [0]

    def dying_collect(self):
        calls[0] += 1
        if calls[0] == kill_at:
            raise Killed
        collect(self)

    try:
        monkeypatch.setattr(StreamingPipeline, "_collect", dying_collect)
        with pytest.raises(Killed):
            _fit(killed, groups)
        monkeypatch.undo()
        newest = CheckpointManager(killed.trainer.output_dir).latest()
        assert newest is not None, f"killed at segment {kill_at}, before the first save"
        resumed = _job(assets, tmp_path / "resumed", resume=str(newest))
        records = _fit(resumed, groups)
    finally:
        groups.shutdown()
    resumed_from = int(newest.name.removeprefix("step_"))
    assert resumed_from < STEPS and [r["step"] for r in records] == list(
        range(resumed_from + 1, STEPS + 1))
    states = _lineage(killed.trainer.output_dir, resumed.trainer.output_dir)
    assert sorted(states) == list(range(1, STEPS + 1))
    trained: set[int] = set()
    for step in range(1, STEPS + 1):
        fates = states[step]["fates"]
        now = {i for i, f in fates.items() if f == TRAINED}
        assert trained < now and len(now - trained) == BATCH, (kill_at, step)
        trained = now
    final = states[STEPS]
    fates = final["fates"]
    assert sorted(fates) == list(range(final["drawn"]))  # every prompt drawn has a fate
    assert set(fates.values()) <= {QUEUED, GENERATING, BUFFERED, TRAINED}  # none dropped
    live = ({i for i, _, _ in final["queue"]} | {g.index for g in final["generating"]}
            | {g.index for g in final["buffer"]})
    assert live == {i for i, f in fates.items() if f != TRAINED}
    for record in records:  # the episodes trained are the environment's, whole
        assert record["env/turns"] == 2.0 and record["env/echoes"] == 1.0
        assert record["env/episode_tokens"] > record["env/model_tokens"] > 0
        assert "reward/env_mean" in record
