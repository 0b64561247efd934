"""What the worker roles share: the Batch field contract, role checks, micro- and mini-batching.

Batch fields (the contract with the PPO driver)
-----------------------------------------------
Samples stay in the driver's order: DP_COMPUTE hands each DP group a contiguous chunk and
concatenates the chunks' results back. A role method returns a NEW Batch holding only the
fields it produced (on the CPU); the driver merges it: `batch = batch.union(result)`.

Per sample:
    prompt_ids         Ragged int64   prompt tokens; at least one (a BOS is enough), because
                                      the first response token is predicted from the last one
    response_ids       Ragged int64   sampled response tokens; may be empty
    rm_scores          (n,) float32   RewardModelWorker.compute_rm_score (see reward_model.py)

Per response token (Ragged with the row lengths of `response_ids`; entry j of row i is about
response token j of sample i, computed at the position that predicts it):
    old_log_probs      float32  ActorWorker.compute_log_prob: log pi(token | prefix) at the
                                sampling temperature (rollout.temperature; 1 when greedy)
    entropy            float32  ActorWorker.compute_log_prob: entropy of that distribution
    ref_log_probs      float32  ReferenceWorker.compute_ref_log_prob, same temperature
    values             float32  CriticWorker.compute_values: V(prompt + response[:j])
    advantages         float    the driver (rlhf.algorithms advantage estimators)
    returns            float    the driver (critic targets)
    response_mask      bool     optional; False tokens count in no loss and no metric
                                (default: every token counts)
    rollout_log_probs  float    optional; the sampler's (vLLM's) log-probs. With
                                rollout.tis_cap set, update_actor needs it and weights each
                                token's policy loss by min(exp(old - rollout), tis_cap)

One PPO step, from the driver (each call reads the fields listed above):
    batch |= rm.compute_rm_score(batch)           if reward.model_path (rm_scores)
    batch |= actor.compute_log_prob(batch)        old_log_probs, entropy
    batch |= ref.compute_ref_log_prob(batch)      if algorithm.use_ref
    batch |= critic.compute_values(batch)         if algorithm.use_critic
    advantages, returns: on the driver (KL penalty, estimator)
    critic.update_critic(batch); actor.update_actor(batch)   -> {"critic/...": x}, {"actor/...": x}
(`|=` standing for `batch = batch.union(...)`). Updates step once per mini-batch of
<role>.ppo_mini_batch_size prompts (x rollout.n samples), taken in order from each DP chunk:
shuffle on the driver if wanted, and send a multiple of that many samples.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from rlhf.config import ForwardRoleConfig, JobConfig, TrainRoleConfig
from rlhf.data.batch import Batch
from rlhf.data.ragged import Ragged
from rlhf.data.packing import pack_prompt_response
from rlhf.data.planner import plan_micro_batches
from rlhf.engine import (MicroBatch, TrainEngine, collect_response_values, predicting_positions,
                         scatter_response_values)
from rlhf.errors import ConfigError
from rlhf.parallel.collectives import group_size
from rlhf.parallel.mesh import ParallelMesh
from workers.base import Worker

MASK = "response_mask"
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


# ---- batches ---------------------------------------------------------------------------------


def require_fields(batch: Batch, names: Iterable[str], where: str) -> None:
    """ValueError naming what `where` needs when the batch lacks some of `names`."""
    missing = [n for n in names if n not in batch]
    if missing:
        raise ValueError(f"{where} needs batch fields {missing}, which the batch lacks "
                         f"(it has {batch.keys()}); see workers/common.py for who makes them")


def response_mask(batch: Batch) -> Ragged:
    """The batch's `response_mask` as bool, or all True over the response tokens."""
    responses = batch["response_ids"]
    if MASK in batch:
        return Ragged(batch[MASK].values.bool(), batch[MASK].offsets)
    return Ragged(torch.ones(responses.values.shape[0], dtype=torch.bool), responses.offsets)


def micro_batches(batch: Batch, per_token: Sequence[str], role: ForwardRoleConfig, *,
                  mesh: ParallelMesh | None = None) -> list[MicroBatch]:
    """Plan `batch` into micro-batches (rlhf.data.planner): within the role's token budget (and,
    for a training role with micro_batch_size, that many samples at most), ordered
    small-large-small for the pipeline; `sample_ids` index `batch`.

    With `mesh`, every DP rank runs the same number of micro-batches (the largest any rank
    needs; collective over DP), short of it only with fewer samples than that.
    """
    fields = {k: _per_token(batch, k) for k in per_token}
    prompts, responses = batch["prompt_ids"], batch["response_ids"]
    lengths = (prompts.lengths + responses.lengths).tolist()
    max_seqs = getattr(role, "micro_batch_size", None)
    budget = role.max_tokens_per_micro_batch
    plan = plan_micro_batches(lengths, dp=1, max_tokens=budget, max_seqs=max_seqs)
    if mesh is not None and group_size(mesh.dp_group) > 1:
        counts = [None] * mesh.dp_size  # an object gather works on CPU and GPU backends alike
        dist.all_gather_object(counts, plan.num_micro_batches, group=mesh.dp_group)
        if max(counts) > plan.num_micro_batches:  # split further to match the busiest rank
            plan = plan_micro_batches(lengths, dp=1, max_tokens=budget, max_seqs=max_seqs,
                                      min_micro_batches=max(counts))
    return [_micro_batch(prompts, responses, fields, rows) for rows in plan.rank(0) if rows]


def _micro_batch(prompts: Ragged, responses: Ragged, fields: Mapping[str, Ragged],
                 rows: Sequence[int]) -> MicroBatch:
    ids = torch.tensor(rows, dtype=torch.int64)
    packed = pack_prompt_response(prompts.select(ids), responses.select(ids))
    predicting_positions(packed)  # ValueError for a response without a prompt
    tensors = {k: scatter_response_values(v.select(ids), packed) for k, v in fields.items()}
    return MicroBatch(packed, tensors, ids)


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


def mini_batches(batch: Batch, size: int, mesh: ParallelMesh, key: str) -> list[Batch]:
    """Consecutive mini-batches of `size` samples of this rank's chunk.

    Every DP rank must run the same number of optimizer steps, so the chunk sizes are gathered
    over DP first and every rank raises the same error when they cannot split evenly.
    """
    sizes = [len(batch)]
    if group_size(mesh.dp_group) > 1:
        sizes = [None] * mesh.dp_size
        dist.all_gather_object(sizes, len(batch), group=mesh.dp_group)
    if size < 1 or any(s != sizes[0] or s % size for s in sizes) or sizes[0] == 0:
        raise ValueError(f"{key}: the DP ranks hold {sizes} samples, which do not split into "
                         f"mini-batches of {size} ({key}.ppo_mini_batch_size * rollout.n / "
                         f"{mesh.dp_size} DP ranks); send a multiple of "
                         f"{max(size, 1) * mesh.dp_size} samples")
    return batch.split([size] * (len(batch) // size))


# ---- training --------------------------------------------------------------------------------


def train_mini_batch(engine: TrainEngine, mini: Batch, per_token: Sequence[str],
                     role: TrainRoleConfig, make_loss, *, outputs: Sequence[str],
                     temperature: float = 1.0) -> dict[str, float]:
    """One optimizer step on one mini-batch; returns its metrics plus grad_norm and lr.

    `make_loss(global_tokens, global_seqs)` gives the engine's loss_fn; its metrics must be
    each micro-batch's SHARE of the mini-batch value (like the losses), so their sum over all
    micro-batches of all DP ranks is the mini-batch value. The engine averages metrics over
    those micro-batches, so the sum is that average times their number.
    """
    mbs = micro_batches(mini, (*per_token, MASK), role, mesh=engine.mesh)
    tokens, seqs = engine.loss_normalizers(mbs, mask_key=MASK)
    stats = engine.forward_backward(mbs, make_loss(max(tokens, 1), max(seqs, 1)),
                                    outputs=outputs, temperature=temperature)
    count = stats.pop("num_micro_batches")
    stats.pop("loss")
    metrics = {k: v * count for k, v in stats.items()}
    return {**metrics, **engine.step()}


def ppo_updates(engine: TrainEngine, batch: Batch, config: JobConfig, key: str,
                per_token: Sequence[str], make_loss, *, outputs: Sequence[str],
                temperature: float = 1.0) -> dict[str, float]:
    """algorithm.ppo_epochs passes over this rank's chunk, one `train_mini_batch` step per
    `<key>.ppo_mini_batch_size` prompts' samples, in order; metrics averaged over the steps,
    named `<key>/...`."""
    role: TrainRoleConfig = getattr(config, key)
    size = role.ppo_mini_batch_size * config.rollout.n // engine.mesh.dp_size
    minis = mini_batches(batch, size, engine.mesh, key)
    history = [train_mini_batch(engine, mini, per_token, role, make_loss, outputs=outputs,
                                temperature=temperature)
               for _ in range(config.algorithm.ppo_epochs) for mini in minis]
    return mean_metrics(history, f"{key}/")


def token_share(mask_T: Tensor, global_tokens: int) -> Tensor:
    """This micro-batch's fraction of the mini-batch's counted tokens: the weight that turns a
    per-micro-batch token mean into its share of the mini-batch token mean."""
    return mask_T.sum() / global_tokens


def mean_metrics(history: Sequence[Mapping[str, float]], prefix: str) -> dict[str, float]:
    """Each metric averaged over the optimizer steps, named `prefix + name`."""
    keys = history[0].keys()
    return {prefix + k: math.fsum(h[k] for h in history) / len(history) for k in keys}
