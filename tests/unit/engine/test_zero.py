"""The pure ZeRO-1 partition: every element owned once, equal shards, padding bounded."""

import pytest

from rlhf.engine.zero import num_shards, partition, state_bytes


def _owned_elements(part, rank):
    return {(p.param, k) for p in part.pieces(rank) for k in range(p.start, p.stop)}


@pytest.mark.parametrize("numels,shards,bucket", [
    ([6, 5, 7], 2, 100), ([6, 5, 7], 4, 100), ([6, 5, 7], 3, 8), ([1], 4, 1),
    ([10, 3, 3, 20, 1], 4, 12), ([4, 4], 1, 100),
])
def test_every_element_is_owned_by_exactly_one_rank(numels, shards, bucket):
    part = partition(numels, shards, bucket_numel=bucket)
    owned = [_owned_elements(part, r) for r in range(shards)]
    assert sum(len(o) for o in owned) == sum(numels)
    assert set().union(*owned) == {(i, k) for i, n in enumerate(numels) for k in range(n)}
    assert part.total % shards == 0 and part.shard_size * shards == part.total
    # padding: fewer than `shards` elements per bucket
    assert sum(numels) <= part.total < sum(numels) + shards * len(part.buckets)
    for i in range(len(numels)):
        assert set(part.owners(i)) == {r for r in range(shards)
                                       if any(p.param == i for p in part.pieces(r))}


def test_pieces_sit_at_their_flat_offsets_inside_the_shard():
    part = partition([6, 5, 7], 2, bucket_numel=100)
    assert part.offsets == (0, 6, 11) and part.total == 18 and part.shard_size == 9
    assert part.shard_ranges(0) == [(0, 9)] and part.shard_ranges(1) == [(9, 18)]
    assert [(p.param, p.start, p.stop, p.shard_start) for p in part.pieces(0)] == [
        (0, 0, 6, 0), (1, 0, 3, 6)]
    assert [(p.param, p.start, p.stop, p.shard_start) for p in part.pieces(1)] == [
        (1, 3, 5, 0), (2, 0, 7, 2)]
    assert part.owners(1) == (0, 1)


def test_buckets_hold_whole_parameters_and_are_padded_each():
    part = partition([6, 5, 7], 4, bucket_numel=11)
    assert [(b.first, b.stop, b.start, b.numel) for b in part.buckets] == [
        (0, 2, 0, 12), (2, 3, 12, 8)]
    assert part.offsets == (0, 6, 12)
    big = partition([3, 50, 3], 2, bucket_numel=10)  # a parameter over the bucket size: alone
    assert [(b.first, b.stop) for b in big.buckets] == [(0, 1), (1, 2), (2, 3)]


def test_one_shard_is_the_unpadded_layout():
    part = partition([6, 5, 7], 1)
    assert part.total == 18 and part.pieces(0)[2].shard_start == 11


def test_state_bytes_shrink_the_optimizer_by_the_dp_size():
    numels = [1000, 10, 3000]
    full = state_bytes(numels, param_bytes=2, shards=1)
    zero = state_bytes(numels, param_bytes=2, shards=4)
    assert full == {"weights": 8020, "grads": 16040, "masters": 16040, "optimizer": 32080}
    assert zero["optimizer"] == 8 * 1003  # 4010 elements padded to 4012, a quarter each
    assert zero["masters"] == 4 * 1003 and zero["grads"] == 4 * 4012
    assert state_bytes(numels, param_bytes=4, shards=4)["masters"] == 0


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="shards"):
        partition([1], 0)
    with pytest.raises(ValueError, match="rank"):
        partition([4], 2).pieces(2)


def test_zero1_is_on_by_default_when_dp_exceeds_one():
    assert [num_shards(1, None), num_shards(4, None), num_shards(4, False),
            num_shards(4, True), num_shards(1, True)] == [1, 4, 1, 4, 1]
    with pytest.raises(ValueError, match="dp"):
        num_shards(0, None)
