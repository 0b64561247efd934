"""One local Ray cluster for the whole test session (starting one takes seconds)."""

import sys

import pytest

ray = pytest.importorskip("ray", reason="tests/ray needs ray, which is not installed here")

from rlhf.controller.warm import keep_ranks_warm  # noqa: E402 - needs ray, checked above

NUM_CPUS = 8  # logical CPUs: more ranks than the machine's cores, each rank uses one thread
STARTS = 3


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray instance shared by every test of tests/ray; shut down at the end."""
    if ray.is_initialized():  # someone else's cluster (e.g. an interactive session): reuse it
        yield
        return
    # The workers inherit these from the raylet, which ray.init starts with this process's
    # environment. Not a job runtime_env: with one, Ray starts a fresh process for every actor
    # and leaves the workers it prestarted (one per CPU, Ray already imported) unused.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        env.setenv("MKL_NUM_THREADS", "1")
        # Ray gives its raylet a fixed 30 s to register; on a loaded machine (the suite's other
        # workers starting clusters of their own) it can miss that once, so start it again.
        for attempt in range(STARTS):
            try:
                ray.init(num_cpus=NUM_CPUS, include_dashboard=False, logging_level="WARNING",
                         log_to_driver=True)
                break
            except Exception as exc:
                if "timed out during startup" not in str(exc) or attempt == STARTS - 1:
                    raise
                ray.shutdown()
    # Rank processes are kept between the tests' worker groups: each new one would import
    # torch, Ray and vLLM again (rlhf.controller.warm).
    with keep_ranks_warm():
        yield
    ray.shutdown()


@pytest.fixture(autouse=True, scope="module")
def _roles_pickled_by_value(request):
    """Role classes defined in a test module travel to the workers by value: the workers cannot
    import test modules, which pytest loads by file path."""
    module = sys.modules.get(request.module.__name__)
    if module is not None:
        ray.cloudpickle.register_pickle_by_value(module)
        yield
        ray.cloudpickle.unregister_pickle_by_value(module)
    else:
        yield
