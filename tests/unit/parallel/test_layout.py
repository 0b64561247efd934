"""Layout, the one owner of rank <-> (dp, pp, tp): hand-computed cases, and the dispatcher, the
memory planner and the rollout replica grouping agreeing with it (the mesh's agreement is in
tests/dist/test_layout_mesh.py)."""

import itertools

import pytest
import torch

from rlhf.config import load_config
from rlhf.controller.dispatch import Dispatch, route_call
from rlhf.controller.dispatch import Layout as DispatchLayout
from rlhf.data.batch import Batch
from rlhf.parallel.layout import Layout

# dp=2 pp=2 tp=2 over 8 ranks, written out by hand (tp fastest, then pp, then dp):
#   rank: 0       1       2       3       4       5       6       7
#   (d,p,t) 000   001     010     011     100     101     110     111
HAND = {0: (0, 0, 0), 1: (0, 0, 1), 2: (0, 1, 0), 3: (0, 1, 1),
        4: (1, 0, 0), 5: (1, 0, 1), 6: (1, 1, 0), 7: (1, 1, 1)}


def _group_of(layout, rank, axis):
    """The group along `axis` that holds position `rank`, or None."""
    return next((g for g in layout.groups(axis) if rank in g), None)


def test_rank_to_coordinate_and_back_by_hand():
    lay = Layout(dp=2, pp=2, tp=2)
    assert {r: lay.coordinate(r) for r in range(8)} == HAND
    assert {c: lay.rank_at(dp=c[0], pp=c[1], tp=c[2]) for c in HAND.values()} == {
        c: r for r, c in HAND.items()}
    assert [lay.stage_of(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_groups_by_hand():
    lay = Layout(dp=2, pp=2, tp=2)
    assert lay.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert lay.groups("pp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert lay.groups("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert lay.groups("mp") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert lay.groups("embedding") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert lay.output_ranks() == [2, 6]  # tp 0 of the last stage of each DP group
    assert _group_of(lay, 5, "pp") == (5, 7) and _group_of(lay, 5, "dp") == (1, 5)
    # pp=4, tp=1, dp=1: one pipeline; the embedding pair is its first and last stage
    pipe = Layout(dp=1, pp=4)
    assert pipe.groups("pp") == [(0, 1, 2, 3)] and pipe.groups("embedding") == [(0, 3)]
    assert _group_of(pipe, 1, "embedding") is None
    assert Layout(dp=4).groups("embedding") == [] and Layout(dp=4).output_ranks() == [0, 1, 2, 3]


@pytest.mark.parametrize("dp,pp,tp", [(1, 1, 1), (3, 1, 1), (1, 4, 1), (1, 1, 4), (2, 3, 2),
                                      (4, 2, 1), (1, 2, 4)])
def test_every_layout_is_megatron_order_and_groups_partition_the_ranks(dp, pp, tp):
    lay = Layout.over(dp * pp * tp, tp=tp, pp=pp)
    assert (lay.dp, lay.pp, lay.tp) == (dp, pp, tp)
    order = list(itertools.product(range(dp), range(pp), range(tp)))  # the loop nest, not //, %
    for rank, coord in enumerate(order):
        assert lay.coordinate(rank) == coord
        assert lay.rank_at(dp=coord[0], pp=coord[1], tp=coord[2]) == rank
    for axis, size in (("dp", dp), ("pp", pp), ("tp", tp), ("mp", pp * tp)):
        groups = lay.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(lay.world_size)), axis
        assert all(len(g) == size for g in groups), axis


def test_expert_groups_are_consecutive_dp_ranks_of_a_line_written_out_by_hand():
    """dp=4 pp=1 tp=2 ep=2 on 8 ranks: dp ranks 0,1 (and 2,3) split the experts, so rank 0's
    ep group is the rank at dp=1 with its tp (rank 2); its edp partner is dp=2 (rank 4)."""
    lay = Layout.over(8, tp=2, ep=2)
    assert (lay.dp, lay.ep, lay.edp) == (4, 2, 2)
    assert lay.groups("ep") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert lay.groups("edp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert [lay.expert_coordinate(r) for r in range(8)] == [
        (0, 0), (0, 0), (1, 0), (1, 0), (0, 1), (0, 1), (1, 1), (1, 1)]
    pipe = Layout.over(8, pp=2, ep=4)  # one ep group per pipeline stage
    assert pipe.groups("ep") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert sorted(pipe.groups("edp")) == [(r,) for r in range(8)]
    plain = Layout(dp=4)  # ep=1: singleton expert groups, and the edp groups are the dp groups
    assert plain.groups("ep") == [(r,) for r in range(4)] and plain.groups("edp") == [
        (0, 1, 2, 3)]


@pytest.mark.parametrize("dp,pp,tp,ep", [(4, 1, 1, 2), (4, 1, 1, 4), (4, 2, 2, 2), (6, 1, 2, 3)])
def test_expert_groups_split_every_dp_group(dp, pp, tp, ep):
    lay = Layout.over(dp * pp * tp, tp=tp, pp=pp, ep=ep)
    for axis, size in (("ep", ep), ("edp", dp // ep)):
        groups = lay.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(lay.world_size)), axis
        assert all(len(g) == size for g in groups), axis
    dp_of = {r: g for g in lay.groups("dp") for r in g}
    for ep_group in lay.groups("ep"):  # inside one dp group, and ep meets edp once
        assert all(set(ep_group) <= set(dp_of[r]) for r in ep_group)
        for edp_group in lay.groups("edp"):
            assert len(set(ep_group) & set(edp_group)) <= 1


def test_invalid_layouts_name_the_problem():
    with pytest.raises(ValueError, match="do not split into pp=2 × tp=2"):
        Layout.over(6, tp=2, pp=2)
    with pytest.raises(ValueError, match="dp=3 × pp=1 × tp=2 = 6 but 4 ranks"):
        Layout.over(4, tp=2, dp=3)
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        Layout.over(4, tp=0)
    with pytest.raises(ValueError, match="Layout.pp must be a positive int"):
        Layout(dp=1, pp=0)
    with pytest.raises(ValueError, match="rank 8 is outside"):
        Layout(dp=2, pp=2, tp=2).coordinate(8)
    with pytest.raises(ValueError, match="pp=2 is outside 0..1"):
        Layout(dp=2, pp=2, tp=2).rank_at(dp=0, pp=2, tp=0)
    with pytest.raises(ValueError, match="ep=3 does not divide dp=4"):
        Layout.over(4, ep=3)
    with pytest.raises(ValueError, match="Layout.ep must be a positive int"):
        Layout(dp=2, ep=0)
    with pytest.raises(ValueError, match="unknown axis 'xp'"):
        Layout(dp=2).groups("xp")


def test_dispatch_sends_each_rank_its_dp_groups_rows_and_keeps_the_layouts_output_ranks(
        monkeypatch):
    import rlhf.controller.dispatch as dispatch

    assert DispatchLayout is Layout  # the dispatcher has no layout arithmetic of its own
    monkeypatch.setattr(dispatch.ray, "put", lambda value: value)  # no object store needed
    batch = Batch({"id": torch.arange(4)})
    routing = route_call(Dispatch.DP_COMPUTE, Layout(dp=2, pp=2, tp=2), (batch,), {})
    rows = [call[0][0]["id"].tolist() for call in routing.args]
    # ranks 0-3 are DP group 0 (by hand, above), 4-7 group 1; the last stage's tp 0 answers
    assert rows == [[0, 1]] * 4 + [[2, 3]] * 4
    assert routing.keep == [False, False, True, False, False, False, True, False]


def test_planner_puts_each_rank_on_the_layouts_stage(monkeypatch):
    """The shipped multi-GPU config on two nodes: actor tp=4 pp=2 on 16 ranks; rank r holds stage
    (r // 4) % 2 written out by hand, and the critic (tp=4, pp=1) stage 0 everywhere."""
    import rlhf.plan.memory as memory
    from rlhf.plan.inputs import hardware, role_specs
    from tests.unit.plan.test_plan import MODELS, MULTIGPU

    calls = []
    real = memory.rank_phases
    monkeypatch.setattr(memory, "rank_phases",
                        lambda cfg, hw, placed, **kw: calls.append(placed) or real(
                            cfg, hw, placed, **kw))
    cfg = load_config(MULTIGPU, ["trainer.nnodes=2"])
    hw = hardware(cfg)
    specs = role_specs(cfg, hw, model_dirs=MODELS)
    plan = memory.plan_memory(cfg, hw, specs)
    shared = calls[:cfg.trainer.pool_size]  # the shared pool's ranks, in rank order
    hand = [0, 0, 0, 0, 1, 1, 1, 1] * 2
    assert [s.layout for s in specs if s.name == "actor"] == [Layout(dp=2, pp=2, tp=4)]
    for rank, placed in enumerate(shared):
        stage = {spec.name: stage for spec, stage in placed}
        assert stage["actor"] is plan.stages["actor"][hand[rank]], rank
        assert stage["critic"] is plan.stages["critic"][0], rank


def test_rollout_replicas_are_the_mp_groups_of_a_dp_by_tp_layout():
    """rollout_spec asks every rank for the same replica groups (collective), in the Layout's
    order, and hands each rank the one it sits in: runs of rollout.tp consecutive ranks."""
    from types import SimpleNamespace

    from tests.unit.plan.test_plan import QUICKSTART
    from workers.rollout import rollout_spec

    class Cache:  # stands in for ProcessGroupCache: a group is the tuple of its ranks
        def __init__(self):
            self.asked = []

        def get(self, ranks):
            self.asked.append(tuple(ranks))
            return tuple(ranks)

    cfg = load_config(QUICKSTART, ["rollout.tp=2", "trainer.device=cuda",
                                   "trainer.ranks_per_node=8"])
    hand = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3), 4: (4, 5), 5: (4, 5), 6: (6, 7), 7: (6, 7)}
    for rank in range(8):
        cache = Cache()
        ctx = SimpleNamespace(world_size=8, rank=rank, group_cache=cache,
                              device=torch.device("cpu"))
        spec = rollout_spec(ctx, cfg)
        assert spec.replica_group == hand[rank]
        assert cache.asked[:4] == Layout.over(8, tp=2).groups("mp") == [(0, 1), (2, 3), (4, 5),
                                                                         (6, 7)]


def test_cp_sits_between_tp_and_pp_by_hand():
    # dp=2 pp=2 cp=2 tp=2 over 16 ranks: tp fastest, then cp, then pp, then dp.
    lay = Layout(dp=2, pp=2, cp=2, tp=2)
    assert lay.world_size == 16
    assert lay.groups("tp")[:2] == [(0, 1), (2, 3)]
    assert lay.groups("cp")[:3] == [(0, 2), (1, 3), (4, 6)]  # a cp group: adjacent tp runs
    assert lay.groups("pp")[:2] == [(0, 4), (1, 5)]
    assert lay.groups("dp")[:2] == [(0, 8), (1, 9)]
    assert lay.groups("mp")[:2] == [(0, 1, 4, 5), (2, 3, 6, 7)]  # one replica per cp rank
    assert lay.groups("dp_cp")[0] == (0, 2, 8, 10)  # grads summed over dp and cp
    assert lay.groups("embedding")[:2] == [(0, 4), (1, 5)]
    assert [lay.cp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert lay.coordinate(6) == (0, 1, 0) and lay.rank_at(dp=0, pp=1, cp=1, tp=0) == 6
    assert lay.output_ranks() == [4, 12]  # tp 0, cp 0 of the last stage
    assert Layout.over(8, tp=2, cp=2) == Layout(dp=2, cp=2, tp=2)
    with pytest.raises(ValueError, match="cp=3"):
        Layout.over(8, tp=2, cp=3)
    with pytest.raises(ValueError, match="cp"):
        Layout.over(8, cp=0)


@pytest.mark.parametrize("dp,pp,cp,tp,ep", [(1, 1, 2, 1, 1), (2, 1, 4, 1, 2), (1, 2, 2, 2, 1),
                                            (2, 3, 2, 1, 1), (3, 1, 3, 2, 3)])
def test_cp_layouts_follow_the_loop_nest_and_groups_partition(dp, pp, cp, tp, ep):
    lay = Layout.over(dp * pp * cp * tp, tp=tp, pp=pp, cp=cp, ep=ep)
    order = list(itertools.product(range(dp), range(pp), range(cp), range(tp)))
    for rank, (d, p, c, t) in enumerate(order):
        assert lay.coordinate(rank) == (d, p, t) and lay.cp_rank(rank) == c
        assert lay.rank_at(dp=d, pp=p, cp=c, tp=t) == rank
    for axis, size in (("dp", dp), ("pp", pp), ("cp", cp), ("tp", tp), ("mp", pp * tp),
                       ("dp_cp", dp * cp), ("ep", ep), ("edp", dp // ep),
                       ("edp_cp", dp // ep * cp)):
        groups = lay.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(lay.world_size)), axis
        assert all(len(g) == size for g in groups), axis
    for group in lay.groups("cp"):  # a cp group differs only in its cp rank
        assert len({lay.coordinate(r) for r in group}) == 1
        assert [lay.cp_rank(r) for r in group] == list(range(cp))


@pytest.mark.parametrize("dp,pp,tp,ep", [(2, 2, 2, 1), (4, 1, 1, 2), (1, 4, 2, 1)])
def test_cp_1_leaves_every_rank_and_group_unchanged(dp, pp, tp, ep):
    plain, with_cp = Layout(dp=dp, pp=pp, tp=tp, ep=ep), Layout(dp=dp, pp=pp, tp=tp, ep=ep, cp=1)
    n = dp * pp * tp
    # the pre-cp formulas, written out
    assert [with_cp.coordinate(r) for r in range(n)] == [
        (r // (tp * pp), (r // tp) % pp, r % tp) for r in range(n)]
    for axis in ("dp", "pp", "tp", "mp", "embedding", "ep", "edp"):
        assert with_cp.groups(axis) == plain.groups(axis)
    assert with_cp.groups("mp") == [tuple(range(d * pp * tp, (d + 1) * pp * tp))
                                    for d in range(dp)]
    assert with_cp.groups("dp_cp") == with_cp.groups("dp")
    assert with_cp.groups("edp_cp") == with_cp.groups("edp")
    assert with_cp.groups("cp") == [(r,) for r in range(n)]
    assert "edp_cp" not in with_cp.mesh_axes()


def test_routed_experts_sum_over_edp_and_cp_by_hand():
    # dp=4 cp=2 ep=2 over 8 ranks: ep groups pair dp ranks (0, 1) and (2, 3) on each cp rank;
    # the experts of ep rank 0 sit on dp ranks 0 and 2 at both cp ranks.
    lay = Layout(dp=4, cp=2, ep=2)
    assert lay.groups("ep")[:2] == [(0, 2), (1, 3)]
    assert lay.groups("edp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert lay.groups("edp_cp") == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert lay.edp_cp == 4 and lay.mesh_axes()[-3:] == ("ep", "edp", "edp_cp")
    # ep=1: the experts' group is dp_cp, which the mesh already has (no axis of its own)
    dense = Layout(dp=2, cp=2)
    assert dense.groups("edp_cp") == dense.groups("dp_cp")
    assert "edp_cp" not in dense.mesh_axes()


def test_mesh_axes_create_cp_and_expert_groups_only_where_they_exist():
    assert Layout(dp=2, tp=2).mesh_axes() == ("dp", "pp", "tp", "mp", "embedding")
    assert Layout(dp=2, tp=2, ep=2).mesh_axes()[-2:] == ("ep", "edp")
    assert Layout(dp=1, cp=2, tp=2).mesh_axes() == ("dp", "pp", "cp", "tp", "mp", "embedding",
                                                     "dp_cp")
