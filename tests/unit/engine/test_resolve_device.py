"""resolve_device(None) takes the process's current CUDA device (the one its worker set from
Ray's assignment), never a GPU guessed from the rank's number."""

import torch

from rlhf.engine.engine import resolve_device


def test_none_is_the_current_cuda_device_not_rank_modulo_count(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device(None) == torch.device("cuda", 3)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_none_is_the_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == torch.device("cpu")
