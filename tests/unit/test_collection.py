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
