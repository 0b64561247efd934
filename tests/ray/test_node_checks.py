"""Checks the driver runs on every node of the job: user files given by path must import there."""

from types import SimpleNamespace

import pytest
import ray

from rlhf.controller.nodes import check_user_files
from rlhf.errors import RLHFError


def views_on_this_node() -> dict:
    node = ray.get_runtime_context().get_node_id()
    return {"actor": SimpleNamespace(group=SimpleNamespace(rank_nodes=[node, node]))}


def test_a_reward_file_missing_on_a_node_is_named_with_the_node(ray_cluster, tmp_path):
    good = tmp_path / "good.py"
    good.write_text("def score(**kwargs):\n    return 1.0\n")
    specs = {"reward.functions[0].path": f"{good}:score",
             "rollout.env.path": f"{tmp_path / 'missing_env.py'}:Env"}
    with pytest.raises(RLHFError) as info:
        check_user_files(specs, views_on_this_node(), timeout_s=120)
    text = str(info.value)
    node = ray.get_runtime_context().get_node_id()[:8]
    assert f"(node {node}): rollout.env.path: environment" in text
    assert "missing_env.py" in text and "does not exist" in text
    assert "reward.functions[0]" not in text  # the file that imports is not reported


def test_files_that_import_everywhere_pass(ray_cluster, tmp_path):
    good = tmp_path / "good.py"
    good.write_text("def score(**kwargs):\n    return 1.0\n")
    check_user_files({"reward.functions[0].path": f"{good}:score"}, views_on_this_node(),
                     timeout_s=120)


# ---- the interface variables, on a real cluster of two nodes ----------------------------------

CHECKS = """
from rlhf.controller import ResourcePool, WorkerGroup
from rlhf.controller.nodes import check_node_interfaces
from rlhf.errors import RLHFError

ids = {k[3:]: n['NodeID'] for n in ray.nodes() if n['Alive'] for k in n['Resources']
       if k.startswith('mn_')}
out = {'ids': ids}
check_node_interfaces([ids['head'], ids['w1']], backend='gloo', timeout_s=60)
check_node_interfaces([ids['w1'], ids['w1']], backend='nccl', timeout_s=60)  # one node: no check
out['passed'] = True

class Role:
    pass

pool = ResourcePool('two-nodes', ranks_per_node=[1, 1], use_gpu=False)
try:
    WorkerGroup(pool, {'actor': Role}, job_name='nics', backend='nccl', init_timeout_s=60)
except RLHFError as e:
    out['error'] = str(e)
finally:
    pool.remove()
"""


def test_a_group_spanning_nodes_is_refused_naming_the_node_without_its_variable(tmp_path):
    """Head: GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME set before `ray start`; w1: only the
    gloo one. A gloo world over both starts, an NCCL one is refused before any rank starts."""
    from tests.ray.multinode_cluster import NODE_ENV, LoopbackCluster

    cluster = LoopbackCluster(tmp_path)
    try:
        cluster.start_node("head", head=True, env={**NODE_ENV, "NCCL_SOCKET_IFNAME": "lo"})
        cluster.start_node("w1", env=NODE_ENV)
        out = cluster.query(CHECKS)
    finally:
        cluster.stop()
    assert out.get("passed")
    message = out["error"]
    assert message.startswith("the job's nccl ranks span 2 nodes"), message
    w1, head = out["ids"]["w1"][:8], out["ids"]["head"][:8]
    assert f"(node {w1}): NCCL_SOCKET_IFNAME is not set (interfaces there: " in message
    assert f"(node {head})" not in message and "GLOO_SOCKET_IFNAME" not in message.splitlines()[1]
    assert "before `ray start`" in message
