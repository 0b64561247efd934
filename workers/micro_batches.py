"""Executing the driver's batch split: a DP group's rows into the engine's micro-batches, and the
engine's per-token outputs back into Batch fields.

The driver plans (rlhf.data.batch_split) and the dispatcher hands each DP group its rows with
its GroupBatches; a role checks the plan against the rows it got (`group_batches`), builds each
mini-batch's micro-batches here (`build_micro_batches`, the one builder), runs them on its
engine and returns the outputs as a Batch (`response_fields`). Without the driver's batch split, a
group plans its own rows: forward passes at any DP size, updates only at dp = 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from rlhf.config import ForwardRoleConfig
from rlhf.data.batch import Batch
from rlhf.data.batch_split import GroupBatches, split_role_batch
from rlhf.data.fields import MASK, response_mask, sample_lengths
from rlhf.data.packing import pack_prompt_response, shared_prompt_lens
from rlhf.data.ragged import Ragged
from rlhf.data.routes import ROUTES, routes_to_stream, stream_to_routes
from rlhf.engine import (
    MicroBatch,
    collect_response_values,
    predicting_positions,
    scatter_response_values,
)


def group_batches(batch: Batch, role: ForwardRoleConfig, split: GroupBatches | None, *,
                  dp_size: int, mini_size: int | None = None, key: str) -> GroupBatches:
    """The plan this DP group executes: the driver's, checked against `batch`; or, without
    one, a plan of `batch` alone (forward: one mini-batch; update: `mini_size` samples each,
    only at dp = 1, since other groups' mini-batch counts are not known here)."""
    if split is not None:
        if split.num_rows != len(batch):
            raise ValueError(f"{key}: the plan covers {split.num_rows} rows but the batch has "
                             f"{len(batch)}; pass the plan made for this batch")
        return split
    if role.parallel.ep > 1:
        raise ValueError(f"{key}: at parallel.ep={role.parallel.ep} the ranks of an ep group must "
                         "run as many micro-batches as each other, which only the driver's "
                         "batch split guarantees: pass the plan the driver made for this batch")
    if mini_size is not None and dp_size > 1:
        raise ValueError(f"{key}: an update on {dp_size} DP groups needs the driver's batch split: "
                         "pass the plan the driver made for this batch (StepSplits.update in "
                         "rlhf.trainer.step_splits, or a BatchSplit from rlhf.data.batch_split)")
    what = f"{key}.ppo_mini_batch_size * rollout.n"
    return split_role_batch(sample_lengths(batch), role, dp=1, mini_size=mini_size, what=what,
                            shared=shared_prompt_lens(batch["prompt_ids"])).groups[0]


def build_micro_batches(batch: Batch, micro: Sequence[Sequence[int]],
                        per_token: Sequence[str] = (), *, share_prompts: bool = False,
                        replay_routes: bool = False) -> list[MicroBatch]:
    """The micro-batches `micro` lists (rows of `batch`, one list per micro-batch), with the
    per-response-token fields `per_token` at their predicting positions; `sample_ids` index
    `batch`. `share_prompts`: consecutive rows of one prompt hold it once (the role's
    `share_prompts`; rlhf.data.packing). `replay_routes`: the batch's MoE routes (if it has
    them) go in as the stream's forced routes. Every worker builds its micro-batches here."""
    fields = {k: _per_token(batch, k) for k in per_token}
    routes = batch[ROUTES] if replay_routes and ROUTES in batch else None
    prompts, responses = batch["prompt_ids"], batch["response_ids"]
    out = []
    for rows in micro:
        ids = torch.tensor(rows, dtype=torch.int64)
        packed = pack_prompt_response(prompts.select(ids), responses.select(ids),
                                      share_prompts=share_prompts)
        predicting_positions(packed)  # ValueError for a response without a prompt
        tensors = {k: scatter_response_values(v.select(ids), packed) for k, v in fields.items()}
        if routes is not None:
            tensors[ROUTES] = routes_to_stream(routes.select(ids), packed)
        out.append(MicroBatch(packed, tensors, ids))
    return out


def forward_micro_batches(batch: Batch, role: ForwardRoleConfig, split: GroupBatches | None, *,
                          key: str, per_token: Sequence[str] = (),
                          replay_routes: bool = False) -> list[MicroBatch]:
    """The micro-batches of a call that runs `batch` as one mini-batch (a forward pass, an SFT
    step) by `plan`, or by this group's own plan of `batch` without one."""
    split = group_batches(batch, role, split, dp_size=1, key=key)
    if len(split.mini_batches) != 1:
        raise ValueError(f"{key}: this call runs one mini-batch but the plan has "
                         f"{len(split.mini_batches)}; plan it with mini_size=None")
    return build_micro_batches(batch, split.mini_batches[0], per_token,
                               share_prompts=role.share_prompts, replay_routes=replay_routes)


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


def routes_field(outputs: Sequence[Mapping[str, Tensor]], mbs: Sequence[MicroBatch],
                 batch: Batch) -> Batch:
    """The routes an MoE forward recorded (output ROUTES of each micro-batch) as the per-sample
    ROUTES field of `batch`'s rows, on the CPU (rlhf.data.routes)."""
    if not mbs or not outputs:  # no samples here, or a pipeline stage before the last
        return Batch({ROUTES: Ragged(torch.empty(0, dtype=torch.int16),
                                     torch.zeros(1, dtype=torch.int64))})
    full = torch.tensor(sample_lengths(batch), dtype=torch.int64)
    rows: list[Tensor | None] = [None] * len(batch)
    for out, mb in zip(outputs, mbs):
        ids = mb.sample_ids.tolist()
        for i, row in zip(ids, stream_to_routes(out[ROUTES].cpu(), mb.packed, full[ids]).to_list()):
            rows[i] = row
    if any(row is None for row in rows):
        raise ValueError("the forward recorded no routes for some rows; every row of the batch "
                         "must be in one micro-batch")
    return Batch({ROUTES: Ragged.from_list(rows, dtype=torch.int16)})
