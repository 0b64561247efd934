"""PPO with trainer.nnodes=2 on a real Ray cluster of three one-CPU nodes on this machine
(tests/ray/multinode_cluster.py).

One module-scoped scenario, each job reused by several tests:
  A  `RAY_ADDRESS=... rlhf train job.yaml` from the job's folder, with relative paths in the
     config, while the nodes were started in other folders; 3 steps, a checkpoint each step.
  B  the same job by `ray job submit --working-dir` (the folder shipped with the job), set to
     run many steps; a worker node hosting one of its ranks is killed, its rank's process
     with it, within milliseconds of its first checkpoint, so it dies in step 2 (a step takes
     a fraction of a second on an idle machine: step 3 is the margin), never after its last.
  C  `ray job submit` again: it resumes B's last checkpoint on the nodes left, while the lost
     node is started again, and runs the steps after it, which must repeat A's exactly.
Between A and B a small driver asks the cluster what it placed where, and runs the network
interface checks (the head alone names the NCCL interface) directly and through a group.
The cluster's system config (multinode_cluster.SYSTEM_CONFIG) declares the killed node dead
in seconds.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf.trainer.metrics import read_metrics
from tests.ray.multinode_cluster import NODE_ENV, RAY, LoopbackCluster, client_env
from tests.unit.trainer.jobs import make_assets

pytestmark = pytest.mark.timeout(900)

STEPS = 3
LOSS_BOUND_S = 90  # node loss to a failed job: Ray's health check plus the group's grace
JOB_YAML = """\
model: {path: model}
actor: {ppo_mini_batch_size: 2, max_tokens_per_micro_batch: 256, optim: {lr: 1.0e-3}}
critic: {ppo_mini_batch_size: 2, max_tokens_per_micro_batch: 256}
reward: {functions: [{path: "my_reward.py:score"}], num_workers: 0}
rollout: {n: 2, max_new_tokens: 4, cpu_kv_cache_gb: 0.05, max_num_seqs: 16}
algorithm: {adv_estimator: gae}
data: {train_files: [train.jsonl], max_prompt_length: 24, train_batch_size: 4}
trainer: {output_dir: run, total_steps: STEPS, save_every: 1, device: cpu, nnodes: 2,
          ranks_per_node: 1, ray_metrics: false, experiment_name: mn}
""".replace("STEPS", str(STEPS))
REWARD_PY = """\
from rlhf.rewards.arith import exact_match


def score(*, prompt, response, ground_truth, extra):
    return exact_match(prompt=prompt, response=response, ground_truth=ground_truth, extra=extra)
"""
# Wall-clock figures differ between runs; everything else must repeat exactly.
VARYING = ("timing/", "throughput/", "sync/", "rollout/seconds", "rollout/tokens_per_s",
           "memory/", "checkpoint/")


# Run on the cluster after job A: the interface checks a job spanning nodes gets before any
# rank starts (rlhf.controller.nodes.check_node_interfaces), directly and through a group.
INTERFACE_CHECKS = """
from rlhf.controller import WorkerGroup
from rlhf.controller.nodes import check_node_interfaces
from rlhf.errors import RLHFError

ids = {k[3:]: n['NodeID'] for n in ray.nodes() if n['Alive'] for k in n['Resources']
       if k.startswith('mn_')}
out['ids'] = ids
check_node_interfaces([ids['head'], ids['w1']], backend='gloo', timeout_s=60)
check_node_interfaces([ids['w1'], ids['w1']], backend='nccl', timeout_s=60)  # one node: no check
out['interfaces_passed'] = True
try:
    check_node_interfaces([ids['head'], ids['w1']], backend='nccl', timeout_s=60)
except RLHFError as e:
    out['nccl_error'] = str(e)

class Role:
    pass

pool = ResourcePool('two-nodes', ranks_per_node=[1, 1], use_gpu=False)
try:
    WorkerGroup(pool, {'actor': Role}, job_name='nics', backend='nccl', init_timeout_s=60)
except RLHFError as e:
    out['group_error'], out['group_nodes'] = str(e), pool.node_ids()
finally:
    pool.remove()
"""


def comparable(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(VARYING)}
            for r in records}


def submit(cluster: LoopbackCluster, job_dir: Path, run_dir: Path, sid: str,
           *overrides: str) -> subprocess.Popen:
    """`ray job submit` of the job in `job_dir`, shipped as its working_dir; blocks until the
    job ends, printing its logs."""
    return subprocess.Popen(
        [RAY, "job", "submit", "--address", cluster.dashboard, "--submission-id", sid,
         "--working-dir", str(job_dir), "--", sys.executable, "-m", "rlhf.cli", "train",
         "job.yaml", f"trainer.output_dir={run_dir}", *overrides, "--no-progress"],
        env=client_env(), cwd=cluster.root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)


def placement(run_dir: Path) -> dict[str, list[int]]:
    """{node id prefix: ranks} from the driver's log line of the shared pool."""
    log = (run_dir / "logs" / "driver.log").read_text()
    line = re.search(r"group 'actor\+critic': (.*)", log).group(1)
    return {node: [int(r) for r in ranks.split(", ")]
            for ranks, node in re.findall(r"ranks \[([\d, ]+)\] on .*? \(node (\w+)\)", line)}


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    root = tmp_path_factory.mktemp("multinode")
    job_dir = root / "job"
    make_assets(job_dir)
    (job_dir / "job.yaml").write_text(JOB_YAML)
    (job_dir / "my_reward.py").write_text(REWARD_PY)
    cluster = LoopbackCluster(root)
    out = {"root": root, "job_dir": job_dir}
    # `timeout` and CI runners stop pytest with SIGTERM: turn it into an exception so that the
    # cluster below is still stopped.
    previous = signal.signal(signal.SIGTERM, _raise_exit)
    try:
        # The head also names the NCCL interface, the workers only gloo's (test_a_group_spanning_...)
        for name in ("head", "w1", "w2"):
            cluster.start_node(name, head=name == "head",
                               env={**NODE_ENV, "NCCL_SOCKET_IFNAME": "lo"} if name == "head"
                               else NODE_ENV)
        out["nodes"] = cluster.node_ids()

        t0 = time.monotonic()
        a = subprocess.run([sys.executable, "-m", "rlhf.cli", "train", "job.yaml",
                            "--no-progress"], cwd=job_dir,
                           env=client_env(RAY_ADDRESS=cluster.address),
                           capture_output=True, text=True, timeout=400)
        out["a"] = {"rc": a.returncode, "output": a.stdout[-3000:] + a.stderr[-6000:],
                    "run": job_dir / "run", "seconds": time.monotonic() - t0}
        out.update(cluster.query(
            "from ray.util.state import list_actors\n"
            "from rlhf.controller import ResourceError, ResourcePool\n"
            f"actors = list_actors(address={cluster.dashboard!r}, "
            "filters=[('class_name', '=', 'ColocatedWorker')], limit=1000)\n"
            "out = {'actors': {a.name: a.node_id for a in actors}}\n"
            "try:\n"
            "    ResourcePool('too-big', ranks_per_node=[2], use_gpu=False, timeout_s=5)\n"
            "except ResourceError as e:\n"
            "    out['too_big_error'] = str(e)\n" + INTERFACE_CHECKS))

        run_b = root / "run-b"
        b = submit(cluster, job_dir, run_b, "mn-b", "trainer.total_steps=20")
        deadline = time.monotonic() + 400
        log_b, step_1 = run_b / "logs" / "driver.log", run_b / "checkpoints" / "step_1"
        # The node to kill is chosen from the placement B logs before its first step, so that
        # the kill follows step 1's checkpoint within milliseconds, not a whole step later.
        while not (log_b.is_file() and "group 'actor+critic': " in log_b.read_text()):
            assert b.poll() is None and time.monotonic() < deadline, b.communicate()[0][-6000:]
            time.sleep(0.5)
        out["b_placement"] = placement(run_b)
        lost = next(node for node, name in out["nodes"].items()
                    if name != "head" and node[:8] in out["b_placement"])
        while not step_1.is_dir():
            assert b.poll() is None and time.monotonic() < deadline, b.communicate()[0][-6000:]
            time.sleep(0.01)
        out["lost"] = lost
        killed_at = time.monotonic()
        cluster.kill_node(out["nodes"][lost])
        b_output, _ = b.communicate(timeout=300)
        out["b"] = {"rc": b.returncode, "output": b_output, "run": run_b,
                    "stop_s": time.monotonic() - killed_at}

        c = submit(cluster, job_dir, run_b, "mn-c")
        cluster.start_node(out["nodes"][lost])  # the node is back (with a new Ray node id)
        c_output, _ = c.communicate(timeout=400)
        out["c"] = {"rc": c.returncode, "output": c_output[-8000:]}
        out["nodes_after"] = cluster.node_ids()
        errors = [line for line in b_output.splitlines() if line.startswith("error: ")]
        print(f"multinode: A {out['a']['seconds']:.0f} s, node loss to stop "
              f"{out['b']['stop_s']:.0f} s, total {time.monotonic() - t0:.0f} s after the "
              f"cluster started; B: {errors[-1:]}", file=sys.stderr)
        yield out
    finally:
        cluster.stop()
        signal.signal(signal.SIGTERM, previous)


def _raise_exit(signum, frame):
    raise SystemExit(f"stopped by signal {signum}")


def test_relative_paths_train_from_another_folder_across_two_nodes(scenario):
    a = scenario["a"]
    assert a["rc"] == 0, a["output"]
    records = read_metrics(a["run"])
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert (a["run"] / "hf_model" / "config.json").is_file()
    cfg = (a["run"] / "config.yaml").read_text()  # what the workers saw: absolute paths only
    assert f"path: {scenario['job_dir'] / 'model'}\n" in cfg
    assert f"{scenario['job_dir'] / 'my_reward.py'}:score" in cfg


def test_ranks_run_on_the_nodes_their_placement_groups_name(scenario):
    assert scenario["a"]["rc"] == 0, scenario["a"]["output"]
    by_node = placement(scenario["a"]["run"])
    assert sorted(r for ranks in by_node.values() for r in ranks) == [0, 1]
    assert len(by_node) == 2  # one rank per node: the actor's dp=2 mesh spans both nodes
    assert set(by_node) <= {n[:8] for n in scenario["nodes"]}
    actors = scenario["actors"]
    for node, ranks in by_node.items():
        for rank in ranks:
            assert actors[f"mn/actor+critic:{rank}"].startswith(node)


def test_a_node_entry_larger_than_any_node_fails_fast(scenario):
    message = scenario["too_big_error"]
    assert "node entry 0 needs {CPU: 2} on one node" in message
    assert "largest node has {CPU: 1}" in message


def test_a_group_spanning_nodes_is_refused_naming_the_node_without_its_variable(scenario):
    """Head: GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME set before `ray start`; w1 and w2: only
    the gloo one. A gloo world over two nodes passes, an NCCL one is refused naming the node
    without the variable, and a worker group is refused before any rank starts."""
    assert scenario.get("interfaces_passed"), scenario
    head, w1 = scenario["ids"]["head"][:8], scenario["ids"]["w1"][:8]
    message = scenario["nccl_error"]
    assert message.startswith("the job's nccl ranks span 2 nodes"), message
    assert f"(node {w1}): NCCL_SOCKET_IFNAME is not set (interfaces there: " in message
    assert f"(node {head})" not in message and "GLOO_SOCKET_IFNAME" not in message.splitlines()[1]
    assert "before `ray start`" in message
    group = scenario["group_error"]  # the pool's two nodes: any two of the three
    assert group.startswith("the job's nccl ranks span 2 nodes"), group
    for node in scenario["group_nodes"]:
        assert (f"(node {node[:8]}): NCCL_SOCKET_IFNAME is not set" in group) == \
            (node[:8] != head), (node, group)


def test_every_node_reads_the_shared_folder_and_imports_the_reward_file(scenario):
    log = (scenario["a"]["run"] / "logs" / "driver.log").read_text()
    shared = re.search(r"trainer.output_dir \S+ is shared: read back on (.*)", log).group(1)
    imported = re.search(r"my_reward.py:score import on (.*)", log).group(1)
    for node in placement(scenario["a"]["run"]):
        assert f"(node {node})" in shared and f"(node {node})" in imported


def test_checkpoints_hold_shards_written_on_both_nodes(scenario):
    # one DCP data file per rank (each holds its ZeRO-1 optimizer partition), the two ranks
    # on different nodes writing into the one shared folder
    actor = scenario["a"]["run"] / "checkpoints" / "step_1" / "actor"
    assert {p.name for p in actor.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}


def test_losing_a_node_stops_the_job_in_bounded_time_naming_it(scenario):
    b = scenario["b"]
    assert b["rc"] != 0 and b["stop_s"] < LOSS_BOUND_S, (b["stop_s"], b["output"][-6000:])
    lost = scenario["lost"][:8]
    ranks = scenario["b_placement"][lost]
    message = next(line for line in b["output"].splitlines() if line.startswith("error: "))
    assert f"(node {lost}) (ranks {ranks} there)" in message, message
    assert "process died" in message


def test_the_job_resumes_after_the_node_is_back_and_repeats_the_run_exactly(scenario):
    c = scenario["c"]
    assert c["rc"] == 0, c["output"]
    # from step 1 or 2, never 3: C has a step of its own to compare with A's
    assert re.search(r"resumed from \S+/checkpoints/step_[12]\b", c["output"]), c["output"]
    assert sorted(scenario["nodes_after"].values()) == ["head", "w1", "w2"]  # the node is back
    submitted = comparable(read_metrics(scenario["b"]["run"]))  # B's steps, then C's
    uninterrupted = comparable(read_metrics(scenario["a"]["run"]))
    assert sorted(submitted) == list(range(1, STEPS + 1))
    for step, record in submitted.items():
        assert record == uninterrupted[step], step
