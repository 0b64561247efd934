"""The output-folder check: a node that cannot read the driver's marker stops the job by name."""

import pytest

from rlhf.errors import RLHFError
from rlhf.trainer.shared_folder import MARKER_PREFIX, check_shared_folder, read_marker


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
