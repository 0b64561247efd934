"""Shared by every tier: no test may reach a model hub (none is reachable here anyway), and a
one-process gloo world for tests that call role code in the test process.

Where Ray, vLLM or flash-attn is not installed (a bare GPU box with torch and transformers,
where `examples/gpu_bringup.sh` runs `pytest -m gpu`), a test module whose import needs one is
reported as skipped, naming the package, instead of as a collection error, and tests marked
`vllm` are skipped. Where the package is installed nothing changes: an import error is an error.
"""

import datetime
import importlib
import importlib.util
import os
import sys

import pytest
import torch.distributed as dist

from rlhf.parallel.launch import fork_ranks_from_a_server, free_port

OPTIONAL_PACKAGES = ("ray", "vllm", "flash_attn", "jsonschema")


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def missing_optional(exc: BaseException | None) -> str | None:
    """The optional package whose absence caused `exc` (followed through its causes), if any.

    "cannot import name X from M" after M itself failed on a missing package (another test
    module imported M first and left it half-initialised) counts as that package too.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ModuleNotFoundError) and exc.name:
            root = exc.name.split(".")[0]
            if root in OPTIONAL_PACKAGES and not installed(root):
                return root
        elif isinstance(exc, ImportError) and exc.name and exc.name.startswith("tests."):
            return _import_fails_for(exc.name)
        exc = exc.__cause__ or exc.__context__
    return None


def _import_fails_for(module: str) -> str | None:
    sys.modules.pop(module, None)
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return missing_optional(exc)
    return None


class _Module(pytest.Module):
    """A test module that is skipped, not an error, when an optional package is missing."""

    def _getobj(self):
        try:
            return super()._getobj()
        except self.CollectError as exc:
            package = missing_optional(exc)
            if package is None:
                raise
            raise pytest.skip.Exception(f"{self.path.name} needs {package}, which is not installed here",
                                        allow_module_level=True) from None


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path, parent):
    return _Module.from_parent(parent, path=module_path)


# What every rank of a tests/dist launch imports: loaded once in the fork server, not per rank.
RANK_PRELOAD = ["pytest", "torch", "torch.distributed", "transformers", "rlhf.demo.tiny_model",
                "rlhf.engine", "rlhf.models.build", "rlhf.parallel.mesh"]


# With pytest-xdist installed the suite runs on two workers: the tests/ray files that share the
# session's local Ray cluster all on one (two clusters at once on this 2-core machine starve
# each other's raylets and health checks), every other file a work unit of its own, handed to
# whichever worker is free, slowest kinds first. `-n N` chooses otherwise, `-n 0` runs it in
# this process (for --pdb).
WORKERS = 2
RAY_TIER = "tests/ray/"
# tests/ray files whose jobs start Ray clusters of their own (`rlhf train` in a subprocess,
# loopback nodes) and never join the session's: units of their own, so they run beside the
# Ray tier instead of after it. Checked at collection: none may use the ray_cluster fixture.
OWN_CLUSTER = ("tests/ray/test_multinode.py", "tests/ray/test_kill_during_save.py",
               "tests/ray/test_first_run.py")
# Files that start processes go out first so that none of them is left to run alone at the end.
SLOW_FIRST = (RAY_TIER, "tests/unit/bench/", "tests/unit/rollout/", "tests/dist/")


def pytest_configure(config):
    # Bytecode caching, which an environment may turn off (PYTHONDONTWRITEBYTECODE=1, as this
    # project's development machines do): the suite starts hundreds of interpreters (Ray
    # workers, ranks, CLI runs) that import the same modules, and each pytest process compiles
    # every test module for its assertion rewriting; without __pycache__ all of them compile
    # everything again. Python's default is back for the suite and the processes it starts.
    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    worker = hasattr(config, "workerinput")
    if (not worker and config.pluginmanager.hasplugin("xdist")
            and config.option.numprocesses is None and not config.option.collectonly):
        config.option.numprocesses = WORKERS
        config.option.tx = ["popen"] * WORKERS
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False  # keep SLOW_FIRST, not the most tests first
        config.stash[_TIERS] = True
    fork_ranks_from_a_server(RANK_PRELOAD)


_TIERS = pytest.StashKey[bool]()


def work_unit(nodeid: str) -> str:
    """The xdist work unit of a test: its file, or "ray" for the session cluster's tier."""
    path = nodeid.split("::")[0]
    return "ray" if path.startswith(RAY_TIER) and path not in OWN_CLUSTER else path


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent without xdist
def pytest_xdist_make_scheduler(config, log):
    """`work_unit` as xdist's scope. (xdist's own xdist_group marks do not reach its scheduler
    under this pytest.)"""
    if not config.stash.get(_TIERS, False):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Tiers(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return Tiers(config, log)


def _slowness(item) -> int:
    if item.get_closest_marker("vllm"):
        return 0
    path = item.nodeid
    return next((i for i, prefix in enumerate(SLOW_FIRST) if path.startswith(prefix)),
                len(SLOW_FIRST))


def pytest_collection_modifyitems(config, items):
    items.sort(key=_slowness)  # stable: a file's tests keep their order
    for item in items:
        if item.nodeid.split("::")[0] in OWN_CLUSTER and "ray_cluster" in item.fixturenames:
            raise pytest.UsageError(f"{item.nodeid} joins the session's Ray cluster, so its file "
                                    "cannot be in tests/conftest.py's OWN_CLUSTER")
    if installed("vllm"):
        return
    skip = pytest.mark.skip(reason="marked vllm: needs vllm, which is not installed here")
    for item in items:
        if item.get_closest_marker("vllm"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def single_process_world():
    """A gloo world of this one process (reused if a previous module left one); its group."""
    owner = not dist.is_initialized()
    if owner:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=60))
    yield dist.group.WORLD
    if owner:
        dist.destroy_process_group()
