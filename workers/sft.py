"""SFTWorker: supervised fine-tuning of a causal LM on packed prompt/answer samples.

The loss is the token-mean negative log-likelihood of the response tokens (the answer and its
EOS), normalised by the global token count of the step over every DP rank, so any tp/pp/dp
layout takes the same step as one process. Export the result with `export_hf`.
"""

from __future__ import annotations

import dataclasses

from torch import Tensor

from rlhf.algorithms import aggregate
from rlhf.config import JobConfig, OffloadConfig
from rlhf.controller import Dispatch, WorkerContext, register
from rlhf.data.batch import Batch
from rlhf.data.batch_split import GroupBatches
from rlhf.data.fields import MASK, TOKENS, require_fields
from rlhf.engine.offload import Offloader
from workers.base import Worker, build_engine
from workers.checkpoint import CheckpointMixin
from workers.micro_batches import forward_micro_batches
from workers.updates import train_mini_batch


class SFTWorker(CheckpointMixin, Worker):
    """The policy on the `config.<plan_key>` plan (sft by default): one optimizer step per
    `train_step` batch. train=False builds it forward-only (to load and export a checkpoint)."""

    def __init__(self, ctx: WorkerContext, *, config: JobConfig, init_path: str,
                 plan_key: str = "sft", train: bool = True):
        super().__init__(ctx)
        # The LR schedule spans the SFT run, not the RL run.
        steps = max(config.sft.total_steps, 1)
        self.config = dataclasses.replace(
            config, trainer=dataclasses.replace(config.trainer, total_steps=steps))
        self.lora = getattr(getattr(config, plan_key), "lora", None)
        self.engine = build_engine(self, self.config, plan_key, path=init_path, head="lm",
                                   train=train)
        self.offload = Offloader(self.engine.state_tensors, config=OffloadConfig())  # no rollouts

    @register(dispatch=Dispatch.DP_COMPUTE_METRICS)
    def train_step(self, batch: Batch, split: GroupBatches | None = None) -> dict[str, float]:
        """One optimizer step on `batch` (prompt_ids, response_ids); returns sft/ metrics.
        Without the driver's batch split each DP group splits its own chunk: one step per call, so
        there is no step count for the groups to agree on."""
        require_fields(batch, TOKENS, "sft.train_step")
        mbs = forward_micro_batches(batch, self.config.sft, split, key="sft", per_token=(MASK,))
        metrics = train_mini_batch(self.engine, mbs, _nll_loss, outputs=("log_probs",))
        return {f"sft/{k}": v for k, v in metrics.items()}


def _nll_loss(global_tokens: int, global_seqs: int):
    def loss_fn(out: dict[str, Tensor], mb) -> tuple[Tensor, dict]:
        mask_T, cu = mb.tensors[MASK].bool(), mb.packed.cu_seqlens
        loss = aggregate(-out["log_probs"], mask_T, cu, "token-mean", global_tokens=global_tokens)
        return loss, {"nll": loss.detach()}

    return loss_fn
