"""Ulysses attention on a context-parallel shard: all-to-all over heads instead of gathering keys.

Each cp rank holds its `ContextShard` of a pack (rlhf.parallel.context_parallel: chunks r and
2cp-1-r of every sequence) and computes q, k, v for all its (tp-local) heads. One all-to-all
over the cp group turns (T_local, H, D) into (cp * T_local, H / cp, D): every rank's local
stream, in cp-rank order (the gathered stream `ContextShard.token_rows` indexes), for this
rank's H / cp heads. The rows are put in stream order (`token_rows`, padding dropped), plain
varlen attention runs on whole sequences (the caller's `attend`, over the unsharded layout),
and a second all-to-all sends every head's output back to the rank holding its tokens. Padding
rows get zeros; no real token sees them. Both all-to-alls are differentiable: the backward of
one is the other. q, k and v travel in one all-to-all.

Heads: the query heads must split evenly over cp. KV heads split too when cp divides them;
when they are fewer than cp and divide it, each KV head is copied to the cp / H_kv ranks whose
query heads use it (autograd sums the copies' grads). Any other count is refused
(`ulysses_heads_problem`): the all-gather of keys and values (`cp_attention: all_gather`)
works for every head count.

Per layer and rank, forward: q, k, v out and the output back, about
(2 H + 2 H_kv') * T_local * D * (cp - 1) / cp elements sent (H_kv' = max(H_kv, cp)), against
the all-gather's 2 (cp - 1) * T_local * H_kv * D received (`bytes_sent`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from rlhf.config.schema import ulysses_heads_problem
from rlhf.parallel.collectives import group_size

Attend = Callable[[Tensor, Tensor, Tensor], Tensor]  # (q, k, v) in stream order -> out


def bytes_sent(*, cp: int, tokens_local: int, heads: int, kv_heads: int, head_dim: int,
               element_size: int) -> dict[str, int]:
    """Bytes one rank sends per attention layer's forward (the backward sends as much again),
    computed from shapes: "ulysses" (q, k, v out, the output back) and "all_gather" (its k and
    v to every other rank)."""
    kv = max(kv_heads, cp)  # copies of a KV head shared by several ranks travel too
    ulysses = (2 * heads + 2 * kv) * tokens_local * head_dim * (cp - 1) // cp
    gather = 2 * (cp - 1) * tokens_local * kv_heads * head_dim
    return {"ulysses": ulysses * element_size, "all_gather": gather * element_size}


def ulysses_attention(q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, *,
                      group: ProcessGroup | None, token_rows: Tensor, attend: Attend) -> Tensor:
    """Attention of one cp rank's local rows (T_local, H, D) by all-to-all over heads:
    `attend(q, k, v)` runs on the whole stream's tokens (T, H / cp, D), in stream order
    (`token_rows`: the gathered-stream row of every stream token). Returns (T_local, H, D).
    Collective over the cp `group`; every rank calls it once per layer."""
    cp = group_size(group)
    heads, kv_heads = q_THD.shape[1], k_THD.shape[1]
    problem = ulysses_heads_problem(heads, kv_heads, cp)
    if problem is not None:
        raise ValueError(f"{problem}; set parallel.cp_attention=all_gather (it takes any "
                         "number of heads)")
    if kv_heads < cp:  # each KV head to the cp / kv_heads ranks whose query heads use it
        k_THD = k_THD.repeat_interleave(cp // kv_heads, dim=1)
        v_THD = v_THD.repeat_interleave(cp // kv_heads, dim=1)
    q_h, kv_h = heads // cp, k_THD.shape[1] // cp
    # (T_local, cp, heads per rank, D): slot j goes to rank j, q, k, v side by side
    qkv = torch.cat([x.reshape(x.shape[0], cp, -1, x.shape[2]) for x in (q_THD, k_THD, v_THD)],
                    dim=2)
    gathered = heads_to_tokens(qkv, group=group)  # (cp * T_local, q_h + 2 kv_h, D)
    stream = gathered.index_select(0, token_rows)
    q, k, v = stream.split([q_h, kv_h, kv_h], dim=1)
    out_TdD = attend(q, k, v)
    out = out_TdD.new_zeros(gathered.shape[0], q_h, out_TdD.shape[2]).index_copy(
        0, token_rows, out_TdD)
    return tokens_to_heads(out, group=group).reshape(q_THD.shape[0], heads, -1)


def heads_to_tokens(x_TCHD: Tensor, *, group: ProcessGroup | None) -> Tensor:
    """(T_local, cp, h, D) -> (cp * T_local, h, D): slot j of every rank's rows goes to rank
    j, which stacks what it receives in cp-rank order. Backward: `tokens_to_heads`."""
    return _Exchange.apply(x_TCHD, group, True)


def tokens_to_heads(x_TD: Tensor, *, group: ProcessGroup | None) -> Tensor:
    """(cp * T_local, h, D) -> (T_local, cp, h, D): the reverse of `heads_to_tokens`."""
    return _Exchange.apply(x_TD, group, False)


def _heads_to_tokens(x: Tensor, group: ProcessGroup | None) -> Tensor:
    T, cp = x.shape[0], x.shape[1]
    send = x.transpose(0, 1).contiguous()  # (cp, T_local, h, D): rank j's block j
    if cp == 1:
        return send.view(T, *x.shape[2:])
    out = torch.empty_like(send)
    dist.all_to_all_single(out, send, group=group)
    return out.view(cp * T, *x.shape[2:])


def _tokens_to_heads(x: Tensor, group: ProcessGroup | None) -> Tensor:
    cp = group_size(group)
    send = x.contiguous().view(cp, x.shape[0] // cp, *x.shape[1:])  # block j: rank j's rows
    out = torch.empty_like(send)
    if cp == 1:
        out = send
    else:
        dist.all_to_all_single(out, send, group=group)
    return out.transpose(0, 1)  # (T_local, cp, h, D): slot j holds rank j's heads


class _Exchange(torch.autograd.Function):
    """One all-to-all, `to_tokens` (heads_to_tokens) or back (tokens_to_heads); the backward
    of either is the other."""

    @staticmethod
    def forward(ctx, x, group, to_tokens):
        ctx.group, ctx.to_tokens = group, to_tokens
        return (_heads_to_tokens if to_tokens else _tokens_to_heads)(x, group)

    @staticmethod
    def backward(ctx, *grad_outputs):
        back = _tokens_to_heads if ctx.to_tokens else _heads_to_tokens
        return back(grad_outputs[0], ctx.group), None, None
