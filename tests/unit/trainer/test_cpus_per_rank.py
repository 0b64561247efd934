"""How many CPUs (intra-op threads) each rank of a CPU job gets."""

import pytest

from rlhf.trainer.jobs import cpus_per_rank


def test_ranks_split_their_node_cpus():
    assert cpus_per_rank(node_cpus=16, ranks_on_node=2, local_cores=None) == 8
    assert cpus_per_rank(node_cpus=16, ranks_on_node=3, local_cores=None) == 5
    assert cpus_per_rank(node_cpus=2, ranks_on_node=2, local_cores=None) == 1


def test_a_local_cluster_never_gets_more_threads_than_this_machine_has_cores():
    # tests/ray starts 8 logical CPUs on a 2-core machine: one thread per rank, not four
    assert cpus_per_rank(node_cpus=8, ranks_on_node=2, local_cores=2) == 1
    assert cpus_per_rank(node_cpus=8, ranks_on_node=2, local_cores=16) == 4


def test_more_ranks_than_cpus_still_get_one_each():
    assert cpus_per_rank(node_cpus=2, ranks_on_node=8, local_cores=2) == 1


def test_a_node_without_ranks_is_refused():
    with pytest.raises(ValueError, match="ranks_on_node"):
        cpus_per_rank(node_cpus=4, ranks_on_node=0, local_cores=None)
