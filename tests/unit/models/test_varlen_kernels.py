"""torch's varlen flash kernel path (rlhf.models.varlen_kernels) against the per-sequence reference.

The kernel itself runs on CUDA only; here CPU stand-ins with the signatures of torch 2.10, 2.11
and 2.12+ implement its contract (cu_seqlens for q and k, bottom-right causal), so the call the
adapter builds for each release is checked in values and grads, with and without a shared
prefix and with grouped-query k/v. The real kernel is checked in test_varlen_kernels_gpu below
and by `examples/gpu_bringup.sh`.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.data.packing import SharedPrefix
from rlhf.models import varlen_kernels
from rlhf.models.attention import flash_varlen, pick_kernel, sdpa_split, sdpa_varlen
from rlhf.models.varlen_kernels import call_keywords, torch_varlen

HEADS, HEAD_DIM = 8, 16


def _flash_contract(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale):
    """Per sequence: its queries against its keys, causal aligned to the bottom right."""
    assert cu_q.dtype == cu_k.dtype == torch.int32
    assert max_q == max((cu_q[1:] - cu_q[:-1]).tolist()) and max_k == max((cu_k[1:] - cu_k[:-1]).tolist())
    outs = []
    for i in range(len(cu_q) - 1):
        q_s, k_s, v_s = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        rep = q_s.shape[1] // k_s.shape[1]
        k_s, v_s = k_s.repeat_interleave(rep, 1), v_s.repeat_interleave(rep, 1)
        s_HQK = torch.einsum("qhd,khd->hqk", q_s, k_s) * scale
        if causal:
            lq, lk = q_s.shape[0], k_s.shape[0]
            keep = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
            s_HQK = s_HQK.masked_fill(~keep, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s_HQK.softmax(-1), v_s))
    return torch.cat(outs)


def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                return_aux=None):
    assert query.shape[1] == key.shape[1], "2.10 takes k/v with the query's heads"
    return _flash_contract(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                           causal=is_causal, scale=query.shape[-1] ** -0.5)


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                scale=None, window_size=(-1, -1)):
    assert query.shape[1] == key.shape[1], "2.11 documents k/v with the query's heads"
    assert window_size in ((-1, -1), (-1, 0))
    return _flash_contract(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                           causal=window_size == (-1, 0), scale=scale)


def varlen_2_12(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                scale=None, window_size=(-1, -1), enable_gqa=False):
    assert enable_gqa or query.shape[1] == key.shape[1]
    return _flash_contract(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                           causal=window_size == (-1, 0), scale=scale)


def _inputs(kv_heads, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = [7, 5, 1, 9, 4]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    T = sum(lengths)
    q = torch.randn(T, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(T, kv_heads, HEAD_DIM, generator=gen) for _ in range(2))
    # Sequences 1 and 2 also see the first 4 tokens of sequence 0 (their shared prompt).
    prefix = SharedPrefix(torch.tensor([0, 0, 0, 0, 0]), torch.tensor([0, 4, 4, 0, 0]))
    return (q, k, v), cu, max(lengths), prefix, torch.randn(T, HEADS, HEAD_DIM, generator=gen)


def _run(kernel, qkv, cu, max_len, prefix, grad_out, scale):
    qkv = [x.detach().clone().requires_grad_() for x in qkv]
    out = kernel(*qkv, cu_seqlens=cu, max_seqlen=max_len, causal=True, scale=scale,
                 prefix=prefix)
    out.backward(grad_out)
    return [out.detach()] + [x.grad for x in qkv]


@pytest.mark.parametrize("release", [varlen_2_10, varlen_2_11, varlen_2_12])
@pytest.mark.parametrize("kv_heads", [8, 2])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("scale", [HEAD_DIM ** -0.5, 0.3])
def test_each_release_signature_gives_the_reference(monkeypatch, release, kv_heads, shared,
                                                    scale):
    monkeypatch.setattr(varlen_kernels, "torch_varlen_fn", lambda: release)
    qkv, cu, max_len, prefix, grad_out = _inputs(kv_heads)
    prefix = prefix if shared else None
    got = _run(torch_varlen, qkv, cu, max_len, prefix, grad_out, scale)
    want = _run(sdpa_varlen, qkv, cu, max_len, prefix, grad_out, scale)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_the_signature_decides_the_keywords():
    assert call_keywords(varlen_2_10) == {"is_causal"}
    assert call_keywords(varlen_2_11) == {"window_size", "scale"}
    assert call_keywords(varlen_2_12) == {"window_size", "scale", "enable_gqa"}
    installed = varlen_kernels.torch_varlen_fn()
    if installed is not None:  # this torch's own: causal must be expressible
        assert call_keywords(installed) & {"is_causal", "window_size"}


def test_cuda_half_precision_takes_torch_varlen_only_without_flash_attn():
    for dtype in (torch.bfloat16, torch.float16):
        assert pick_kernel("cuda", dtype, flash_available=False,
                           torch_varlen_available=True) is torch_varlen
        assert pick_kernel("cuda", dtype, flash_available=True,
                           torch_varlen_available=True) is flash_varlen
        assert pick_kernel("cuda", dtype, flash_available=False,
                           torch_varlen_available=False) is sdpa_split
    assert pick_kernel("cuda", torch.float32, flash_available=False,
                       torch_varlen_available=True) is sdpa_split  # the flash kernel is half only
    assert pick_kernel("cpu", torch.bfloat16, flash_available=False,
                       torch_varlen_available=True) is sdpa_split


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or varlen_kernels.torch_varlen_fn() is None,
                    reason="needs CUDA and torch.nn.attention.varlen")
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_kernels_gpu(shared, dtype):
    """The real kernel against the fp32 reference on the same GPU: values and grads."""
    qkv, cu, max_len, prefix, grad_out = _inputs(2)
    prefix = prefix.to("cuda") if shared else None
    scale = 1 / math.sqrt(HEAD_DIM)
    half = [x.to("cuda", dtype) for x in qkv]
    got = _run(torch_varlen, half, cu.cuda(), max_len, prefix, grad_out.to("cuda", dtype), scale)
    want = _run(sdpa_varlen, [x.to("cuda") for x in qkv], cu.cuda(), max_len, prefix,
                grad_out.cuda(), scale)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err = (a.float() - b).abs().max().item()
        assert err < 3e-2 * max(1.0, b.abs().max().item()), f"{name}: {err}"
