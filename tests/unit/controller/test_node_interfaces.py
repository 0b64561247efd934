"""The interface variables a world spanning nodes needs (rlhf.controller.nodes), as pure logic:
what one node's environment and interfaces give for each backend, and a one-node group that is
never checked. The Ray part runs on a loopback cluster in tests/ray/test_node_checks.py."""

import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.controller import nodes
from rlhf.controller.nodes import check_node_interfaces, interface_problems
from rlhf.node_probes import import_each, interface_facts

ROOT = Path(__file__).resolve().parents[3]

IFACES = ["lo", "eth0", "ib0"]


def test_gloo_needs_its_variable_naming_interfaces_the_node_has():
    assert interface_problems({"GLOO_SOCKET_IFNAME": "eth0"}, IFACES, backend="gloo") == []
    assert interface_problems({"GLOO_SOCKET_IFNAME": "eth0,ib0"}, IFACES, backend="gloo") == []
    (missing,) = interface_problems({}, IFACES, backend="gloo")
    assert missing == "GLOO_SOCKET_IFNAME is not set (interfaces there: eth0, ib0, lo)"
    (wrong,) = interface_problems({"GLOO_SOCKET_IFNAME": "eth1"}, IFACES, backend="gloo")
    assert wrong.startswith("GLOO_SOCKET_IFNAME=eth1 names no interface of that node")
    # gloo takes exact names: a prefix that NCCL would accept is not one
    assert interface_problems({"GLOO_SOCKET_IFNAME": "eth"}, IFACES, backend="gloo")
    assert interface_problems({"GLOO_SOCKET_IFNAME": "eth0,eth9"}, IFACES, backend="gloo")


def test_nccl_needs_both_variables():
    both = {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    assert interface_problems(both, IFACES, backend="nccl") == []
    found = interface_problems({"GLOO_SOCKET_IFNAME": "eth0"}, IFACES, backend="nccl")
    assert [p.split(" ")[0] for p in found] == ["NCCL_SOCKET_IFNAME"]
    found = interface_problems({"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": " "},
                               IFACES, backend="nccl")
    assert [p.split(" ")[0] for p in found] == ["GLOO_SOCKET_IFNAME"]


@pytest.mark.parametrize("value, ok", [
    ("eth", True),      # a prefix, as NCCL reads it
    ("=eth0", True),    # an exact name
    ("=eth", False),    # an exact name the node lacks
    ("en,ib", True),    # any of several prefixes
    ("^lo,docker", True),   # names to avoid: eth0 and ib0 remain
    ("^lo,eth,ib", False),  # every interface avoided
    ("wlan", False),
])
def test_nccl_reads_prefixes_exact_names_and_exclusions(value, ok):
    env = {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": value}
    assert (interface_problems(env, IFACES, backend="nccl") == []) is ok


def test_a_group_on_one_node_is_never_checked(monkeypatch):
    ran = []
    monkeypatch.setattr(nodes, "run_on_nodes", lambda *a, **kw: ran.append(a))
    check_node_interfaces(["n1", "n1", "n1"], backend="nccl", timeout_s=1)
    check_node_interfaces([], backend="gloo", timeout_s=1)
    assert ran == []


def test_the_error_names_each_node_and_variable_and_the_fix(monkeypatch):
    facts = {"aaaaaaaa11": ({"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}, IFACES),
             "bbbbbbbb22": ({"GLOO_SOCKET_IFNAME": "enp1"}, IFACES)}
    monkeypatch.setattr(nodes, "run_on_nodes", lambda fn, ids, *a, **kw: {
        n: facts[n] for n in ids})
    monkeypatch.setattr(nodes, "node_table", lambda: {})
    with pytest.raises(nodes.RLHFError) as info:
        check_node_interfaces(["aaaaaaaa11", "bbbbbbbb22"], backend="nccl", timeout_s=1)
    lines = str(info.value).splitlines()
    assert lines[0].startswith("the job's nccl ranks span 2 nodes")
    assert lines[1:3] == [
        "on node bbbbbbbb: NCCL_SOCKET_IFNAME is not set (interfaces there: eth0, ib0, lo)",
        "on node bbbbbbbb: GLOO_SOCKET_IFNAME=enp1 names no interface of that node "
        "(interfaces there: eth0, ib0, lo)"]
    assert "before `ray start`" in lines[3] and "node aaaaaaaa" not in str(info.value)


def test_a_node_check_task_imports_neither_torch_nor_the_controller():
    # A task's worker imports the task's module first; each job with a runtime_env of its own
    # starts fresh workers on every node, so this import is paid per node and job.
    code = ("import sys\nfrom rlhf.node_probes import import_each, interface_facts\n"
            "print(sorted({'torch', 'rlhf.controller'} & set(sys.modules)))\n"
            "print(interface_facts(('NO_SUCH_VARIABLE',)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    imported, facts = out.stdout.splitlines()
    assert imported == "[]"
    assert facts.startswith("({}, [") and "'lo'" in facts
    assert nodes.import_each is import_each and nodes.interface_facts is interface_facts
