"""LoRA under TP, SP, PP, interleaved PP, recompute and ZeRO-1 against unsharded references.

References (pytest process, one tiny qwen2 with tied embeddings and q/k/v biases, 4 layers):
the merged model (W + scaling B A) for the forward outputs, and the unsharded LoRA model for
the loss, the adapter grads and one AdamW step over the adapters (torch's AdamW after
clip_grad_norm_). One 4-rank launch builds every layout with `build_model(lora=...)`, loads the
same full adapter (B non-zero) as slices, and checks: the initial adapter is the unsharded one
sliced, full logits (pp = 1) and log-probs equal the merged model's, grads and the stepped
adapter equal the references, the base gets no grad, and the optimizer holds adapter state only.
"""

import pytest
import torch

from rlhf.config.schema import LoraConfig, OptimizerConfig, ParallelConfig, TinyModelConfig
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.engine import TrainEngine, collect_response_values, make_micro_batches
from rlhf.models import lora as L
from rlhf.models.build import build_model
from rlhf.models.outputs import forward_packed, vocab_shard
from rlhf.parallel import collectives as C
from rlhf.parallel.launch import run_distributed
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from rlhf.parallel.tensor_parallel import shard_for_rank
from tests.unit.engine.reference import (SMALL, _sequence_outputs, actor_loss_fn, load_plain,
                                         make_batch, reference_loss)

TOL = 1e-5
SEED = 5
LORA = LoraConfig(r=4, lora_alpha=8.0)
OPTIM = OptimizerConfig(lr=1e-2, weight_decay=0.1, eps=1e-3, grad_clip=0.05)
N, MAX_SEQS = 8, 2
# case -> (ParallelConfig kwargs, recompute, ZeRO-1 (optim.distributed))
CASES = {
    "tp2": (dict(tp=2), "none", None),
    "tp2-sp-recompute": (dict(tp=2, sequence_parallel=True), "full", None),
    "pp2": (dict(pp=2), "none", None),
    "pp2-vpp2-recompute": (dict(pp=2, vpp=2), "attention_block", None),
    "tp2-pp2-sp": (dict(tp=2, pp=2, sequence_parallel=True), "none", None),
    "dp4-zero1": (dict(), "none", True),
    "dp4-replicated": (dict(), "none", False),
}


def _mbs():
    batch = make_batch(SEED, n=N)
    return make_micro_batches(batch.prompts, batch.responses, batch.per_token, max_tokens=1000,
                              max_seqs=MAX_SEQS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    spec = TinyModelConfig(arch="qwen2", tie_embeddings=True, **{**SMALL, "num_layers": 4})
    folder = make_tiny_model(spec, tmp_path_factory.mktemp("lora") / "qwen2")
    init = load_plain(folder)
    L.apply_lora(init, LORA, seed=0)  # build_model's seed (value_head_seed)
    initial = {n: p.detach().clone() for n, p in init.named_parameters() if p.requires_grad}
    model = load_plain(folder)
    L.apply_lora(model, LORA, seed=11)
    gen = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for _, m in L.lora_modules(model):
            m.lora_B.weight.normal_(0.0, 0.05, generator=gen)
    adapter = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    merged = load_plain(folder)
    merged.load_state_dict(L.merged_weights(model.state_dict(), lora=LORA))
    batch = make_batch(SEED, n=N)
    with torch.no_grad():
        log_probs = [_sequence_outputs(merged, batch.prompts[i], batch.responses[i], "lm")
                     ["log_probs"] for i in range(N)]
        mbs = _mbs()
        logits = [merged(mb.packed.tokens, mb.packed.position_ids, mb.packed.cu_seqlens,
                         mb.packed.max_seqlen) for mb in mbs]
    loss = reference_loss(model, batch, "lm")
    loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    torch.nn.utils.clip_grad_norm_(params, OPTIM.grad_clip)
    opt = torch.optim.AdamW(params, lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps,
                            weight_decay=OPTIM.weight_decay)
    opt.step()
    stepped = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return dict(folder=str(folder), initial=initial, adapter=adapter, log_probs=log_probs,
                logits=logits, loss=float(loss.detach()), grads=grads, stepped=stepped)


def _max_err(got, want):
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    return max(float((got[k].float() - want[k].float()).abs().max()) for k in want)


def _local(table, full, mesh):
    """This rank's slices of full adapter tensors, by parameter name."""
    out = {}
    for e in table:
        if L.is_lora_param(e.name):
            t = full[e.name]
            out[e.name] = t if e.shard is None else shard_for_rank(t, e.shard.dim, mesh.tp_rank,
                                                                  mesh.tp_size)
    return out


def _run_case(mesh, ref, parallel, recompute, distributed):
    e = {}
    built = build_model(ref["folder"], mesh=mesh, parallel=parallel, head="lm", lora=LORA)
    params = dict(built.model.named_parameters())
    e["init"] = max(float((params[n].detach() - t).abs().max())
                    for n, t in _local(built.table, ref["initial"], mesh).items())
    with torch.no_grad():
        for n, t in _local(built.table, ref["adapter"], mesh).items():
            params[n].copy_(t)
    optim = OptimizerConfig(**{**OPTIM.__dict__, "distributed": distributed})
    engine = TrainEngine(built, mesh, optim=optim, total_steps=10, recompute=recompute)
    local = _mbs()[mesh.dp_rank::mesh.dp_size]
    if mesh.pp_size == 1:  # the full-vocabulary logits of each micro-batch
        shard = vocab_shard(engine.model, mesh)
        with torch.no_grad():
            e["logits"] = max(float((C.all_gather(forward_packed(
                engine.model, mb.packed, mesh=mesh, tp=engine.tp), dim=-1, group=shard["group"])
                [:, :shard["real_vocab_size"]] - ref["logits"][mesh.dp_rank + k * mesh.dp_size])
                .abs().max()) for k, mb in enumerate(local))
    outs = engine.forward(local, outputs=("log_probs",))
    if outs:  # the last stage
        rows = collect_response_values([o["log_probs"] for o in outs], local)
        ids = torch.cat([mb.sample_ids for mb in local]).sort().values.tolist()
        e["log_probs"] = float((rows.values - torch.cat([ref["log_probs"][i] for i in ids]))
                               .abs().max())
    tokens, _ = engine.loss_normalizers(local, mask_key="loss_mask")
    e["loss"] = abs(engine.forward_backward(local, actor_loss_fn(tokens))["loss"] - ref["loss"])
    e["base_grads"] = sum(p.grad is not None for p in engine.model.parameters())
    e["grads"] = _max_err(engine.full_grads(), ref["grads"])
    adapter_numel = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
    shards = mesh.dp_size if engine.distributed else 1
    e["state_is_adapters"] = (engine.grads.flat.numel() >= adapter_numel
                              and engine.grads.flat.numel() < adapter_numel + 64 * shards
                              and engine.optimizer.exp_avg.numel() * shards
                              == engine.grads.flat.numel())
    engine.step()
    weights = {n: t for bucket in engine.export_hf_weights(bucket_bytes=1 << 20)
               for n, t in bucket if L.is_lora_param(n)}
    e["stepped"] = _max_err(weights, ref["stepped"])
    return e, weights


def _run_all(rank, world, ref):
    cache = ProcessGroupCache()
    results, weights = {}, {}
    for name, (kw, recompute, distributed) in CASES.items():
        parallel = ParallelConfig(**kw)
        mesh = ParallelMesh(list(range(world)), tp=parallel.tp, pp=parallel.pp, cache=cache)
        results[name], weights[name] = _run_case(mesh, ref, parallel, recompute, distributed)
    zero, plain = weights["dp4-zero1"], weights["dp4-replicated"]
    results["zero1_vs_replicated"] = _max_err(zero, plain)
    return results


@pytest.fixture(scope="module")
def four_ranks(reference):
    return run_distributed(_run_all, 4, reference, timeout_s=180)


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_lora_equals_the_merged_model_and_the_unsharded_adapter(four_ranks, name):
    pp = CASES[name][0].get("pp", 1)
    last = [r[name] for r in four_ranks if "log_probs" in r[name]]
    assert len(last) == 4 // pp  # every rank of the last stage checked its forward rows
    for rank, e in enumerate(four_ranks):
        e = e[name]
        assert e["init"] == 0.0, (name, rank, e)  # the unsharded init, sliced
        for check in ("logits", "log_probs", "loss", "grads", "stepped"):
            assert e.get(check, 0.0) < TOL, (check, name, rank, e)
        assert ("logits" in e) == (pp == 1)
        assert e["base_grads"] == 0 and e["state_is_adapters"], (name, rank, e)


def test_zero1_over_adapters_equals_the_replicated_optimizer(four_ranks):
    assert all(r["zero1_vs_replicated"] < 1e-7 for r in four_ranks)
