"""Training engine: a role's model shard, optimizer and schedule over one ParallelMesh.

- `micro_batch.py`: MicroBatch (packed sequences + per-token tensors), make_micro_batches.
- `engine.py`: TrainEngine (forward, forward_backward, step, state_tensors, checkpoints).
- `recompute.py`: activation recomputation by wrapping layers or attention blocks.
- `schedule.py`: the Schedule contract and the pp=1 loop; `make_schedule` picks the schedule.
- `loss_fn.py`: what a schedule hands a loss function and keeps of each micro-batch.
- `pipeline.py`: pipelined forward, 1F1B and interleaved 1F1B over one stage's model chunks.
- `pipeline_order.py`: each pipeline rank's step order, checked deadlock-free and in order.
- `grads.py`: the flat fp32 grad buffer, the one grad sync (TP, pipeline ties, DP) and norm.
- `optim.py`: LR schedule, which params decay, AdamW on the (ZeRO-1 sharded) flat state.
- `zero.py`: the pure ZeRO-1 partition and per-rank state bytes (shared with the planner).
- `metrics.py`: loss and metrics reduced over DP and pipeline stages by tensor collectives.
- `checkpoint.py`: atomic per-model-parallel-rank checkpoint files, ZeRO-1 shard files.
"""

from rlhf.engine.engine import TrainEngine, resolve_device, resolve_dtype
from rlhf.engine.micro_batch import (
                                     MicroBatch,
                                     collect_response_values,
                                     make_micro_batches,
                                     predicting_positions,
                                     scatter_response_values,
)
from rlhf.engine.optim import lr_at
from rlhf.engine.recompute import Recomputed, apply_recompute
from rlhf.engine.schedule import LossFn, MicroBatchResult, NoPipeline, Schedule, make_schedule

__all__ = [
    "LossFn", "MicroBatch", "MicroBatchResult", "NoPipeline", "Recomputed", "Schedule",
    "TrainEngine",
    "apply_recompute", "collect_response_values", "lr_at", "make_micro_batches", "make_schedule",
    "predicting_positions", "resolve_device", "resolve_dtype", "scatter_response_values",
]
