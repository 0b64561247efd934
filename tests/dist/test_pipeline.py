"""Pipeline-parallel TrainEngine (1F1B, interleaved, tp x pp) against the unsharded reference.

The reference (pytest process) is the hand-written per-sequence loss of tests/unit/engine/
reference.py on the unsharded model: its loss, every gradient by HF name and the log-probs of
every response token. Each spawned launch (one per world size) builds every case's engine,
runs forward (log-probs / values), forward_backward, gathers the full grads and the export,
steps, and for some cases saves and resumes a checkpoint. Every launch has a timeout, so a
deadlock fails the test instead of hanging it. The "-shared" cases give 3 samples to each
prompt and pack them with shared prompts (rlhf.data.packing); the reference packs nothing.
"""

import functools

import pytest
import torch

from rlhf.config.schema import ParallelConfig, TinyModelConfig
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.engine import TrainEngine, collect_response_values, make_micro_batches
from rlhf.parallel.launch import run_distributed
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from tests.unit.engine.reference import (OPTIM, SMALL, _sequence_outputs, actor_loss_fn,
                                         critic_loss_fn, exported, load_plain, make_batch,
                                         reference_loss)

TOL = 1e-5
BUCKET_BYTES = 40_000  # an embedding (98 kB) goes alone; a few layer matrices share one
CHECKPOINTED = {"pp2-vpp2-m3-tied", "tp2-pp2-sp-tied"}
SEED = 5
LAYERS = 4
MODELS = {"llama": ("llama", False), "qwen3-tied": ("qwen3", True), "qwen2-tied": ("qwen2", True),
          "gemma-tied": ("gemma", True)}
# case -> model, head, ParallelConfig kwargs, samples, max_seqs per micro-batch (sets m)
# [, samples per prompt: > 1 packs them with shared prompts]
CASES_2 = {
    "pp2-m1": ("llama", "lm", dict(pp=2), 6, 6),
    "pp2-m2-tied": ("qwen3-tied", "lm", dict(pp=2), 6, 3),
    "pp2-m6-critic": ("llama", "value", dict(pp=2), 6, 1),
    "pp2-uneven-m3": ("llama", "lm", dict(pp=2, layers_per_stage=(1, 3)), 6, 2),
    "pp2-vpp2-m4": ("llama", "lm", dict(pp=2, vpp=2), 8, 2),  # paired exchanges (Megatron)
    "pp2-vpp2-m3-tied": ("qwen3-tied", "lm", dict(pp=2, vpp=2), 6, 2),  # longer warmup
    "pp2-m2-shared": ("llama", "lm", dict(pp=2), 6, 3, 3),
    "pp2-vpp2-m3-gemma": ("gemma-tied", "lm", dict(pp=2, vpp=2), 6, 2),
}
CASES_4 = {
    "pp4-m2": ("llama", "lm", dict(pp=4), 6, 3),
    "pp4-m4-tied": ("qwen3-tied", "lm", dict(pp=4), 8, 2),
    "pp4-m7-critic": ("llama", "value", dict(pp=4), 7, 1),
    "tp2-pp2-sp-tied": ("qwen2-tied", "lm", dict(tp=2, pp=2, sequence_parallel=True), 6, 2),
    "tp2-pp2-critic": ("llama", "value", dict(tp=2, pp=2, sequence_parallel=True), 6, 1),
    "pp2-dp2": ("llama", "lm", dict(pp=2), 8, 2),
    "tp2-pp2-sp-shared": ("qwen2-tied", "lm", dict(tp=2, pp=2, sequence_parallel=True), 6, 3, 3),
    "tp2-pp2-sp-gemma": ("gemma-tied", "lm", dict(tp=2, pp=2, sequence_parallel=True), 6, 2),
}
# Also run untagged: the messages matched in posting order, as NCCL (which ignores tags) does.
UNTAGGED = "-untagged"
CASES_2 |= {name + UNTAGGED: CASES_2[name] for name in ("pp2-m2-tied", "pp2-vpp2-m4",
                                                        "pp2-vpp2-m3-tied")}
CASES_4 |= {name + UNTAGGED: CASES_4[name] for name in ("pp4-m4-tied", "tp2-pp2-sp-tied")}


def _folder(root, name):
    arch, tied = MODELS[name]
    cfg = TinyModelConfig(arch=arch, tie_embeddings=tied, **{**SMALL, "num_layers": LAYERS})
    return make_tiny_model(cfg, root / name)


def _spec(case):
    """(model, head, parallel kwargs, samples, max_seqs, samples per prompt) of a case."""
    return (*case, 1)[:6]


def _mbs(n, max_seqs, group=1):
    batch = make_batch(SEED, n=n, group=group)
    return make_micro_batches(batch.prompts, batch.responses, batch.per_token,
                              max_tokens=1000, max_seqs=max_seqs, share_prompts=group > 1)


def _engine(mesh, folder, head, parallel):
    return TrainEngine.from_pretrained(folder, mesh=mesh, parallel=parallel, head=head, optim=OPTIM,
                                       total_steps=10, device="cpu")


def _train_step(engine, local, head):
    tokens, _ = engine.loss_normalizers(local, mask_key="loss_mask")
    make_loss = actor_loss_fn if head == "lm" else critic_loss_fn
    metrics = engine.forward_backward(local, make_loss(tokens))
    return metrics, engine.step()


def _resumed(engine, mesh, folder, head, parallel, local, ckpt):
    """Save, load into a fresh engine, train one more step on both: the same weights."""
    engine.save_checkpoint(ckpt)
    restored = _engine(mesh, folder, head, parallel)
    restored.load_checkpoint(ckpt)
    for e in (engine, restored):
        _train_step(e, local, head)
    return exported(engine), exported(restored), restored.step_count


def _run_case(mesh, folder, head, parallel, n, max_seqs, group, ckpt=None, *, tagged=True):
    engine = _engine(mesh, folder, head, parallel)
    engine.schedule.tagged = tagged
    mbs = _mbs(n, max_seqs, group)
    local = mbs[mesh.dp_rank::mesh.dp_size]
    name = "log_probs" if head == "lm" else "values"
    outs = engine.forward(local, outputs=(name,))
    rows = collect_response_values([o[name] for o in outs], local) if outs else None
    weights = exported(engine)
    buckets = [[(name, t.numel() * t.element_size()) for name, t in bucket]
               for bucket in engine.export_hf_weights(bucket_bytes=BUCKET_BYTES)]
    tokens, _ = engine.loss_normalizers(local, mask_key="loss_mask")
    make_loss = actor_loss_fn if head == "lm" else critic_loss_fn
    metrics = engine.forward_backward(local, make_loss(tokens))
    grads = engine.full_grads()
    stats = engine.step()
    after = exported(engine)
    return {"buckets": buckets,
            "resumed": _resumed(engine, mesh, folder, head, parallel, local, ckpt) if ckpt else None,
            "stage": mesh.pp_rank, "dp": mesh.dp_rank, "num_local": len(local),
            "forward": None if rows is None else (rows.values, rows.lengths),
            "weights": weights, "grads": grads, "loss": metrics["loss"],
            "grad_norm": stats["grad_norm"], "peak": engine.schedule.peak_held,
            "after": after}


def _run_cases(rank, world_size, cases, folders, ckpt_root):
    cache = ProcessGroupCache()
    results = {}
    for name, case in cases.items():
        model, head, parallel_kw, n, max_seqs, group = _spec(case)
        parallel = ParallelConfig(**parallel_kw)
        mesh = ParallelMesh(list(range(world_size)), tp=parallel.tp, pp=parallel.pp, cache=cache)
        ckpt = f"{ckpt_root}/{name}" if name in CHECKPOINTED else None
        results[name] = _run_case(mesh, folders[model], head, parallel, n, max_seqs, group, ckpt,
                                  tagged=not name.endswith(UNTAGGED))
    return results


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    return {name: str(_folder(root, name)) for name in MODELS}


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("pipeline-ckpt"))


@functools.cache
def _reference(folder, head, n, group=1):
    model = load_plain(folder, head)
    batch = make_batch(SEED, n=n, group=group)
    loss = reference_loss(model, batch, head)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"loss": float(loss.detach()), "grads": grads, "grad_norm": float(norm), "weights": weights,
            "model": model, "batch": batch}


@pytest.fixture(scope="module")
def two_ranks(setup, ckpt_root):
    return run_distributed(_run_cases, 2, CASES_2, setup, ckpt_root, timeout_s=120)


@pytest.fixture(scope="module")
def four_ranks(setup, ckpt_root):
    return run_distributed(_run_cases, 4, CASES_4, setup, ckpt_root, timeout_s=150)


def _max_err(got, want):
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    return max(float((got[k].float() - want[k].float()).abs().max()) for k in want)


def _check(results, setup, cases, name):
    model, head, parallel_kw, n, max_seqs, group = _spec(cases[name])
    ref = _reference(setup[model], head, n, group)
    parallel = ParallelConfig(**parallel_kw)
    mbs = _mbs(n, max_seqs, group)
    m = len(mbs)
    assert (group > 1) == any(mb.packed.prefix is not None for mb in mbs)
    for rank, result in enumerate(results):
        got = result[name]
        assert got["loss"] == pytest.approx(ref["loss"], abs=TOL), (name, rank)
        assert _max_err(got["grads"], ref["grads"]) < TOL, (name, rank)
        assert _max_err(got["weights"], ref["weights"]) == 0.0, (name, rank)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), (name, rank)
        held_bound = parallel.pp - got["stage"] if parallel.vpp == 1 else m * parallel.vpp
        assert 1 <= got["peak"] <= min(held_bound, got["num_local"] * parallel.vpp), (name, rank)
        if got["stage"] == parallel.pp - 1:
            _check_forward(got, ref, head, rank_slice=slice(got["dp"], None, len(results) //
                                                            (parallel.pp * parallel.tp)), n=n,
                           max_seqs=max_seqs, group=group)
        else:
            assert got["forward"] is None
    # One step later every rank of every stage agrees on the weights (tied copies included).
    afters = [r[name]["after"] for r in results]
    assert all(_max_err(a, afters[0]) == 0.0 for a in afters)


def _check_forward(got, ref, head, *, rank_slice, n, max_seqs, group):
    """The last stage's forward rows equal the reference's per-sequence outputs."""
    mbs = _mbs(n, max_seqs, group)[rank_slice]
    ids = torch.cat([mb.sample_ids for mb in mbs]).sort().values.tolist()
    key = "log_probs" if head == "lm" else "values"
    batch = ref["batch"]
    with torch.no_grad():
        want = torch.cat([_sequence_outputs(ref["model"], batch.prompts[i], batch.responses[i],
                                            head)[key] for i in ids])
    values, lengths = got["forward"]
    assert lengths.tolist() == [int(batch.responses.lengths[i]) for i in ids]
    assert float((values - want).abs().max()) < TOL


@pytest.mark.parametrize("name", list(CASES_2))
def test_two_stages_equal_the_unsharded_reference(two_ranks, setup, name):
    _check(two_ranks, setup, CASES_2, name)


@pytest.mark.parametrize("name", list(CASES_4))
def test_four_ranks_equal_the_unsharded_reference(four_ranks, setup, name):
    _check(four_ranks, setup, CASES_4, name)


@pytest.mark.parametrize("name", sorted(CHECKPOINTED))
def test_checkpoints_resume_every_stage(two_ranks, four_ranks, name):
    results = two_ranks if name in CASES_2 else four_ranks
    for result in results:
        original, restored, step = result[name]["resumed"]
        assert step == 2 and _max_err(restored, original) == 0.0  # resumed at 1, stepped once
        assert _max_err(original, result[name]["after"]) > 0  # the extra step did change them


@pytest.mark.parametrize("name", ["pp2-m2-tied", "pp4-m2", "tp2-pp2-sp-tied"])
def test_export_is_bucketed_and_the_same_on_every_rank(two_ranks, four_ranks, setup, name):
    results = two_ranks if name in CASES_2 else four_ranks
    buckets = results[0][name]["buckets"]
    assert all(r[name]["buckets"] == buckets for r in results)
    names = [n for bucket in buckets for n, _ in bucket]
    assert len(names) == len(set(names))
    assert ("lm_head.weight" in names) == (name == "pp4-m2")  # a tied head is left out
    assert set(names) == set(results[0][name]["weights"])
    assert len(buckets) > 3
    assert all(len(b) == 1 or sum(size for _, size in b) <= BUCKET_BYTES for b in buckets)


def test_one_f_one_b_holds_at_most_pp_minus_stage_micro_batches(four_ranks):
    peaks = {r["pp4-m7-critic"]["stage"]: r["pp4-m7-critic"]["peak"] for r in four_ranks}
    assert peaks == {0: 4, 1: 3, 2: 2, 3: 1}
