"""Ulysses' head rule and byte counts (pure), and its attention on one rank (cp=1, no group)
against plain varlen attention; tests/dist/test_ulysses.py runs it over cp ranks."""

import pytest
import torch

from rlhf.config.schema import ulysses_heads_problem
from rlhf.data.packing import SharedPrefix
from rlhf.models.attention import varlen_attention
from rlhf.models.varlen_layout import ulysses_layout, varlen_layout
from rlhf.parallel.context_parallel import plan_context_shard, shard_tokens
from rlhf.parallel.ulysses import bytes_sent


@pytest.mark.parametrize("heads,kv,cp,ok", [
    (8, 8, 2, True), (8, 2, 2, True), (8, 2, 4, True),  # KV heads split, or copied (2 -> 4)
    (4, 1, 4, True), (32, 8, 8, True),
    (6, 2, 4, False),  # query heads do not split
    (12, 3, 4, False),  # 3 KV heads neither split over 4 nor divide it
])
def test_heads_rule(heads, kv, cp, ok):
    problem = ulysses_heads_problem(heads, kv, cp)
    assert (problem is None) == ok, problem


def test_bytes_sent_follow_the_formulas():
    # all_gather: 2 (cp - 1) T_local H_kv D; ulysses: (2 H + 2 max(H_kv, cp)) T_local D (cp-1)/cp
    sent = bytes_sent(cp=4, tokens_local=1000, heads=8, kv_heads=2, head_dim=64, element_size=2)
    assert sent["all_gather"] == 2 * 3 * 1000 * 2 * 64 * 2
    assert sent["ulysses"] == (16 + 8) * 1000 * 64 * 3 // 4 * 2


@pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared-prompt"])
def test_one_rank_equals_plain_attention(shared):
    # shared: sequence 2 reads sequence 0's first 3 tokens as its prompt (a SharedPrefix)
    lens, prefix_lens = [9, 1, 4], [0, 0, 3] if shared else [0, 0, 0]
    prefix = SharedPrefix(torch.zeros(3, dtype=torch.int64), torch.tensor(prefix_lens))
    prefix = prefix if shared else None
    cu = torch.tensor([0, 9, 10, 14], dtype=torch.int32)
    shard = plan_context_shard(lens, cp=1, rank=0, prefix_starts=[0, 0, 0],
                               prefix_lens=prefix_lens)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lens), h, 8, generator=gen) for h in (4, 2, 2))
    want = varlen_attention(q, k, v, cu_seqlens=cu, max_seqlen=9, scale=0.3, prefix=prefix)
    layout = ulysses_layout(shard, varlen_layout(cu, prefix), prefix, group=None, device="cpu")
    local = [shard_tokens(x, shard) for x in (q, k, v)]
    got = varlen_attention(*local, cu_seqlens=torch.tensor(shard.query_bounds,
                                                           dtype=torch.int32),
                           max_seqlen=shard.max_query, scale=0.3, layout=layout)
    real = shard.holds_token
    torch.testing.assert_close(got[real], want[shard.source[real]])
    assert (got[~real] == 0).all()  # padding rows: zeros, seen by no real token
    if shared:  # the prompt did change sequence 2's output
        plain = varlen_attention(q, k, v, cu_seqlens=cu, max_seqlen=9, scale=0.3)
        assert not torch.allclose(want[10:], plain[10:])
