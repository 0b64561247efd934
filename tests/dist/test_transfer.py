"""The weight transfer group (rlhf.rollout.transfer) across processes: what the receivers get
equals what the sender sent, bucket by bucket, every tensor exactly once on every receiver;
the group is standalone (its own store), so it works beside any default world."""

import datetime

import pytest
import torch
import torch.distributed as dist

from rlhf.parallel.launch import run_distributed
from rlhf.rollout.transfer import TransferAddress, TransferGroup


def _buckets(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [
        [("model.embed_tokens.weight", torch.randn(7, 5, generator=g)),
         ("model.norm.weight", torch.randn(5, generator=g).to(torch.bfloat16))],
        [("empty", torch.empty(0, 3)),
         ("lm_head.weight", torch.randn(7, 5, generator=g).t())],  # not contiguous
        [],  # an empty bucket sends nothing
        [("counts", torch.arange(6, dtype=torch.int64).view(2, 3))],
    ]


def _transfer(rank, world, rounds):
    # The transfer group meets at its own store; the default world only passes the port.
    store, port = (TransferGroup.host_store(60.0) if rank == 0 else (None, 0))
    box = [port]
    dist.broadcast_object_list(box, src=0)
    address = TransferAddress(host="127.0.0.1", port=box[0], world_size=world, backend="gloo")
    group = TransferGroup.join(address, rank=rank, device=torch.device("cpu"), timeout_s=60.0,
                               store=store)
    out = []
    for r in range(rounds):  # the group is made once and reused
        if rank == 0:
            out.append(group.send(iter(_buckets(r))))
        else:
            out.append([[(n, t.clone()) for n, t in b] for b in group.receive()])
    return out


def test_every_receiver_gets_every_tensor_once_and_equal():
    results = run_distributed(_transfer, 3, 2, timeout_s=120.0)
    for r in range(2):
        sent = [b for b in _buckets(r) if b]
        nbytes = sum(t.numel() * t.element_size() for b in sent for _, t in b)
        assert results[0][r]["bytes"] == nbytes and results[0][r]["seconds"] > 0
        for receiver in results[1:]:
            got = receiver[r]
            assert [[n for n, _ in b] for b in got] == [[n for n, _ in b] for b in sent]
            for got_b, sent_b in zip(got, sent):
                for (name, g), (_, s) in zip(got_b, sent_b):
                    assert g.dtype == s.dtype and g.shape == s.shape, name
                    assert torch.equal(g, s), name


def _receive_without_sender(rank, world, timeout_s):
    import time

    store, port = (TransferGroup.host_store(60.0) if rank == 0 else (None, 0))
    box = [port]
    dist.broadcast_object_list(box, src=0)
    address = TransferAddress(host="127.0.0.1", port=box[0], world_size=world, backend="gloo")
    group = TransferGroup.join(address, rank=rank, device=torch.device("cpu"),
                               timeout_s=timeout_s, store=store)
    outcome = None
    if rank == 1:  # the sender joined, then never sends (as if its actor were stuck)
        start = time.monotonic()
        try:
            next(group.receive())
        except RuntimeError as e:
            outcome = (time.monotonic() - start, str(e))
    dist.barrier()  # the sender stays alive (and silent) until the receiver gave up
    return outcome


def test_a_receive_with_no_sender_fails_after_the_timeout():
    results = run_distributed(_receive_without_sender, 2, 2.0, timeout_s=60.0,
                              collective_timeout_s=60.0)
    assert results[1] is not None, "the receive returned without a sender"
    seconds, message = results[1]
    assert 1.5 < seconds < 20.0, seconds
    assert "timed out" in message.lower(), message


def test_the_nccl_group_gets_the_timeout(monkeypatch):
    """No NCCL here: a stand-in records the options the group is built with."""
    built = []

    class FakeNCCL:
        class Options:
            def __init__(self):
                self._timeout = datetime.timedelta(minutes=10)  # NCCL's own default

        def __init__(self, store, rank, size, options=None):
            built.append((rank, size, options))

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    address = TransferAddress(host="127.0.0.1", port=0, world_size=3, backend="nccl")
    TransferGroup(dist.HashStore(), rank=1, address=address, device=torch.device("cpu"),
                  timeout_s=7.0)
    (rank, size, options), = built
    assert (rank, size) == (1, 3)
    assert options is not None and options._timeout == datetime.timedelta(seconds=7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_nccl_group_is_built_with_its_timeout_and_broadcasts():
    """On a GPU: the real NCCL group takes the options (one rank: one GPU is enough)."""
    store, port = TransferGroup.host_store(30.0)
    address = TransferAddress(host="127.0.0.1", port=port, world_size=1, backend="nccl")
    group = TransferGroup.join(address, rank=0, device=torch.device("cuda"), timeout_s=30.0,
                               store=store)
    assert group.pg.options._timeout == datetime.timedelta(seconds=30)
    assert group.send(iter([[("w", torch.ones(3))]]))["bytes"] == 12
