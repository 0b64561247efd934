"""Tensor/sequence-parallel layers at tp in {1, 2, 4} against their unsharded references.

Every rank builds the full layer from one seed, computes the reference forward/backward, then
shards the layer and checks outputs and input/weight/bias grads (fp32, within 1e-5). Each
launch runs every check and returns the max errors; the tests below assert on them.
"""

import traceback

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rlhf.parallel import collectives as C
from rlhf.parallel.launch import run_distributed
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from rlhf.parallel.tensor_parallel import (ColumnParallelLinear, ParallelLMHead,
                                           RowParallelLinear, VocabParallelEmbedding,
                                           shard_for_rank)
from rlhf.parallel.vocab_parallel import (padded_vocab_size, vocab_parallel_entropy,
                                          vocab_parallel_log_probs_entropy,
                                          vocab_parallel_log_probs, vocab_shard_range)

TOL = 1e-5
T, H, FF, V = 8, 6, 8, 11  # tokens (divisible by 4), hidden, MLP width, vocab (not divisible)


class _Errors:
    """Max abs error per named comparison; refuses all-zero references (nothing to compare)."""

    def __init__(self):
        self.errors = {}

    def cmp(self, name, got, want, *, may_be_zero=False):
        if tuple(got.shape) != tuple(want.shape):
            raise AssertionError(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        if want.numel() == 0:  # e.g. no padding rows on this rank
            self.errors[name] = 0.0
            return
        if not may_be_zero and not want.abs().max() > 0:
            raise AssertionError(f"{name}: the reference is all zeros, the check proves nothing")
        self.errors[name] = (got.detach().float() - want.detach().float()).abs().max().item()


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _real_vocab(t, dim, group):
    """Gather vocab shards along `dim` from every rank and drop the padding."""
    return C.all_gather(t.detach(), dim=dim, group=group).narrow(dim, 0, V)


def _reference_linear(seed, in_features, out_features):
    """An nn.Linear, its input x, a random output cotangent R, and the backward of (y * R)."""
    torch.manual_seed(seed)
    full = nn.Linear(in_features, out_features)
    x, R = torch.randn(T, in_features), torch.randn(T, out_features)
    xr = _leaf(x)
    yr = full(xr)
    (yr * R).sum().backward()
    return full, x, R, xr, yr


def _full_weight(layer):
    """The full weight (and bias) a TP layer holds in shards, padding trimmed (collective)."""
    group = layer.group
    if isinstance(layer, RowParallelLinear):  # input features split; the bias is replicated
        bias = None if layer.bias is None else layer.bias.detach().clone()
        return C.all_gather(layer.weight.detach(), dim=-1, group=group), bias
    weight = C.all_gather(layer.weight.detach(), dim=0, group=group)
    if isinstance(layer, VocabParallelEmbedding):
        return weight[: layer.num_embeddings]
    if isinstance(layer, ParallelLMHead):
        return weight[: layer.vocab_size], None
    bias = None if layer.bias is None else C.all_gather(layer.bias.detach(), dim=0, group=group)
    return weight, bias


def _check_export(e, layer, full):
    w, b = _full_weight(layer)
    e.cmp("export_w", w, full.weight)
    e.cmp("export_b", b, full.bias)
    return e.errors


def _column(group, sp, gather_output):
    r, tp, e = C.group_rank(group), C.group_size(group), _Errors()
    full, x, R, xr, yr = _reference_linear(1, H, FF)
    layer = ColumnParallelLinear.from_linear(full, group=group, gather_output=gather_output,
                                             sequence_parallel=sp)
    xin = _leaf(shard_for_rank(x, 0, r, tp) if sp else x)
    y = layer(xin)
    if gather_output:
        want_y, Ry = yr, R
    else:
        want_y, Ry = shard_for_rank(yr, 1, r, tp), shard_for_rank(R, 1, r, tp)
    (y * Ry).sum().backward()
    e.cmp("out", y, want_y)
    e.cmp("grad_x", xin.grad, shard_for_rank(xr.grad, 0, r, tp) if sp else xr.grad)
    e.cmp("grad_w", layer.weight.grad, shard_for_rank(full.weight.grad, 0, r, tp))
    e.cmp("grad_b", layer.bias.grad, shard_for_rank(full.bias.grad, 0, r, tp))
    return _check_export(e, layer, full)


def _row(group, sp, input_is_parallel):
    r, tp, e = C.group_rank(group), C.group_size(group), _Errors()
    full, x, R, xr, yr = _reference_linear(2, FF, H)
    layer = RowParallelLinear.from_linear(full, group=group, input_is_parallel=input_is_parallel,
                                          sequence_parallel=sp)
    xin = _leaf(shard_for_rank(x, 1, r, tp) if input_is_parallel else x)
    y = layer(xin)
    (y * (shard_for_rank(R, 0, r, tp) if sp else R)).sum().backward()
    if sp:  # each rank added the bias to its token chunk only: its grad is partial
        C.all_reduce_tensors([layer.bias.grad], group=group)
    e.cmp("out", y, shard_for_rank(yr, 0, r, tp) if sp else yr)
    e.cmp("grad_x", xin.grad, shard_for_rank(xr.grad, 1, r, tp) if input_is_parallel else xr.grad)
    e.cmp("grad_w", layer.weight.grad, shard_for_rank(full.weight.grad, 1, r, tp))
    e.cmp("grad_b", layer.bias.grad, full.bias.grad)
    return _check_export(e, layer, full)


def _mlp(group, sp, seed=3):
    """Column -> gelu -> row, the Megatron MLP block; also used on two meshes in one process."""
    r, tp, e = C.group_rank(group), C.group_size(group), _Errors()
    torch.manual_seed(seed)
    fc1, fc2, x, R = nn.Linear(H, FF), nn.Linear(FF, H), torch.randn(T, H), torch.randn(T, H)
    xr = _leaf(x)
    yr = fc2(F.gelu(fc1(xr)))
    (yr * R).sum().backward()
    col = ColumnParallelLinear.from_linear(fc1, group=group, sequence_parallel=sp)
    row = RowParallelLinear.from_linear(fc2, group=group, sequence_parallel=sp)
    xin = _leaf(shard_for_rank(x, 0, r, tp) if sp else x)
    y = row(F.gelu(col(xin)))
    (y * (shard_for_rank(R, 0, r, tp) if sp else R)).sum().backward()
    if sp:
        C.all_reduce_tensors([row.bias.grad], group=group)
    e.cmp("out", y, shard_for_rank(yr, 0, r, tp) if sp else yr)
    e.cmp("grad_x", xin.grad, shard_for_rank(xr.grad, 0, r, tp) if sp else xr.grad)
    e.cmp("grad_w1", col.weight.grad, shard_for_rank(fc1.weight.grad, 0, r, tp))
    e.cmp("grad_b1", col.bias.grad, shard_for_rank(fc1.bias.grad, 0, r, tp))
    e.cmp("grad_w2", row.weight.grad, shard_for_rank(fc2.weight.grad, 1, r, tp))
    e.cmp("grad_b2", row.bias.grad, fc2.bias.grad)
    return e.errors


def _embedding(group, sp):
    r, tp, e = C.group_rank(group), C.group_size(group), _Errors()
    torch.manual_seed(4)
    full, R = nn.Embedding(V, H), torch.randn(T, H)
    ids = torch.randint(0, V, (T,))
    ids[0], ids[1] = 0, V - 1  # both ends of the vocabulary
    out_ref = full(ids)
    (out_ref * R).sum().backward()
    layer = VocabParallelEmbedding.from_embedding(full, group=group, sequence_parallel=sp)
    assert layer.padded_num_embeddings == padded_vocab_size(V, tp)
    assert layer.padded_num_embeddings % tp == 0
    out = layer(ids)
    (out * (shard_for_rank(R, 0, r, tp) if sp else R)).sum().backward()
    n_real = max(0, min(layer.vocab_end, V) - layer.vocab_start)
    e.cmp("out", out, shard_for_rank(out_ref, 0, r, tp) if sp else out_ref)
    if n_real:
        e.cmp("grad_w", layer.weight.grad[:n_real],
              full.weight.grad[layer.vocab_start: layer.vocab_start + n_real], may_be_zero=True)
    e.cmp("pad_rows_grad", layer.weight.grad[n_real:], torch.zeros_like(layer.weight[n_real:]),
          may_be_zero=True)
    e.cmp("grad_w_all_ranks", _real_vocab(layer.weight.grad, 0, group), full.weight.grad)
    e.cmp("export_w", _full_weight(layer), full.weight)
    return e.errors


def _lm_head(group, sp):
    r, tp, e = C.group_rank(group), C.group_size(group), _Errors()
    torch.manual_seed(5)
    full, x = nn.Linear(H, V, bias=False), torch.randn(T, H)
    vp = padded_vocab_size(V, tp)
    R = torch.randn(T, vp)
    R[:, V:] = 0  # padded logits carry no loss (the log-prob functions give them zero grad)
    xr = _leaf(x)
    logits_ref = full(xr)
    (logits_ref * R[:, :V]).sum().backward()
    head = ParallelLMHead.from_linear(full, group=group, sequence_parallel=sp)
    start, end = head.vocab_start, head.vocab_end
    assert (start, end) == vocab_shard_range(vp, r, tp) and head.padded_vocab_size == vp
    xin = _leaf(shard_for_rank(x, 0, r, tp) if sp else x)
    logits_TV_local = head(xin)
    (logits_TV_local * R[:, start:end]).sum().backward()
    n_real = max(0, min(end, V) - start)
    e.cmp("logits_all_ranks", _real_vocab(logits_TV_local, -1, group), logits_ref)
    e.cmp("pad_logits", logits_TV_local[:, n_real:], torch.zeros(T, end - start - n_real),
          may_be_zero=True)
    e.cmp("grad_x", xin.grad, shard_for_rank(xr.grad, 0, r, tp) if sp else xr.grad)
    e.cmp("grad_w_all_ranks", _real_vocab(head.weight.grad, 0, group), full.weight.grad)
    e.cmp("export_w", _full_weight(head)[0], full.weight)
    return e.errors


def _vocab_losses(group):
    r, tp, e = C.group_rank(group), C.group_size(group), _Errors()
    torch.manual_seed(6)
    logits, g = torch.randn(T, V) * 3, torch.randn(T)
    targets = torch.randint(0, V, (T,))
    targets[0], targets[1] = 0, V - 1
    vp = padded_vocab_size(V, tp)
    start, end = vocab_shard_range(vp, r, tp)
    n_real = max(0, min(end, V) - start)
    # garbage in the padded columns: it must not leak into the softmax
    padded = torch.cat([logits, torch.full((T, vp - V), 50.0)], dim=1)
    kw = dict(group=group, vocab_start=start, vocab_end=end, real_vocab_size=V)
    for name in ("log_probs", "entropy"):
        ref_in = _leaf(logits)
        logp_ref = torch.log_softmax(ref_in, -1)
        if name == "log_probs":
            ref = logp_ref.gather(-1, targets[:, None])[:, 0]
        else:
            ref = -(logp_ref.exp() * logp_ref).sum(-1)
        (ref * g).sum().backward()
        local = _leaf(padded[:, start:end])
        if name == "log_probs":
            out = vocab_parallel_log_probs(local, targets, **kw)
            out_3d = vocab_parallel_log_probs(local.view(2, T // 2, -1),
                                              targets.view(2, T // 2), **kw)
        else:
            out = vocab_parallel_entropy(local, **kw)
            out_3d = vocab_parallel_entropy(local.view(2, T // 2, -1), **kw)
        (out * g).sum().backward()
        e.cmp(f"{name}", out, ref)
        e.cmp(f"{name}_leading_dims", out_3d, ref.view(2, T // 2))
        e.cmp(f"{name}_grad_all_ranks", _real_vocab(local.grad, -1, group), ref_in.grad)
        e.cmp(f"{name}_pad_grad", local.grad[:, n_real:], torch.zeros(T, end - start - n_real),
              may_be_zero=True)
    return e.errors


def _fused_head(group, *, temperature, chunk_elements, dtype):
    """Log-probs and entropy in one fused pass, chunked over tokens, at a temperature; the
    loss uses both, then only the log-probs (the entropy's backward term is skipped)."""
    r, tp, e = C.group_rank(group), C.group_size(group), _Errors()
    torch.manual_seed(8)
    logits = (torch.randn(T, V) * 3).to(dtype)
    g_lp, g_ent = torch.randn(T), torch.randn(T)
    targets = torch.randint(0, V, (T,))
    targets[0], targets[1] = 0, V - 1
    vp = padded_vocab_size(V, tp)
    start, end = vocab_shard_range(vp, r, tp)
    padded = torch.cat([logits, torch.full((T, vp - V), 50.0, dtype=dtype)], dim=1)
    kw = dict(group=group, vocab_start=start, vocab_end=end, real_vocab_size=V,
              temperature=temperature, chunk_elements=chunk_elements)
    for uses_entropy in (True, False):
        ref_in = _leaf(logits.float())
        logp_ref = torch.log_softmax(ref_in / temperature, -1)
        ref_lp = logp_ref.gather(-1, targets[:, None])[:, 0]
        ref_ent = -(logp_ref.exp() * logp_ref).sum(-1)
        ((ref_lp * g_lp).sum() + uses_entropy * (ref_ent * g_ent).sum()).backward()
        local = _leaf(padded[:, start:end])
        lp, ent = vocab_parallel_log_probs_entropy(local, targets, **kw)
        ((lp * g_lp).sum() + (ent * g_ent).sum() if uses_entropy else (lp * g_lp).sum()).backward()
        tag = f"{dtype}_entropy_in_loss={uses_entropy}"
        e.cmp(f"log_probs_{tag}", lp, ref_lp)
        e.cmp(f"entropy_{tag}", ent, ref_ent)
        grad = _real_vocab(local.grad.float(), -1, group)
        if dtype == torch.float32:
            e.cmp(f"grad_{tag}", grad, ref_in.grad)
        else:  # the grad is rounded to bf16 once: half an ulp (2^-8 relative) is allowed
            slack = (grad - ref_in.grad).abs() - ref_in.grad.abs() * 2**-8
            e.errors[f"grad_{tag}"] = float(slack.clamp(min=0).max())
    return e.errors


def _mini_model(group, sp):
    """embedding -> replicated scale (a norm weight) -> residual MLP -> LM head -> log-probs."""
    r, tp, e = C.group_rank(group), C.group_size(group), _Errors()
    torch.manual_seed(7)
    emb, fc1, fc2 = nn.Embedding(V, H), nn.Linear(H, FF), nn.Linear(FF, H)
    head, scale = nn.Linear(H, V, bias=False), nn.Parameter(torch.randn(H))
    ids, g = torch.randint(0, V, (T,)), torch.randn(T)
    targets = torch.roll(ids, -1)

    def forward(emb, fc1, fc2, head, scale, logp):
        h = emb(ids) * scale
        h = h + fc2(F.gelu(fc1(h)))
        return logp(head(h))

    ref = forward(emb, fc1, fc2, head, scale,
                  lambda lg: torch.log_softmax(lg, -1).gather(-1, targets[:, None])[:, 0])
    (ref * g).sum().backward()
    p_emb = VocabParallelEmbedding.from_embedding(emb, group=group, sequence_parallel=sp)
    p_fc1 = ColumnParallelLinear.from_linear(fc1, group=group, sequence_parallel=sp)
    p_fc2 = RowParallelLinear.from_linear(fc2, group=group, sequence_parallel=sp)
    p_head = ParallelLMHead.from_linear(head, group=group, sequence_parallel=sp)
    p_scale = nn.Parameter(scale.detach().clone())
    model = nn.ModuleList([p_emb, p_fc1, p_fc2, p_head])
    model.register_parameter("scale", p_scale)
    out = forward(p_emb, p_fc1, p_fc2, p_head, p_scale, lambda lg: vocab_parallel_log_probs(
        lg, targets, group=group, vocab_start=p_head.vocab_start, vocab_end=p_head.vocab_end,
        real_vocab_size=V))
    (out * g).sum().backward()
    if sp:  # the replicated parameters fed token chunks hold partial grads
        C.all_reduce_tensors([p_scale.grad, p_fc2.bias.grad], group=group)
    e.cmp("log_probs", out, ref)
    e.cmp("grad_scale", p_scale.grad, scale.grad)
    e.cmp("grad_fc2_bias", p_fc2.bias.grad, fc2.bias.grad)
    e.cmp("grad_fc1_w", p_fc1.weight.grad, shard_for_rank(fc1.weight.grad, 0, r, tp))
    e.cmp("grad_emb_all_ranks", _real_vocab(p_emb.weight.grad, 0, group), emb.weight.grad)
    e.cmp("grad_head_all_ranks", _real_vocab(p_head.weight.grad, 0, group), head.weight.grad)
    return e.errors


def _collectives(group):
    """Each differentiable collective against values every rank can compute for all ranks."""
    r, tp, e = C.group_rank(group), C.group_size(group), _Errors()
    torch.manual_seed(8)
    base_x, base_g = torch.randn(T, 4 * H), torch.randn(T, 4 * H)
    xs = [base_x + k for k in range(tp)]  # rank k's input
    gs = [base_g * (k + 1) for k in range(tp)]  # rank k's upstream grad

    def run(fn, x, g):
        x = _leaf(x)
        y = fn(x)
        y.backward(g)
        return y, x.grad

    def chunk(t, dim):
        return shard_for_rank(t, dim, r, tp)

    def cat_chunks(ts, dim):  # rank k's chunk of ts[k], for every k
        return torch.cat([shard_for_rank(t, dim, k, tp) for k, t in enumerate(ts)], dim)

    y, gx = run(lambda x: C.copy_to_tp(x, group=group), xs[r], gs[r])
    e.cmp("copy_to_tp", y, xs[r])
    e.cmp("copy_to_tp_grad", gx, sum(gs))
    y, gx = run(lambda x: C.reduce_from_tp(x, group=group), xs[r], gs[r])
    e.cmp("reduce_from_tp", y, sum(xs))
    e.cmp("reduce_from_tp_grad", gx, gs[r])
    y, gx = run(lambda x: C.gather_from_tp(x, group=group), chunk(xs[r], 1), gs[r])
    e.cmp("gather_from_tp", y, cat_chunks(xs, 1))
    e.cmp("gather_from_tp_grad", gx, chunk(gs[r], 1))
    y, gx = run(lambda x: C.scatter_to_tp(x, group=group), base_x, chunk(gs[r], 1))
    e.cmp("scatter_to_tp", y, chunk(base_x, 1))
    e.cmp("scatter_to_tp_grad", gx, cat_chunks(gs, 1))
    y, gx = run(lambda x: C.scatter_to_sequence(x, group=group), base_x, chunk(gs[r], 0))
    e.cmp("scatter_to_sequence", y, chunk(base_x, 0))
    e.cmp("scatter_to_sequence_grad", gx, cat_chunks(gs, 0))
    y, gx = run(lambda x: C.gather_from_sequence(x, group=group), chunk(xs[r], 0), gs[r])
    e.cmp("gather_from_sequence", y, cat_chunks(xs, 0))
    e.cmp("gather_from_sequence_grad", gx, chunk(sum(gs), 0))
    y, gx = run(lambda x: C.gather_from_sequence(x, group=group, grad_is_partial=False),
                chunk(xs[r], 0), gs[r])
    e.cmp("gather_from_sequence_replicated_grad", gx, chunk(gs[r], 0))
    y, gx = run(lambda x: C.reduce_scatter_to_sequence(x, group=group), xs[r], chunk(gs[r], 0))
    e.cmp("reduce_scatter_to_sequence", y, chunk(sum(xs), 0))
    e.cmp("reduce_scatter_to_sequence_grad", gx, cat_chunks(gs, 0))
    return e.errors


CHECKS = {
    "column": lambda g: _column(g, sp=False, gather_output=False),
    "column_sp": lambda g: _column(g, sp=True, gather_output=False),
    "column_gather_output": lambda g: _column(g, sp=False, gather_output=True),
    "column_gather_output_sp": lambda g: _column(g, sp=True, gather_output=True),
    "row": lambda g: _row(g, sp=False, input_is_parallel=True),
    "row_sp": lambda g: _row(g, sp=True, input_is_parallel=True),
    "row_replicated_input": lambda g: _row(g, sp=False, input_is_parallel=False),
    "mlp": lambda g: _mlp(g, sp=False),
    "mlp_sp": lambda g: _mlp(g, sp=True),
    "mlp_group_none": lambda g: _mlp(None, sp=False),
    "embedding": lambda g: _embedding(g, sp=False),
    "embedding_sp": lambda g: _embedding(g, sp=True),
    "lm_head": lambda g: _lm_head(g, sp=False),
    "lm_head_sp": lambda g: _lm_head(g, sp=True),
    "vocab_log_probs_entropy": _vocab_losses,
    "vocab_fused_chunked_temperature": lambda g: _fused_head(
        g, temperature=0.7, chunk_elements=3, dtype=torch.float32),
    "vocab_fused_chunked_bf16": lambda g: _fused_head(
        g, temperature=1.3, chunk_elements=20, dtype=torch.bfloat16),
    "mini_model": lambda g: _mini_model(g, sp=False),
    "mini_model_sp": lambda g: _mini_model(g, sp=True),
    "collectives": _collectives,
}


def _run_checks(rank, world_size):
    mesh = ParallelMesh(range(world_size), tp=world_size, cache=ProcessGroupCache())
    results = {}
    for name, check in CHECKS.items():
        try:
            results[name] = check(mesh.tp_group)
        except Exception:  # one broken check fails one test, not the whole launch
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda tp: f"tp{tp}")
def tp_results(request):
    return run_distributed(_run_checks, request.param, timeout_s=60)


def _assert_small(per_rank, label):
    for rank, errors in enumerate(per_rank):
        assert not isinstance(errors, str), f"{label}: rank {rank} raised:\n{errors}"
        assert errors, f"{label}: rank {rank} compared nothing"
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        assert not bad, f"{label}: rank {rank} errors above {TOL}: {bad}"


@pytest.mark.parametrize("check", list(CHECKS))
def test_layer_matches_unsharded_reference(tp_results, check):
    _assert_small([results[check] for results in tp_results], check)


def _two_meshes(rank, world_size):
    cache = ProcessGroupCache()
    mesh_a = ParallelMesh(range(4), tp=2, cache=cache)  # tp=2, dp=2
    mesh_b = ParallelMesh(range(4), tp=4, cache=cache)
    return {
        "a": _mlp(mesh_a.tp_group, sp=False, seed=10),
        "b_sp": _mlp(mesh_b.tp_group, sp=True, seed=11),
        "a_sp_again": _mlp(mesh_a.tp_group, sp=True, seed=12),
        "b_log_probs": _vocab_losses(mesh_b.tp_group),
        "sizes": (C.group_size(mesh_a.tp_group), C.group_size(mesh_b.tp_group)),
    }


def test_two_meshes_with_different_layouts_in_the_same_processes():
    results = run_distributed(_two_meshes, 4, timeout_s=60)
    assert all(res["sizes"] == (2, 4) for res in results)
    for key in ("a", "b_sp", "a_sp_again", "b_log_probs"):
        _assert_small([res[key] for res in results], key)
