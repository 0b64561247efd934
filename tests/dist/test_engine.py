"""TrainEngine over dp / tp / tp x dp meshes against the single-process hand-written reference.

The "-shared" cases pack a batch of grouped samples (3 per prompt) with shared prompts
(rlhf.data.packing) against the reference on the same batch computed without.

The reference step (whole mini-batch, unsharded model, torch AdamW, clip_grad_norm_) is
computed here in the pytest process. Each spawned launch builds every case's engine over its
ranks, gives each DP rank its share of the micro-batches, takes one step, and returns the max
parameter error (full HF tensors gathered by export), the grad norm and the loss; the tests
below assert on them. The reference's grad norm exceeds grad_clip, so clipping is active.
"""

import pytest

from rlhf.config.schema import ParallelConfig
from rlhf.engine import TrainEngine, make_micro_batches
from rlhf.parallel.launch import run_distributed
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from tests.unit.engine.reference import (OPTIM, actor_loss_fn, critic_loss_fn, exported,
                                         make_batch, max_param_error, reference_step,
                                         tiny_folder)

TOL = 1e-6
BATCH_SEED, N_SAMPLES, MAX_TOKENS = 11, 10, 24
SHARED_SAMPLES, GROUP = 12, 3  # the shared cases' batch: 4 prompts x 3 samples
# case -> (model, tp, sequence_parallel, head, how micro-batches go to DP ranks, shared prompts)
CASES_2 = {
    "dp2": ("llama", 1, False, "lm", "alternate", False),
    "dp2-one-rank-idle": ("llama", 1, False, "lm", "first-rank-only", False),
    "tp2": ("llama", 2, False, "lm", "alternate", False),
    "tp2-sp": ("llama", 2, True, "lm", "alternate", False),
    "tp2-critic": ("llama", 2, False, "value", "alternate", False),
    "tp2-qwen3-tied": ("qwen3", 2, False, "lm", "alternate", False),
    "tp2-sp-shared": ("llama", 2, True, "lm", "alternate", True),
    "dp2-critic-shared": ("llama", 1, False, "value", "alternate", True),
}
CASES_4 = {
    "tp2-dp2-sp": ("qwen2", 2, True, "lm", "alternate", False),
    "tp2-dp2-sp-critic": ("qwen2", 2, True, "value", "alternate", False),
    "tp2-dp2-sp-shared": ("qwen2", 2, True, "lm", "alternate", True),
}
MODELS = {"llama": ("llama", False), "qwen3": ("qwen3", True), "qwen2": ("qwen2", True)}


def _local(micro_batches, mesh, split):
    if split == "first-rank-only":
        return micro_batches if mesh.dp_rank == 0 else []
    return micro_batches[mesh.dp_rank::mesh.dp_size]


def _batch(shared: bool):
    return (make_batch(BATCH_SEED, n=SHARED_SAMPLES, group=GROUP) if shared
            else make_batch(BATCH_SEED, n=N_SAMPLES))


def _micro_batches(shared: bool):
    batch = _batch(shared)
    return make_micro_batches(batch.prompts, batch.responses, batch.per_token,
                              max_tokens=MAX_TOKENS, share_prompts=shared)


def _run_cases(rank, world_size, cases, folders):
    cache = ProcessGroupCache()
    results = {}
    for name, (model, tp, sp, head, split, shared) in cases.items():
        mbs = _micro_batches(shared)
        mesh = ParallelMesh(list(range(world_size)), tp=tp, cache=cache)
        engine = TrainEngine.from_pretrained(
            folders[model], mesh=mesh, parallel=ParallelConfig(tp=tp, sequence_parallel=sp),
            head=head, optim=OPTIM, total_steps=10, device="cpu")
        local = _local(mbs, mesh, split)
        tokens, _ = engine.loss_normalizers(local, mask_key="loss_mask")
        make_loss = actor_loss_fn if head == "lm" else critic_loss_fn
        metrics = engine.forward_backward(local, make_loss(tokens))
        stats = engine.step()
        results[name] = {"params": exported(engine), "grad_norm": stats["grad_norm"],
                         "loss": metrics["loss"], "num_micro_batches": len(local),
                         "total_micro_batches": metrics["num_micro_batches"]}
    return results


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-dist")
    folders = {name: str(tiny_folder(root, arch=arch, tied=tied))
               for name, (arch, tied) in MODELS.items()}
    refs = {(model, head, shared): reference_step(folders[model], _batch(shared), head=head)
            for model in MODELS for head in ("lm", "value") for shared in (False, True)}
    num_mbs = len(_micro_batches(False))
    return folders, refs, num_mbs


@pytest.fixture(scope="module")
def two_ranks(setup):
    folders, _, _ = setup
    return run_distributed(_run_cases, 2, CASES_2, folders, timeout_s=150)


@pytest.fixture(scope="module")
def four_ranks(setup):
    folders, _, _ = setup
    return run_distributed(_run_cases, 4, CASES_4, folders, timeout_s=150)


def _check(results, setup, cases, name):
    _, refs, num_mbs = setup
    model, _, _, head, _, shared = cases[name]
    ref = refs[(model, head, shared)]
    if shared:  # the packing did share: fewer tokens than the same samples packed whole
        batch, mbs = _batch(True), _micro_batches(True)
        whole = make_micro_batches(batch.prompts, batch.responses, max_tokens=MAX_TOKENS)
        assert any(mb.packed.prefix is not None for mb in mbs)
        assert sum(mb.num_tokens for mb in mbs) < sum(mb.num_tokens for mb in whole)
    assert ref["grad_norm"] > OPTIM.grad_clip  # the step is clipped
    assert sum(r[name]["num_micro_batches"] for r in results) > 0
    for rank, result in enumerate(results):
        got = result[name]
        assert max_param_error(got["params"], ref["params"]) < TOL, (name, rank)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), (name, rank)
        assert got["loss"] == pytest.approx(ref["loss"], abs=TOL), (name, rank)


@pytest.mark.parametrize("name", list(CASES_2))
def test_two_ranks_equal_the_single_process_reference(two_ranks, setup, name):
    _check(two_ranks, setup, CASES_2, name)


def test_data_parallel_ranks_share_the_micro_batches(two_ranks, setup):
    _, _, num_mbs = setup
    counts = [r["dp2"]["num_micro_batches"] for r in two_ranks]
    assert num_mbs >= 4 and 0 < counts[0] < num_mbs and sum(counts) == num_mbs
    assert all(r["dp2"]["total_micro_batches"] == num_mbs for r in two_ranks)
    assert [r["dp2-one-rank-idle"]["num_micro_batches"] for r in two_ranks] == [num_mbs, 0]


@pytest.mark.parametrize("name", list(CASES_4))
def test_tp2_x_dp2_equals_the_single_process_reference(four_ranks, setup, name):
    _check(four_ranks, setup, CASES_4, name)
