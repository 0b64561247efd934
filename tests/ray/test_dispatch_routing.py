"""Dispatch routing and collecting, without actors: splits, puts, output ranks, reductions."""

import pytest
import ray
import torch

from rlhf.controller.dispatch import (
    CallRouting,
    Dispatch,
    Layout,
    collect,
    reduce_metrics,
    register,
    registered_methods,
    route_call,
)
from rlhf.data.batch import Batch
from rlhf.data.batch_split import GroupBatches, split_batch

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("ray_cluster")]


@pytest.fixture
def put_counter(monkeypatch):
    """Counts ray.put calls made by the dispatcher."""
    calls = []
    real_put = ray.put

    def counting_put(value, **kw):
        calls.append(value)
        return real_put(value, **kw)

    monkeypatch.setattr(ray, "put", counting_put)
    return calls


def ids(n):
    return Batch({"id": torch.arange(n)})


@pytest.mark.parametrize("dp,pp,tp", [(2, 1, 2), (4, 1, 1), (1, 2, 2), (2, 2, 2), (3, 2, 1)])
def test_layout_uses_megatron_rank_order(dp, pp, tp):
    layout = Layout(dp=dp, pp=pp, tp=tp)
    grid = torch.arange(layout.world_size).reshape(dp, pp, tp)  # ParallelMesh's grid
    for d in range(dp):
        for p in range(pp):
            for t in range(tp):
                assert layout.coordinate(int(grid[d, p, t])) == (d, p, t)
    assert layout.output_ranks() == [int(grid[d, pp - 1, 0]) for d in range(dp)]


@pytest.mark.parametrize("bad", [0, -1, 1.0, True])
def test_layout_rejects_non_positive_sizes(bad):
    with pytest.raises(ValueError, match="Layout.tp"):
        Layout(dp=1, tp=bad)


@pytest.mark.parametrize("n,dp,pp,tp,sizes", [
    (7, 2, 1, 2, [4, 3]),
    (5, 4, 1, 1, [2, 1, 1, 1]),
    (3, 2, 2, 2, [2, 1]),
    (2, 4, 1, 1, [1, 1, 0, 0]),
])
def test_dp_compute_puts_each_chunk_once_and_shares_it(put_counter, n, dp, pp, tp, sizes):
    layout = Layout(dp=dp, pp=pp, tp=tp)
    routing = route_call(Dispatch.DP_COMPUTE, layout, (ids(n),), {"scale": 2})
    assert len(put_counter) == dp  # one put per DP chunk, none for the inline int
    assert routing.weights == sizes
    chunk_refs = []
    for d in range(dp):
        peers = [r for r in range(layout.world_size) if layout.coordinate(r)[0] == d]
        refs = {id(routing.args[r][0][0]) for r in peers}
        assert len(refs) == 1, "tp/pp peers of one DP rank must share one object ref"
        assert all(routing.args[r][1] == {"scale": 2} for r in peers)
        chunk_refs.append(routing.args[peers[0]][0][0])
    chunks = ray.get(chunk_refs)
    assert [len(c) for c in chunks] == sizes
    assert torch.equal(torch.cat([c["id"] for c in chunks]), torch.arange(n))
    assert [r for r in range(layout.world_size) if routing.keep[r]] == layout.output_ranks()


def test_dp_compute_shares_non_batch_arguments_with_one_put(put_counter):
    layout = Layout(dp=2, tp=2)
    config = {"temperature": 0.7}
    routing = route_call(Dispatch.DP_COMPUTE, layout, (ids(4),), {"config": config})
    assert len(put_counter) == 2 + 1  # two chunks, one shared dict
    assert len({id(routing.args[r][1]["config"]) for r in range(4)}) == 1
    assert ray.get(routing.args[3][1]["config"]) == config


def test_dp_compute_needs_a_batch():
    with pytest.raises(TypeError, match="at least one Batch"):
        route_call(Dispatch.DP_COMPUTE, Layout(dp=2), (3,), {})


def test_one_to_all_puts_large_arguments_once(put_counter):
    routing = route_call(Dispatch.ONE_TO_ALL, Layout(dp=4), (ids(3), 5), {"name": "x"})
    assert len(put_counter) == 1
    assert len({id(a[0][0]) for a in routing.args}) == 1
    assert all(a[0][1] == 5 and a[1] == {"name": "x"} for a in routing.args)
    assert routing.keep == [True] * 4


def test_all_to_all_scatters_and_checks_lengths():
    routing = route_call(Dispatch.ALL_TO_ALL, Layout(dp=2, tp=2), ([10, 11, 12, 13],),
                         {"k": ["a", "b", "c", "d"]})
    assert routing.args == [((10 + r,), {"k": "abcd"[r]}) for r in range(4)]
    with pytest.raises(ValueError, match="one element per rank \\(4\\), got 3"):
        route_call(Dispatch.ALL_TO_ALL, Layout(dp=4), ([1, 2, 3],), {})


def test_rank_zero_runs_on_rank_zero_only():
    routing = route_call(Dispatch.RANK_ZERO, Layout(dp=3), (1,), {})
    assert routing.args == [((1,), {}), None, None]
    assert collect(Dispatch.RANK_ZERO, Layout(dp=3), routing, {0: "r0"}) == "r0"


def test_collect_concatenates_output_ranks_in_dp_order():
    layout = Layout(dp=2, pp=2, tp=2)  # output ranks 2 and 6
    routing = CallRouting([((), {})] * 8, [False] * 8)
    results = {2: ids(3), 6: Batch({"id": torch.arange(3, 5)})}
    out = collect(Dispatch.DP_COMPUTE, layout, routing, results)
    assert torch.equal(out["id"], torch.arange(5))
    assert collect(Dispatch.DP_COMPUTE, layout, routing, {2: "a", 6: "b"}) == ["a", "b"]
    assert collect(Dispatch.DP_COMPUTE, layout, routing, {2: None, 6: None}) is None


def split_of(n, dp, mini=None):
    lengths = [(7 * i) % 11 + 1 for i in range(n)]  # uneven, so groups get shuffled rows
    return split_batch(lengths, dp=dp, max_tokens=16, mini_size=mini)


def run_ranks(layout, routing, fn):
    """What the ranks would return: `fn(chunk, group_batches)` on each kept rank."""
    out = {}
    for r in range(layout.world_size):
        if routing.keep[r]:
            args, kwargs = routing.args[r]
            out[r] = fn(ray.get(args[0]), kwargs["split"])
    return out


@pytest.mark.parametrize("dp,pp,tp", [(2, 1, 1), (4, 1, 1), (2, 2, 2)])
def test_planned_dispatch_sends_each_group_its_rows_and_restores_driver_order(put_counter, dp,
                                                                               pp, tp):
    layout, n = Layout(dp=dp, pp=pp, tp=tp), 13
    split = split_of(n, dp)
    assert any(list(r) != sorted(r) or r[0] != 0 for r in split.rows)  # not contiguous chunks
    call = route_call(Dispatch.DP_COMPUTE, layout, (ids(n),), {"split": split})
    assert len(put_counter) == dp and call.weights == [len(r) for r in split.rows]
    for r in range(layout.world_size):
        d = layout.coordinate(r)[0]
        assert call.args[r][1]["split"] is split.groups[d]  # the group's own small split
        assert isinstance(call.args[r][1]["split"], GroupBatches)
        assert ray.get(call.args[r][0][0])["id"].tolist() == list(split.rows[d])
    results = run_ranks(layout, call, lambda chunk, _: Batch({"x": chunk["id"] * 10}))
    out = collect(Dispatch.DP_COMPUTE, layout, call, results)
    assert out["x"].tolist() == [10 * i for i in range(n)]


def test_planned_metrics_call_returns_metrics_and_fields_in_driver_order():
    layout, n = Layout(dp=2), 8
    split = split_of(n, 2, mini=8)
    call = route_call(Dispatch.DP_COMPUTE_METRICS, layout, (ids(n),), {"split": split})
    results = run_ranks(layout, call, lambda chunk, grp: (
        {"loss": float(len(chunk))}, Batch({"y": chunk["id"] + 100})))
    metrics, fields = collect(Dispatch.DP_COMPUTE_METRICS, layout, call, results)
    sizes = [len(r) for r in split.rows]
    assert metrics == pytest.approx({"loss": sum(s * s for s in sizes) / n})
    assert fields["y"].tolist() == list(range(100, 100 + n))
    plain = collect(Dispatch.DP_COMPUTE_METRICS, layout, call, {0: {"a": 1.0}, 1: {"a": 3.0}})
    assert plain == pytest.approx({"a": (sizes[0] + 3 * sizes[1]) / n})


def test_planned_dispatch_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"BatchSplit is for 2 DP groups but the role has 4"):
        route_call(Dispatch.DP_COMPUTE, Layout(dp=4), (ids(6),), {"split": split_of(6, 2)})
    with pytest.raises(ValueError, match=r"covers 6 samples but a Batch argument has 5"):
        route_call(Dispatch.DP_COMPUTE, Layout(dp=2), (ids(5),), {"split": split_of(6, 2)})
    with pytest.raises(TypeError, match="only for DP_COMPUTE"):
        route_call(Dispatch.RANK_SPLIT, Layout(dp=2), (ids(6),), {"split": split_of(6, 2)})
    call = route_call(Dispatch.DP_COMPUTE, Layout(dp=2), (ids(6),), {"split": split_of(6, 2)})
    with pytest.raises(ValueError, match="one row per row it got"):
        collect(Dispatch.DP_COMPUTE, Layout(dp=2), call, {0: ids(1), 1: ids(1)})


def test_rank_split_gives_every_rank_a_chunk_and_concatenates_in_rank_order(put_counter):
    layout = Layout(dp=1, pp=2, tp=2)  # one DP group, yet four chunks
    routing = route_call(Dispatch.RANK_SPLIT, layout, (ids(6),), {"greedy": True})
    assert len(put_counter) == 4 and routing.keep == [True] * 4 and routing.weights == [2, 2, 1, 1]
    chunks = [ray.get(routing.args[r][0][0]) for r in range(4)]
    assert [c["id"].tolist() for c in chunks] == [[0, 1], [2, 3], [4], [5]]
    assert all(routing.args[r][1] == {"greedy": True} for r in range(4))
    results = {r: Batch({"x": c["id"] * 10}) for r, c in enumerate(chunks)}
    out = collect(Dispatch.RANK_SPLIT, layout, routing, results)
    assert out["x"].tolist() == [0, 10, 20, 30, 40, 50]


def test_collective_runs_everywhere_and_returns_rank_zero():
    layout = Layout(dp=2, tp=2)
    routing = route_call(Dispatch.COLLECTIVE, layout, (7,), {})
    assert routing.args == [((7,), {})] * 4 and routing.keep == [True, False, False, False]
    assert collect(Dispatch.COLLECTIVE, layout, routing, {0: {"m": 1.0}}) == {"m": 1.0}


def test_metrics_are_sample_weighted_means():
    out = reduce_metrics([{"loss": 1.0, "acc": torch.tensor(0.5)}, {"loss": 4.0, "acc": 1}], [4, 3])
    assert out == pytest.approx({"loss": (4 * 1.0 + 3 * 4.0) / 7, "acc": (4 * 0.5 + 3) / 7})
    same = reduce_metrics([{"grad_norm": 2.5}] * 3, [2, 2, 1])  # already all-reduced by workers
    assert same == {"grad_norm": 2.5}
    assert reduce_metrics([{"x": 1.0}, {"x": 3.0}], [0, 0]) == {"x": 2.0}


def test_metrics_errors_name_the_problem():
    with pytest.raises(ValueError, match="same keys"):
        reduce_metrics([{"a": 1.0}, {"b": 1.0}], [1, 1])
    with pytest.raises(TypeError, match="metric 'a' is a str"):
        reduce_metrics([{"a": "high"}], [1])
    with pytest.raises(TypeError, match="not a dict"):
        reduce_metrics([[1.0]], [1])


def test_register_marks_methods_and_is_inherited():
    class Base:
        @register(dispatch=Dispatch.ONE_TO_ALL)
        def ping(self):
            return 1

    class Role(Base):
        @register(dispatch=Dispatch.DP_COMPUTE)
        def forward(self, batch):
            return batch

        def helper(self):
            return 0

    assert registered_methods(Role) == {"ping": Dispatch.ONE_TO_ALL, "forward": Dispatch.DP_COMPUTE}
    with pytest.raises(TypeError, match="Dispatch member"):
        register(dispatch="dp_compute")
