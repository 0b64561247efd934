"""A pool spanning two (simulated) nodes: ranks packed per node, one torch.distributed world."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)

SCRIPT = pathlib.Path(__file__).with_name("multinode_cluster.py")
REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)  # its own cluster, never the session's
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=170)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    output = f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0 and lines, f"script failed:\n{output}"
    return json.loads(lines[-1])


def test_pool_packs_ranks_node_by_node(report):
    nodes = report["pool_node_ids"]
    assert len(report["nodes"]) == 2
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]
    assert set(nodes) == set(report["nodes"])


def test_workers_run_where_the_pool_put_them_and_share_one_world(report):
    where = report["where"]
    assert [w["node_id"] for w in where] == report["pool_node_ids"]
    assert [w["world_sum"] for w in where] == [6.0] * 4
    assert [w["coordinate"] for w in where] == [[0, 0, 0], [0, 0, 1], [1, 0, 0], [1, 0, 1]]


def test_dp_compute_across_nodes_keeps_order(report):
    assert report["ids"] == [0, 1, 2, 3, 4]
    nodes = report["pool_node_ids"]
    assert report["forward_nodes"] == [nodes[0]] * 3 + [nodes[2]] * 2  # chunks 3+2 from ranks 0, 2


def test_node_entry_larger_than_any_node_fails_fast(report):
    message = report["too_big_error"]
    assert "on one node" in message and "{CPU: 3}" in message
    assert "largest node has {CPU: 2}" in message
