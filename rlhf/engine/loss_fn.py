"""What a schedule hands a loss function and what it keeps of each micro-batch.

Shared by the pp = 1 loop (`schedule.py`) and the pipelined schedules (`pipeline.py`), so
neither module imports the other for these types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from rlhf.engine.micro_batch import MicroBatch

Outputs = dict[str, Tensor]  # per-token (T,) outputs: "log_probs", "entropy", "values"
LossFn = Callable[[Outputs, MicroBatch], "tuple[Tensor, dict[str, float | Tensor]]"]


@dataclass(frozen=True)
class MicroBatchResult:
    """The detached loss and metrics of one micro-batch (last pipeline stage only)."""

    loss: float
    metrics: dict[str, float]


def check_loss(loss) -> None:
    """ValueError unless loss_fn gave a 0-d tensor."""
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        raise ValueError("loss_fn must return (0-d loss tensor, metrics dict); got a "
                         f"{type(loss).__name__} of shape {getattr(loss, 'shape', None)}")


def floats(metrics: dict) -> dict[str, float]:
    """Metric values as Python floats."""
    return {k: float(v.detach()) if isinstance(v, Tensor) else float(v)
            for k, v in metrics.items()}
