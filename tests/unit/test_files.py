"""atomic_write: the complete new file or the untouched old one, and no leftovers."""

import pytest

from rlhf.files import atomic_write


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
