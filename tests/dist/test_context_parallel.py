"""Context parallelism against the unsharded model, on 4 gloo ranks in one launch.

Each rank holds its cp shard of one pack (a long sequence and several short ones, lengths
never a multiple of 2 * cp) and runs the model with keys and values gathered over its cp
group. Logits, next-token log-probs and entropy of every real token, the grads of a loss
summed over the shards, and the critic's values and their grads must equal our unsharded
CausalLM's and ValueModel's on the whole pack (computed here, in the pytest process):
- cp=2 and cp=4 alone (dp takes the other ranks) and cp=2 with tp=2 and sequence
  parallelism, on tiny Llama and Qwen2 (qkv biases), both with 2 KV heads (< cp=4);
- a tiny Qwen3-MoE at cp=2 with ep=2 (its tokens reach their experts by all-to-all over the
  ep group of their cp rank; every dp replica runs the whole pack with 1/dp of the loss);
- Llama at cp=2 with a two-stage pipeline (the stages of one cp rank pass its shard's
  hidden states and their grads);
- Llama on a GRPO-like pack with shared prompts (several prompts x n samples, one long
  response) at cp=2, cp=4 and cp=2 with tp=2 and sequence parallelism: its reference is the
  unsharded model on the same samples packed whole (each shared-pack token's row of it), and
  a cp=1 forward of the shared pack must match that reference too.
"""

import pytest
import torch
import torch.distributed as dist

from rlhf.config.schema import ParallelConfig, TinyModelConfig
from rlhf.data.packing import pack, pack_prompt_response, shifted_targets
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.models.build import build_model
from rlhf.models.config import ModelArgs
from rlhf.models.export import gather_full_grads
from rlhf.models.hf_io import load_hf_weights
from rlhf.models.outputs import vocab_shard
from rlhf.models.transformer import CausalLM, ValueModel
from rlhf.models.varlen_layout import context_layout
from rlhf.parallel import collectives as C
from rlhf.parallel.context_parallel import (
    gather_tokens,
    plan_context_shard,
    shard_tokens,
)
from rlhf.parallel.launch import run_distributed
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from rlhf.parallel.vocab_parallel import vocab_parallel_log_probs_entropy
from tests.unit.data.test_shared_prompts import grouped

TOL = 1e-5
SMALL = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96,
             max_position_embeddings=64, vocab_size=384)
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32)
MODELS = {"llama": dict(arch="llama", tie_embeddings=False),
          "qwen2": dict(arch="qwen2", tie_embeddings=True),
          "qwen3_moe": dict(arch="qwen3_moe", tie_embeddings=False, **MOE)}
LENGTHS = [45, 3, 1, 7, 2, 10]  # one long sequence, several short; 68 tokens
DENSE = [(2, 1, 1), (4, 1, 1), (2, 2, 1)]  # (cp, tp, ep); tp=2 with sequence parallelism
# (prompt length, response lengths) of the shared-prompts pack: runs of n samples, one long
# response, an empty one, a 1-token prompt (nothing to share)
GRPO = [(6, [3, 40, 1, 0]), (9, [5, 2, 6]), (1, [2, 2]), (5, [12, 3])]
LAYOUTS = {"llama": DENSE, "qwen2": DENSE, "qwen3_moe": [(2, 1, 2)], "shared": DENSE}
CASES = [(name, *layout) for name, layouts in LAYOUTS.items() for layout in layouts]


def _loss_terms(log_probs_T, entropy_T, valid_T, real_T, w1_T, w2_T, num_valid, num_tokens):
    """A weighted mix of log-probs and entropies; summed over shards it is the whole loss."""
    return ((w1_T * log_probs_T * valid_T).sum() / num_valid
            + (w2_T * entropy_T * real_T).sum() / num_tokens)


def _reference(folder, packed, whole):
    """The unsharded models on the `whole` pack, read at the row of every token of `packed`
    (the same pack, or its shared-prompts packing), the loss's grads of those rows."""
    model = CausalLM(ModelArgs.from_pretrained(folder))
    load_hf_weights(model, folder)
    seq_T = torch.repeat_interleave(torch.arange(packed.num_seqs), packed.seq_lens)
    rows = whole.cu_seqlens.long()[seq_T] + packed.position_ids  # positions count the prompt
    logits_WV = model(whole.tokens, whole.position_ids, whole.cu_seqlens, whole.max_seqlen)
    targets_W, _ = shifted_targets(whole)
    _, valid_T = shifted_targets(packed)
    logp_WV = torch.log_softmax(logits_WV, -1)
    log_probs_T = logp_WV.gather(-1, targets_W[:, None])[:, 0][rows] * valid_T
    entropy_T = -(logp_WV.exp() * logp_WV).sum(-1)[rows]
    gen = torch.Generator().manual_seed(3)
    w1_T, w2_T = (torch.randn(valid_T.numel(), generator=gen) for _ in range(2))
    _loss_terms(log_probs_T, entropy_T, valid_T, torch.ones_like(valid_T), w1_T, w2_T,
                valid_T.sum(), valid_T.numel()).backward()
    critic = ValueModel(ModelArgs.from_pretrained(folder))
    load_hf_weights(critic, folder, value_head_seed=7)
    values_T = critic(whole.tokens, whole.position_ids, whole.cu_seqlens, whole.max_seqlen)[rows]
    ((w1_T * values_T).sum() / valid_T.numel()).backward()  # grads ~1: fp32 error ~1e-7
    return dict(logits=logits_WV.detach()[rows], log_probs=log_probs_T.detach(),
                entropy=entropy_T.detach(), w1=w1_T, w2=w2_T,
                grads={n: p.grad.clone() for n, p in model.named_parameters()},
                values=values_T.detach(),
                value_grads={n: p.grad.clone() for n, p in critic.named_parameters()})


def _grpo_packs():
    """The GRPO-like samples packed with shared prompts, and whole."""
    prompts, responses = grouped(GRPO, seed=1)
    return (pack_prompt_response(prompts, responses, share_prompts=True),
            pack_prompt_response(prompts, responses))


def _plan(packed, mesh, *, multiple=1):
    """This rank's cp shard of `packed`, its shared prompts' runs included."""
    prefix = packed.prefix
    return plan_context_shard(packed.seq_lens.tolist(), cp=mesh.cp_size, rank=mesh.cp_rank,
                              multiple=multiple,
                              prefix_starts=None if prefix is None else prefix.starts.tolist(),
                              prefix_lens=None if prefix is None else prefix.lens.tolist())


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_models")
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, SMALL["vocab_size"] - 1, (n,), generator=gen) for n in LENGTHS]
    out = {}
    for index, (name, kw) in enumerate(MODELS.items()):
        folder = str(make_tiny_model(TinyModelConfig(seed=index, **kw, **SMALL), root / name))
        packed = pack(seqs)
        out[name] = dict(folder=folder, packed=packed, ref=_reference(folder, packed, packed))
    shared, whole = _grpo_packs()
    assert shared.prefix is not None and shared.tokens.shape[0] < whole.tokens.shape[0]
    out["shared"] = dict(folder=out["llama"]["folder"], packed=shared,
                         ref=_reference(out["llama"]["folder"], shared, whole))
    return out


def _check(case, mesh):
    """Max abs error of every check of one model on one cp layout, on this rank."""
    tp, dp = mesh.tp_size, mesh.dp_size
    built = build_model(case["folder"], mesh=mesh, head="lm", parallel=ParallelConfig(
        tp=tp, sequence_parallel=tp > 1, ep=mesh.ep_size))
    model, ref, group = built.model, case["ref"], mesh.cp_group
    packed = case["packed"]
    shard = _plan(packed, mesh, multiple=tp)
    layout = context_layout(shard, group=group, device="cpu")
    logits_local = model(shard_tokens(packed.tokens, shard), shard.positions,
                         torch.tensor(shard.query_bounds, dtype=torch.int32), shard.max_query,
                         layout=layout)
    vocab = vocab_shard(model, mesh)
    real = shard.source >= 0
    errors = {}
    full_vocab = C.all_gather(logits_local.detach(), dim=-1,
                              group=vocab["group"])[:, :vocab["real_vocab_size"]]
    errors["logits"] = (full_vocab[real] - ref["logits"][shard.source[real]]).abs().max().item()
    # labels shifted on the whole stream, then sharded: a chunk's last position predicts a
    # token another rank holds
    targets_T, valid_T = shifted_targets(packed)
    valid_local = shard_tokens(valid_T, shard, fill=False)
    log_probs, entropy = vocab_parallel_log_probs_entropy(
        logits_local, shard_tokens(targets_T, shard), **vocab, temperature=1.0)
    log_probs = log_probs.masked_fill(~valid_local, 0.0)
    for key, local in (("log_probs", log_probs), ("entropy", entropy)):
        gathered = gather_tokens(local.detach(), shard, group=group)
        errors[key] = (gathered - ref[key]).abs().max().item()
    loss = _loss_terms(log_probs, entropy, valid_local, real, shard_tokens(ref["w1"], shard),
                       shard_tokens(ref["w2"], shard), valid_T.sum(), valid_T.numel())
    (loss / dp).backward()  # each dp replica runs the whole pack (an expert gets 1/dp of it
    # from each replica of its ep group)
    errors["grads"] = _grad_error(built, mesh, ref["grads"])
    errors["local_tokens"] = shard.num_local
    if mesh.ep_size == 1:  # the critic: values on sharded tokens, gathered back in order
        critic = build_model(case["folder"], mesh=mesh, head="value", value_head_seed=7,
                             parallel=ParallelConfig(tp=tp, sequence_parallel=tp > 1))
        values_local = critic.model(shard_tokens(packed.tokens, shard), shard.positions,
                                    torch.tensor(shard.query_bounds, dtype=torch.int32),
                                    shard.max_query, layout=layout)
        errors["values"] = (gather_tokens(values_local.detach(), shard, group=group)
                            - ref["values"]).abs().max().item()
        w_local = shard_tokens(ref["w1"], shard) * real
        ((w_local * values_local).sum() / (dp * packed.tokens.shape[0])).backward()
        errors["value_grads"] = _grad_error(critic, mesh, ref["value_grads"])
    return errors


def _grad_error(built, mesh, want):
    """Max error of the full grads after the sum a training engine does: over dp x cp (the cp
    ranks saw different tokens; an expert's over cp x edp, the ranks holding it), TP-partial
    ones over tp."""
    for entry, param in zip(built.table, built.model.parameters()):
        dist.all_reduce(param.grad, group=mesh.dp_cp_group if entry.expert is None
                        else mesh.cp_group)
        if entry.expert is not None:
            dist.all_reduce(param.grad, group=mesh.edp_group)
        if entry.tp_partial_grad:
            dist.all_reduce(param.grad, group=mesh.tp_group)
    grads = gather_full_grads(built.model, built.table, mesh)
    if grads.keys() != want.keys():
        raise AssertionError(f"grad names differ: {sorted(grads.keys() ^ want.keys())}")
    return max((grads[n] - want[n]).abs().max().item() for n in grads)


def _check_pipeline(case, mesh):
    """cp=2 x pp=2: each stage runs its layers on its cp shard; the hidden states and their
    grads go between the two stages of one cp rank. Max error of each stage's grads."""
    built = build_model(case["folder"], mesh=mesh, head="lm", parallel=ParallelConfig(pp=2))
    model, ref, group = built.model, case["ref"], mesh.cp_group
    packed = case["packed"]
    shard = _plan(packed, mesh)
    layout = context_layout(shard, group=group, device="cpu")
    bounds = torch.tensor(shard.query_bounds, dtype=torch.int32)
    other = mesh.rank_at(dp=mesh.dp_rank, pp=1 - mesh.pp_rank, tp=0)  # same cp rank
    hidden_size = model.args.hidden_size
    if mesh.pp_rank == 0:
        hidden = model(shard_tokens(packed.tokens, shard), shard.positions, bounds,
                       shard.max_query, layout=layout)
        dist.send(hidden.detach().contiguous(), other)
        grad = torch.empty_like(hidden)
        dist.recv(grad, other)
        hidden.backward(grad)
        errors = {}
    else:
        hidden = torch.empty(shard.num_local, hidden_size)
        dist.recv(hidden, other)
        hidden.requires_grad_()
        logits = model(hidden, shard.positions, bounds, shard.max_query, layout=layout)
        targets_T, valid_T = shifted_targets(packed)
        valid_local = shard_tokens(valid_T, shard, fill=False)
        log_probs, entropy = vocab_parallel_log_probs_entropy(
            logits, shard_tokens(targets_T, shard), group=None, vocab_start=0,
            vocab_end=logits.shape[-1], real_vocab_size=logits.shape[-1], temperature=1.0)
        gathered = gather_tokens(log_probs.masked_fill(~valid_local, 0.0).detach(), shard,
                                 group=group)
        errors = {"pp_log_probs": (gathered - ref["log_probs"]).abs().max().item()}
        _loss_terms(log_probs.masked_fill(~valid_local, 0.0), entropy, valid_local,
                    shard.source >= 0, shard_tokens(ref["w1"], shard),
                    shard_tokens(ref["w2"], shard), valid_T.sum(), valid_T.numel()).backward()
        dist.send(hidden.grad.contiguous(), other)
    for name, param in model.named_parameters():  # tp=1: every local parameter is whole
        dist.all_reduce(param.grad, group=mesh.dp_cp_group)
        err = (param.grad - ref["grads"][name]).abs().max().item()
        errors["pp_grads"] = max(errors.get("pp_grads", 0.0), err)
    return errors


def _matrix(rank, world, cases):
    cache = ProcessGroupCache()
    meshes = {(cp, tp, ep): ParallelMesh(list(range(world)), cp=cp, tp=tp, ep=ep, cache=cache)
              for _, cp, tp, ep in CASES}
    results = {(name, cp, tp, ep): _check(cases[name], meshes[cp, tp, ep])
               for name, cp, tp, ep in CASES}
    pipeline = ParallelMesh(list(range(world)), cp=2, pp=2, cache=cache)
    results["pipeline"] = _check_pipeline(cases["llama"], pipeline)
    return results


@pytest.fixture(scope="module")
def matrix(cases):
    return run_distributed(_matrix, 4, cases, timeout_s=120)


@pytest.mark.parametrize("name,cp,tp,ep", CASES,
                         ids=[f"{n}-cp{cp}-tp{tp}-ep{ep}" for n, cp, tp, ep in CASES])
def test_cp_matches_the_unsharded_model(matrix, name, cp, tp, ep):
    for rank, results in enumerate(matrix):
        errors = results[name, cp, tp, ep]
        checks = ("logits", "log_probs", "entropy", "grads") + (
            ("values", "value_grads") if ep == 1 else ())
        for check in checks:
            assert errors[check] < TOL, (rank, check, errors)
        # every cp rank holds an equal share: the pack padded per sequence to 2 * cp chunks
        lens = _grpo_packs()[0].seq_lens.tolist() if name == "shared" else LENGTHS
        padded = sum(-(-n // (2 * cp)) * 2 * cp for n in lens)
        assert errors["local_tokens"] == padded // cp + (-(padded // cp) % tp)


def test_cp_with_a_two_stage_pipeline_matches_the_unsharded_model(matrix):
    """cp=2 x pp=2 on Llama: log-probs (last stages) and every stage's grads."""
    for rank, results in enumerate(matrix):
        errors = results["pipeline"]
        assert errors["pp_grads"] < TOL, (rank, errors)
        if "pp_log_probs" in errors:
            assert errors["pp_log_probs"] < TOL, (rank, errors)
    assert sum("pp_log_probs" in results["pipeline"] for results in matrix) == 2


def test_the_shared_pack_at_cp1_matches_the_whole_pack(cases):
    """The shared-prompts reference closes the loop: the unsharded model on the shared pack
    (cp=1) gives the whole pack's logits at every token it holds."""
    case = cases["shared"]
    model = CausalLM(ModelArgs.from_pretrained(case["folder"]))
    load_hf_weights(model, case["folder"])
    packed = case["packed"]
    with torch.no_grad():
        logits_TV = model(packed.tokens, packed.position_ids, packed.cu_seqlens,
                          packed.max_seqlen, prefix=packed.prefix)
    assert (logits_TV - case["ref"]["logits"]).abs().max().item() < TOL
