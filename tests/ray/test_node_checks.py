"""Checks the driver runs on every node of the job: user files given by path must import there.
The interface-variable checks run on the loopback cluster of tests/ray/test_multinode.py."""

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
