"""The context-parallel shard plan (pure arithmetic), and attention over a shard in one process:
every rank's local stream is built from the whole one, concatenated in cp-rank order as the
cp all-gather would (gathering over no group is a no-op), and each rank's attention output
must equal the unsharded attention's at the tokens it holds, through sdpa_split and through
the flash-style paths (flash-attn's and torch's varlen calls, faked on CPU by the stand-ins of
tests/unit/models)."""

import pytest
import torch

from rlhf.models import attention, varlen_kernels
from rlhf.models.varlen_kernels import torch_varlen
from rlhf.models.varlen_layout import context_layout
from rlhf.parallel.context_parallel import plan_context_shard, shard_tokens
from tests.unit.models.fake_flash import make_flash_attn_varlen_func
from tests.unit.models.test_varlen_kernels import varlen_2_10, varlen_2_12

LENGTHS = [45, 3, 1, 0, 7, 2, 10]


def _starts(lens):
    return [sum(lens[:i]) for i in range(len(lens))]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("multiple", [1, 2, 4])
def test_every_token_is_held_once_and_work_is_balanced(cp, multiple):
    shards = [plan_context_shard(LENGTHS, cp=cp, rank=r, multiple=multiple) for r in range(cp)]
    sizes = {s.num_local for s in shards}
    assert len(sizes) == 1 and sizes.pop() % multiple == 0  # equal shares, a multiple of tp
    held = torch.cat([s.source[s.source >= 0] for s in shards])
    assert sorted(held.tolist()) == list(range(sum(LENGTHS)))
    # token_rows points every stream token at its row of the gathered stream
    gathered = torch.cat([s.source for s in shards])
    for s in shards:
        assert torch.equal(gathered[s.token_rows], torch.arange(sum(LENGTHS)))
    # positions restart per sequence and carry on over the padding
    starts = _starts(LENGTHS)
    for s in shards:
        real = s.source >= 0
        seq = torch.bucketize(s.source[real], torch.tensor(starts), right=True) - 1
        assert torch.equal(s.positions[real], s.source[real] - torch.tensor(starts)[seq])
    # causal work (query x visible key pairs) is the same on every rank: chunks r and 2cp-1-r
    work = [sum((b - a) * ((kb - ka) - (b - a) + (b - a + 1) / 2)
                for a, b, ka, kb in zip(s.query_bounds[:-1], s.query_bounds[1:],
                                         s.key_bounds[:-1], s.key_bounds[1:])) for s in shards]
    tail = shards[0].num_local - 2 * sum(-(-n // (2 * cp)) for n in LENGTHS)
    body = [w - tail * (tail + 1) / 2 for w in work]
    assert max(body) == min(body)


def test_padding_is_at_most_2cp_minus_1_per_sequence():
    shards = [plan_context_shard([16, 17, 1], cp=2, rank=r) for r in range(2)]
    assert [s.num_local for s in shards] == [(16 + 20 + 4) // 2] * 2
    assert sum(int((s.source < 0).sum()) for s in shards) == (20 - 17) + (4 - 1)
    s = shards[0]
    assert s.query_bounds == (0, 4, 8, 13, 18, 19, 20)  # chunks 0 and 3 of each sequence
    assert s.key_bounds == (0, 4, 20, 25, 45, 46, 50)  # keys: the sequence up to the chunk


def test_plan_rejects_bad_ranks():
    with pytest.raises(ValueError, match="cp rank 2 is outside 0..1"):
        plan_context_shard([4], cp=2, rank=2)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_attention_on_shards_equals_the_whole_streams(cp, monkeypatch):
    gen = torch.Generator().manual_seed(cp)
    total, heads, kv_heads, dim = sum(LENGTHS), 4, 2, 8  # 2 KV heads: fewer than cp=3, 4
    q, k, v = (torch.randn(total, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    want = attention.sdpa_varlen(q, k, v, cu_seqlens=cu, max_seqlen=max(LENGTHS), causal=True,
                                 scale=dim ** -0.5)
    shards = [plan_context_shard(LENGTHS, cp=cp, rank=r, multiple=2) for r in range(cp)]
    k_all, v_all = (torch.cat([shard_tokens(x, s) for s in shards]) for x in (k, v))
    monkeypatch.setattr(attention, "_flash_fn",
                        lambda: make_flash_attn_varlen_func(half_only=False))
    for s in shards:
        layout = context_layout(s, group=None, device="cpu")
        q_local, real = shard_tokens(q, s), s.source >= 0
        bounds = torch.tensor(s.query_bounds, dtype=torch.int32)
        for kernel, release in ((attention.sdpa_split, None), (attention.flash_varlen, None),
                                (torch_varlen, varlen_2_10), (torch_varlen, varlen_2_12)):
            monkeypatch.setattr(varlen_kernels, "torch_varlen_fn", lambda r=release: r)
            got = kernel(q_local, k_all, v_all, cu_seqlens=bounds, max_seqlen=s.max_query,
                         causal=True, scale=dim ** -0.5, layout=layout)
            torch.testing.assert_close(got[real], want[s.source[real]], atol=1e-6, rtol=1e-5)
        # the model's entry point: gathering over no group leaves the gathered stream as is
        got = attention.varlen_attention(q_local, k_all, v_all, cu_seqlens=bounds,
                                         max_seqlen=s.max_query, scale=dim ** -0.5,
                                         layout=layout)
        torch.testing.assert_close(got[real], want[s.source[real]], atol=1e-6, rtol=1e-5)
