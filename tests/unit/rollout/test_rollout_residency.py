"""Two and more generates with policy updates between, on replicas behind a fake CUDA vLLM that
really discards its weights at sleep level 2 (and takes and frees device memory as vLLM does),
driven by the driver's RolloutSource (synchronous) and RolloutPipeline (one step off), colocated
(ActorWorker's replica) and separate (RolloutWorker's): every batch is sampled by the weights of
the version it is labelled with, PyTorch's allocator cache is emptied before every wake, and
each sleep reports what it freed and what the engine still holds."""

import gc
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from rlhf.config import OffloadConfig, RolloutConfig
from rlhf.controller.dispatch import Dispatch, Layout, registered_methods
from rlhf.data.batch import Batch
from rlhf.data.ragged import Ragged
from rlhf.engine.offload import Offloader
from rlhf.rollout.replica import ReplicaSpec, RolloutReplica
from rlhf.rollout.residency import replica_sleeps
from rlhf.trainer.metrics import SectionTimer
from rlhf.trainer.rollout_source import VERSION, RolloutPipeline, RolloutSource
from tests.unit.rollout.vllm_fakes import install_fake_reload
from workers.actor import ActorWorker
from workers.rollout import RolloutWorker

N = 2  # samples per prompt
GIB = 2**30


class Device:
    """One GPU's free memory as a fake vLLM takes and gives it back: building takes the
    weights, the KV cache and a residual (graphs, buffers); the first generate loads kernels
    it keeps; a level-2 sleep frees the weights and the KV cache, each wake takes its part."""

    TOTAL, WEIGHTS, KV, RESIDUAL, LAZY = 80 * GIB, 14 * GIB, 28 * GIB, 3 * GIB, GIB // 4

    def __init__(self, log):
        self.free, self.log = self.TOTAL - 10 * GIB, log  # the trainer holds 10 GiB

    def mem_get_info(self, *args):
        self.log.append(("free",))
        return self.free, self.TOTAL


class DiscardingLLM:
    """A stand-in for a CUDA `vllm.LLM` with sleep mode: level 2 really discards the weights
    (a wake brings back uninitialised memory until they are reloaded), generating without
    weights or KV cache raises, and every sampled token is the version of the weights."""

    def __init__(self, model, log, device, **kwargs):
        self.log, self.kwargs, self.device = log, kwargs, device
        device.free -= device.WEIGHTS + device.KV + device.RESIDUAL
        self.generated = False
        self.workers = [SimpleNamespace(model_runner=SimpleNamespace(model=object()))]
        self.version: float | None = 0.0  # model.path is policy version 0
        self.asleep: set[str] = set()

    def generate(self, requests, params, use_tqdm):
        self.log.append(("generate", len(requests)))
        if self.asleep:
            raise RuntimeError(f"generate while {sorted(self.asleep)} asleep")
        if self.version is None:
            raise RuntimeError("generate from discarded (uninitialised) weights")
        if not self.generated:  # kernels loaded on first use stay
            self.device.free -= self.device.LAZY
            self.generated = True
        token = int(self.version)
        sample = SimpleNamespace(token_ids=[token], logprobs=[{token: SimpleNamespace(
            logprob=-0.5)}], finish_reason="length")
        return [SimpleNamespace(outputs=[sample]) for _ in requests]

    def collective_rpc(self, fn, args=()):
        if fn.__name__ != "reload_weights":
            return [fn(worker, *args) for worker in self.workers]
        self.log.append(("reload",))
        if "weights" in self.asleep:
            raise RuntimeError("load_weights into sleeping weights")
        for _, tensor in args[0]:
            self.version = float(tensor.flatten()[0])
        return [[]]  # the worker's receipts

    def sleep(self, level):
        self.log.append(("sleep", level))
        self.device.free += (self.device.WEIGHTS * ("weights" not in self.asleep)
                             + self.device.KV * ("kv_cache" not in self.asleep))
        self.asleep = {"weights", "kv_cache"}
        if level == 2:
            self.version = None

    def wake_up(self, tags=None):
        self.log.append(("wake_up", tuple(tags)))
        for tag in set(tags) & self.asleep:
            self.device.free -= self.device.WEIGHTS if tag == "weights" else self.device.KV
        self.asleep -= set(tags)

    def reset_prefix_cache(self):
        self.log.append(("reset_prefix_cache",))


@pytest.fixture
def fake_cuda(monkeypatch):
    """A fake `vllm` whose LLM discards weights, and torch.cuda's cache calls recorded in the
    same log (no GPU here: the code branches on the device type "cuda")."""
    log: list[tuple] = []
    device = Device(log)
    vllm = types.ModuleType("vllm")
    vllm.LLM = lambda model, **kw: DiscardingLLM(model, log, device, **kw)
    vllm.SamplingParams, vllm.__version__ = (lambda **kw: SimpleNamespace(**kw)), "0.99.fake"
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    install_fake_reload(monkeypatch)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append(("empty_cache",)))
    monkeypatch.setattr(gc, "collect", lambda *a: log.append(("gc",)) or 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", device.mem_get_info)
    return log


class Policy:
    """The trainer's weights: version v exports tensors holding v."""

    def __init__(self):
        self.version = 0

    def export_hf_weights(self, *, bucket_bytes, select=None):
        yield [("model.embed_tokens.weight", torch.full((2, 2), float(self.version)))]
        yield [("lm_head.weight", torch.full((2, 2), float(self.version)))]

    def export_nbytes(self, *, select=None):
        return 2 * 4 * 4


class View:
    """The driver's handle on one rank of a role: calls the worker's registered methods in
    process, as the dispatcher would for a group of one rank."""

    layout = Layout(dp=1)

    def __init__(self, worker):
        self.worker, self.modes = worker, registered_methods(type(worker))

    def __getattr__(self, name):
        if name in ("open_weight_transfer", "join_weight_transfer"):
            return lambda *a, blocking=True, **kw: Done(None) if not blocking else None
        method, mode = getattr(self.worker, name), self.modes[name]

        def call(*args, blocking=True, **kwargs):
            out = method(*args, **kwargs)
            out = [out] if mode == Dispatch.ONE_TO_ALL else out
            return out if blocking else Done(out)
        return call


class Done:
    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


class Wire:
    """The transfer group between actor rank 0 and one rollout rank: what is sent is received."""

    def __init__(self):
        self.buckets: list = []

    def send(self, buckets):
        self.buckets = [list(bucket) for bucket in buckets]
        return {"bytes": 8.0}

    def receive(self):
        return iter(self.buckets)


def _replica(placement: str) -> RolloutReplica:
    extra = {"world_size": 1} if placement == "separate" else {}
    config = RolloutConfig(max_new_tokens=4, n=N, placement=placement, **extra)
    return RolloutReplica(ReplicaSpec(
        model_path="unused", config=config, device=torch.device("cuda"), dtype=torch.bfloat16,
        max_model_len=32, world_group=None, replica_group=None))


def _job(placement: str):
    """(policy, RolloutSource, actor worker) with the replica where `placement` puts it."""
    policy, wire = Policy(), Wire()
    replica = _replica(placement)
    config = SimpleNamespace(rollout=replica.spec.config)
    actor = ActorWorker.__new__(ActorWorker)
    actor.ctx = SimpleNamespace(rank=0)
    actor.config, actor.engine, actor._transfer = config, policy, wire
    actor.offload = Offloader(lambda: {}, config=OffloadConfig())
    actor.rollout = replica if placement == "colocated" else None
    views = {"actor": View(actor)}
    if placement == "separate":
        pool = RolloutWorker.__new__(RolloutWorker)
        pool.config, pool.replica, pool.transfer = config, replica, wire
        views["rollout"] = View(pool)
    return policy, RolloutSource(views, n=N), actor, replica


def _prompts(step: int) -> Batch:
    return Batch({"prompt_ids": Ragged.from_list([[step, 1], [step, 2]], dtype=torch.int64)}
                 ).with_meta(seed=step)


def _update(policy, source, actor):
    """What one actor update does to the policy and to the replica it hosts (if any)."""
    policy.version += 1
    if actor.rollout is not None:
        actor.rollout.mark_stale()  # as update_actor does
    source.policy_changed()


def _sampled_by(batch: Batch) -> set[int]:
    return {int(t) for t in batch["response_ids"].values}


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_synchronous_generates_sample_with_the_current_policy(fake_cuda, placement):
    """Train steps and a greedy validation between them (no update before the next step)."""
    policy, source, actor, replica = _job(placement)
    for step in range(1, 4):
        for greedy in (False, True):  # the step's batch, then a validation pass
            source.sync()
            prompts = _prompts(step)
            out = source.generate(prompts, greedy=greedy)
            batch, _ = source.assemble(prompts, out, greedy=greedy,
                                       version=source.policy_version)
            assert _sampled_by(batch) == {policy.version} == set(batch[VERSION].tolist())
        _update(policy, source, actor)
    sleeps = [entry for entry in fake_cuda if entry[0] == "sleep"]
    if placement == "colocated":
        assert sleeps and set(sleeps) == {("sleep", 2)}
    else:
        assert not sleeps  # a separate rank keeps its weights between calls


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_one_step_off_generates_sample_with_the_version_they_carry(fake_cuda, placement):
    policy, source, actor, replica = _job(placement)
    pipe = RolloutPipeline(source, _prompts, max_staleness=1, total_steps=4,
                           old_from_rollout=True)
    trained = []
    for step in range(1, 5):
        batch, _ = pipe.next_batch(step, SectionTimer())
        versions = set(batch[VERSION].tolist())
        assert _sampled_by(batch) == versions and len(versions) == 1
        assert source.policy_version - versions.pop() <= 1
        trained.append(step)
        _update(policy, source, actor)
    assert trained == [1, 2, 3, 4] and pipe.pending is None


def test_the_driver_asks_the_rollout_ranks_before_skipping_a_sync(fake_cuda):
    """A separate rank that lost its weights (here: put to sleep by hand) is re-sent the
    current policy even though the driver's counter says it holds it."""
    policy, source, actor, replica = _job("separate")
    source.sync()
    source.generate(_prompts(1), greedy=False)
    assert source.sync()["sync/skipped"] == 1.0  # resident: it still holds version 0
    replica.sampler.llm.sleep(level=2)
    replica.sampler.asleep, replica.sampler.has_weights = {"weights", "kv_cache"}, False
    assert source.held_version() is None
    assert source.sync()["sync/skipped"] == 0.0
    out = source.generate(_prompts(2), greedy=False)
    assert {int(t) for t in out["response_ids"].values} == {0}


def test_the_residency_rule():
    assert replica_sleeps(device_type="cuda", placement="colocated")
    assert not replica_sleeps(device_type="cuda", placement="separate")
    assert not replica_sleeps(device_type="cpu", placement="colocated")


def test_every_wake_comes_after_the_allocator_cache_is_emptied_weights_sync_then_kv(fake_cuda):
    policy, source, actor, replica = _job("colocated")
    for step in (1, 2):
        source.sync()
        source.generate(_prompts(step), greedy=False)
        _update(policy, source, actor)
    log = [entry for entry in fake_cuda if entry[0] != "reset_prefix_cache"]
    wakes = [i for i, entry in enumerate(log) if entry[0] == "wake_up"]
    assert len(wakes) == 2
    for i in wakes:
        assert log[i - 3:i] == [("gc",), ("empty_cache",), ("free",)], log
    read = [("gc",), ("empty_cache",), ("free",)]  # a reading of the emptied device
    # before the engine acts the cache is emptied; after a wake or a sleep it need not be
    assert log == [*read, *read, ("generate", 4), *read, ("sleep", 2), ("free",),  # build
                   *read, ("wake_up", ("weights",)), ("free",), ("reload",),
                   *read, ("wake_up", ("kv_cache",)), ("free",), ("generate", 4),
                   *read, ("sleep", 2), ("free",)]
    assert replica.sampler.llm.kwargs["enable_sleep_mode"] is True


def test_a_separate_cuda_engine_is_built_without_sleep_mode(fake_cuda):
    _, source, _, replica = _job("separate")
    source.generate(_prompts(1), greedy=False)
    assert replica.sampler.llm.kwargs["enable_sleep_mode"] is False and not replica.sampler.sleeps


def test_each_sleep_reports_what_it_freed_and_what_vllm_keeps_whatever_the_trainer_moves(
        fake_cuda):
    """The residual is what the engine took (building, waking, its first generate's kernels)
    less what its sleeps gave back, the same every step, while the trainer's own memory
    changes between the calls (its state moved off and back, a sync's buckets)."""
    policy, source, actor, replica = _job("colocated")
    reports = []
    for step in (1, 2, 3):
        source.sync()
        out = source.generate(_prompts(step), greedy=False)
        reports.append({k: v for k, v in out.meta["metrics"].items() if "sleep" in k})
        device = replica.sampler.llm.device
        device.free += 5 * GIB * (-1) ** step  # the trainer moves state on and off the device
        _update(policy, source, actor)
    expected = {"rollout/sleep_freed_gb": (Device.WEIGHTS + Device.KV) / GIB,
                "rollout/sleep_residual_gb": (Device.RESIDUAL + Device.LAZY) / GIB}
    assert reports == [expected] * 3


def test_a_resident_engine_reports_no_sleep(fake_cuda):
    _, source, _, replica = _job("separate")
    out = source.generate(_prompts(1), greedy=False)
    assert not any("sleep" in k for k in out.meta["metrics"]) and replica.sampler.ledger is None


def test_a_call_whose_replica_got_no_prompts_reports_no_sleep(fake_cuda):
    """Its engine stays as the sync left it (nothing to sleep): no figure, and every rank still
    joins the metric reductions (a rank with prompts reports for the group)."""
    policy, source, actor, replica = _job("colocated")
    source.generate(_prompts(1), greedy=False)
    _update(policy, source, actor)
    source.sync()  # the weights wake; no generate wakes the KV cache
    out = replica.generate(Ragged.from_list([], dtype=torch.int64), greedy=False, seed=0)
    assert len(out["response_ids"]) == 0 and not replica.sampler.awake
    assert not any("sleep" in k for k in out.meta["metrics"])
    assert replica._sleep_metrics(None) == {}
