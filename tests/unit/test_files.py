"""atomic_write and atomic_folder: the complete new file or folder or the untouched old one, and
no leftovers. The output-folder check: a node that cannot read the driver's marker stops the job
by name."""

import pytest

from rlhf.errors import RLHFError
from rlhf.files import MARKER_PREFIX, atomic_folder, atomic_write, check_shared_folder, read_marker


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


def _ranks(nodes_seeing):
    """A role's `read_marker` over ranks on the given nodes: (node, sees the file?)."""
    def reader(path):
        return [read_marker(path) if sees else (node, None) for node, sees in nodes_seeing]
    return reader


def test_every_node_seeing_the_folder_passes_and_leaves_no_marker(tmp_path):
    folder = tmp_path / "out"
    check_shared_folder(folder, {"actor": _ranks([("a", True), ("a", True)])})
    assert folder.is_dir() and not list(folder.glob(MARKER_PREFIX + "*"))


def test_nodes_that_do_not_see_the_folder_are_named(tmp_path):
    readers = {"actor": _ranks([("node-1", True), ("node-7", False), ("node-7", False)]),
               "critic": _ranks([("node-7", False), ("node-9", False)])}
    with pytest.raises(RLHFError, match=r"node-7 \(actor, critic\); node-9 \(critic\) cannot "
                       r"read") as err:
        check_shared_folder(tmp_path, readers)
    assert "node-1" not in str(err.value) and "trainer.output_dir" in str(err.value)
    assert not list(tmp_path.glob(MARKER_PREFIX + "*"))


def test_a_stale_marker_of_another_run_does_not_count(tmp_path):
    def reader(path):  # a node whose local folder of the same name holds an old marker
        return [("elsewhere", "an old token")]
    with pytest.raises(RLHFError, match="elsewhere"):
        check_shared_folder(tmp_path, {"actor": reader})
