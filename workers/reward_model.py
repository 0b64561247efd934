"""RewardModelWorker: a sequence-scoring value-head model (reward.model_path), forward only.

Convention: the score of a sample is the value head at its LAST token, the last response
token (the last prompt token when the response is empty), as Hugging Face's
*ForSequenceClassification pools an unpadded sequence. The model sees prompt + response
exactly as sampled: no chat template or EOS is added here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf.config import JobConfig
from rlhf.controller import Dispatch, WorkerContext, register
from rlhf.data.batch import Batch
from rlhf.data.batch_split import GroupBatches
from rlhf.data.fields import TOKENS, require_fields
from rlhf.engine import MicroBatch
from rlhf.errors import ConfigError
from workers.base import Worker, build_engine
from workers.micro_batches import forward_micro_batches


class RewardModelWorker(Worker):
    """The reward model on its own (config.reward.parallel) layout."""

    def __init__(self, ctx: WorkerContext, *, config: JobConfig):
        super().__init__(ctx)
        if config.reward.model_path is None:
            raise ConfigError("reward: reward.model_path is null, so there is no reward model; "
                              "do not create a RewardModelWorker, or set reward.model_path")
        self.config = config
        self.engine = build_engine(self, config, "reward", path=config.reward.model_path,
                                   head="value", train=False)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_rm_score(self, batch: Batch, split: GroupBatches | None = None) -> Batch:
        """`rm_scores` (n,) float32: the value at each sample's last token."""
        require_fields(batch, TOKENS, "reward.compute_rm_score")
        mbs = forward_micro_batches(batch, self.config.reward, split, key="reward")
        outputs = self.engine.forward(mbs, outputs=("values",))
        scores = torch.zeros(len(batch), dtype=torch.float32)
        for out, mb in zip(outputs, mbs):
            scores[mb.sample_ids] = last_token_values(out["values"], mb).float().cpu()
        return Batch({"rm_scores": scores})


def last_token_values(values_T: Tensor, mb: MicroBatch) -> Tensor:
    """(n,) value at the last position of every sequence of a micro-batch."""
    cu = mb.packed.cu_seqlens.long().to(values_T.device)
    if bool((cu[1:] == cu[:-1]).any()):
        i = int((cu[1:] == cu[:-1]).nonzero()[0])
        raise ValueError(f"sample {int(mb.sample_ids[i])} has an empty prompt and an empty "
                         "response: there is no token to score")
    return values_T[cu[1:] - 1]
