"""make_micro_batches: response fields land on the positions that predict them; token budget."""

import pytest
import torch

from rlhf.data.packing import shifted_targets
from rlhf.data.ragged import Ragged
from rlhf.engine.micro_batch import (
    MicroBatch,
    collect_response_values,
    make_micro_batches,
    predicting_positions,
)


def _r(rows):
    return Ragged.from_list(rows)  # python lists: empty rows take the others' dtype


def test_response_values_sit_at_the_predicting_positions():
    prompts, responses = _r([[1, 2], [3]]), _r([[10, 11, 12], [13, 14]])
    adv = _r([[0.1, 0.2, 0.3], [0.4, 0.5]])
    mask = _r([[True, False, True], [True, True]])
    [mb] = make_micro_batches(prompts, responses, {"adv": adv, "mask": mask}, max_tokens=100)
    # stream: 1 2 10 11 12 | 3 13 14 ; token at p is predicted at p - 1
    assert mb.packed.tokens.tolist() == [1, 2, 10, 11, 12, 3, 13, 14]
    assert mb.tensors["adv"].tolist() == pytest.approx([0, .1, .2, .3, 0, .4, .5, 0])
    assert mb.tensors["mask"].tolist() == [False, True, False, True, False, True, True, False]
    assert mb.tensors["mask"].dtype == torch.bool
    assert mb.predicts_response_T.tolist() == [False, True, True, True, False, True, True, False]
    # the next-token targets at those positions are exactly the response tokens
    targets_T, valid_T = shifted_targets(mb.packed)
    pred_T = mb.predicts_response_T
    assert valid_T[pred_T].all()
    assert targets_T[pred_T].tolist() == [10, 11, 12, 13, 14]
    assert mb.sample_ids.tolist() == [0, 1]


def test_feature_dims_and_empty_responses_are_kept():
    prompts, responses = _r([[1], [2, 3]]), _r([[], [4]])
    feats = Ragged(torch.tensor([[1.0, 2.0]]), torch.tensor([0, 0, 1]))
    [mb] = make_micro_batches(prompts, responses, {"f": feats}, max_tokens=10)
    assert mb.tensors["f"].shape == (4, 2)
    assert mb.tensors["f"].tolist() == [[0, 0], [0, 0], [1, 2], [0, 0]]


def test_budget_is_respected_in_order():
    lengths = [(3, 2), (1, 2), (2, 2), (4, 2), (1, 1)]  # totals 5 3 4 6 2, budget 8
    prompts = _r([list(range(1, p + 1)) for p, _ in lengths])
    responses = _r([[7] * r for _, r in lengths])
    mbs = make_micro_batches(prompts, responses, max_tokens=8)
    assert [mb.sample_ids.tolist() for mb in mbs] == [[0, 1], [2], [3, 4]]
    assert [mb.num_tokens for mb in mbs] == [8, 4, 8]
    assert all(mb.num_tokens <= 8 for mb in mbs)


def test_sample_cap_splits_alongside_the_token_budget():
    prompts, responses = _r([[1, 2]] * 5), _r([[7]] * 5)  # 3 tokens each
    mbs = make_micro_batches(prompts, responses, max_tokens=100, max_seqs=2)
    assert [mb.sample_ids.tolist() for mb in mbs] == [[0, 1], [2, 3], [4]]
    mbs = make_micro_batches(prompts, responses, max_tokens=7, max_seqs=3)  # budget binds first
    assert [mb.sample_ids.tolist() for mb in mbs] == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="max_seqs"):
        make_micro_batches(prompts, responses, max_tokens=7, max_seqs=0)


def test_a_sequence_longer_than_the_budget_names_both_numbers():
    prompts, responses = _r([[1, 2], [1, 2, 3, 4]]), _r([[5], [5, 6, 7]])
    with pytest.raises(ValueError, match=r"sample 1 has 7 tokens.*max_tokens=6"):
        make_micro_batches(prompts, responses, max_tokens=6)


def test_mismatched_fields_and_empty_prompts_are_refused():
    prompts, responses = _r([[1], [2]]), _r([[3, 4], [5]])
    with pytest.raises(ValueError, match="per_token\\['adv'\\]"):
        make_micro_batches(prompts, responses, {"adv": _r([[0.1], [0.2]])}, max_tokens=10)
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        make_micro_batches(prompts, _r([[3]]), max_tokens=10)
    with pytest.raises(ValueError, match="empty prompt"):
        make_micro_batches(_r([[1], []]), responses, max_tokens=10)


def test_collect_response_values_inverts_the_scatter():
    gen = torch.Generator().manual_seed(0)
    prompts = _r([torch.randint(0, 9, (k,), generator=gen).tolist() for k in (2, 1, 3, 2)])
    responses = _r([torch.randint(0, 9, (k,), generator=gen).tolist() for k in (3, 0, 2, 4)])
    vals = Ragged(torch.randn(9, generator=gen), responses.offsets.clone())
    mbs = make_micro_batches(prompts, responses, {"v": vals}, max_tokens=6)
    assert len(mbs) > 1
    back = collect_response_values([mb.tensors["v"] for mb in mbs], mbs)
    assert back.equal(vals)
    # order comes from sample_ids, not from the list order
    back = collect_response_values([mb.tensors["v"] for mb in mbs[::-1]], mbs[::-1])
    assert back.equal(vals)


def test_to_moves_every_tensor():
    [mb] = make_micro_batches(_r([[1]]), _r([[2]]), {"a": _r([[1.0]])}, max_tokens=4)
    assert mb.to("cpu") is mb
    moved = MicroBatch(mb.packed, mb.tensors, mb.sample_ids).to("meta")
    assert moved.packed.tokens.device.type == "meta" and moved.tensors["a"].is_meta
    assert predicting_positions(mb.packed).tolist() == [True, False]
