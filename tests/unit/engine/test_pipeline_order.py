"""Pipeline step orders: complete, never stalling under rendezvous exchanges, 1F1B's memory."""

import pytest

from rlhf.engine.pipeline_order import (
    BACKWARD,
    FORWARD,
    Message,
    Step,
    comm_program,
    forward_only_order,
    interleaved_order,
    one_f_one_b_order,
    peak_held,
    simulate,
    training_orders,
    units,
)

SIZES = [(pp, vpp, m) for pp in (2, 3, 4) for vpp in (1, 2, 3) for m in range(1, 14)]
SIZES += [(8, vpp, m) for vpp in (1, 2) for m in (1, 7, 8, 9, 16)]


def _complete(order, m, vpp):
    want = {(kind, i, k) for kind in (FORWARD, BACKWARD) for i in range(m) for k in range(vpp)}
    return len(order) == len(want) and set(order) == want


@pytest.mark.parametrize("pp, vpp, m", SIZES)
def test_training_and_forward_orders_are_complete_and_never_stall(pp, vpp, m):
    orders, pair = training_orders(m, pp=pp, vpp=vpp)
    assert all(_complete(o, m, vpp) for o in orders)
    assert simulate(orders, pp=pp, vpp=vpp, pair=pair)
    forward = forward_only_order(m, pp=pp, vpp=vpp)
    assert sorted(forward) == sorted((FORWARD, i, k) for i in range(m) for k in range(vpp))
    assert simulate([forward] * pp, pp=pp, vpp=vpp)


@pytest.mark.parametrize("pp, m", [(pp, m) for pp in (2, 4, 8) for m in (1, pp - 1, pp, 3 * pp)])
def test_one_f_one_b_holds_at_most_pp_minus_stage(pp, m):
    for rank in range(pp):
        assert peak_held(one_f_one_b_order(m, pp=pp, pp_rank=rank)) == min(pp - rank, m)


@pytest.mark.parametrize("pp, vpp", [(2, 2), (4, 2), (4, 3)])
def test_interleaving_pairs_exchanges_as_megatron_when_m_is_a_multiple_of_pp(pp, vpp):
    m = 3 * pp
    orders, pair = training_orders(m, pp=pp, vpp=vpp)
    assert pair
    assert list(orders[0]) == interleaved_order(m, pp=pp, vpp=vpp, pp_rank=0)  # no extra warmup
    # Fewer activations held than running all forwards first.
    assert max(peak_held(o) for o in orders) < m * vpp


def test_simulate_catches_a_stall():
    """pp=2: stage 0 waits for micro-batch 0's grad, which stage 1 sends only after
    micro-batch 1, which stage 0 forwards only after that backward: a cycle."""
    f, b = (lambda i: Step(FORWARD, i, 0)), (lambda i: Step(BACKWARD, i, 0))
    assert not simulate([[f(0), b(0), f(1), b(1)], [f(1), b(1), f(0), b(0)]], pp=2, vpp=1)
    assert simulate([[f(0), b(0), f(1), b(1)], [f(0), b(0), f(1), b(1)]], pp=2, vpp=1)
    assert not simulate([[b(0), f(0)], [f(0), b(0)]], pp=2, vpp=1)  # backward before forward


def test_rendezvous_catches_what_buffered_sends_would_hide():
    """Chunk by chunk over all micro-batches (vpp=2) stalls once sends wait for their
    receiver; grouping micro-batches by pp (forward_only_order) does not."""
    naive = [Step(FORWARD, i, k) for k in range(2) for i in range(4)]
    assert not simulate([naive] * 2, pp=2, vpp=2)
    assert simulate([forward_only_order(4, pp=2, vpp=2)] * 2, pp=2, vpp=2)


def test_a_send_rides_with_the_next_receive():
    """1F1B on the first of two stages: micro-batch 1's activation goes out with the receive
    of micro-batch 0's gradient (send-forward-recv-backward)."""
    order = one_f_one_b_order(2, pp=2, pp_rank=0)
    assert order == [Step(FORWARD, 0, 0), Step(FORWARD, 1, 0), Step(BACKWARD, 0, 0),
                     Step(BACKWARD, 1, 0)]
    program = comm_program(order, pp=2, vpp=1, pp_rank=0, pair=False)
    assert program == [[("send", Message(FORWARD, 0, 1))],
                       [("send", Message(FORWARD, 1, 1)), ("recv", Message(BACKWARD, 0, 0))],
                       [("recv", Message(BACKWARD, 1, 0))]]


def test_units_never_pair_a_backward_with_its_own_forward():
    order = [Step(FORWARD, 0, 1), Step(BACKWARD, 0, 1), Step(FORWARD, 1, 0), Step(BACKWARD, 0, 0)]
    assert units(order, pair=True) == [[order[0]], [order[1]], [order[2], order[3]]]
    assert units(order, pair=False) == [[s] for s in order]


def test_tag_less_matching_is_required(monkeypatch):
    """Interleaving 3 micro-batches over 2 stages with paired exchanges completes when messages
    match by tag, but rank 0 sends an activation and a gradient to rank 1 in the other order
    than rank 1 receives them: refused, so NCCL (no tags) cannot mismatch them."""
    from rlhf.engine import pipeline_order
    orders = [interleaved_order(3, pp=2, vpp=2, pp_rank=r) for r in range(2)]
    assert not simulate(orders, pp=2, vpp=2, pair=True)
    monkeypatch.setattr(pipeline_order, "_fifo_matched", lambda programs, pp: True)
    assert simulate(orders, pp=2, vpp=2, pair=True)
