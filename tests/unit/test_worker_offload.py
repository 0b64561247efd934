"""Worker roles with every offload switch on, in a one-process gloo world: between calls their
state is on the host (device storage emptied), and each call computes what it computes without
offload (actor scoring and updates, critic values, reference log-probs, a checkpoint)."""

import dataclasses
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from rlhf.config import OffloadConfig  # noqa: E402
from tests.unit.test_worker_roles import context, folders, make_config, rl_batch, world  # noqa: E402,F401
from workers.actor import ActorWorker  # noqa: E402
from workers.critic import CriticWorker  # noqa: E402
from workers.reference import ReferenceWorker  # noqa: E402

ALL = OffloadConfig(params=True, grads=True, optimizer=True)


def _offloaded(cfg):
    return dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, offload=ALL),
                               critic=dataclasses.replace(cfg.critic, offload=ALL),
                               ref=dataclasses.replace(cfg.ref,
                                                       offload=OffloadConfig(params=True)))


def _all_on_host(worker):
    state = worker.engine.state_tensors()
    tensors = [t for kind in state.values() for t in kind]
    return bool(tensors) and all(t.numel() == 0 and worker.offload.on_host(t) for t in tensors)


def _roles(cfg, world):
    return (ActorWorker(context(world, "actor"), config=cfg),
            CriticWorker(context(world, "critic"), config=cfg),
            ReferenceWorker(context(world, "ref"), config=cfg))


def test_offloaded_roles_compute_exactly_what_resident_ones_do(folders, world, tmp_path):
    policy, _ = folders
    cfg = make_config(policy, algorithm={"adv_estimator": "gae", "kl_in_reward": True})
    results = []
    for config in (cfg, _offloaded(cfg)):
        actor, critic, ref = _roles(config, world)
        offloaded = config is not cfg
        assert all(_all_on_host(w) for w in (actor, critic, ref)) == offloaded
        batch, _ = rl_batch(actor)
        # rl_batch's stand-in ref_log_probs (the actor's) give way to the reference role's: it
        # packs micro-batches by its own budget, so they may differ in the last fp32 bit
        batch = batch.pop("ref_log_probs")[1]
        batch = batch.union(critic.compute_values(batch)).union(ref.compute_ref_log_prob(batch))
        metrics = {**actor.update_actor(batch), **critic.update_critic(batch)}
        after = actor.compute_log_prob(batch)["old_log_probs"]
        # Grads are gone after each step; the weights, masters and AdamW moments are back
        # on the host between calls.
        assert all(_all_on_host(w) for w in (actor, critic, ref)) == offloaded
        assert actor.engine.state_tensors()["optimizer"]
        actor.save_checkpoint(str(tmp_path / f"ckpt-{offloaded}"))
        results.append((batch, metrics, after))
    (batch_a, metrics_a, after_a), (batch_b, metrics_b, after_b) = results
    assert metrics_a == metrics_b
    for key in ("old_log_probs", "values", "ref_log_probs"):
        assert torch.equal(batch_a[key].values, batch_b[key].values), key
    assert torch.equal(after_a.values, after_b.values)
    saved = []
    for o in (False, True):  # each DCP checkpoint as one plain state dict
        dcp_to_torch_save(tmp_path / f"ckpt-{o}", tmp_path / f"ckpt-{o}.pt")
        saved.append(torch.load(tmp_path / f"ckpt-{o}.pt", weights_only=False))
    assert saved[0].keys() == saved[1].keys() and len(saved[0]) > 0
    for name, value in saved[0].items():
        if isinstance(value, torch.Tensor):
            assert value.numel() > 0 and torch.equal(value, saved[1][name]), name
