"""Ulysses attention (all-to-all over heads) against the unsharded model, on 4 gloo ranks.

Each rank holds its cp shard of one pack (one long sequence and several short ones, lengths
never a multiple of 2 * cp, so every sequence has padding rows) and runs a tiny GQA Llama
(4 query heads, 2 KV heads) with `parallel.cp_attention=ulysses`: logits and next-token
log-probs of every real token, and the grads of a loss summed over the shards, must equal the
unsharded CausalLM's on the whole pack. Layouts: cp=2 (KV heads split), cp=4 (2 KV heads
copied to 2 ranks each) and cp=2 with tp=2 and sequence parallelism (1 KV head per tp rank,
copied; the local stream padded to a multiple of tp). The engine path (rank_stream picking
the layout from the built model) runs one forward at cp=2 against the cp=1 engine.
"""

import pytest
import torch
import torch.distributed as dist

from rlhf.config.schema import ParallelConfig, TinyModelConfig
from rlhf.data.packing import pack, shifted_targets
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.engine import TrainEngine, make_micro_batches
from rlhf.models.build import build_model
from rlhf.models.config import ModelArgs
from rlhf.models.export import gather_full_grads
from rlhf.models.hf_io import load_hf_weights
from rlhf.models.outputs import vocab_shard
from rlhf.models.transformer import CausalLM
from rlhf.models.varlen_layout import ContextHeads, ulysses_layout, varlen_layout
from rlhf.parallel import collectives as C
from rlhf.parallel.context_parallel import gather_tokens, plan_context_shard, shard_tokens
from rlhf.parallel.launch import run_distributed
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from rlhf.parallel.vocab_parallel import vocab_parallel_log_probs_entropy

TOL = 1e-5
SMALL = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96,
             max_position_embeddings=64, vocab_size=384)
LENGTHS = [45, 3, 1, 7, 2, 10]  # one long sequence, several short; 68 tokens
LAYOUTS = [(2, 1), (4, 1), (2, 2)]  # (cp, tp); tp=2 with sequence parallelism


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    folder = str(make_tiny_model(TinyModelConfig(arch="llama", tie_embeddings=False, seed=5,
                                                 **SMALL), tmp_path_factory.mktemp("ulysses")))
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, SMALL["vocab_size"] - 1, (n,), generator=gen) for n in LENGTHS]
    model = CausalLM(ModelArgs.from_pretrained(folder))
    load_hf_weights(model, folder)
    packed = pack(seqs)
    logits_TV = model(packed.tokens, packed.position_ids, packed.cu_seqlens, packed.max_seqlen)
    targets_T, valid_T = shifted_targets(packed)
    log_probs_T = torch.log_softmax(logits_TV, -1).gather(-1, targets_T[:, None])[:, 0] * valid_T
    w_T = torch.randn(valid_T.numel(), generator=gen)
    (w_T * log_probs_T).sum().backward()
    ref = dict(logits=logits_TV.detach(), log_probs=log_probs_T.detach(), w=w_T,
               grads={n: torch.clone(p.grad) for n, p in model.named_parameters()
                      if p.grad is not None})
    return dict(folder=folder, seqs=seqs, ref=ref)


def _check(case, mesh):
    """Max abs error of logits, log-probs and grads on this rank at one (cp, tp) layout."""
    tp, ref, group = mesh.tp_size, case["ref"], mesh.cp_group
    parallel = ParallelConfig(tp=tp, cp=mesh.cp_size, sequence_parallel=tp > 1,
                              cp_attention="ulysses")
    built = build_model(case["folder"], mesh=mesh, head="lm", parallel=parallel)
    model = built.model
    assert isinstance(model, CausalLM)
    packed = pack(case["seqs"])
    shard = plan_context_shard(packed.seq_lens.tolist(), cp=mesh.cp_size, rank=mesh.cp_rank,
                               multiple=tp)
    layout = ulysses_layout(shard, varlen_layout(packed.cu_seqlens, None), None, group=group,
                            device="cpu")
    assert isinstance(layout.context, ContextHeads)
    logits = model(shard_tokens(packed.tokens, shard), shard.positions,
                   torch.tensor(shard.query_bounds, dtype=torch.int32), shard.max_query,
                   layout=layout)
    vocab = vocab_shard(model, mesh)
    real = shard.holds_token
    full_vocab = C.all_gather(logits.detach(), dim=-1,
                              group=vocab["group"])[:, :vocab["real_vocab_size"]]
    errors = {"logits": (full_vocab[real] - ref["logits"][shard.source[real]]).abs().max().item(),
              "padding_rows": int((~real).sum())}
    targets_T, valid_T = shifted_targets(packed)
    log_probs, _ = vocab_parallel_log_probs_entropy(
        logits, shard_tokens(targets_T, shard), **vocab, temperature=1.0)
    log_probs = log_probs.masked_fill(~shard_tokens(valid_T, shard, fill=False), 0.0)
    errors["log_probs"] = (gather_tokens(log_probs.detach(), shard, group=group)
                           - ref["log_probs"]).abs().max().item()
    (shard_tokens(ref["w"], shard) * log_probs).sum().div(mesh.dp_size).backward()
    for entry, param in zip(built.table, model.parameters()):
        dist.all_reduce(param.grad, group=mesh.dp_cp_group)
        if entry.tp_partial_grad:
            dist.all_reduce(param.grad, group=mesh.tp_group)
    grads = gather_full_grads(model, built.table, mesh)
    assert grads.keys() == ref["grads"].keys()
    errors["grads"] = max((grads[n] - ref["grads"][n]).abs().max().item() for n in grads)
    return errors


def _engine_log_probs(case, mesh, parallel):
    """Log-probs of one forward of a TrainEngine (rank_stream's path) over the pack's
    micro-batches."""
    engine = TrainEngine.from_pretrained(case["folder"], mesh=mesh, parallel=parallel)
    seqs = [s for s in case["seqs"] if len(s) > 1]  # a prompt token and a response
    mbs = make_micro_batches([s[:1] for s in seqs], [s[1:] for s in seqs], {},
                             max_tokens=max(LENGTHS))
    return [out["log_probs"] for out in engine.forward(mbs, outputs=("log_probs",))]


def _matrix(rank, world, case):
    cache = ProcessGroupCache()
    results = {}
    for cp, tp in LAYOUTS:
        results[cp, tp] = _check(case, ParallelMesh(list(range(world)), cp=cp, tp=tp,
                                                    cache=cache))
    mesh = ParallelMesh(list(range(world)), cp=2, cache=cache)
    results["engine"] = _engine_log_probs(case, mesh, ParallelConfig(cp=2,
                                                                     cp_attention="ulysses"))
    results["engine_ref"] = _engine_log_probs(
        case, ParallelMesh(list(range(world)), cache=cache), ParallelConfig())
    return results


@pytest.fixture(scope="module")
def matrix(case):
    return run_distributed(_matrix, 4, case, timeout_s=120)


@pytest.mark.parametrize("cp,tp", LAYOUTS, ids=[f"cp{cp}-tp{tp}" for cp, tp in LAYOUTS])
def test_ulysses_matches_the_unsharded_model(matrix, cp, tp):
    for rank, results in enumerate(matrix):
        errors = results[cp, tp]
        for check in ("logits", "log_probs", "grads"):
            assert errors[check] < TOL, (rank, check, errors)
        assert errors["padding_rows"] > 0  # the pads must not have changed any real token


def test_the_engine_runs_ulysses_from_its_config(matrix):
    for results in matrix:
        got, want = results["engine"], results["engine_ref"]
        assert len(got) == len(want) > 0
        for g, w in zip(got, want):
            assert (g - w).abs().max().item() < TOL
