"""Engine saves written in a background thread from a host copy, and the digests recorded from
the bytes as they were written (one process; tests/dist/test_checkpoint_layouts.py loads
across layouts, tests/unit/trainer/test_checkpoint.py publishes saves)."""

import hashlib
import threading

import pytest
import torch

import rlhf.engine.checkpoint as ckpt
from rlhf.errors import RLHFError
from tests.unit.engine.reference import make_batch
from tests.unit.engine.test_engine import _engine, _train_step


def _tensors(engine):
    state = engine.state_dict()
    out = {f"model/{k}": v.clone() for k, v in state["model"].items()}
    for key, value in state["optimizer"].items():
        if isinstance(value, torch.Tensor):
            out[f"optimizer/{key}"] = value.clone()
    return out


def test_a_background_save_holds_the_state_of_its_step_while_training_goes_on(
        folder, world, tmp_path, monkeypatch):
    engine = _engine(folder)
    _train_step(engine, make_batch(6))
    saved = _tensors(engine)
    # The writer thread starts writing only once the next step has changed the engine.
    stepped, create_stream = threading.Event(), ckpt._HashingFileSystem.create_stream

    def after_the_step(self, path, mode):
        stepped.wait()
        return create_stream(self, path, mode)

    monkeypatch.setattr(ckpt._HashingFileSystem, "create_stream", after_the_step)
    write = engine.start_checkpoint(tmp_path / "ckpt", background=True)
    assert not write.done()
    _, stats = _train_step(engine, make_batch(7))  # changes every tensor the write reads
    stepped.set()
    assert stats["grad_norm"] > 0
    moved = _tensors(engine)
    assert any(not torch.equal(moved[k], saved[k]) for k in saved)
    result = write.finish()
    assert write.done() and result["write_s"] > 0

    resumed = _engine(folder)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.step_count == 1
    got = _tensors(resumed)
    assert sorted(got) == sorted(saved)
    for key, want in saved.items():
        assert torch.equal(got[key], want), key

    # Every file of the folder, each hashed as it was written: the same digest as its bytes.
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert sorted(result["files"]) == files == [".metadata", "__0_0.distcp", ckpt.ENGINE_FILE]
    for name, digest in result["files"].items():
        data = (tmp_path / "ckpt" / name).read_bytes()
        assert digest == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


def test_a_failed_background_write_is_raised_by_finish_and_writes_no_metadata(
        folder, world, tmp_path, monkeypatch):
    engine = _engine(folder)
    _train_step(engine, make_batch(6))

    def full_disk(self, path, mode):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt._HashingFileSystem, "create_stream", full_disk)
    write = engine.start_checkpoint(tmp_path / "ckpt", background=True)
    with pytest.raises(RLHFError, match=r"writing the engine checkpoint .*ckpt failed \(mesh rank "
                                        r"0: OSError: .*No space left on device\); it is not "
                                        r"complete and is not published"):
        write.finish()
    assert not (tmp_path / "ckpt" / ".metadata").exists()
