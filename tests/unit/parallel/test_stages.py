"""Pipeline stage layout: even and uneven layer splits, interleaved chunks, first/last stage."""

import pytest

from rlhf.config.schema import ParallelConfig
from rlhf.errors import ConfigError
from rlhf.parallel.p2p import activation_shape, message_tag
from rlhf.parallel.stages import rank_chunks, split_layers, stage_rank


@pytest.mark.parametrize("num_layers, stages", [(4, 2), (5, 2), (7, 4), (8, 8), (30, 4)])
def test_even_split_covers_every_layer_once_within_one_layer_of_even(num_layers, stages):
    bounds = split_layers(num_layers, stages=stages)
    assert len(bounds) == stages and bounds[0][0] == 0 and bounds[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous
    counts = [stop - start for start, stop in bounds]
    assert max(counts) - min(counts) <= 1 and min(counts) >= 1
    assert counts[0] == num_layers // stages  # the embedding stage never gets an extra layer


def test_explicit_layers_per_stage_are_used_as_given():
    assert split_layers(6, stages=3, layers_per_stage=(1, 4, 1)) == [(0, 1), (1, 5), (5, 6)]


@pytest.mark.parametrize("counts, stages, layers", [((1, 2), 2, 4), ((2, 2, 0), 3, 4),
                                                    ((4,), 2, 4)])
def test_bad_layers_per_stage_is_refused_with_the_rule(counts, stages, layers):
    with pytest.raises(ConfigError, match="layers_per_stage=.* must have pp \\* vpp"):
        split_layers(layers, stages=stages, layers_per_stage=counts)


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ConfigError, match="need at least 4 decoder layers but the model has 3"):
        split_layers(3, stages=4)


def test_interleaved_chunks_follow_megatron_and_own_embedding_and_head():
    pp, vpp, layers = 2, 3, 12
    chunks = {r: rank_chunks(layers, pp=pp, vpp=vpp, pp_rank=r) for r in range(pp)}
    assert [c.virtual_stage for c in chunks[0]] == [0, 2, 4]
    assert [c.virtual_stage for c in chunks[1]] == [1, 3, 5]
    assert [c.layer_range for c in chunks[1]] == [(2, 4), (6, 8), (10, 12)]
    assert chunks[1][0].layer_names == ("2", "3")
    flags = [(c.virtual_stage, c.has_embedding, c.has_head) for r in chunks for c in chunks[r]]
    assert {v for v, emb, _ in flags if emb} == {0} and {v for v, _, head in flags if head} == {5}
    assert all(stage_rank(c.virtual_stage, pp) == r for r in chunks for c in chunks[r])


def test_uneven_plan_lays_out_the_stages_of_a_parallel_config():
    plan = ParallelConfig(pp=2, layers_per_stage=(1, 3))
    first, last = (rank_chunks(4, pp=plan.pp, pp_rank=r, layers_per_stage=plan.layers_per_stage)
                   for r in range(2))
    assert first[0].layer_range == (0, 1) and first[0].has_embedding and not first[0].has_head
    assert last[0].layer_range == (1, 4) and last[0].has_head and not last[0].has_embedding


def test_rank_out_of_range_is_refused():
    with pytest.raises(ValueError, match="pp_rank must be in"):
        rank_chunks(4, pp=2, pp_rank=2)


@pytest.mark.parametrize("tokens, tp, sp, want", [(10, 1, False, (10, 8)), (10, 2, False, (10, 8)),
                                                  (10, 2, True, (5, 8)), (11, 4, True, (3, 8))])
def test_activation_shape_is_the_sequence_parallel_chunk(tokens, tp, sp, want):
    assert activation_shape(tokens, 8, tp=tp, sequence_parallel=sp) == want


def test_message_tags_are_unique_within_a_run():
    tags = {message_tag(i, v, d, num_virtual_stages=6)
            for i in range(9) for v in range(6) for d in (0, 1)}
    assert len(tags) == 9 * 6 * 2
