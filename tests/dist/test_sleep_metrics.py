"""The sleep figures of a rollout group across processes (gloo): every rank joins the same
reductions, a rank whose engine did not sleep this call adds nothing, and the group reports
the least freed and the most kept of the ranks that slept."""

import torch
import torch.distributed as dist

from rlhf.config import RolloutConfig
from rlhf.parallel.launch import run_distributed
from rlhf.rollout.replica import ReplicaSpec, RolloutReplica
from rlhf.rollout.residency import SleepReport

GIB = 2**30
REPORTS = [SleepReport(freed_bytes=30 * GIB, residual_bytes=2 * GIB), None,
           SleepReport(freed_bytes=29 * GIB, residual_bytes=3 * GIB)]


def _metrics(rank, world, reports):
    replica = RolloutReplica(ReplicaSpec(
        model_path="unused", config=RolloutConfig(), device=torch.device("cpu"),
        dtype=torch.float32, max_model_len=8, world_group=dist.group.WORLD, replica_group=None))
    return replica._sleep_metrics(reports[rank]), replica._sleep_metrics(None)


def test_the_group_reports_the_worst_rank_that_slept():
    results = run_distributed(_metrics, 3, REPORTS, timeout_s=120.0)
    expected = {"rollout/sleep_freed_gb": 29.0, "rollout/sleep_residual_gb": 3.0}
    assert [r[0] for r in results] == [expected] * 3
    assert [r[1] for r in results] == [{}] * 3  # no rank slept: no figure
