"""Run by test_multinode.py in its own process: a simulated two-node Ray cluster.

`ray.cluster_utils.Cluster` needs its own ray.init, which cannot share a process with the
session cluster of the other tests. Prints one JSON line with what the test checks.
"""

import json
import sys

import ray
import torch
import torch.distributed as dist
from ray.cluster_utils import Cluster

from rlhf.controller import Dispatch, ResourceError, ResourcePool, WorkerGroup, register
from rlhf.data.batch import Batch
from workers.base import Worker

CPUS_PER_NODE = 2


class Probe(Worker):
    """tp=2 over 4 ranks: tp groups {0,1} and {2,3}, one per node."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.build_mesh(tp=2)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def where(self):
        x = torch.tensor([float(self.ctx.rank)])
        dist.all_reduce(x)  # the world spans both nodes
        return {"node_id": ray.get_runtime_context().get_node_id(), "world_sum": x.item(),
                "coordinate": list(self.mesh.coordinate)}

    @register(dispatch=Dispatch.DP_COMPUTE)
    def forward(self, batch):
        node = ray.get_runtime_context().get_node_id()
        return Batch({"id": batch["id"], "node": [node] * len(batch)})


def main() -> dict:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": CPUS_PER_NODE,
                                                             "include_dashboard": False})
    cluster.add_node(num_cpus=CPUS_PER_NODE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING")
    try:
        out = {"nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])}
        try:
            ResourcePool("too-big", ranks_per_node=[CPUS_PER_NODE + 1], use_gpu=False, timeout_s=5)
        except ResourceError as e:
            out["too_big_error"] = str(e)
        pool = ResourcePool("mn", ranks_per_node=[CPUS_PER_NODE, CPUS_PER_NODE], use_gpu=False,
                            timeout_s=60)
        out["pool_node_ids"] = pool.node_ids()
        group = WorkerGroup(pool, {"probe": Probe}, job_name="mn", init_timeout_s=120)
        out["where"] = group.where()
        result = group.forward(Batch({"id": torch.arange(5)}))
        out["ids"], out["forward_nodes"] = result["id"].tolist(), result["node"]
        group.shutdown()
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    print(json.dumps(main()))
    sys.stdout.flush()
