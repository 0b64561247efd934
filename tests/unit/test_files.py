"""atomic_write and atomic_folder: the complete new file or folder or the untouched old one, and
no leftovers."""

import pytest

from rlhf.files import atomic_folder, atomic_write


def test_success_replaces_the_file_and_creates_parents(tmp_path):
    path = tmp_path / "a" / "b" / "data.jsonl"
    with atomic_write(path) as f:
        f.write("one\n")
    with atomic_write(path, "wb") as f:
        f.write(b"two\n")
    assert path.read_text() == "two\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["data.jsonl"]


def test_failure_keeps_the_old_file_and_removes_the_partial_one(tmp_path):
    path = tmp_path / "state.pt"
    path.write_text("good")
    with pytest.raises(RuntimeError, match="crash"):
        with atomic_write(path) as f:
            f.write("half")
            raise RuntimeError("crash while writing")
    assert path.read_text() == "good"
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]


def test_atomic_folder_publishes_the_new_folder_whole(tmp_path):
    target = tmp_path / "model"
    with atomic_folder(target) as tmp:
        (tmp / "a.txt").write_text("one")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    with atomic_folder(target) as tmp:
        (tmp / "b.txt").write_text("two")
    assert sorted(p.name for p in target.iterdir()) == ["b.txt"]  # replaced, not merged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temp or old left


def test_atomic_folder_failure_keeps_the_old_folder(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "a.txt").write_text("old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_folder(target) as tmp:
            (tmp / "a.txt").write_text("half")
            raise RuntimeError("boom")
    assert (target / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
