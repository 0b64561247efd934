"""No host sync per micro-batch or per layer: one training step's tensor -> host conversions.

Every `.item()`, `float(t)`, `int(t)` and `bool(t)` goes through `aten._local_scalar_dense`
(counted by a TorchDispatchMode); `.tolist()` does not dispatch on the CPU, so it is counted
by patching `Tensor.tolist`. On CUDA each of these waits for the device, so the count of one
step must not grow with the number of micro-batches or layers.
"""

import collections
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlhf.config.schema import TinyModelConfig
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.engine import TrainEngine, make_micro_batches
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from tests.unit.engine.reference import OPTIM, SMALL, actor_loss_fn, make_batch


class HostReads(TorchDispatchMode):
    """Counts tensor -> Python scalar conversions and `.tolist()` calls while active."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.count = collections.Counter()
        real = torch.Tensor.tolist

        def tolist(tensor):
            self.count["tolist"] += 1
            return real(tensor)

        monkeypatch.setattr(torch.Tensor, "tolist", tolist)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count["scalar"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.count.values())


class CudaSyncs:
    """Counts the operations that make the host wait for a CUDA stream (torch's sync debug
    mode warns on each: scalar reads, copies to the host, blocking copies from pageable memory)."""

    def __enter__(self):
        torch.cuda.synchronize()
        self._warnings = warnings.catch_warnings(record=True)
        self.caught = self._warnings.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        self._warnings.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum("synchroniz" in str(w.message) for w in self.caught)


def _step_reads(root, monkeypatch, *, layers: int, micro_batches: int, share: bool,
                device: str = "cpu", dtype: str = "float32") -> int:
    folder = root / f"llama-{layers}"
    if not folder.exists():
        make_tiny_model(TinyModelConfig(arch="llama", **{**SMALL, "num_layers": layers}), folder)
    mesh = ParallelMesh([0], cache=ProcessGroupCache())
    engine = TrainEngine.from_pretrained(folder, mesh=mesh, optim=OPTIM, total_steps=10,
                                         device=device, dtype=dtype)
    batch = make_batch(3, n=8, group=2)
    mbs = make_micro_batches(batch.prompts, batch.responses, batch.per_token,
                             max_tokens=1000, max_seqs=8 // micro_batches, share_prompts=share)
    assert len(mbs) == micro_batches
    for _ in range(2):  # the second step counts: the first also warms kernels and caches
        with (HostReads(monkeypatch) if device == "cpu" else CudaSyncs()) as reads:
            tokens, _ = engine.loss_normalizers(mbs, mask_key="loss_mask")
            engine.forward_backward(mbs, actor_loss_fn(tokens))
            engine.step()
    return reads.total


@pytest.mark.parametrize("share", [False, True], ids=["own-prompts", "shared-prompts"])
def test_host_reads_of_a_step_do_not_grow_with_micro_batches_or_layers(tmp_path, monkeypatch,
                                                                     world, share):
    base = _step_reads(tmp_path, monkeypatch, layers=2, micro_batches=2, share=share)
    more_micro = _step_reads(tmp_path, monkeypatch, layers=2, micro_batches=4, share=share)
    more_layers = _step_reads(tmp_path, monkeypatch, layers=4, micro_batches=2, share=share)
    assert base > 0  # the counter sees the step's own reads (the loss, the grad norm)
    assert (more_micro, more_layers) == (base, base)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("share", [False, True], ids=["own-prompts", "shared-prompts"])
def test_cuda_syncs_of_a_step_do_not_grow_with_micro_batches_or_layers(tmp_path, monkeypatch,
                                                                       world, share, dtype):
    kw = dict(share=share, device="cuda", dtype=dtype)
    base = _step_reads(tmp_path, monkeypatch, layers=2, micro_batches=2, **kw)
    more_micro = _step_reads(tmp_path, monkeypatch, layers=2, micro_batches=4, **kw)
    more_layers = _step_reads(tmp_path, monkeypatch, layers=4, micro_batches=2, **kw)
    assert (more_micro, more_layers) == (base, base)
