"""A CPU stand-in for flash-attn's varlen kernel with its memory behaviour: forward keeps only
q, k, v, the output and the per-head log-sum-exp; backward recomputes the attention."""

from __future__ import annotations

import torch

from rlhf.models.attention import sdpa_varlen


class _FlashLike(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_THD, k_THD, v_THD, cu_seqlens, max_seqlen, causal, scale):
        with torch.no_grad():
            out_THD = sdpa_varlen(q_THD, k_THD, v_THD, cu_seqlens=cu_seqlens,
                                  max_seqlen=max_seqlen, causal=causal, scale=scale)
        lse_HT = q_THD.new_zeros((q_THD.shape[1], q_THD.shape[0]), dtype=torch.float32)
        ctx.save_for_backward(q_THD, k_THD, v_THD, out_THD, lse_HT, cu_seqlens)
        ctx.args = (max_seqlen, causal, scale)
        return out_THD

    @staticmethod
    def backward(ctx, grad_THD):
        q_THD, k_THD, v_THD, _, _, cu_seqlens = ctx.saved_tensors
        max_seqlen, causal, scale = ctx.args
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in (q_THD, k_THD, v_THD))
            out = sdpa_varlen(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                              causal=causal, scale=scale)
            grads = torch.autograd.grad(out, (q, k, v), grad_THD)
        return (*grads, None, None, None, None)


def flash_like_varlen(q_THD, k_THD, v_THD, *, cu_seqlens, max_seqlen, causal, scale,
                      prefix=None, layout=None):
    """flash_varlen's signature and saved tensors, computed on the CPU (no shared prefix)."""
    assert prefix is None, "the stand-in has no shared-prefix path"
    return _FlashLike.apply(q_THD, k_THD, v_THD, cu_seqlens, max_seqlen, causal, scale)
