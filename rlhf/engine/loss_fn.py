"""What a schedule hands a loss function, what it keeps of each micro-batch, and the hook
around the last micro-batch's backward.

Shared by the pp = 1 loop (`schedule.py`) and the pipelined schedules (`pipeline.py`), so
neither module imports the other for these types.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

from torch import Tensor

from rlhf.engine.micro_batch import MicroBatch

Outputs = dict[str, Tensor]  # per-token (T,) outputs: "log_probs", "entropy", "values"
LossFn = Callable[[Outputs, MicroBatch], "tuple[Tensor, dict[str, float | Tensor]]"]
# Entered around each model chunk's backward of the last micro-batch: the grads final there.
FinalBackward = Callable[[], AbstractContextManager[None]]


@dataclass(frozen=True)
class MicroBatchResult:
    """The detached loss and metrics of one micro-batch (last pipeline stage only), left on
    the device: `reduce_metrics` reads them back once per step, not once per micro-batch."""

    loss: Tensor | float
    metrics: dict[str, Tensor | float]


def check_loss(loss) -> None:
    """ValueError unless loss_fn gave a 0-d tensor."""
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        raise ValueError("loss_fn must return (0-d loss tensor, metrics dict); got a "
                         f"{type(loss).__name__} of shape {getattr(loss, 'shape', None)}")


def detached(metrics: dict) -> dict[str, Tensor | float]:
    """Metric values detached from autograd, tensors kept where they are (no host sync)."""
    return {k: v.detach() if isinstance(v, Tensor) else float(v) for k, v in metrics.items()}
