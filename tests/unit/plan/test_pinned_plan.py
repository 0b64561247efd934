"""The pinned host memory the planner counts is what the offloader pins: one flat buffer per
(role, kind of state) laid out by `rlhf.engine.offload.host_layout`, on CUDA through a patched
pinning call (no GPU here), and every copy a view that keeps the round trip bit-exact."""

import sys
from pathlib import Path

import pytest
import torch

_ROOT = str(Path(__file__).resolve().parents[3])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from rlhf.config.schema import OffloadConfig, ParallelConfig  # noqa: E402
from rlhf.engine import TrainEngine, offload  # noqa: E402
from rlhf.engine.offload import HOST_ALIGN, PAGE_BYTES, Offloader, host_layout, offloaded_kinds  # noqa: E402
from rlhf.engine.zero import STATE_KINDS  # noqa: E402
from rlhf.models.config import ModelArgs  # noqa: E402
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache  # noqa: E402
from rlhf.plan.inputs import RoleSpec  # noqa: E402
from rlhf.plan.memory import stage_memory  # noqa: E402
from tests.unit.engine.reference import OPTIM, GlooWorld, tiny_folder  # noqa: E402

ALL = OffloadConfig(params=True, grads=True, optimizer=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_folder(tmp_path_factory.mktemp("pinned"))


@pytest.fixture(scope="module")
def world():
    with GlooWorld():
        yield


@pytest.fixture
def fake_cuda(monkeypatch):
    """The offloader's CUDA branch on the CPU: pinning records (address, bytes) instead of
    registering them with the driver; synchronising and emptying the cache do nothing."""
    pinned = []
    monkeypatch.setattr(offload, "pin_host_memory", lambda buffer: pinned.append(
        (buffer.data_ptr(), buffer.numel())) or (lambda: None))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return pinned


def _cuda_offloader(state, config):
    """An offloader that takes the CUDA branch from its first move (the tensors are on CPU)."""
    offloader = Offloader(state, config=OffloadConfig())  # nothing moves yet
    offloader.device_type, offloader.config = "cuda", config
    offloader.enter("idle")
    return offloader


def test_the_layout_aligns_every_copy_and_pins_whole_pages():
    layout = host_layout([100, 0, 512, 513, 8])
    assert layout.offsets == (0, 512, 512, 1024, 2048)
    # 2048 + 512 rounded up to a page, and the spare page that lets the copies start on one
    assert layout.nbytes == 2 * PAGE_BYTES
    assert host_layout([PAGE_BYTES]).nbytes == 2 * PAGE_BYTES
    assert host_layout([PAGE_BYTES + 1]).nbytes == 3 * PAGE_BYTES
    assert host_layout([]).nbytes == 0
    sizes = [3, 4096 * 3 + 7, 1, 2 * HOST_ALIGN, 77]
    layout = host_layout(sizes)
    ends = [o + s for o, s in zip(layout.offsets, sizes)]
    assert all(o % HOST_ALIGN == 0 for o in layout.offsets)
    assert all(end <= nxt for end, nxt in zip(ends, layout.offsets[1:]))  # no overlap
    assert ends[-1] <= layout.nbytes - PAGE_BYTES and layout.nbytes % PAGE_BYTES == 0


def test_one_pinned_buffer_per_kind_holds_aligned_views_and_round_trips_exactly(fake_cuda):
    tensors = {"weights": [torch.randn(3, 5, dtype=torch.bfloat16), torch.randn(7),
                           torch.arange(5, dtype=torch.int64)],
               "grads": [], "masters": [torch.randn(11)],
               "optimizer": [torch.randn(13), torch.randn(13)]}
    want = {kind: [t.clone() for t in ts] for kind, ts in tensors.items()}
    offloader = _cuda_offloader(lambda: tensors, ALL)
    # one registration per kind that holds anything: the whole allocation, in whole pages
    assert len(fake_cuda) == 3
    assert all(n % PAGE_BYTES == 0 for _, n in fake_cuda)
    assert offloader.pinned_bytes == {"weights": 2 * PAGE_BYTES, "masters": 2 * PAGE_BYTES,
                                      "optimizer": 2 * PAGE_BYTES}
    assert sum(n for _, n in fake_cuda) == sum(offloader.pinned_bytes.values())
    base = dict(fake_cuda)
    for ts in tensors.values():
        views = [offloader._away[id(t)][1] for t in ts]
        assert all(t.numel() == 0 for t in ts)
        if views:
            start = min(v.data_ptr() for v in views)
            ptr = next(p for p in base if p <= start < p + base[p])  # inside its registration
            assert start % PAGE_BYTES == 0 and start - ptr < PAGE_BYTES
            assert all((v.data_ptr() - start) % HOST_ALIGN == 0 for v in views)
            assert all(v.untyped_storage().data_ptr() == ptr for v in views)  # is_pinned asks it
    offloader.enter("update")
    for kind, ts in tensors.items():
        for t, w in zip(ts, want[kind]):
            assert t.dtype == w.dtype and torch.equal(t, w), kind
    offloader.enter("idle")  # the same buffers again: nothing more is pinned
    assert len(fake_cuda) == 3
    metrics = offloader.take_memory_metrics()
    assert metrics["memory/pinned_gb"] == 6 * PAGE_BYTES / 2**30
    assert metrics["timing/pin_s"] > 0


def test_the_plan_counts_exactly_what_the_engine_pins(folder, world, fake_cuda):
    """A bf16 training engine with every switch on, and a forward-only one with its weights
    offloaded: the planner's per-kind host buffer bytes equal what the offloader pinned."""
    args = ModelArgs.from_pretrained(folder)
    for trains, config in ((True, ALL), (False, OffloadConfig(params=True))):
        mesh = ParallelMesh([0], cache=ProcessGroupCache())
        engine = TrainEngine.from_pretrained(folder, mesh=mesh, head="lm",
                                             optim=OPTIM if trains else None, total_steps=10,
                                             device="cpu", dtype="bfloat16")
        offloader = _cuda_offloader(engine.state_tensors, config)
        spec = RoleSpec(name="actor", head="lm", args=args, parallel=ParallelConfig(),
                        world_size=1, colocated=True, dtype=torch.bfloat16, trains=trains,
                        recompute="none", tokens=64, shards=1, offload=config)
        (stage,) = stage_memory(spec)
        kinds = offloaded_kinds(config)
        planned = {kind: stage.host_buffer[kind] for kind in STATE_KINDS
                   if kind in kinds and stage.host_buffer[kind]}
        assert offloader.pinned_bytes == planned, trains
        assert sum(n for _, n in fake_cuda) == sum(planned.values())
        # the padding is counted: the tiny model's small norm weights take 512 bytes each
        assert stage.host_buffer["weights"] > stage.state["weights"]
        fake_cuda.clear()


def test_a_failed_pinning_names_the_bytes_and_what_to_do(monkeypatch):
    class Cudart:
        class cudaError:  # noqa: N801 (torch's name)
            success = 0

        def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    with pytest.raises(RuntimeError, match=r"pinning 0\.00 GB of host memory.*offload less"):
        offload.pin_host_memory(torch.empty(PAGE_BYTES, dtype=torch.uint8))
