"""The context-parallel shard plan (pure arithmetic), and attention over a shard in one process:
every rank's local stream is built from the whole one, concatenated in cp-rank order as the
cp all-gather would (gathering over no group is a no-op), and each rank's attention output
must equal the unsharded attention's at the tokens it holds, through sdpa_split and through
the flash-style paths (flash-attn's and torch's varlen calls, faked on CPU by the stand-ins of
tests/unit/models), with and without shared prompts (a GRPO-like pack: several prompts x n
samples, one long response)."""

import pytest
import torch

from rlhf.data.packing import pack, pack_prompt_response
from rlhf.models import attention, varlen_kernels
from rlhf.models.varlen_kernels import torch_varlen
from rlhf.models.varlen_layout import context_layout
from rlhf.parallel.context_parallel import plan_context_shard, shard_tokens
from tests.unit.data.test_shared_prompts import grouped
from tests.unit.models.fake_flash import make_flash_attn_varlen_func
from tests.unit.models.test_varlen_kernels import varlen_2_10, varlen_2_12

LENGTHS = [45, 3, 1, 0, 7, 2, 10]
# (prompt length, response lengths): runs of samples sharing a prompt, one long response, an
# empty one, a 1-token prompt (nothing shared) and a lone sample
GRPO = [(6, [3, 40, 1, 0]), (9, [5, 2, 6]), (1, [2, 2]), (4, [7]), (5, [12, 3])]


def _packs():
    """The GRPO-like samples packed with shared prompts and whole (for the reference)."""
    prompts, responses = grouped(GRPO, seed=1)
    return (pack_prompt_response(prompts, responses, share_prompts=True),
            pack_prompt_response(prompts, responses))


def _plan(packed, *, cp, rank, multiple=1):
    prefix = packed.prefix
    return plan_context_shard(packed.seq_lens.tolist(), cp=cp, rank=rank, multiple=multiple,
                              prefix_starts=None if prefix is None else prefix.starts.tolist(),
                              prefix_lens=None if prefix is None else prefix.lens.tolist())


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


def test_plan_rejects_prefix_runs_outside_the_stream():
    with pytest.raises(ValueError, match="must lie inside the stream of 7 tokens"):
        plan_context_shard([4, 3], cp=2, rank=0, prefix_starts=[0, 5], prefix_lens=[0, 3])
    with pytest.raises(ValueError, match="2 sequences but 1 prefix starts"):
        plan_context_shard([4, 3], cp=2, rank=0, prefix_starts=[0], prefix_lens=[0])


def _visible_keys(packed):
    """Per stream token, the stream tokens its query sees unsharded: its shared prompt's run,
    then its own sequence up to itself."""
    bounds, out = packed.cu_seqlens.tolist(), []
    prefix = packed.prefix
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        start, shared = (0, 0) if prefix is None else (int(prefix.starts[i]),
                                                       int(prefix.lens[i]))
        out += [[*range(start, start + shared), *range(a, t + 1)] for t in range(a, b)]
    return out


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("multiple", [1, 2])
def test_every_query_sees_its_unsharded_keys_with_shared_prompts(cp, multiple):
    """Each real query's keys, read through key_rows and the bottom-right causal alignment of
    its run, are the unsharded query's keys in order; positions are the packing's."""
    packed, _ = _packs()
    assert packed.prefix is not None and int(packed.prefix.lens.max()) == 8
    shards = [_plan(packed, cp=cp, rank=r, multiple=multiple) for r in range(cp)]
    gathered = torch.cat([s.source for s in shards])  # the stream token of every gathered row
    want = _visible_keys(packed)
    seen = []
    for s in shards:
        for j, (a, b) in enumerate(zip(s.query_bounds[:-1], s.query_bounds[1:])):
            keys = s.key_rows[s.key_bounds[j]:s.key_bounds[j + 1]]
            for q in range(a, b):
                token = int(s.source[q])
                if token >= 0:  # query q sees the run's keys up to its own diagonal
                    visible = gathered[keys[:keys.numel() - (b - q) + 1]]
                    assert visible.tolist() == want[token], (s.rank, j, q)
                    seen.append(token)
        real = s.source >= 0
        assert torch.equal(s.positions[real], packed.position_ids[s.source[real]])
    assert sorted(seen) == list(range(packed.tokens.shape[0]))
    # the prompt's keys cost every rank the same: balance is kept
    work = [sum((b - a) * ((kb - ka) - (b - a) + (b - a + 1) / 2)
                for a, b, ka, kb in zip(s.query_bounds[:-1], s.query_bounds[1:],
                                         s.key_bounds[:-1], s.key_bounds[1:])) for s in shards]
    assert max(work) == min(work)


@pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared-prompts"])
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_attention_on_shards_equals_the_whole_streams(cp, shared, monkeypatch):
    gen = torch.Generator().manual_seed(cp)
    packed = _packs()[0] if shared else pack([torch.zeros(n) for n in LENGTHS])
    total, heads, kv_heads, dim = packed.tokens.shape[0], 4, 2, 8  # 2 KV heads: < cp=3, 4
    q, k, v = (torch.randn(total, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    want = attention.sdpa_varlen(q, k, v, cu_seqlens=packed.cu_seqlens,
                                 max_seqlen=packed.max_seqlen, causal=True, scale=dim ** -0.5,
                                 prefix=packed.prefix)
    shards = [_plan(packed, cp=cp, rank=r, multiple=2) for r in range(cp)]
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
