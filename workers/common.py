"""What the worker roles share: the Batch field contract, role checks, executing the plan.

Batch fields (the contract with the PPO driver)
-----------------------------------------------
The driver plans (rlhf.data.batch_plan): a role method takes `plan=`, the driver's BatchPlan;
the dispatcher hands DP group g the rows the plan gives it with its GroupPlan (mini-batches of
micro-batches, as indices into those rows) and puts results back in the driver's order. The
worker only executes the plan. Without one, a group plans its own contiguous chunk (forward
passes at any DP size; updates only at dp = 1). A role method returns a NEW Batch holding only
the fields it produced (on the CPU); the driver merges it: `batch = batch.union(result)`.

Per sample:
    prompt_ids         Ragged int64   prompt tokens; at least one (a BOS is enough), because
                                      the first response token is predicted from the last one
    response_ids       Ragged int64   sampled response tokens; may be empty
    rm_scores          (n,) float32   RewardModelWorker.compute_rm_score (see reward_model.py)
    policy_version     (n,) int64     the driver (rlhf.trainer.rollout_source): the version of the
                                      weights that sampled it (actor updates before them)

Per response token (Ragged with the row lengths of `response_ids`; entry j of row i is about
response token j of sample i, computed at the position that predicts it):
    old_log_probs      float32  ActorWorker.compute_log_prob: log pi(token | prefix) at the
                                sampling temperature (rollout.temperature; 1 when greedy);
                                or, on-policy, update_actor's first forward (see actor.py)
    entropy            float32  the same pass: entropy of that distribution
    ref_log_probs      float32  ReferenceWorker.compute_ref_log_prob, same temperature
    values             float32  CriticWorker.compute_values: V(prompt + response[:j])
    advantages         float    the driver (rlhf.algorithms advantage estimators)
    returns            float    the driver (critic targets)
    response_mask      bool     optional; False tokens count in no loss and no metric
                                (default: every token counts)
    rollout_log_probs  float    optional; the sampler's (vLLM's) log-probs. With
                                rollout.tis_cap set, update_actor needs it and weights each
                                token's policy loss by min(exp(old - rollout), tis_cap)
    seq_is_weights     float    optional; the driver's sequence-level rollout correction
                                (rollout.seq_tis_cap): one weight per response on its tokens

One PPO step, from the driver (each call reads the fields listed above and takes its plan,
`plan=plans.forward(role)` or `plans.update(role)`, see rlhf/trainer/step_plan.py):
    batch |= rm.compute_rm_score(batch)           if reward.model_path (rm_scores)
    batch |= actor.compute_log_prob(batch)        old_log_probs, entropy (unless fused)
    batch |= ref.compute_ref_log_prob(batch)      if algorithm.use_ref
    batch |= critic.compute_values(batch)         if algorithm.use_critic
    advantages, returns: on the driver (KL penalty, estimator)
    critic.update_critic(batch); actor.update_actor(batch)   -> {"critic/...": x}, {"actor/...": x}
    (fused: actor.update_actor -> ({"actor/...": x}, Batch of old_log_probs, entropy))
(`|=` standing for `batch = batch.union(...)`). Updates step once per mini-batch of the plan:
<role>.ppo_mini_batch_size prompts (x rollout.n samples), consecutive in the driver's order
whatever the DP size: shuffle on the driver if wanted, and send a multiple of that many.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from rlhf.config import ForwardRoleConfig, JobConfig, TrainRoleConfig
from rlhf.data.batch import Batch
from rlhf.data.batch_plan import GroupPlan, plan_role_batch
from rlhf.data.fields import MASK, response_mask, sample_lengths
from rlhf.data.packing import pack_prompt_response, shared_prompt_lens
from rlhf.data.ragged import Ragged
from rlhf.engine import (MicroBatch, TrainEngine, collect_response_values, predicting_positions,
                         scatter_response_values)
from rlhf.errors import ConfigError
from rlhf.rollout.multiturn import env_rows
from workers.base import Worker

TOKENS = ("prompt_ids", "response_ids")


# ---- construction ----------------------------------------------------------------------------


def build_engine(worker: Worker, config: JobConfig, key: str, *, path: str, head: str,
                 train: bool) -> TrainEngine:
    """Check `config.<key>`'s plan against the worker group, build the role's mesh and engine."""
    role: ForwardRoleConfig = getattr(config, key)
    check_layout(worker.ctx.world_size, config, key)
    mesh = worker.build_mesh(tp=role.parallel.tp, pp=role.parallel.pp)
    return TrainEngine.from_pretrained(
        path, mesh=mesh, plan=role.parallel, head=head,
        optim=role.optim if train else None, total_steps=config.trainer.total_steps,
        dtype=role.dtype, device=worker.ctx.device,
        recompute=getattr(role, "recompute", "none"), seed=config.trainer.seed)


def check_layout(world_size: int, config: JobConfig, key: str) -> None:
    """ConfigError naming the keys unless `config.<key>`'s plan fits a group of `world_size`."""
    role: ForwardRoleConfig = getattr(config, key)
    want = config.role_world_size(role)
    if world_size != want:
        source = (f"{key}.world_size" if role.placement == "separate"
                  else "trainer.nnodes * trainer.ranks_per_node")
        raise ConfigError(f"{key}: the worker group has {world_size} ranks but {source} = {want}; "
                          "build the group from the same config")
    model_ranks = role.parallel.tp * role.parallel.pp
    if world_size % model_ranks:
        raise ConfigError(f"{key}.parallel.tp * {key}.parallel.pp = {model_ranks} ranks per model "
                          f"replica do not fit the {world_size} ranks of the worker group; use a "
                          f"plan whose tp * pp divides {world_size}")


def sampling_temperature(config: JobConfig) -> float:
    """The temperature responses were sampled at; greedy (0) is scored at temperature 1."""
    return config.rollout.temperature if config.rollout.temperature > 0 else 1.0


# ---- batches and plans ----------------------------------------------------------------------


def require_fields(batch: Batch, names: Sequence[str], where: str) -> None:
    """ValueError naming what `where` needs when the batch lacks some of `names`."""
    missing = [n for n in names if n not in batch]
    if missing:
        raise ValueError(f"{where} needs batch fields {missing}, which the batch lacks "
                         f"(it has {batch.keys()}); see workers/common.py for who makes them")


def group_plan(batch: Batch, role: ForwardRoleConfig, plan: GroupPlan | None, *,
               dp_size: int, mini_size: int | None = None, key: str) -> GroupPlan:
    """The plan this DP group executes: the driver's, checked against `batch`; or, without
    one, a plan of `batch` alone (forward: one mini-batch; update: `mini_size` samples each,
    only at dp = 1, since other groups' mini-batch counts are not known here)."""
    if plan is not None:
        if plan.num_rows != len(batch):
            raise ValueError(f"{key}: the plan covers {plan.num_rows} rows but the batch has "
                             f"{len(batch)}; pass the plan made for this batch")
        return plan
    if mini_size is not None and dp_size > 1:
        raise ValueError(f"{key}: an update on {dp_size} DP groups needs the driver's plan: "
                         "pass plan=rlhf.trainer.step_plan.StepPlanner(...).update(key) (or a "
                         "BatchPlan from rlhf.data.batch_plan)")
    what = f"{key}.ppo_mini_batch_size * rollout.n"
    return plan_role_batch(sample_lengths(batch), role, dp=1, mini_size=mini_size, what=what,
                           shared=shared_prompt_lens(batch["prompt_ids"])).groups[0]


def build_micro_batches(batch: Batch, micro: Sequence[Sequence[int]],
                        per_token: Sequence[str] = (), *,
                        share_prompts: bool = False) -> list[MicroBatch]:
    """The micro-batches `micro` lists (rows of `batch`, one list per micro-batch), with the
    per-response-token fields `per_token` at their predicting positions; `sample_ids` index
    `batch`. `share_prompts`: consecutive rows of one prompt hold it once (the role's
    `share_prompts`; rlhf.data.packing). Every worker builds its micro-batches here."""
    fields = {k: _per_token(batch, k) for k in per_token}
    prompts, responses = batch["prompt_ids"], batch["response_ids"]
    out = []
    for rows in micro:
        ids = torch.tensor(rows, dtype=torch.int64)
        packed = pack_prompt_response(prompts.select(ids), responses.select(ids),
                                      share_prompts=share_prompts)
        predicting_positions(packed)  # ValueError for a response without a prompt
        tensors = {k: scatter_response_values(v.select(ids), packed) for k, v in fields.items()}
        out.append(MicroBatch(packed, tensors, ids))
    return out


def forward_micro_batches(batch: Batch, role: ForwardRoleConfig, plan: GroupPlan | None, *,
                          key: str, per_token: Sequence[str] = ()) -> list[MicroBatch]:
    """The micro-batches of a call that runs `batch` as one mini-batch (a forward pass, an SFT
    step) by `plan`, or by this group's own plan of `batch` without one."""
    plan = group_plan(batch, role, plan, dp_size=1, key=key)
    if len(plan.mini_batches) != 1:
        raise ValueError(f"{key}: this call runs one mini-batch but the plan has "
                         f"{len(plan.mini_batches)}; plan it with mini_size=None")
    return build_micro_batches(batch, plan.mini_batches[0], per_token,
                               share_prompts=role.share_prompts)


def _per_token(batch: Batch, key: str) -> Ragged:
    if key == MASK:
        return response_mask(batch)
    rows = batch[key]
    if not isinstance(rows, Ragged):
        raise ValueError(f"batch field '{key}' must be a Ragged with one value per response "
                         f"token, got a {type(rows).__name__}")
    return Ragged(rows.values.float(), rows.offsets)


def response_fields(outputs: Sequence[Mapping[str, Tensor]], mbs: Sequence[MicroBatch],
                    names: Mapping[str, str]) -> Batch:
    """A Batch of per-response-token fields {field: engine output name} on the CPU."""
    if not mbs or not outputs:  # no samples here, or a pipeline stage before the last
        empty = Ragged(torch.empty(0), torch.zeros(1, dtype=torch.int64))
        return Batch({field: empty for field in names})
    return Batch({field: collect_response_values([o[name] for o in outputs], mbs).to("cpu")
                  for field, name in names.items()})


# ---- training --------------------------------------------------------------------------------


def train_mini_batch(engine: TrainEngine, mbs: Sequence[MicroBatch], make_loss, *,
                     outputs: Sequence[str], temperature: float = 1.0) -> dict[str, float]:
    """One optimizer step on one mini-batch's micro-batches (this DP group's share); returns
    its metrics plus grad_norm and lr.

    `make_loss(global_tokens, global_seqs)` gives the engine's loss_fn; its metrics must be
    each micro-batch's SHARE of the mini-batch value (like the losses), so their sum over all
    micro-batches of all DP ranks is the mini-batch value. The engine averages metrics over
    those micro-batches, so the sum is that average times their number.
    """
    tokens, seqs = engine.loss_normalizers(mbs, mask_key=MASK)
    stats = engine.forward_backward(mbs, make_loss(max(tokens, 1), max(seqs, 1)),
                                    outputs=outputs, temperature=temperature)
    count = stats.pop("num_micro_batches")
    stats.pop("loss")
    metrics = {k: v * count for k, v in stats.items()}
    return {**metrics, **engine.step()}


def ppo_updates(engine: TrainEngine, batch: Batch, plan: GroupPlan | None, config: JobConfig,
                key: str, per_token: Sequence[str], make_loss, *, outputs: Sequence[str],
                temperature: float = 1.0, on_policy: bool = False) -> dict[str, float]:
    """algorithm.ppo_epochs passes over the plan's mini-batches (the driver's plan, or this
    group's own at dp = 1: `<key>.ppo_mini_batch_size` prompts' samples each, in order), one
    `train_mini_batch` step each; metrics averaged over the steps, named `<key>/...`.
    `on_policy`: ValueError unless that is one step (the loss reads the old policy from it)."""
    role: TrainRoleConfig = getattr(config, key)
    plan = group_plan(batch, role, plan, dp_size=engine.mesh.dp_size, key=key,
                      mini_size=role.ppo_mini_batch_size * config.rollout.n)
    steps = config.algorithm.ppo_epochs * len(plan.mini_batches)
    if on_policy and steps != 1:
        raise ValueError(f"{key}: the batch has no old_log_probs, which the update can take from "
                         f"its first forward only when it is one step; this one is {steps} "
                         f"(algorithm.ppo_epochs x mini-batches): call compute_log_prob first")
    minis = [build_micro_batches(batch, micro, (*per_token, MASK),
                                 share_prompts=role.share_prompts)
             for micro in plan.mini_batches]
    history = [train_mini_batch(engine, mbs, make_loss, outputs=outputs, temperature=temperature)
               for _ in range(config.algorithm.ppo_epochs) for mbs in minis]
    return mean_metrics(history, f"{key}/")


def token_share(mask_T: Tensor, global_tokens: int) -> Tensor:
    """This micro-batch's fraction of the mini-batch's counted tokens: the weight that turns a
    per-micro-batch token mean into its share of the mini-batch token mean."""
    return mask_T.sum() / global_tokens


def mean_metrics(history: Sequence[Mapping[str, float]], prefix: str) -> dict[str, float]:
    """Each metric averaged over the optimizer steps, named `prefix + name`."""
    keys = history[0].keys()
    return {prefix + k: math.fsum(h[k] for h in history) / len(history) for k in keys}


def sample_rollouts(replica, batch: Batch, *, greedy: bool, where: str, env: bool) -> Batch:
    """`replica.generate` on this rank's `prompt_ids` (the actor's colocated replica or a
    separate rollout rank's), after checking the driver's `batch.meta["seed"]`; with `env`
    (rollout.env set), multi-turn episodes started from the batch's dataset rows."""
    require_fields(batch, ("prompt_ids",), where)
    seed = batch.meta.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"batch.meta['seed'] must be an int, got {seed!r}")
    rows = env_rows(batch) if env else None
    return replica.generate(batch["prompt_ids"], greedy=greedy, seed=seed, env_rows=rows)
