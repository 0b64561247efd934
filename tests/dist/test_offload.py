"""Offload on sharded engines (tp 2 with sequence parallelism, pp 2 with a tied embedding, dp 2)
in gloo processes: with every switch on, phase after phase, two training steps give exactly
the losses, grad norms, forward outputs and weights of the same engine with none."""

import pytest
import torch

from rlhf.config.schema import OffloadConfig, ParallelConfig
from rlhf.engine import TrainEngine, make_micro_batches
from rlhf.engine.offload import Offloader
from rlhf.parallel.launch import run_distributed
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from tests.unit.engine.reference import OPTIM, actor_loss_fn, exported, make_batch, tiny_folder

CASES = {  # name -> model, ParallelConfig kwargs
    "tp2-sp": (("llama", False), dict(tp=2, sequence_parallel=True)),
    "pp2-tied": (("qwen3", True), dict(pp=2)),
    "dp2": (("llama", False), dict()),
}
ALL = OffloadConfig(params=True, grads=True, optimizer=True)


def _steps(mesh, folder, parallel, config):
    engine = TrainEngine.from_pretrained(folder, mesh=mesh, parallel=parallel, optim=OPTIM,
                                         total_steps=10, device="cpu", dtype="bfloat16")
    offload = Offloader(engine.state_tensors, config=config)
    record = []
    for step in range(2):
        batch = make_batch(step, n=8)
        mbs = make_micro_batches(batch.prompts, batch.responses, batch.per_token,
                                 max_tokens=24)[mesh.dp_rank::mesh.dp_size]
        offload.enter("forward")
        outs = [o["log_probs"] for o in engine.forward(mbs)]
        offload.enter("update")
        tokens, _ = engine.loss_normalizers(mbs, mask_key="loss_mask")
        metrics = engine.forward_backward(mbs, actor_loss_fn(tokens))
        offload.enter("idle")  # grads to the host and back between backward and step
        offload.enter("update")
        metrics.update(engine.step())
        offload.enter("generate")
        record.append((outs, metrics))
    offload.enter("sync")
    return record, exported(engine)


def _run(rank, world_size, folders):
    cache, results = ProcessGroupCache(), {}
    for name, (model, parallel_kw) in CASES.items():
        parallel = ParallelConfig(**parallel_kw)
        mesh = ParallelMesh(list(range(world_size)), tp=parallel.tp, pp=parallel.pp, cache=cache)
        results[name] = [_steps(mesh, folders[model], parallel, config)
                         for config in (OffloadConfig(), ALL)]
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload-dist")
    folders = {model: str(tiny_folder(root, arch=model[0], tied=model[1]))
               for model in {model for model, _ in CASES.values()}}
    return run_distributed(_run, 2, folders, timeout_s=240)


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_offload_trains_exactly_like_none(ranks, name):
    for rank, result in enumerate(ranks):
        (steps_off, weights_off), (steps_on, weights_on) = result[name]
        for (outs_off, met_off), (outs_on, met_on) in zip(steps_off, steps_on, strict=True):
            assert met_off == met_on, (name, rank)
            assert len(outs_off) == len(outs_on)
            assert all(torch.equal(a, b) for a, b in zip(outs_off, outs_on)), (name, rank)
        assert steps_on[1][1]["grad_norm"] > 0
        assert weights_off.keys() == weights_on.keys()
        assert all(torch.equal(weights_off[k], weights_on[k]) for k in weights_off), (name, rank)
