"""keep_ranks_warm inside another one (a benchmark run by a harness that keeps ranks warm
itself) leaves the outer one's processes and settings alone."""

from rlhf.controller.warm import WARM, keep_ranks_warm


def test_an_inner_keep_ranks_warm_leaves_the_outer_one_on(monkeypatch):
    # Whatever this session keeps (the tests/ray cluster's ranks) is put back after the test.
    monkeypatch.setattr(WARM, "enabled", False)
    monkeypatch.setattr(WARM, "max_idle", 0)
    monkeypatch.setattr(WARM, "_idle", [])
    idle = object()  # an idle rank the inner block must not kill (close() would ray.kill it)
    with keep_ranks_warm(max_idle=3) as outer:
        WARM._idle.append(idle)
        with keep_ranks_warm(max_idle=5) as inner:
            assert inner is outer and (WARM.enabled, WARM.max_idle) == (True, 3)
        assert (WARM.enabled, WARM.max_idle, WARM._idle) == (True, 3, [idle])
        WARM._idle.clear()
    assert (WARM.enabled, WARM.max_idle) == (False, 0)
