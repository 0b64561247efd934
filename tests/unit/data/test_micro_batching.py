"""Cost-model micro-batching: the fit, the DP cut against brute force, the memory limit,
the pipeline simulation against 1F1B's closed form, and determinism."""

import dataclasses
import itertools
import json
import random

import pytest

from rlhf.data.balancing import assign_micro_batches
from rlhf.data.batch_split import split_batch
from rlhf.data.cost_model import (
    MEMORY_FEATURES,
    TIME_FEATURES,
    CostModelFile,
    PhaseCost,
    RoleCost,
    Shape,
    StageCost,
    fit_nonnegative,
    linear,
)
from rlhf.data.micro_batching import (
    CostPlan,
    choose_order,
    faster_plan,
    memory_limit,
    optimal_cut,
    pass_time,
    plan_by_cost,
    predicted_passes,
    simulate_pipeline,
)
from rlhf.engine.pipeline_order import forward_only_order, training_orders

TIME = {"const": 2e-3, "tokens": 1e-5, "seqs": 1e-4, "sum_sq": 2e-8}
MEMORY = {"const": 0.0, "tokens": 1e3, "sum_sq": 4.0, "max_sq": 0.0}


def phase(pp=1):
    stages = tuple(StageCost(dict(TIME), dict(MEMORY)) for _ in range(pp))
    return PhaseCost(stages, {"const": 1e-4, "tokens": 1e-7})


def test_fit_recovers_nonnegative_coefficients_and_clamps_negative_ones():
    rng = random.Random(0)
    shapes = [Shape.of([rng.randint(4, 300) for _ in range(rng.randint(1, 12))])
              for _ in range(40)]
    coefs = fit_nonnegative(shapes, [linear(TIME, s) for s in shapes], TIME_FEATURES)
    assert coefs == pytest.approx(TIME, rel=1e-6)
    # A truth with a negative slope: the fit keeps every coefficient >= 0.
    neg = {"const": 1.0, "tokens": -1e-4}
    fit = fit_nonnegative(shapes, [max(linear(neg, s), 0.5) for s in shapes], TIME_FEATURES)
    assert min(fit.values()) >= 0 and fit["tokens"] == 0


def test_fit_predicts_the_mean_time_of_runs_a_loaded_machine_slows():
    """A third of the runs preempted (twice as long): the mean run is 1.3x the clean time.
    Weighing each run by its own time (one round) discounts the slow ones and fits low; the
    reweighted fit predicts the mean."""
    rng = random.Random(1)
    shapes = [Shape.of([rng.randint(4, 600) for _ in range(rng.randint(1, 12))])
              for _ in range(90)]
    slow = [rng.random() < 1 / 3 for _ in shapes]
    runs = [linear(TIME, s) * (2.0 if x else 1.0) for s, x in zip(shapes, slow)]
    mean = 1 + sum(slow) / len(slow)

    def ratio(rounds):
        coefs = fit_nonnegative(shapes, runs, TIME_FEATURES, rounds=rounds)
        return sum(linear(coefs, s) / linear(TIME, s) for s in shapes) / len(shapes)
    assert ratio(1) < mean - 0.1
    assert ratio(3) == pytest.approx(mean, rel=0.05)


def brute_force(shapes, cost, fits, pp, max_seqs=None):
    n, best = len(shapes), None
    for k in range(n):
        for bounds in itertools.combinations(range(1, n), k):
            cut = list(zip((0, *bounds), (*bounds, n)))
            segs = [sum((shapes[i] for i in range(a, b)), Shape(0, 0, 0, 0)) for a, b in cut]
            if any(not fits(s) for s in segs) or (
                    max_seqs and any(b - a > max_seqs for a, b in cut)):
                continue
            value = pass_time([cost(s) for s in segs], pp)
            best = value if best is None else min(best, value)
    return best


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_dp_cut_is_optimal_against_brute_force(pp):
    rng = random.Random(pp)
    cost = phase(pp).bottleneck
    for trial in range(25):
        lengths = sorted(rng.choice([8, 20, 50, 120, 400, 900]) for _ in range(rng.randint(1, 8)))
        shapes = [Shape.of([n]) for n in lengths]
        limit = rng.choice([4.2e6, 8e6, 1e9])
        fits = (lambda s, limit=limit: linear(MEMORY, s) <= limit)
        max_seqs = rng.choice([None, 3])
        cut = optimal_cut(shapes, cost, fits=fits, pp=pp, max_seqs=max_seqs)
        segs = [sum((shapes[i] for i in range(a, b)), Shape(0, 0, 0, 0)) for a, b in cut]
        assert [a for a, _ in cut] == [0] + [b for _, b in cut[:-1]] and cut[-1][1] == len(shapes)
        assert all(fits(s) for s in segs)
        assert pass_time([cost(s) for s in segs], pp) == pytest.approx(
            brute_force(shapes, cost, fits, pp, max_seqs), rel=1e-12), (trial, lengths)


def test_plan_respects_the_memory_limit_and_rejects_a_sample_over_it():
    p = phase()
    plan = CostPlan(p, memory_limit(p, 1024))
    rng = random.Random(3)
    lengths = [int(rng.paretovariate(1.2) * 20) % 1000 + 4 for _ in range(200)]
    assignment = plan_by_cost([Shape.of([n]) for n in lengths], dp=2, plan=plan)
    covered = sorted(i for r in assignment.micro_batches for mb in r for i in mb)
    assert covered == list(range(len(lengths)))
    for rank in assignment.micro_batches:
        for mb in rank:
            assert p.memory(Shape.of([lengths[i] for i in mb])) <= plan.memory_limit
    # Short samples pack past the token budget where the model predicts room (no quadratic
    # memory of one long sequence): the point of planning by memory, not tokens.
    assert max(max(r) for r in assignment.token_counts) > 1024
    with pytest.raises(ValueError, match="memory limit"):
        plan_by_cost([Shape.of([2000])], dp=1, plan=plan)


def test_plan_is_deterministic_and_beats_the_token_budget_prediction():
    p = phase(2)
    orders = lambda m: training_orders(m, pp=2, vpp=1)[0]  # noqa: E731
    plan = CostPlan(p, memory_limit(p, 2048), pp=2, orders_for=orders)
    rng = random.Random(7)
    lengths = [min(2000, int(rng.lognormvariate(4, 1.2)) + 4) for _ in range(96)]
    a = split_batch(lengths, dp=2, max_tokens=2048, cost_plan=plan)
    b = split_batch(list(lengths), dp=2, max_tokens=2048, cost_plan=plan)
    assert a == b
    budget = split_batch(lengths, dp=2, max_tokens=2048)

    def predicted(split):
        return max(pass_time([plan.micro_batch_cost(Shape.of([lengths[rows[i]] for i in mb]))
                              for mb in g.mini_batches[0]], 2)
                   for rows, g in zip(split.rows, split.groups))
    assert predicted(a) < predicted(budget)


def test_simulated_1f1b_matches_its_closed_form():
    pp, m, f, b = 4, 6, 1.0, 2.0
    orders = training_orders(m, pp=pp, vpp=1)[0]
    fwd = [[f] * pp for _ in range(m)]
    bwd = [[b] * pp for _ in range(m)]
    seconds = simulate_pipeline(orders, forward=fwd, backward=bwd, p2p=[0.0] * m, pp=pp)
    assert seconds == pytest.approx((m + pp - 1) * (f + b))
    fo = [forward_only_order(m, pp=pp, vpp=1) for _ in range(pp)]
    fo = [[(k, i, c) for k, i, c in forward_only_order(m, pp=pp, vpp=1)] for _ in range(pp)]
    assert simulate_pipeline(fo, forward=fwd, backward=bwd, p2p=[0.5] * m, pp=pp) == \
        pytest.approx((m + pp - 1) * f + (pp - 1) * 0.5)
    # A deadlocking order set (both ranks wait for a gradient first) never ends.
    stuck = [[("B", 0, 0), ("F", 0, 0)], [("B", 0, 0), ("F", 0, 0)]]
    assert simulate_pipeline(stuck, forward=fwd, backward=bwd, p2p=[0] * m, pp=2) == float("inf")


def test_cost_model_file_round_trip_and_fingerprint(tmp_path):
    p = phase(2)
    print_ = {"model": {"hidden": 128}, "dtype": "float32"}
    path = tmp_path / "cost_model.json"
    CostModelFile({"actor": RoleCost(print_, {"forward": p}, {})}).save(path)
    loaded = CostModelFile.load(path)
    assert loaded.require("actor", print_, path=path).phase("forward") == p
    assert set(json.loads(path.read_text())["roles"]["actor"]) >= {"digest", "phases"}
    with pytest.raises(ValueError, match="dtype changed"):
        loaded.require("actor", {**print_, "dtype": "bfloat16"}, path=path)
    with pytest.raises(ValueError, match="no cost model of role 'critic'"):
        loaded.require("critic", print_, path=path)
    with pytest.raises(ValueError, match="no cost model at .*absent.json.*rlhf profile"):
        CostModelFile.load(tmp_path / "absent.json").require("actor", print_,
                                                            path=tmp_path / "absent.json")
    assert MEMORY_FEATURES[0] == "const"


def pipelined(pp=2, p2p=None):
    """A pp-stage plan whose messages cost `p2p` (a handoff's constant and per-token seconds)."""
    stages = tuple(StageCost(dict(TIME), dict(MEMORY)) for _ in range(pp))
    cost = PhaseCost(stages, p2p or {"const": 1e-4, "tokens": 1e-7})
    orders = lambda m: training_orders(m, pp=pp, vpp=1)[0]  # noqa: E731
    return CostPlan(cost, memory_limit(cost, 2048), pp=pp, orders_for=orders)


def test_pipelined_cut_is_ranked_by_the_simulated_schedule():
    """At pp > 1 each candidate cut is ranked by its simulated pass, so the chosen one is never
    predicted slower than the closed form's choice, and costly handoffs mean fewer, fuller
    micro-batches."""
    rng = random.Random(11)
    counts, gains = {}, []
    for p2p in ({"const": 1e-4, "tokens": 1e-7}, {"const": 2e-2, "tokens": 1e-6}):
        plan = pipelined(p2p=p2p)
        counts[p2p["const"]] = 0
        for _ in range(8):
            shapes = sorted((Shape.of([min(2000, int(rng.lognormvariate(4, 1.3)) + 4)])
                             for _ in range(24)), key=lambda s: s.tokens)
            fits = lambda s, plan=plan: plan.phase.memory(s) <= plan.memory_limit  # noqa: E731
            closed = optimal_cut(shapes, plan.micro_batch_cost, fits=fits, pp=2)

            def simulated(cut, shapes=shapes, plan=plan):
                return choose_order([list(range(a, b)) for a, b in cut], shapes, plan)[1]
            chosen = optimal_cut(shapes, plan.micro_batch_cost, fits=fits, pp=2,
                                 evaluate=simulated)
            assert simulated(chosen) <= simulated(closed) + 1e-12
            gains.append(simulated(closed) - simulated(chosen))
            counts[p2p["const"]] += len(chosen)
    assert counts[2e-2] < counts[1e-4]
    assert max(gains) > 1e-6  # the closed form alone is not what picked them


def test_cost_model_split_is_never_predicted_slower_than_the_token_budget():
    """The split keeps the token budget's plan exactly where the cost model predicts it
    faster, flags that mini-batch, and its group costs are the predicted passes."""
    rng = random.Random(5)
    for trial in range(12):
        plan = pipelined(p2p={"const": rng.choice([1e-4, 5e-2]), "tokens": 1e-7})
        lengths = [min(2000, int(rng.lognormvariate(4, 1.5)) + 4) for _ in range(32)]
        split = split_batch(lengths, dp=2, max_tokens=2048, cost_plan=plan)
        shapes = [Shape.of([n]) for n in lengths]
        ours = plan_by_cost(shapes, dp=2, plan=plan)
        budget = assign_micro_batches(lengths, dp=2, max_tokens=2048)
        best = min(max(ours.rank_costs), max(predicted_passes(budget, shapes, plan)))
        assert max(split.group_costs[0]) == pytest.approx(best, rel=1e-12), trial
        assert split.fallbacks == (faster_plan(ours, budget, shapes, plan)[1],)
    assert split_batch(lengths, dp=2, max_tokens=2048).fallbacks == ()
    # The rule itself: a plan with every sample on one rank loses to the budget's.
    lopsided = dataclasses.replace(ours, micro_batches=(tuple(
        mb for r in ours.micro_batches for mb in r), ()))
    lopsided = dataclasses.replace(lopsided, rank_costs=predicted_passes(lopsided, shapes, plan))
    kept, fell_back = faster_plan(lopsided, budget, shapes, plan)
    assert fell_back and kept.micro_batches == budget.micro_batches
    assert kept.rank_costs == predicted_passes(budget, shapes, plan)
    assert faster_plan(ours, lopsided, shapes, plan) == (ours, False)
    # A gain the model's own error could explain is not trusted: the budget's plan runs.
    gain = 1 - max(ours.rank_costs) / max(predicted_passes(budget, shapes, plan))
    assert 0 < gain < 0.99
    for margin, fell_back in ((gain * 0.9, False), (gain * 1.1, True)):
        careful = dataclasses.replace(plan, margin=margin)
        assert faster_plan(ours, budget, shapes, careful)[1] == fell_back
