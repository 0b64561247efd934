"""Worker roles' updates without Ray (set-up in test_worker_roles.py): the actor's PPO loss
and steps against hand-computed values, fused old log-probs against a separate pass, and the
critic's value loss."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from rlhf.algorithms import truncated_is_weights  # noqa: E402
from rlhf.config import OptimizerConfig  # noqa: E402
from rlhf.data.batch import Batch  # noqa: E402
from rlhf.data.fields import MASK  # noqa: E402
from tests.unit.test_worker_roles import (  # noqa: E402,F401
    ACTOR_KEYS,
    CRITIC_KEYS,
    context,
    folders,
    make_batch,
    make_config,
    per_token,
    rl_batch,
    weights_of,
    world,
)
from workers.actor import ActorWorker  # noqa: E402
from workers.critic import CriticWorker  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def test_update_actor_first_step_metrics_are_exact(folders, world):
    """At the first step pi == pi_old: pg_loss = -(masked token mean of A), nothing is clipped,
    approx_kl = kl_loss = 0 and entropy is the masked token mean of compute_log_prob's."""
    policy, _ = folders
    cfg = make_config(policy, algorithm={"use_kl_loss": True, "ppo_epochs": 1})
    actor = ActorWorker(context(world, "actor"), config=cfg)
    batch, _ = rl_batch(actor, mask_every=3)
    metrics = actor.update_actor(batch)
    assert set(metrics) == ACTOR_KEYS | {"actor/kl_loss"}
    mask = batch["response_mask"].values
    adv, ent = batch["advantages"].values, batch["entropy"].values
    assert metrics["actor/pg_loss"] == pytest.approx(-(adv[mask].mean().item()), abs=1e-5)
    assert metrics["actor/entropy"] == pytest.approx(ent[mask].mean().item(), abs=1e-5)
    assert metrics["actor/clipfrac"] == 0.0
    assert abs(metrics["actor/approx_kl"]) < 1e-6 and abs(metrics["actor/kl_loss"]) < 1e-6
    assert metrics["actor/lr"] == pytest.approx(1e-3)
    assert metrics["actor/grad_norm"] > 0


def test_a_policy_loss_from_a_file_named_in_the_config_drives_the_update(folders, world,
                                                                      tmp_path):
    """algorithm.policy_loss: 'file.py:function' reaches the actor's loss: at the first step
    (pi == pi_old) the file's loss, three times PPO's, gives pg_loss = -3 * mean(A)."""
    (tmp_path / "my_loss.py").write_text(
        "from rlhf.algorithms import ppo_policy_loss\n\n"
        "def triple_ppo(logp_T, old_logp_T, advantages_T, mask_T, cu_seqlens, **kwargs):\n"
        "    loss, metrics = ppo_policy_loss(logp_T, old_logp_T, advantages_T, mask_T,\n"
        "                                    cu_seqlens, **kwargs)\n"
        "    return 3 * loss, metrics\n")
    policy, _ = folders
    cfg = make_config(policy, algorithm={"ppo_epochs": 1,
                                         "policy_loss": f"{tmp_path / 'my_loss.py'}:triple_ppo"})
    actor = ActorWorker(context(world, "actor"), config=cfg)
    batch, _ = rl_batch(actor, mask_every=3)
    metrics = actor.update_actor(batch)
    adv, mask = batch["advantages"].values, batch["response_mask"].values
    assert metrics["actor/pg_loss"] == pytest.approx(-3 * adv[mask].mean().item(), abs=1e-5)


def test_update_actor_moves_log_probs_along_the_advantages(folders, world):
    policy, _ = folders
    cfg = make_config(policy, actor={"ppo_mini_batch_size": 4}, algorithm={"ppo_epochs": 2})
    actor = ActorWorker(context(world, "actor"), config=cfg)
    batch, sign = rl_batch(actor, seed=1)
    metrics = actor.update_actor(batch)  # 2 epochs x 2 mini-batches = 4 steps
    assert actor.engine.step_count == 4
    assert set(metrics) == ACTOR_KEYS
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    after = actor.compute_log_prob(batch)["old_log_probs"]
    delta = [(after[i] - batch["old_log_probs"][i]).sum().item() for i in range(len(batch))]
    for i, s in enumerate(sign.tolist()):
        if len(batch["response_ids"][i]):
            assert delta[i] * s > 0, f"sample {i}: log-prob moved by {delta[i]} against A={s}"


def test_truncated_importance_sampling(folders, world):
    w = truncated_is_weights(torch.tensor([0.0, -1.0, -3.0]), torch.tensor([-1.0, -1.0, 0.0]),
                             cap=2.0)
    torch.testing.assert_close(w, torch.tensor([2.0, 1.0, torch.exp(torch.tensor(-3.0)).item()]))
    policy, _ = folders
    cfg = make_config(policy, rollout={"tis_cap": 2.0})
    actor = ActorWorker(context(world, "actor"), config=cfg)
    batch, _ = rl_batch(actor, seed=2)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        actor.update_actor(batch)
    # sampler == trainer: every weight is 1, so the first-step loss is the plain one
    metrics = actor.update_actor(batch.union(Batch({"rollout_log_probs": batch["old_log_probs"]})))
    adv = batch["advantages"].values
    assert metrics["actor/pg_loss"] == pytest.approx(-adv.mean().item(), abs=1e-5)


@pytest.mark.parametrize("coeff", [0.0, 0.5])
def test_entropy_enters_the_loss_only_with_a_coefficient(folders, world, coeff):
    """The actor loss subtracts entropy_coeff x the token-mean entropy; at 0 the entropy is
    only a metric and the backward never reaches it (no grad is computed for it)."""
    policy, _ = folders
    cfg = make_config(policy, algorithm={"entropy_coeff": coeff, "use_kl_loss": False})
    actor = ActorWorker(context(world, "actor"), config=cfg)
    tokens = 5
    mb = SimpleNamespace(packed=SimpleNamespace(cu_seqlens=torch.tensor([0, 2, 5])),
                         tensors={MASK: torch.ones(tokens), "advantages": torch.ones(tokens),
                                  "old_log_probs": torch.full((tokens,), -1.0)})
    out = {"log_probs": torch.full((tokens,), -1.0, requires_grad=True),
           "entropy": torch.full((tokens,), 2.0, requires_grad=True)}
    loss, metrics = actor._loss_fn(tokens, 2)(out, mb)
    loss.backward()
    assert out["log_probs"].grad is not None
    assert metrics["entropy"] == pytest.approx(2.0)
    if coeff:
        torch.testing.assert_close(out["entropy"].grad, torch.full((tokens,), -coeff / tokens))
    else:
        assert out["entropy"].grad is None


@pytest.mark.parametrize("algorithm,rollout", [
    ({"use_kl_loss": True}, {}),
    ({"loss_agg_mode": "seq-mean-token-sum"}, {"tis_cap": 1.5}),
])
def test_fused_old_log_probs_equal_a_separate_pass(folders, world, algorithm, rollout):
    """On-policy (one epoch, one mini-batch), update_actor without old_log_probs takes them from
    its first forward: the same losses, grad norm, updated weights, old log-probs and entropy
    as computing them in their own pass first."""
    policy, _ = folders
    cfg = make_config(policy, algorithm={"ppo_epochs": 1, **algorithm}, rollout=rollout)
    separate = ActorWorker(context(world, "actor"), config=cfg)
    batch, _ = rl_batch(separate, seed=9, mask_every=3)  # old log-probs from their own pass
    if "tis_cap" in rollout:  # a sampler a little off the trainer, so the weights matter
        noise = 0.3 * torch.randn(batch["old_log_probs"].values.shape,
                                  generator=torch.Generator().manual_seed(0))
        batch = batch.union(Batch({"rollout_log_probs": per_token(
            batch, batch["old_log_probs"].values + noise)}))
    fused = ActorWorker(context(world, "actor"), config=cfg)
    assert all(torch.equal(a, b) for a, b in zip(weights_of(separate).values(),
                                                 weights_of(fused).values()))
    want = separate.update_actor(batch)
    assert want["actor/grad_norm"] > 0
    got, fields = fused.update_actor(batch.pop("old_log_probs")[1].pop("entropy")[1])
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    torch.testing.assert_close(fields["old_log_probs"].values, batch["old_log_probs"].values,
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(fields["entropy"].values, batch["entropy"].values,
                               atol=1e-6, rtol=0)
    assert torch.equal(fields["old_log_probs"].offsets, batch["response_ids"].offsets)
    after_separate, after_fused = weights_of(separate), weights_of(fused)
    for name, value in after_separate.items():
        torch.testing.assert_close(after_fused[name], value, atol=1e-6, rtol=0, msg=name)
    assert fused.engine.step_count == 1


def test_fused_old_log_probs_refuse_more_than_one_step(folders, world):
    policy, _ = folders
    cfg = make_config(policy, algorithm={"ppo_epochs": 2})
    actor = ActorWorker(context(world, "actor"), config=cfg)
    batch, _ = rl_batch(actor, seed=10)
    with pytest.raises(ValueError, match=r"no old_log_probs.*this one is 2 "
                                         r"\(algorithm.ppo_epochs x mini-batches\)"):
        actor.update_actor(batch.pop("old_log_probs")[1])
    assert actor.engine.step_count == 0


def test_update_critic_fits_the_returns(folders, world):
    policy, _ = folders
    cfg = make_config(policy, critic={"optim": OptimizerConfig(lr=3e-3, grad_clip=None)},
                      algorithm={"value_clip": None})
    critic = CriticWorker(context(world, "critic"), config=cfg)
    batch = make_batch(seed=6)
    values = critic.compute_values(batch)["values"]
    returns = per_token(batch, torch.linspace(-1.0, 1.0, values.values.numel()))
    batch = batch.union(Batch({"values": values, "returns": returns}))
    first = critic.update_critic(batch)
    assert set(first) == CRITIC_KEYS
    want_loss = 0.5 * (values.values - returns.values).square().mean().item()
    assert first["critic/value_loss"] == pytest.approx(want_loss, abs=1e-5)
    assert first["critic/values_mean"] == pytest.approx(values.values.mean().item(), abs=1e-5)
    for _ in range(5):
        last = critic.update_critic(batch)
    assert last["critic/value_loss"] < 0.5 * first["critic/value_loss"]
