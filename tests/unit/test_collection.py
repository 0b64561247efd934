"""Every folder of tests/ is collected by the README's `pytest tests`: pytest's default
`norecursedirs` skips folders named "dist" or "build", which left tests/dist out of CI unseen."""

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_test_folder_matches_a_norecursedirs_pattern():
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    patterns = options["norecursedirs"]  # set there: pytest's default would skip tests/dist
    folders = {p.parent for p in (ROOT / "tests").rglob("test_*.py")}
    assert ROOT / "tests" / "dist" in folders
    for folder in folders:
        for part in folder.relative_to(ROOT).parts:
            hit = [p for p in patterns if fnmatch.fnmatch(part, p)]
            assert not hit, f"{folder.relative_to(ROOT)} is skipped by norecursedirs {hit}"


def test_the_session_cluster_tier_is_one_work_unit_and_own_cluster_files_are_apart():
    from tests.conftest import OWN_CLUSTER, work_unit

    assert {work_unit("tests/ray/test_trainer_ppo.py::test_steps"),
            work_unit("tests/ray/test_async.py::test_x[a]")} == {"ray"}
    for path in OWN_CLUSTER:
        assert (ROOT / path).is_file(), path
        assert work_unit(f"{path}::test_x") == path
    assert work_unit("tests/unit/config/test_schema.py::test_x") == "tests/unit/config/test_schema.py"
