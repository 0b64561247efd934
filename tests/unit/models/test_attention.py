"""Varlen attention kernels against the per-sequence reference, values and grads."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from rlhf.models import attention, varlen_layout
from rlhf.models.attention import (
    flash_varlen,
    missing_flash_message,
    pick_kernel,
    sdpa_split,
    sdpa_varlen,
    varlen_attention,
)

HEADS, HEAD_DIM = 8, 16


def _packed(lengths, kv_heads, seed):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    T = sum(lengths)
    q = torch.randn(T, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(T, kv_heads, HEAD_DIM, generator=gen) for _ in range(2))
    return [x.requires_grad_() for x in (q, k, v)], cu, torch.randn(T, HEADS, HEAD_DIM, generator=gen)


def _value_and_grads(kernel, qkv, cu, grad_out, *, causal=True):
    qkv = [x.detach().clone().requires_grad_() for x in qkv]
    out = kernel(*qkv, cu_seqlens=cu, max_seqlen=max((cu[1:] - cu[:-1]).tolist(), default=0),
                 causal=causal, scale=0.3)
    out.backward(grad_out)
    return [out.detach()] + [x.grad for x in qkv]


def _random_lengths(seed):
    """RL-like: mostly 5-60 tokens, with empty and length-1 sequences mixed in."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 60, (int(torch.randint(3, 12, (1,), generator=gen)),),
                            generator=gen).tolist()
    for special in (0, 1, 0, 1):
        lengths.insert(int(torch.randint(0, len(lengths) + 1, (1,), generator=gen)), special)
    return lengths


@pytest.mark.parametrize("kv_heads", [8, 4, 2, 1])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_split_kernel_equals_reference_in_values_and_grads(kv_heads, seed):
    lengths = _random_lengths(seed)
    qkv, cu, grad_out = _packed(lengths, kv_heads, seed)
    ours = _value_and_grads(sdpa_split, qkv, cu, grad_out)
    ref = _value_and_grads(sdpa_varlen, qkv, cu, grad_out)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    # Tokens never see another sequence: changing sequence 0's keys leaves the rest alone.
    first = lengths.index(next(n for n in lengths if n > 1))
    start = sum(lengths[:first])
    q, k, v = (x.detach() for x in qkv)
    k2 = k.clone()
    k2[start:start + lengths[first]] += 1.0
    out2 = sdpa_split(q, k2, v, cu_seqlens=cu, max_seqlen=60, causal=True, scale=0.3)
    others = torch.ones(sum(lengths), dtype=torch.bool)
    others[start:start + lengths[first]] = False
    assert torch.equal(out2[others], ours[0][others])
    assert not torch.equal(out2[~others], ours[0][~others])


def test_split_kernel_non_causal_equals_reference():
    qkv, cu, grad_out = _packed([7, 0, 1, 12], 2, seed=3)
    ours = _value_and_grads(sdpa_split, qkv, cu, grad_out, causal=False)
    ref = _value_and_grads(sdpa_varlen, qkv, cu, grad_out, causal=False)
    causal = _value_and_grads(sdpa_split, qkv, cu, grad_out, causal=True)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours[0], causal[0])


def test_split_kernel_builds_its_grouping_once_per_packed_batch(monkeypatch):
    """Every layer of a forward sees the same packed layout: the grouping into equal lengths is
    built on the first call and kept on the layout (whichever tensor holds the bounds), with
    the same values and grads; another layout builds its own."""
    qkv, cu, grad_out = _packed([6, 6, 4, 0, 6], 4, seed=7)
    builds = []
    build = varlen_layout._sdpa_groups
    monkeypatch.setattr(varlen_layout, "_sdpa_groups",
                        lambda *a: builds.append(a) or build(*a))
    layout = varlen_layout.varlen_layout(cu, None)
    kernel = functools.partial(sdpa_split, layout=layout)
    runs = [_value_and_grads(kernel, qkv, bounds, grad_out) for bounds in (cu, cu, cu.clone())]
    assert len(builds) == 1
    ref = _value_and_grads(sdpa_varlen, qkv, cu, grad_out)
    for ours in runs:
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    other = torch.tensor([0, 4, 10, 10, 16, 22], dtype=torch.int32)  # lengths 4, 6, 0, 6, 6
    for a, b in zip(_value_and_grads(sdpa_split, qkv, other, grad_out),
                    _value_and_grads(sdpa_varlen, qkv, other, grad_out)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert len(builds) == 2


def test_split_kernel_takes_the_fused_path():
    """SDPA silently falls back to its slow math path on 3-D inputs; ours must not."""
    qkv, cu, grad_out = _packed([9, 1, 30], 4, seed=4)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # raises if the fused kernel cannot run
        _value_and_grads(sdpa_split, qkv, cu, grad_out)
        with pytest.raises(RuntimeError), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SDPA's own note on why it cannot fuse 3-D inputs
            _value_and_grads(sdpa_varlen, qkv, cu, grad_out)


def test_only_empty_sequences_give_an_empty_output():
    (q, k, v), cu, _ = _packed([0, 0], 4, seed=5)
    for kernel in (sdpa_split, sdpa_varlen):
        out = kernel(q, k, v, cu_seqlens=cu, max_seqlen=0, causal=True, scale=0.3)
        assert out.shape == (0, HEADS, HEAD_DIM)


def test_cu_seqlens_that_do_not_cover_the_tokens_are_refused():
    (q, k, v), cu, _ = _packed([4, 5], 4, seed=6)
    with pytest.raises(ValueError, match="cu_seqlens covers 8 tokens but the packed tensors hold 9"):
        sdpa_split(q, k, v, cu_seqlens=torch.tensor([0, 4, 8], dtype=torch.int32), max_seqlen=5,
                   causal=True, scale=0.3)


def test_kernel_dispatch_is_a_function_of_device_dtype_and_availability():
    assert pick_kernel("cuda", torch.bfloat16, flash_available=True) is flash_varlen
    assert pick_kernel("cuda", torch.float16, flash_available=True) is flash_varlen
    assert pick_kernel("cuda", torch.float32, flash_available=True) is sdpa_split  # half only
    assert pick_kernel("cuda", torch.bfloat16, flash_available=False) is sdpa_split
    assert pick_kernel("cpu", torch.bfloat16, flash_available=True) is sdpa_split
    assert pick_kernel("cpu", torch.float32, flash_available=False) is sdpa_split


def test_missing_flash_attn_on_cuda_is_named_with_its_fix():
    message = missing_flash_message("cuda", torch.bfloat16, flash_available=False)
    assert "flash-attn is not installed" in message and attention.FLASH_INSTALL_HINT in message
    assert missing_flash_message("cuda", torch.bfloat16, flash_available=True) is None
    assert missing_flash_message("cuda", torch.float32, flash_available=False) is None
    assert missing_flash_message("cpu", torch.bfloat16, flash_available=False) is None


def test_missing_flash_attn_warning_is_given_once():
    attention._warn_missing_flash_once.cache_clear()
    with pytest.warns(RuntimeWarning, match="pip install flash-attn"):
        attention._warn_missing_flash_once("cuda", torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attention._warn_missing_flash_once("cuda", torch.bfloat16)
    assert caught == []
    attention._warn_missing_flash_once.cache_clear()


def test_cpu_run_gives_no_flash_warning():
    qkv, cu, _ = _packed([3, 4], 4, seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = varlen_attention(*(x.detach() for x in qkv), cu_seqlens=cu, max_seqlen=4, scale=0.3)
    assert out.shape == (7, HEADS, HEAD_DIM)
