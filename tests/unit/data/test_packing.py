"""Packing into one token stream, checked against per-sequence python loops."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from rlhf.data.packing import (
    Packed,
    pack,
    pack_prompt_response,
    response_values,
    shifted_targets,
)
from rlhf.data.ragged import Ragged

FAST = settings(max_examples=40, deadline=None)
lengths_st = st.lists(st.integers(0, 7), min_size=0, max_size=8)


def seqs_of(lengths, seed=0, low=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, 1000, (n,), generator=g) for n in lengths]


def unpack(values_T: Tensor, cu_seqlens: Tensor) -> list[Tensor]:
    """Split a per-token tensor (T, *feature_dims) back into per-sequence views: the inverse
    of `pack` that these tests check it against."""
    if not isinstance(cu_seqlens, Tensor):
        raise ValueError(f"unpack: cu_seqlens must be a tensor, got {type(cu_seqlens).__name__}")
    try:
        rows = Ragged(values_T, cu_seqlens.to(device=values_T.device, dtype=torch.int64))
    except ValueError as e:
        raise ValueError(f"unpack: values_T does not match cu_seqlens: {e}") from e
    return rows.to_list()


def loop_cu_seqlens(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


@FAST
@given(lengths=lengths_st)
def test_pack_unpack_roundtrip(lengths):
    seqs = seqs_of(lengths)
    packed = pack(seqs)
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == loop_cu_seqlens(lengths)
    expected_tokens = [t for s in seqs for t in s.tolist()]
    assert packed.tokens.tolist() == expected_tokens
    assert packed.position_ids.tolist() == [p for n in lengths for p in range(n)]
    assert packed.position_ids.dtype == torch.int64
    assert packed.max_seqlen == max(lengths, default=0)
    assert packed.num_seqs == len(lengths) and packed.seq_lens.tolist() == lengths
    back = unpack(packed.tokens, packed.cu_seqlens)
    assert len(back) == len(seqs) and all(torch.equal(a, b) for a, b in zip(back, seqs))
    from_ragged = pack(Ragged.from_list(seqs, dtype=torch.int64))
    assert torch.equal(from_ragged.tokens, packed.tokens)
    assert torch.equal(from_ragged.cu_seqlens, packed.cu_seqlens)


def test_unpack_keeps_trailing_feature_dims():
    packed = pack(seqs_of([3, 0, 2]))
    hidden_TH = torch.arange(5 * 4, dtype=torch.float32).reshape(5, 4)
    rows = unpack(hidden_TH, packed.cu_seqlens)
    assert [tuple(r.shape) for r in rows] == [(3, 4), (0, 4), (2, 4)]
    assert torch.equal(rows[2], hidden_TH[3:5])
    with pytest.raises(ValueError, match="unpack: .*end at 5 but values has 4"):
        unpack(hidden_TH[:4], packed.cu_seqlens)


def test_pack_edge_cases():
    empty = pack([])
    assert empty.tokens.numel() == 0 and empty.cu_seqlens.tolist() == [0] and empty.max_seqlen == 0
    assert unpack(empty.tokens, empty.cu_seqlens) == []
    ones = pack([torch.tensor([5]), torch.tensor([6]), torch.tensor([7])])
    assert ones.position_ids.tolist() == [0, 0, 0] and ones.cu_seqlens.tolist() == [0, 1, 2, 3]
    assert ones.max_seqlen == 1
    all_empty = pack([torch.zeros(0, dtype=torch.int64)] * 3)
    assert all_empty.cu_seqlens.tolist() == [0, 0, 0, 0] and all_empty.position_ids.numel() == 0
    with pytest.raises(ValueError, match="pack: .*row 1"):
        pack([torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32)])
    with pytest.raises(AttributeError):
        ones.max_seqlen = 3  # frozen


def loop_prompt_response(prompts, responses):
    tokens, mask, positions, cu = [], [], [], [0]
    for p, r in zip(prompts, responses):
        seq = p.tolist() + r.tolist()
        tokens += seq
        mask += [False] * len(p) + [True] * len(r)
        positions += list(range(len(seq)))
        cu.append(cu[-1] + len(seq))
    return tokens, mask, positions, cu


def loop_shifted(seqs):
    targets, valid = [], []
    for s in seqs:
        s = s.tolist()
        for t in range(len(s)):
            last = t == len(s) - 1
            targets.append(0 if last else s[t + 1])
            valid.append(not last)
    return targets, valid


@FAST
@given(prompt_lens=lengths_st, data=st.data())
def test_pack_prompt_response_matches_loop(prompt_lens, data):
    n = len(prompt_lens)
    response_lens = data.draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    prompts, responses = seqs_of(prompt_lens, 1), seqs_of(response_lens, 2)
    packed = pack_prompt_response(prompts, responses)
    tokens, mask, positions, cu = loop_prompt_response(prompts, responses)
    assert packed.tokens.tolist() == tokens
    assert packed.response_mask.dtype == torch.bool and packed.response_mask.tolist() == mask
    assert packed.position_ids.tolist() == positions
    assert packed.cu_seqlens.dtype == torch.int32 and packed.cu_seqlens.tolist() == cu
    assert packed.prompt_lens.tolist() == prompt_lens
    assert packed.response_lens.tolist() == response_lens
    assert packed.max_seqlen == max((p + r for p, r in zip(prompt_lens, response_lens)), default=0)
    as_ragged = pack_prompt_response(Ragged.from_list(prompts), Ragged.from_list(responses))
    assert torch.equal(as_ragged.tokens, packed.tokens)

    # Values on the packed stream: each token's value is its own stream index.
    values_T = torch.arange(len(tokens), dtype=torch.float32)
    got = response_values(values_T, packed).to_list()
    expected, start = [], 0
    for p, r in zip(prompt_lens, response_lens):
        expected.append(list(range(start + p, start + p + r)))
        start += p + r
    assert [g.tolist() for g in got] == expected

    targets, valid = shifted_targets(packed)
    seqs = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    assert (targets.tolist(), valid.tolist()) == loop_shifted(seqs)

    if any(p == 0 and r > 0 for p, r in zip(prompt_lens, response_lens)):
        with pytest.raises(ValueError, match="non-empty prompt"):
            response_values(values_T, packed, next_token=True)
    else:
        shifted = response_values(values_T, packed, next_token=True).to_list()
        assert [s.tolist() for s in shifted] == [[i - 1 for i in e] for e in expected]


def test_next_token_log_probs_pick_the_response_tokens():
    """Log-probs computed at t for tokens[t+1], read back per response, score those tokens."""
    prompts = [torch.tensor([3, 1]), torch.tensor([4]), torch.tensor([2, 2, 2])]
    responses = [torch.tensor([5, 6, 7]), torch.tensor([], dtype=torch.int64), torch.tensor([1])]
    packed = pack_prompt_response(prompts, responses)
    logits_TV = torch.randn(packed.tokens.shape[0], 8, requires_grad=True)
    targets_T, valid_T = shifted_targets(packed)
    logp_T = torch.log_softmax(logits_TV, -1).gather(-1, targets_T[:, None])[:, 0] * valid_T
    got = response_values(logp_T, packed, next_token=True)
    start = 0
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ref = [
            torch.log_softmax(logits_TV[start + len(p) + j - 1], -1)[int(token)]
            for j, token in enumerate(r)
        ]
        assert torch.allclose(got[i], torch.stack(ref) if ref else torch.zeros(0))
        start += len(p) + len(r)
    got.values.sum().backward()  # gradients reach exactly the rows that predict response tokens
    assert logits_TV.grad.abs().sum(-1).nonzero().flatten().tolist() == [1, 2, 3, 8]


def test_prompt_response_edge_cases():
    empty_resp = [torch.zeros(0, dtype=torch.int64)] * 2
    packed = pack_prompt_response([torch.tensor([1, 2]), torch.tensor([3])], empty_resp)
    assert not packed.response_mask.any() and packed.response_lens.tolist() == [0, 0]
    for next_token in (False, True):
        got = response_values(torch.ones(3), packed, next_token=next_token)
        assert [r.tolist() for r in got.to_list()] == [[], []]
    singles = pack_prompt_response([[1], [2]], [[9], [8]])
    assert singles.tokens.tolist() == [1, 9, 2, 8] and singles.position_ids.tolist() == [0, 1, 0, 1]
    targets, valid = shifted_targets(singles)
    assert targets.tolist() == [9, 0, 8, 0] and valid.tolist() == [True, False, True, False]
    nothing = pack_prompt_response([], [])
    assert nothing.tokens.numel() == 0 and nothing.cu_seqlens.tolist() == [0]
    assert len(response_values(torch.zeros(0), nothing)) == 0
    assert shifted_targets(nothing)[0].numel() == 0
    assert isinstance(singles, Packed)


def test_prompt_response_errors():
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        pack_prompt_response([torch.tensor([1]), torch.tensor([2])], [torch.tensor([3])])
    with pytest.raises(ValueError, match="prompts are torch.int64 .* responses are torch.int32"):
        pack_prompt_response([torch.tensor([1])], [torch.tensor([3], dtype=torch.int32)])
    packed = pack_prompt_response([torch.tensor([1])], [torch.tensor([3])])
    with pytest.raises(ValueError, match="values_T has 3 positions but the packed stream has 2"):
        response_values(torch.zeros(3), packed)
    with pytest.raises(ValueError, match="1-D token ids"):
        shifted_targets(pack([torch.zeros(2, 3)]))
