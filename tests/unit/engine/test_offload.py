"""The offload state machine on CPU: where every tensor of a tiny engine lives in each phase,
and training with every switch on computes exactly what it computes with none."""

import pytest
import torch

from rlhf import trace
from rlhf.config.schema import OffloadConfig
from rlhf.engine import TrainEngine, make_micro_batches
from rlhf.engine.offload import NEEDS, Offloader, in_phase, placement
from rlhf.engine.zero import STATE_KINDS
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from rlhf.trace import SpanRecorder
from tests.unit.engine.reference import OPTIM, actor_loss_fn, make_batch

ALL = OffloadConfig(params=True, grads=True, optimizer=True)
NONE = OffloadConfig()


def _engine(folder, *, dtype="bfloat16", optim=OPTIM):
    mesh = ParallelMesh([0], cache=ProcessGroupCache())
    return TrainEngine.from_pretrained(folder, mesh=mesh, head="lm", optim=optim, total_steps=10,
                                       device="cpu", dtype=dtype)


def _mbs(seed):
    batch = make_batch(seed)
    return make_micro_batches(batch.prompts, batch.responses, batch.per_token, max_tokens=24)


def _forward_backward(engine, mbs):
    tokens, _ = engine.loss_normalizers(mbs, mask_key="loss_mask")
    return engine.forward_backward(mbs, actor_loss_fn(tokens))


def _assert_placed(offloader, engine, phase, config):
    """Every tensor of every kind is where the table says: on the host means a host copy is
    held and the tensor's own storage is empty; on the device means it is whole."""
    where = placement(phase, config)
    state = engine.state_tensors()
    for kind in STATE_KINDS:
        for t in state[kind]:
            if where[kind] == "host":
                assert offloader.on_host(t) and t.numel() == 0, (phase, kind)
            else:
                assert not offloader.on_host(t) and t.numel() > 0, (phase, kind)


def test_the_table_read_through_the_switches():
    assert set(placement("update", ALL).values()) == {"device"}
    assert set(placement("generate", NONE).values()) == {"device"}
    assert placement("generate", ALL) == dict.fromkeys(STATE_KINDS, "host")
    assert placement("forward", ALL) == {"weights": "device", "grads": "host", "masters": "host",
                                         "optimizer": "host"}
    params_only = OffloadConfig(params=True)
    assert placement("idle", params_only) == {"weights": "host", "grads": "device",
                                              "masters": "device", "optimizer": "device"}
    assert placement("checkpoint", ALL)["grads"] == "host"
    assert placement("checkpoint", ALL)["masters"] == "device"
    with pytest.raises(ValueError, match="unknown offload phase 'rollout'"):
        placement("rollout", ALL)


def test_phase_by_phase_every_tensor_is_where_the_table_says(folder, world):
    engine = _engine(folder)  # bf16: separate fp32 masters
    offloader = Offloader(engine.state_tensors, config=ALL)
    _assert_placed(offloader, engine, "idle", ALL)
    # The first update creates grads and the AdamW moments; each phase then moves them.
    offloader.enter("update")
    _assert_placed(offloader, engine, "update", ALL)
    _forward_backward(engine, _mbs(0))
    assert engine.state_tensors()["grads"]
    for phase in ("idle", "generate", "sync", "forward", "checkpoint", "update"):
        offloader.enter(phase)
        _assert_placed(offloader, engine, phase, ALL)
    engine.step()
    state = engine.state_tensors()
    # The flat grad buffer stays allocated (zeroed by the step); the moments and the bf16
    # model's master shard exist from construction.
    assert len(state["grads"]) == 1 and not state["grads"][0].any()
    assert len(state["optimizer"]) == 2 and len(state["masters"]) == 1
    for phase in ("idle", "sync", "idle", "forward", "generate", "checkpoint", "idle"):
        offloader.enter(phase)
        _assert_placed(offloader, engine, phase, ALL)
    assert offloader.phase == "idle"


def test_params_only_moves_only_the_weights(folder, world):
    engine = _engine(folder)
    config = OffloadConfig(params=True)
    offloader = Offloader(engine.state_tensors, config=config)
    offloader.enter("update")
    _forward_backward(engine, _mbs(0))
    engine.step()
    for phase in NEEDS:
        offloader.enter(phase)
        _assert_placed(offloader, engine, phase, config)


def test_every_switch_on_trains_exactly_like_none(folder, world):
    """Two PPO-like steps, with forward passes and idle phases between, bit for bit equal."""
    results = []
    for config in (NONE, ALL):
        engine = _engine(folder)
        offloader = Offloader(engine.state_tensors, config=config)
        outputs, metrics = [], []
        for step in range(2):
            offloader.enter("sync")
            exported = {name: t.clone() for bucket in engine.export_hf_weights(bucket_bytes=2**16)
                        for name, t in bucket}
            offloader.enter("generate")
            offloader.enter("forward")
            outputs.append(engine.forward(_mbs(step)))
            offloader.enter("idle")
            offloader.enter("update")
            fb = _forward_backward(engine, _mbs(10 + step))
            offloader.enter("idle")  # grads on the host between backward and step
            offloader.enter("update")
            metrics.append({**fb, **engine.step()})
            offloader.enter("idle")
        offloader.enter("checkpoint")
        results.append((outputs, metrics, exported, engine.state_dict()))
    (out_a, met_a, exp_a, sd_a), (out_b, met_b, exp_b, sd_b) = results
    assert met_a == met_b
    for step_a, step_b in zip(out_a, out_b):
        for mb_a, mb_b in zip(step_a, step_b, strict=True):
            for key in mb_a:
                assert torch.equal(mb_a[key], mb_b[key])
    assert exp_a.keys() == exp_b.keys() and all(torch.equal(exp_a[k], exp_b[k]) for k in exp_a)
    for k, v in sd_a["model"].items():
        assert torch.equal(v, sd_b["model"][k]), k
    for key in ("master", "exp_avg", "exp_avg_sq"):
        a, b = sd_a["optimizer"][key], sd_b["optimizer"][key]
        assert a is not None and a.any() and torch.equal(a, b), key


def test_a_tensor_listed_twice_stays_where_either_kind_needs_it():
    """An fp32 model is its own master: with params kept and the optimizer offloaded, a
    tensor that is both weight and master stays whole; a tied weight listed twice moves once."""
    shared, moment = torch.randn(4, 3), torch.randn(4, 3)
    want_shared, want_moment = shared.clone(), moment.clone()
    state = {"weights": [shared, shared], "grads": [], "masters": [shared], "optimizer": [moment]}
    offloader = Offloader(lambda: state, config=OffloadConfig(optimizer=True))
    assert not offloader.on_host(shared) and torch.equal(shared, want_shared)
    assert offloader.on_host(moment) and moment.numel() == 0
    offloader.enter("update")
    assert torch.equal(moment, want_moment)
    offloader = Offloader(lambda: state, config=ALL)
    assert offloader.on_host(shared) and shared.numel() == 0
    offloader.enter("forward")
    assert torch.equal(shared, want_shared) and moment.numel() == 0
    offloader.enter("update")
    assert torch.equal(moment, want_moment)


def test_a_traced_phase_change_records_the_bytes_it_moved(monkeypatch):
    recorder = SpanRecorder()
    recorder.on = True
    monkeypatch.setattr(trace, "RECORDER", recorder)
    weight, moment = torch.randn(4, 3), torch.randn(5, dtype=torch.float64)
    offloader = Offloader(lambda: {"weights": [weight], "optimizer": [moment]}, config=ALL)
    offloader.enter("update")  # both come back
    offloader.enter("forward")  # the moments leave again
    spans = [(s[0], s[5]) for s in recorder.take()]
    assert spans == [("offload:idle", {"to_device_bytes": 0, "to_host_bytes": 48 + 40}),
                     ("offload:update", {"to_device_bytes": 48 + 40, "to_host_bytes": 0}),
                     ("offload:forward", {"to_device_bytes": 0, "to_host_bytes": 40})]


def test_a_view_is_refused_because_moving_it_would_free_nothing():
    flat = torch.randn(12)
    with pytest.raises(ValueError, match="weights:0 is a view"):
        Offloader(lambda: {"weights": [flat[:6]]}, config=ALL)


def test_in_phase_enters_the_phase_and_returns_to_idle_even_on_error():
    weight = torch.randn(5)

    class Role:
        def __init__(self):
            self.offload = Offloader(lambda: {"weights": [weight]},
                                     config=OffloadConfig(params=True))

        @in_phase("forward")
        def compute(self, fail=False):
            seen = (self.offload.phase, weight.numel())
            if fail:
                raise RuntimeError("boom")
            return seen

    role = Role()
    assert weight.numel() == 0
    assert role.compute() == ("forward", 5)
    assert role.offload.phase == "idle" and weight.numel() == 0
    with pytest.raises(RuntimeError, match="boom"):
        role.compute(fail=True)
    assert role.offload.phase == "idle" and weight.numel() == 0
    with pytest.raises(ValueError, match="unknown offload phase"):
        in_phase("rollouts")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offload_releases_device_memory_into_pinned_host_copies():
    weight = torch.randn(1024, 1024, device="cuda")
    want = weight.cpu()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    offloader = Offloader(lambda: {"weights": [weight]}, config=OffloadConfig(params=True))
    assert torch.cuda.memory_allocated() <= before - weight.element_size() * 1024 * 1024
    assert offloader._away[id(weight)][1].is_pinned()  # registered with the driver
    assert offloader.pinned_bytes == {"weights": 4 * 2**20}  # exactly: no power-of-two block
    offloader.enter("forward")
    assert weight.is_cuda and torch.equal(weight.cpu(), want)


def test_entering_generate_or_sync_on_cuda_empties_the_allocator_cache(monkeypatch):
    """Even a resident role (nothing moves) hands PyTorch's cached blocks back before vLLM
    wakes; other phases and the CPU leave the cache alone."""
    import gc

    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("gc") or 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    offloader = Offloader(lambda: {"weights": [torch.randn(3)]}, config=NONE)
    assert offloader.device_type == "cpu"
    offloader.device_type = "cuda"  # where the code branches on it (no GPU here)
    for phase, release in [("update", False), ("idle", False), ("generate", True),
                           ("forward", False), ("sync", True), ("checkpoint", False)]:
        calls.clear()
        offloader.enter(phase)
        assert calls == (["gc", "empty_cache"] if release else []), phase
    offloader.device_type = "cpu"
    calls.clear()
    offloader.enter("generate")
    assert calls == []


def test_a_checkpoint_is_read_into_host_memory_then_copied(folder, world, tmp_path, monkeypatch):
    from rlhf.engine import checkpoint

    engine = _engine(folder)
    engine.save_checkpoint(tmp_path)
    want = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with torch.no_grad():
        for p in engine.model.parameters():
            p.zero_()
    places, load = [], torch.load
    monkeypatch.setattr(checkpoint.torch, "load", lambda *a, **kw: places.append(
        kw["map_location"]) or load(*a, **kw))
    engine.load_checkpoint(tmp_path)
    assert places and set(places) == {"cpu"}
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, want[name]), name


def test_each_call_reports_its_memory_the_worst_call_and_rank_kept(monkeypatch):
    from rlhf.parallel.memory_probes import worst_memory

    peaks = iter([3 * 2**30, 5 * 2**30, 4 * 2**30])
    free = iter([30 * 2**30, 10 * 2**30, 20 * 2**30])
    resets = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: resets.append(1))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: next(peaks))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 6 * 2**30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (next(free), 80 * 2**30))

    class Role:
        def __init__(self):
            self.offload = Offloader(lambda: {"weights": [torch.randn(3)]}, config=NONE)
            self.offload.device_type = "cuda"  # no GPU here: the CUDA branch, patched

        @in_phase("update")
        def update_actor(self):
            return {"actor/loss": 1.0}

        @in_phase("generate")
        def generate(self):
            return None

    role = Role()
    assert role.update_actor() == {"actor/loss": 1.0}  # the call's own result is untouched
    role.generate()
    role.update_actor()
    assert len(resets) == 3
    assert role.offload.take_memory_metrics() == {
        "memory/update_actor/allocated_gb": 4.0, "memory/update_actor/reserved_gb": 6.0,
        "memory/update_actor/free_gb": 20.0, "memory/generate/allocated_gb": 5.0,
        "memory/generate/reserved_gb": 6.0, "memory/generate/free_gb": 10.0,
        "memory/pinned_gb": 0.0, "timing/pin_s": 0.0}  # nothing offloaded, nothing pinned
    assert role.offload.take_memory_metrics() == {"memory/pinned_gb": 0.0, "timing/pin_s": 0.0}
    role.offload.device_type = "cpu"
    role.generate()
    assert role.offload.take_memory_metrics()["memory/generate/host_rss_gb"] > 0.01
    ranks = [{"memory/x/allocated_gb": 1.0, "memory/x/free_gb": 9.0},
             {"memory/x/allocated_gb": 2.0, "memory/x/free_gb": 7.0}]
    assert worst_memory(ranks) == {"memory/x/allocated_gb": 2.0, "memory/x/free_gb": 7.0}
