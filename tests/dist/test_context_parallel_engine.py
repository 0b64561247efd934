"""TrainEngine at cp > 1 against the single-process reference step, on 4 gloo ranks in one launch.

Each dp replica's cp ranks receive the same micro-batches (whole packs) and run their shards;
the loss, the grad norm (clipping active) and every parameter after one AdamW step must equal
the hand-written unsharded reference (tests/unit/engine/reference.py), and the full synced
grads and the per-token outputs of a forward pass (log-probs, entropy, values) must equal a
cp=1 (dp=4) engine's on the same micro-batches. Cases: cp=2 alone (dp=2), cp=4 on Qwen2
(2 KV heads), cp=2 with tp=2 and sequence parallelism on Qwen2 (qkv biases, tied embeddings),
a critic at cp=2, and cp=2 with a two-stage pipeline, 1F1B and interleaved (vpp=2, a 4-layer
Llama).
"""

from pathlib import Path

import pytest
import torch

from rlhf.config.schema import ParallelConfig, TinyModelConfig
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.engine import TrainEngine, make_micro_batches
from rlhf.engine.engine import Head
from rlhf.parallel.context_parallel import plan_context_shard
from rlhf.parallel.launch import run_distributed
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from tests.unit.engine.reference import (
    OPTIM,
    SMALL,
    actor_loss_fn,
    critic_loss_fn,
    exported,
    make_batch,
    max_param_error,
    reference_step,
    tiny_folder,
)

TOL = 1e-6
BATCH_SEED, N_SAMPLES, MAX_TOKENS = 11, 10, 24
# case -> (model, head, ParallelConfig)
CASES: dict[str, tuple[str, Head, ParallelConfig]] = {
    "cp2-dp2": ("llama", "lm", ParallelConfig(cp=2)),
    "cp4": ("qwen2", "lm", ParallelConfig(cp=4)),
    "cp2-tp2-sp": ("qwen2", "lm", ParallelConfig(cp=2, tp=2, sequence_parallel=True)),
    "cp2-critic": ("llama", "value", ParallelConfig(cp=2)),
    "cp2-pp2": ("llama", "lm", ParallelConfig(cp=2, pp=2)),
    "cp2-pp2-vpp2": ("llama4", "lm", ParallelConfig(cp=2, pp=2, vpp=2)),
}
MODELS = {"llama": ("llama", False), "qwen2": ("qwen2", True), "llama4": ("llama", False)}


def _micro_batches():
    batch = make_batch(BATCH_SEED, n=N_SAMPLES)
    return make_micro_batches(batch.prompts, batch.responses, batch.per_token,
                              max_tokens=MAX_TOKENS)


def _update(engine, mbs, mesh, head):
    """forward_backward's arguments: this dp replica's micro-batches (the cp ranks of a
    replica get the same packs) and the loss over the global token count."""
    local = mbs[mesh.dp_rank::mesh.dp_size]
    tokens, _ = engine.loss_normalizers(local, mask_key="loss_mask")
    return local, (actor_loss_fn if head == "lm" else critic_loss_fn)(tokens)


def _run(rank, world_size, folders):
    cache = ProcessGroupCache()
    mbs = _micro_batches()
    plain, plain_grads = {}, {}  # cp=1, dp=4: forwards of every micro-batch, synced grads
    for model, head in sorted({(model, head) for model, head, _ in CASES.values()}):
        mesh = ParallelMesh(list(range(world_size)), cache=cache)
        engine = TrainEngine.from_pretrained(folders[model], mesh=mesh, head=head, optim=OPTIM,
                                             total_steps=10, device="cpu")
        plain[model, head] = engine.forward(mbs)
        engine.forward_backward(*_update(engine, mbs, mesh, head))
        plain_grads[model, head] = engine.full_grads()
    results = {}
    for name, (model, head, parallel) in CASES.items():
        mesh = ParallelMesh(list(range(world_size)), tp=parallel.tp, pp=parallel.pp,
                            cp=parallel.cp, cache=cache)
        engine = TrainEngine.from_pretrained(folders[model], mesh=mesh, parallel=parallel,
                                             head=head, optim=OPTIM, total_steps=10, device="cpu")
        outs = engine.forward(mbs)
        errors = [max((out[k] - ref[k]).abs().max().item() for k in ref)
                  for out, ref in zip(outs, plain[model, head])]
        metrics = engine.forward_backward(*_update(engine, mbs, mesh, head))
        grads = engine.full_grads()  # reads the synced buffer, leaves it for the step
        grad_error = max((grads[n] - g).abs().max().item()
                         for n, g in plain_grads[model, head].items())
        stats = engine.step()
        results[name] = {"params": exported(engine), "grad_norm": stats["grad_norm"],
                         "loss": metrics["loss"], "output_error": max(errors, default=None),
                         "grad_error": grad_error,
                         "num_outputs": len(outs), "cp_rank": mesh.cp_rank}
    return results


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-cp")
    folders = {name: str(tiny_folder(root, arch=arch, tied=tied))
               for name, (arch, tied) in MODELS.items() if name != "llama4"}
    folders["llama4"] = str(make_tiny_model(
        TinyModelConfig(arch="llama", tie_embeddings=False, **{**SMALL, "num_layers": 4}),
        root / "llama4"))
    batch = make_batch(BATCH_SEED, n=N_SAMPLES)
    refs = {(model, head): reference_step(Path(folders[model]), batch, head=head)
            for model, head, _ in CASES.values()}
    return folders, refs


@pytest.fixture(scope="module")
def four_ranks(setup):
    folders, _ = setup
    return run_distributed(_run, 4, folders, timeout_s=150)


@pytest.mark.parametrize("name", list(CASES))
def test_cp_engine_equals_the_single_process_reference(four_ranks, setup, name):
    _, refs = setup
    model, head, parallel = CASES[name]
    ref = refs[model, head]
    assert ref["grad_norm"] > OPTIM.grad_clip  # the step is clipped
    for rank, result in enumerate(four_ranks):
        got = result[name]
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), (name, rank)
        assert got["loss"] == pytest.approx(ref["loss"], abs=TOL), (name, rank)
        assert max_param_error(got["params"], ref["params"]) < TOL, (name, rank)
        assert got["grad_error"] < 1e-6, (name, rank, got["grad_error"])  # against cp=1
    # forward outputs on the last stage (every rank at pp=1), whole packs on both cp ranks
    with_outputs = [r[name] for r in four_ranks if r[name]["num_outputs"]]
    assert len(with_outputs) == 4 // parallel.pp
    assert {r["cp_rank"] for r in with_outputs} == set(range(parallel.cp))
    for got in with_outputs:
        assert got["output_error"] < 1e-5, (name, got["output_error"])


def test_the_packs_are_sharded_not_replicated():
    """A cp rank's stream is half the pack plus per-sequence padding, not the whole pack."""
    for mb in _micro_batches():
        lens = mb.packed.seq_lens.tolist()
        local = plan_context_shard(lens, cp=2, rank=0).num_local
        assert local == sum(-(-n // 4) * 2 for n in lens) < mb.num_tokens
        assert torch.equal(mb.packed.seq_lens.sum(), torch.tensor(mb.num_tokens))
