"""PPO with every offload switch on (actor, critic, reference) repeats exactly the run with
none: the same metrics at every step, the same checkpointed and exported policy."""

import pytest
import torch
from safetensors.torch import load_file

from rlhf.trainer.jobs import RoleGroups, job_workers, load_tokenizer
from rlhf.trainer.ppo import PPOTrainer
from tests.unit.trainer.jobs import job_config, make_assets

pytestmark = pytest.mark.timeout(400)

VARYING = ("timing/", "throughput/", "sync/seconds", "sync/gb_per_s", "sync/gather_s",
           "sync/broadcast_s", "sync/reload_s", "rollout/seconds", "rollout/tokens_per_s",
           "memory/")  # what offload changes, by design


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


def test_offloaded_checkpoints_hold_the_whole_state(runs):
    (_, _, folder_off), (_, _, folder_on) = runs["off"], runs["on"]
    for role in ("actor", "critic"):
        shard_off = torch.load(folder_off / role / "engine_pp00_tp00.pt", weights_only=False)
        shard_on = torch.load(folder_on / role / "engine_pp00_tp00.pt", weights_only=False)
        for key, value in shard_off["model"].items():
            assert value.numel() > 0 and torch.equal(value, shard_on["model"][key]), (role, key)
        optim_files = sorted(p.name for p in (folder_off / role).glob("optim_*.pt"))
        assert optim_files, role  # ZeRO-1 over dp=2: one optimizer shard per dp rank
        for name in optim_files:
            optim_off = torch.load(folder_off / role / name, weights_only=False)
            optim_on = torch.load(folder_on / role / name, weights_only=False)
            for key in ("exp_avg", "exp_avg_sq"):
                assert optim_off[key].any() and torch.equal(optim_off[key], optim_on[key]), \
                    (role, name, key)
