"""The order in which a pipeline rank runs its forward and backward steps (pure bookkeeping).

An order is a list of `Step(kind, micro_batch, chunk)`: `chunk` is the rank's local model chunk
(virtual stage chunk * pp + rank). A step receives at most one message before its compute (the
activation, or the output's gradient) and sends at most one after. The executor holds that send
back: it goes out together with the next step's receive in one batched exchange (Megatron's
send-forward-recv-backward), or alone just before the next step when that step receives
nothing; when interleaving, a forward and the backward after it may exchange as one unit.
`comm_program` writes this out; `simulate` runs it with rendezvous semantics (an
exchange completes only once every peer has posted the matching half, as NCCL's do), so an
order set is safe exactly when `simulate` runs every rank to the end, and every two ranks
post their messages to each other in the same order (tag-less backends match by order).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

FORWARD, BACKWARD = "F", "B"


class Step(NamedTuple):
    kind: str  # FORWARD or BACKWARD
    micro_batch: int
    chunk: int  # local chunk index on this rank


class Message(NamedTuple):
    kind: str  # FORWARD: an activation; BACKWARD: the gradient of one
    micro_batch: int
    virtual_stage: int  # the receiving virtual stage


def forward_only_order(num_micro_batches: int, *, pp: int, vpp: int) -> list[Step]:
    """Forwards in groups of pp micro-batches, each group through chunk 0, 1, ... before the
    next group (chunk by chunk over ALL micro-batches can stall once vpp > 1)."""
    return [Step(FORWARD, i, k) for i, k in _forward_sequence(num_micro_batches, pp, vpp)]


def _groups(num_micro_batches: int, pp: int) -> list[list[int]]:
    return [list(range(g, min(g + pp, num_micro_batches)))
            for g in range(0, num_micro_batches, pp)]


def _forward_sequence(m: int, pp: int, vpp: int) -> list[tuple[int, int]]:
    return [(i, k) for group in _groups(m, pp) for k in range(vpp) for i in group]


def one_f_one_b_order(num_micro_batches: int, *, pp: int, pp_rank: int) -> list[Step]:
    """1F1B: pp - rank - 1 warmup forwards, then one forward / one backward, then the rest.

    A stage holds at most pp - rank micro-batches' activations (warmup + the steady one).
    """
    m = num_micro_batches
    warmup = min(pp - pp_rank - 1, m)
    order = [Step(FORWARD, i, 0) for i in range(warmup)]
    for j in range(m - warmup):
        order += [Step(FORWARD, warmup + j, 0), Step(BACKWARD, j, 0)]
    order += [Step(BACKWARD, j, 0) for j in range(m - warmup, m)]
    return order


def interleaved_order(num_micro_batches: int, *, pp: int, vpp: int, pp_rank: int,
                      extra_warmup: int = 0) -> list[Step]:
    """Interleaved 1F1B (Megatron): micro-batches in groups of pp run chunk 0, 1, ... of a group
    before the next group; backwards walk the chunks in reverse. A last, smaller group takes
    the remaining micro-batches. `extra_warmup` adds forwards before the first backward."""
    m = num_micro_batches
    forwards = _forward_sequence(m, pp, vpp)
    backwards = [(i, k) for group in _groups(m, pp) for k in reversed(range(vpp)) for i in group]
    total = m * vpp
    warmup = min(total, (pp - pp_rank - 1) * 2 + (vpp - 1) * pp + extra_warmup)
    order = [Step(FORWARD, i, k) for i, k in forwards[:warmup]]
    for j in range(total - warmup):
        order += [Step(FORWARD, *forwards[warmup + j]), Step(BACKWARD, *backwards[j])]
    order += [Step(BACKWARD, i, k) for i, k in backwards[total - warmup:]]
    return order


@functools.cache
def training_orders(num_micro_batches: int, *, pp: int,
                    vpp: int) -> tuple[tuple[tuple[Step, ...], ...], bool]:
    """(the order of every rank, whether forward/backward pairs exchange as one unit): 1F1B at
    vpp = 1; interleaved above, first with paired exchanges as Megatron, then without, and
    where that would stall (micro-batch counts that are not a multiple of pp), with a longer
    warmup on every rank, up to all forwards first. Cached: a pure function of its arguments."""
    if vpp == 1:
        return tuple(tuple(one_f_one_b_order(num_micro_batches, pp=pp, pp_rank=r))
                     for r in range(pp)), False
    for pair in (True, False):
        for extra in range(num_micro_batches * vpp + 1):
            orders = tuple(tuple(interleaved_order(num_micro_batches, pp=pp, vpp=vpp, pp_rank=r,
                                                   extra_warmup=extra)) for r in range(pp))
            if simulate(orders, pp=pp, vpp=vpp, pair=pair):
                return orders, pair
    raise AssertionError("all forwards first, unpaired, cannot stall")


def units(order: Sequence[Step], *, pair: bool) -> list[list[Step]]:
    """The order cut into exchange units: single steps, or with `pair` (interleaving) each
    forward directly followed by a backward of another micro-batch as one unit, whose two
    receives are posted together (Megatron's send-forward-backward-recv-forward-backward)."""
    out, j = [], 0
    while j < len(order):
        # A backward of the forward's own micro-batch needs that forward's output first.
        take = 2 if (pair and j + 1 < len(order) and order[j].kind == FORWARD
                     and order[j + 1].kind == BACKWARD
                     and order[j].micro_batch != order[j + 1].micro_batch) else 1
        out.append(list(order[j:j + take]))
        j += take
    return out


def messages(step: Step, *, pp: int, vpp: int,
             pp_rank: int) -> tuple[Message | None, Message | None]:
    """(what the step receives before its compute, what it sends after), None for nothing."""
    kind, i, k = step
    v, last = k * pp + pp_rank, pp * vpp - 1
    if kind == FORWARD:
        return (Message(FORWARD, i, v) if v > 0 else None,
                Message(FORWARD, i, v + 1) if v < last else None)
    return (Message(BACKWARD, i, v) if v < last else None,
            Message(BACKWARD, i, v - 1) if v > 0 else None)


def comm_program(order: Sequence[Step], *, pp: int, vpp: int, pp_rank: int,
                 pair: bool) -> list[list[tuple[str, Message]]]:
    """The batched exchanges ("send" / "recv", message) a rank running `order` posts, in order:
    before each unit, the previous unit's sends with this unit's receives."""
    batches, pending = [], []
    for unit in units(order, pair=pair):
        msgs = [messages(step, pp=pp, vpp=vpp, pp_rank=pp_rank) for step in unit]
        batch = pending + [("recv", recv) for recv, _ in msgs if recv is not None]
        if batch:
            batches.append(batch)
        pending = [("send", send) for _, send in msgs if send is not None]
    return batches + ([pending] if pending else [])


def simulate(orders: Sequence[Sequence[Step]], *, pp: int, vpp: int,
             pair: bool = False) -> bool:
    """True when every rank runs its order to the end under rendezvous semantics (see the
    module doc); False when some ranks wait on each other forever."""
    programs = [comm_program(o, pp=pp, vpp=vpp, pp_rank=r, pair=pair)
                for r, o in enumerate(orders)]
    if not _backwards_follow_forwards(orders) or not _fifo_matched(programs, pp):
        return False
    pos, done = [0] * pp, set()
    while True:
        posted = {op for r in range(pp) if pos[r] < len(programs[r]) for op in programs[r][pos[r]]}
        done |= {msg for kind, msg in posted if kind == "send" and ("recv", msg) in posted}
        advanced = False
        for r in range(pp):
            if pos[r] < len(programs[r]) and all(msg in done for _, msg in programs[r][pos[r]]):
                pos[r] += 1
                advanced = True
        if not advanced:
            return all(p == len(prog) for p, prog in zip(pos, programs))


def _fifo_matched(programs: Sequence[Sequence[Sequence[tuple[str, Message]]]], pp: int) -> bool:
    """Between every two ranks, messages are received in the order they are sent, so a
    backend that ignores tags (NCCL) matches them right too."""
    sent: dict[tuple[int, int], list[Message]] = {}
    received: dict[tuple[int, int], list[Message]] = {}
    for program in programs:
        for kind, msg in (op for batch in program for op in batch):
            sender = (msg.virtual_stage + (-1 if msg.kind == FORWARD else 1)) % pp
            book = sent if kind == "send" else received
            book.setdefault((sender, msg.virtual_stage % pp), []).append(msg)
    return sent == received


def _backwards_follow_forwards(orders: Sequence[Sequence[Step]]) -> bool:
    for order in orders:
        seen = set()
        for kind, i, k in order:
            if kind == BACKWARD and (i, k) not in seen:
                return False
            seen.add((i, k))
    return True


def peak_held(order: Sequence[Step]) -> int:
    """Most (micro-batch, chunk) activation sets held at once by a rank running `order`."""
    held = peak = 0
    for step in order:
        held += 1 if step.kind == FORWARD else -1
        peak = max(peak, held)
    return peak
