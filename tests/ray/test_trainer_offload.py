"""PPO with every offload switch on (actor, critic, reference) repeats exactly the run with
none: the same metrics at every step, the same checkpointed and exported policy."""

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from rlhf.trainer.jobs import RoleGroups, job_workers, load_tokenizer
from rlhf.trainer.ppo import PPOTrainer
from tests.unit.trainer.jobs import job_config, make_assets

pytestmark = pytest.mark.timeout(400)

VARYING = ("timing/", "throughput/", "sync/seconds", "sync/gb_per_s", "sync/gather_s",
           "sync/broadcast_s", "sync/reload_s", "rollout/seconds", "rollout/tokens_per_s",
           "memory/", "checkpoint/")  # what offload changes, by design (and save times)


def _run(assets, root, name, switch):
    offload = {"params": switch, "grads": switch, "optimizer": switch}
    cfg = job_config(assets, root / name, trainer={"total_steps": 2},
                     actor={"offload": offload}, critic={"offload": offload},
                     ref={"offload": {"params": switch}})
    roles, role_configs = job_workers(cfg)
    groups = RoleGroups(cfg, roles, job_name=f"offload-{name}", role_configs=role_configs)
    try:
        trainer = PPOTrainer(cfg, groups.views, tokenizer=load_tokenizer(cfg.model.path),
                             job_name=f"offload-{name}", progress=False)
        records = trainer.fit()
        exported = trainer.export_policy(root / name / "policy")
        return records, load_file(str(exported / "model.safetensors")), trainer.ckpt.latest()
    finally:
        groups.shutdown()


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("offload")
    assets = make_assets(root)
    return {name: _run(assets, root, name, switch) for name, switch in (("off", False),
                                                                       ("on", True))}


def test_offloaded_ppo_steps_equal_the_resident_ones(runs):
    (off, weights_off, _), (on, weights_on, _) = runs["off"], runs["on"]
    assert [r["step"] for r in on] == [1, 2]
    for a, b in zip(off, on, strict=True):
        a = {k: v for k, v in a.items() if not k.startswith(VARYING)}
        b = {k: v for k, v in b.items() if not k.startswith(VARYING)}
        assert a == b
    assert on[1]["actor/grad_norm"] > 0 and on[1]["critic/value_loss"] > 0
    assert weights_off.keys() == weights_on.keys()
    assert all(torch.equal(weights_off[k], weights_on[k]) for k in weights_off)


def test_offloaded_checkpoints_hold_the_whole_state(runs, tmp_path):
    (_, _, folder_off), (_, _, folder_on) = runs["off"], runs["on"]
    for role in ("actor", "critic"):
        states = []
        for name, folder in (("off", folder_off), ("on", folder_on)):
            # ZeRO-1 over dp=2: both ranks write a data file (their optimizer partitions)
            assert len(list((folder / role).glob("*.distcp"))) == 2, (role, name)
            dcp_to_torch_save(folder / role, tmp_path / f"{role}-{name}.pt")
            states.append(torch.load(tmp_path / f"{role}-{name}.pt", weights_only=False))
        state_off, state_on = states
        assert state_off.keys() == state_on.keys(), role
        moments = [k for k in state_off if k.startswith(("optim/exp_avg/", "optim/exp_avg_sq/"))]
        assert moments and any(k.startswith("model/") for k in state_off), role
        for key, value in state_off.items():
            assert value.numel() > 0 and torch.equal(value, state_on[key]), (role, key)
        assert all(state_off[k].any() for k in moments), role
