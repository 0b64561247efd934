"""`flash_varlen` (the CUDA path) on the CPU, through a stand-in for flash-attn's varlen
kernel (tests/unit/models/fake_flash.py), against the per-sequence reference `sdpa_varlen`:
values and grads, with and without shared prompts, with the sequence-parallel dummy."""

from __future__ import annotations

import pytest
import torch

from rlhf.data.packing import pack_prompt_response
from rlhf.data.ragged import Ragged
from rlhf.models import attention
from rlhf.models.attention import flash_varlen, sdpa_varlen
from rlhf.models.outputs import sp_pad
from rlhf.models.varlen_layout import varlen_layout
from tests.unit.models.fake_flash import make_flash_attn_varlen_func

HEADS, KV_HEADS, HEAD_DIM, SCALE = 4, 2, 8, 0.3


def _packed(seed: int, *, share: bool, group: int = 3):
    """Prompt+response sequences (every prompt on `group` consecutive samples)."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(3):
        prompt = torch.randint(0, 50, (int(torch.randint(2, 7, (1,), generator=gen)),),
                               generator=gen)
        for _ in range(group):
            prompts.append(prompt)
            responses.append(torch.randint(0, 50, (int(torch.randint(0, 6, (1,),
                                                                     generator=gen)),),
                                           generator=gen))
    return pack_prompt_response(Ragged.from_list(prompts), Ragged.from_list(responses),
                                share_prompts=share)


def _qkv(num_tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed + 100)
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    return [q, k, v], torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen)


def _run(kernel, qkv, grad_out, packed, *, dtype=torch.float32, **kw):
    leaves = [x.detach().to(dtype).requires_grad_() for x in qkv]
    out = kernel(*leaves, cu_seqlens=packed.cu_seqlens, max_seqlen=packed.max_seqlen,
                 causal=True, scale=SCALE, prefix=packed.prefix, **kw)
    out.float().backward(grad_out)
    return [out.detach().float()] + [x.grad.float() for x in leaves]


@pytest.fixture
def fp32_flash(monkeypatch):
    monkeypatch.setattr(attention, "_flash_fn", lambda: make_flash_attn_varlen_func(
        half_only=False))


@pytest.mark.parametrize("share", [False, True], ids=["own-prompts", "shared-prompts"])
@pytest.mark.parametrize("sp_dummy", [False, True], ids=["", "sp-dummy"])
@pytest.mark.parametrize("with_layout", [False, True], ids=["reads-back", "layout"])
@pytest.mark.parametrize("seed", [0, 1])
def test_flash_varlen_equals_the_reference_in_values_and_grads(fp32_flash, share, sp_dummy,
                                                              with_layout, seed):
    packed = _packed(seed, share=share)
    assert (packed.prefix is not None) == share
    if sp_dummy:  # tp = 4: a dummy sequence fills the stream to a multiple of 4
        num_tokens = packed.tokens.shape[0]
        packed = sp_pad(packed, 4 if num_tokens % 4 else 3)
        assert packed.tokens.shape[0] > num_tokens
    qkv, grad_out = _qkv(packed.tokens.shape[0], seed)
    kw = {"layout": varlen_layout(packed.cu_seqlens, packed.prefix)} if with_layout else {}
    got = _run(flash_varlen, qkv, grad_out, packed, **kw)
    want = _run(sdpa_varlen, qkv, grad_out, packed)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_the_sp_dummy_layout_equals_one_built_from_the_padded_stream():
    packed = _packed(3, share=True)
    padded = sp_pad(packed, 4 if packed.tokens.shape[0] % 4 else 3)
    from_micro_batch = varlen_layout(packed.cu_seqlens, packed.prefix).padded(
        padded.tokens.shape[0])
    direct = varlen_layout(padded.cu_seqlens, padded.prefix)
    assert from_micro_batch.bounds == direct.bounds
    assert from_micro_batch.max_k == direct.max_k
    assert torch.equal(from_micro_batch.source_K, direct.source_K)
    assert torch.equal(from_micro_batch.cu_k, direct.cu_k)


@pytest.mark.parametrize("share", [False, True], ids=["own-prompts", "shared-prompts"])
def test_flash_varlen_in_bf16_is_within_bf16_noise_of_the_fp32_reference(monkeypatch, share):
    """The stand-in refuses float32 as flash-attn does; bf16 against the fp32 reference."""
    monkeypatch.setattr(attention, "_flash_fn", make_flash_attn_varlen_func)
    packed = _packed(5, share=share)
    qkv, grad_out = _qkv(packed.tokens.shape[0], 5)
    qkv = [x.to(torch.bfloat16).float() for x in qkv]  # the same values in both dtypes
    got = _run(flash_varlen, qkv, grad_out, packed, dtype=torch.bfloat16)
    want = _run(sdpa_varlen, qkv, grad_out, packed)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2, msg=name)
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        _run(flash_varlen, qkv, grad_out, packed)


def test_the_stand_in_masks_bottom_right_as_flash_attn_documents():
    """flash-attn's docstring: seqlen_q = 2, seqlen_k = 5 keeps [[1 1 1 1 0], [1 1 1 1 1]];
    seqlen_q = 5, seqlen_k = 2 keeps nothing in rows 0-2, then [1 0], [1 1]."""
    flash = make_flash_attn_varlen_func(half_only=False)
    for lq, lk, want in ((2, 5, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]),
                         (5, 2, [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]])):
        q = torch.zeros(lq, 1, 1)  # equal scores: each query averages the keys it sees
        k = torch.zeros(lk, 1, 1)
        v = torch.eye(lk)[:, None, :]  # key j's value is the unit vector e_j
        out = flash(q, k, v, torch.tensor([0, lq], dtype=torch.int32),
                    torch.tensor([0, lk], dtype=torch.int32), lq, lk, causal=True)
        seen = (out[:, 0, :] > 0).int().tolist()
        assert seen == want
