"""TrainEngine at cp > 1 against the single-process reference step, on 4 gloo ranks in one launch.

Each dp replica's cp ranks receive the same micro-batches (whole packs) and run their shards;
the loss, the grad norm (clipping active) and every parameter after one AdamW step must equal
the hand-written unsharded reference (tests/unit/engine/reference.py), and the full synced
grads and the per-token outputs of a forward pass (log-probs, entropy, values) must equal a
cp=1 (dp=4) engine's on the same micro-batches. Cases: cp=2 alone (dp=2), cp=4 on Qwen2
(2 KV heads), cp=2 with tp=2 and sequence parallelism on Qwen2 (qkv biases, tied embeddings),
a critic at cp=2, and cp=2 with a two-stage pipeline, 1F1B and interleaved (vpp=2, a 4-layer
Llama); with `cp_attention=ulysses`, cp=4 on Qwen2 (each KV head copied to 2 ranks) and cp=2
with a two-stage pipeline (the schedules pass the method to every stage's stream). The
"-shared" cases pack a batch of 4 prompts x 3 samples with shared prompts (the default of every
role): the actor and the critic at cp=2, and the actor at cp=2 with Ulysses, against the
reference step on the same samples and a cp=1 engine on the same shared packs.

Qwen3-MoE (4 experts, top-2) at cp=2 (dp=2) and cp=2 x ep=2 trains with the router aux loss
on; its reference is the cp=1 (dp=4) engine's step on the same micro-batches (loss, aux loss,
grad norm, synced grads, updated params). Its routes are recorded at cp=2 and must be the cp=1
engine's; replayed, they give the recorded log-probs, and other forced routes give the cp=1
engine's log-probs under the same forcing. The cp=2 x ep=2 engine then saves a checkpoint
(the experts' ZeRO-1 state split over edp x cp) and resumes from it, at cp=2 x ep=2 and at cp=1.
"""

import dataclasses
from pathlib import Path

import pytest
import torch

from rlhf.config.schema import ParallelConfig, TinyModelConfig
from rlhf.data.routes import ROUTES
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
    "cp2-shared": ("llama", "lm", ParallelConfig(cp=2)),
    "cp2-critic-shared": ("llama", "value", ParallelConfig(cp=2)),
    "cp4-ulysses": ("qwen2", "lm", ParallelConfig(cp=4, cp_attention="ulysses")),
    "cp2-pp2-ulysses": ("llama", "lm", ParallelConfig(cp=2, pp=2, cp_attention="ulysses")),
    "cp2-ulysses-shared": ("llama", "lm", ParallelConfig(cp=2, cp_attention="ulysses")),
    "moe-cp2": ("moe", "lm", ParallelConfig(cp=2)),
    "moe-cp2-ep2": ("moe", "lm", ParallelConfig(cp=2, ep=2)),
}
MODELS = {"llama": ("llama", False), "qwen2": ("qwen2", True), "llama4": ("llama", False)}
MOE = TinyModelConfig(arch="qwen3_moe", tie_embeddings=False, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, **SMALL)
COEF = 0.5  # the router aux loss's weight: large, so its share of the router grads shows
REPLAYED = ("log_probs", ROUTES)
CHECKPOINTED = "moe-cp2-ep2"  # saved after its step (experts' ZeRO-1 over edp x cp), resumed
SHARED_SAMPLES, GROUP = 12, 3  # the shared cases' batch: 4 prompts x 3 samples


def _shared(name: str) -> bool:
    return name.endswith("-shared")


def _batch(shared: bool = False):
    return (make_batch(BATCH_SEED, n=SHARED_SAMPLES, group=GROUP) if shared
            else make_batch(BATCH_SEED, n=N_SAMPLES))


def _micro_batches(shared: bool = False):
    batch = _batch(shared)
    return make_micro_batches(batch.prompts, batch.responses, batch.per_token,
                              max_tokens=MAX_TOKENS, share_prompts=shared)


def _update(engine, mbs, mesh, head):
    """forward_backward's arguments: this dp replica's micro-batches (the cp ranks of a
    replica get the same packs) and the loss over the global token count."""
    local = mbs[mesh.dp_rank::mesh.dp_size]
    tokens, _ = engine.loss_normalizers(local, mask_key="loss_mask")
    return local, (actor_loss_fn if head == "lm" else critic_loss_fn)(tokens)


def _forced(mbs, routes):
    """`mbs` with `routes` (one (T, layers, top_k) tensor per micro-batch) forced."""
    return [dataclasses.replace(mb, tensors={**mb.tensors, ROUTES: r})
            for mb, r in zip(mbs, routes)]


def _errors(outs, refs):
    return max((max((out[k] - ref[k]).abs().max().item() for k in ref if k != ROUTES)
                for out, ref in zip(outs, refs)), default=None)


def _second_steps(engine, folders, mbs, cache):
    """Save `engine` after its first step; the params after a second step of it, of a fresh
    engine of its layout loading the save, and of one at cp=1 (dp=4, ep=2) loading it."""
    engine.save_checkpoint(folders["checkpoint"])

    def second(e):
        e.forward_backward(*_update(e, mbs, e.mesh, "lm"))
        e.step()
        return exported(e)

    out = {"uninterrupted": second(engine)}
    for key, cp in (("resumed", 2), ("resumed_cp1", 1)):
        parallel = ParallelConfig(cp=cp, ep=2)
        mesh = ParallelMesh(list(range(4)), cp=cp, ep=2, cache=cache)
        fresh = TrainEngine.from_pretrained(folders["moe"], mesh=mesh, parallel=parallel,
                                            optim=OPTIM, total_steps=10, device="cpu",
                                            router_aux_loss_coef=COEF)
        fresh.load_checkpoint(folders["checkpoint"])
        out[key] = second(fresh)
    return out


def _run(rank, world_size, folders):
    cache = ProcessGroupCache()
    # cp=1, dp=4: forwards of every micro-batch, synced grads; for the MoE model also its
    # routes, a forward under other forced routes, and its step (the MoE cases' reference)
    plain, plain_grads, plain_moe = {}, {}, {}
    for model, head, shared in sorted({(model, head, _shared(name))
                                       for name, (model, head, _) in CASES.items()}):
        mesh = ParallelMesh(list(range(world_size)), cache=cache)
        moe, mbs = model == "moe", _micro_batches(shared)
        engine = TrainEngine.from_pretrained(folders[model], mesh=mesh, head=head, optim=OPTIM,
                                             total_steps=10, device="cpu",
                                             router_aux_loss_coef=COEF if moe else None)
        plain[model, head, shared] = engine.forward(
            mbs, outputs=("log_probs", "entropy", ROUTES) if moe else None)
        if moe:  # other experts than the free choice: (e + 1) mod E stays top-k distinct
            other = [(out[ROUTES] + 1) % MOE.num_experts for out in plain[model, head, shared]]
            plain_moe["other"] = other
            plain_moe["forced"] = engine.forward(_forced(mbs, other), outputs=REPLAYED)
        metrics = engine.forward_backward(*_update(engine, mbs, mesh, head))
        plain_grads[model, head, shared] = engine.full_grads()
        if moe:
            stats = engine.step()
            plain_moe["step"] = {"params": exported(engine), "grad_norm": stats["grad_norm"],
                                 "loss": metrics["loss"],
                                 "router_aux_loss": metrics["router_aux_loss"]}
    results = {}
    for name, (model, head, parallel) in CASES.items():
        mesh = ParallelMesh(list(range(world_size)), tp=parallel.tp, pp=parallel.pp,
                            cp=parallel.cp, ep=parallel.ep, cache=cache)
        moe, shared, mbs = model == "moe", _shared(name), _micro_batches(_shared(name))
        engine = TrainEngine.from_pretrained(folders[model], mesh=mesh, parallel=parallel,
                                             head=head, optim=OPTIM, total_steps=10, device="cpu",
                                             router_aux_loss_coef=COEF if moe else None)
        outs = engine.forward(mbs, outputs=("log_probs", "entropy", ROUTES) if moe else None)
        result = {"output_error": _errors(outs, plain[model, head, shared])}
        if moe:
            result["routes_equal"] = all(torch.equal(out[ROUTES], ref[ROUTES])
                                         for out, ref in zip(outs, plain[model, head, shared]))
            replayed = engine.forward(_forced(mbs, [out[ROUTES] for out in outs]),
                                      outputs=REPLAYED)
            result["replay_error"] = _errors(replayed, [{"log_probs": o["log_probs"]}
                                                        for o in outs])
            forced = engine.forward(_forced(mbs, plain_moe["other"]), outputs=REPLAYED)
            result["forced_error"] = _errors(forced, plain_moe["forced"])
            result["forced_moves"] = _errors(forced, [{"log_probs": o["log_probs"]}
                                                      for o in outs])
            result["reference"] = plain_moe["step"]
        metrics = engine.forward_backward(*_update(engine, mbs, mesh, head))
        grads = engine.full_grads()  # reads the synced buffer, leaves it for the step
        grad_error = max((grads[n] - g).abs().max().item()
                         for n, g in plain_grads[model, head, shared].items())
        stats = engine.step()
        results[name] = {**result, "params": exported(engine), "grad_norm": stats["grad_norm"],
                         "loss": metrics["loss"], "grad_error": grad_error,
                         "router_aux_loss": metrics.get("router_aux_loss"),
                         "num_outputs": len(outs), "cp_rank": mesh.cp_rank}
        if name == CHECKPOINTED:
            results[name]["second"] = _second_steps(engine, folders, mbs, cache)
    return results


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-cp")
    folders = {name: str(tiny_folder(root, arch=arch, tied=tied))
               for name, (arch, tied) in MODELS.items() if name != "llama4"}
    folders["llama4"] = str(make_tiny_model(
        TinyModelConfig(arch="llama", tie_embeddings=False, **{**SMALL, "num_layers": 4}),
        root / "llama4"))
    folders["moe"] = str(make_tiny_model(MOE, root / "moe"))
    folders["checkpoint"] = str(root / "checkpoint")
    refs = {(model, head, _shared(name)): reference_step(Path(folders[model]),
                                                         _batch(_shared(name)), head=head)
            for name, (model, head, _) in CASES.items() if model != "moe"}
    return folders, refs


@pytest.fixture(scope="module")
def four_ranks(setup):
    folders, _ = setup
    return run_distributed(_run, 4, folders, timeout_s=150)


DENSE = [name for name, (model, _, _) in CASES.items() if model != "moe"]


@pytest.mark.parametrize("name", DENSE)
def test_cp_engine_equals_the_single_process_reference(four_ranks, setup, name):
    _, refs = setup
    model, head, parallel = CASES[name]
    ref = refs[model, head, _shared(name)]
    if _shared(name):  # the packs did share: fewer tokens than the same samples packed whole
        mbs = _micro_batches(shared=True)
        assert any(mb.packed.prefix is not None for mb in mbs)
        assert sum(mb.num_tokens for mb in mbs) < sum(
            mb.num_tokens for mb in make_micro_batches(
                _batch(True).prompts, _batch(True).responses, max_tokens=MAX_TOKENS))
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


@pytest.mark.parametrize("name", [name for name in CASES if name not in DENSE])
def test_cp_moe_engine_equals_the_cp1_engine(four_ranks, name):
    for rank, result in enumerate(four_ranks):
        got = result[name]
        ref = got["reference"]  # the cp=1, dp=4 engine's step, taken on this rank
        assert ref["grad_norm"] > OPTIM.grad_clip  # the step is clipped
        assert ref["router_aux_loss"] > 0.5  # the aux loss is on: E * sum f * P >= 1 / top_k
        assert got["router_aux_loss"] == pytest.approx(ref["router_aux_loss"], abs=TOL)
        assert got["loss"] == pytest.approx(ref["loss"], abs=TOL), (name, rank)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), (name, rank)
        assert got["grad_error"] < 1e-6, (name, rank, got["grad_error"])
        assert max_param_error(got["params"], ref["params"]) < TOL, (name, rank)
        # routing replay on cp shards: the pack's routes, fed back, and other forced routes
        assert got["output_error"] < 1e-5 and got["routes_equal"], (name, rank)
        assert got["replay_error"] < 1e-6, (name, rank)
        assert got["forced_error"] < 1e-5 < got["forced_moves"], (name, rank)


def test_a_cp2_ep2_checkpoint_resumes_exactly_and_at_cp1(four_ranks):
    """The experts' optimizer state, ZeRO-1 split over edp x cp, saves and loads: the resumed
    engine's second step is the uninterrupted one's, at cp=2 x ep=2 and at cp=1 (dp=4)."""
    for rank, result in enumerate(four_ranks):
        second = result[CHECKPOINTED]["second"]
        assert max_param_error(second["resumed"], second["uninterrupted"]) == 0.0, rank
        assert max_param_error(second["resumed_cp1"], second["uninterrupted"]) < TOL, rank
        assert max_param_error(second["uninterrupted"], result[CHECKPOINTED]["params"]) > TOL


def test_the_packs_are_sharded_not_replicated():
    """A cp rank's stream is half the pack plus per-sequence padding, not the whole pack."""
    for mb in _micro_batches():
        lens = mb.packed.seq_lens.tolist()
        local = plan_context_shard(lens, cp=2, rank=0).num_local
        assert local == sum(-(-n // 4) * 2 for n in lens) < mb.num_tokens
        assert torch.equal(mb.packed.seq_lens.sum(), torch.tensor(mb.num_tokens))
