"""Tensor/vocab-parallel helpers on one process (no process group): vocab padding and shard
ranges, slicing, and the vocab log-prob / entropy functions in fp32 and bf16."""

import pytest
import torch

from rlhf.parallel.tensor_parallel import shard_for_rank
from rlhf.parallel.vocab_parallel import (
    padded_vocab_size,
    vocab_parallel_entropy,
    vocab_parallel_log_probs,
    vocab_shard_range,
)


def _leaf(t):
    return t.detach().clone().requires_grad_()


def test_helpers_without_a_process_group():
    assert padded_vocab_size(11, 4) == 12 and padded_vocab_size(12, 4) == 12
    assert padded_vocab_size(11, 2, pad_to_multiple_of=8) == 16
    assert vocab_shard_range(12, 3, 4) == (9, 12)
    full = torch.arange(12).reshape(3, 4)
    assert shard_for_rank(full, 1, 1, 2).tolist() == [[2, 3], [6, 7], [10, 11]]
    with pytest.raises(ValueError, match="not divisible"):
        shard_for_rank(full, 0, 0, 2)
    with pytest.raises(ValueError, match="not divisible by tp=1|positive"):
        padded_vocab_size(0, 2)
    with pytest.raises(ValueError, match="vocab range"):
        vocab_parallel_entropy(torch.zeros(2, 3), group=None, vocab_start=0, vocab_end=4,
                               real_vocab_size=4)


def test_vocab_functions_in_bf16_and_with_masked_logits_without_a_group():
    torch.manual_seed(0)
    logits = torch.randn(5, 7) * 4
    logits[0, 3] = float("-inf")  # a caller-masked token
    targets = torch.tensor([0, 6, 2, 3, 1])
    kw = dict(group=None, vocab_start=0, vocab_end=7, real_vocab_size=7)
    for dtype in (torch.float32, torch.bfloat16):
        x = _leaf(logits.to(dtype))
        # reference: -inf as a finite logit whose exp underflows to exactly 0 (no nan grads)
        ref_in = _leaf(x.detach().float().clamp(min=-1e4))
        logp_ref = torch.log_softmax(ref_in, -1)
        ent_ref = -(logp_ref.exp() * logp_ref).sum(-1)
        (logp_ref.gather(-1, targets[:, None])[:, 0].sum() + ent_ref.sum()).backward()
        logp = vocab_parallel_log_probs(x, targets, **kw)
        ent = vocab_parallel_entropy(x, **kw)
        (logp.sum() + ent.sum()).backward()
        assert logp.dtype == ent.dtype == torch.float32 and x.grad.dtype == dtype
        torch.testing.assert_close(logp, logp_ref.gather(-1, targets[:, None])[:, 0].detach())
        torch.testing.assert_close(ent, ent_ref.detach())
        assert torch.isfinite(x.grad).all() and x.grad[0, 3] == 0
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # the grad is rounded to bf16
        torch.testing.assert_close(x.grad.float(), ref_in.grad, atol=tol, rtol=tol)
