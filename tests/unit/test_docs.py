"""The docs stay true: the site builds in strict mode, the generated references match the code,
every `rlhf` command shown parses with the real parser, and every config snippet loads."""

import functools
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.algorithms import algorithm_needs
from rlhf.cli import build_parser
from rlhf.config import JobConfig, config_from_dict
from rlhf.config.loader import dotted_keys, merge_trees, parse_yaml, read_config_tree
from rlhf.config.paths import resolve_paths

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
_spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "scripts" / "generate.py")
generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate)

# Job commands whose trailing `key=value` arguments are config overrides.
JOB_COMMANDS = {("train",), ("sft",), ("plan",), ("config", "show")}
CONFIG_KEYS = set(dotted_keys(JobConfig))
parser = functools.cache(build_parser)  # building it imports every command's module once


def test_the_site_builds_in_strict_mode(tmp_path):
    """A broken link, a missing page or a page left out of the navigation fails the build."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "reference" / "metrics" / "index.html").is_file()


@pytest.mark.parametrize("page", sorted(generate.GENERATED))
def test_generated_references_match_the_code(page):
    assert (DOCS / page).read_text(encoding="utf-8") == generate.expected(page), (
        f"docs/{page} is stale: run `PYTHONPATH=. python docs/scripts/generate.py`")


def test_cli_reference_has_every_command():
    text = (DOCS / "reference" / "cli.md").read_text(encoding="utf-8")
    for name, _ in generate.parsers(parser()):
        assert f"`{name}`\n" in text, f"docs/reference/cli.md has no section for {name}"


def _shell_lines(text: str) -> list[str]:
    """Lines of the shell code blocks (bash, sh, shell, console), continuations joined."""
    lines = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        if lang not in ("bash", "sh", "shell", "console"):
            continue
        lines += body.replace("\\\n", " ").splitlines()
    return lines


def shown_commands(text: str) -> list[list[str]]:
    """Every `rlhf ...` invocation in the shell code blocks of `text`, as argv after `rlhf`."""
    found = []
    for line in _shell_lines(text):
        for segment in re.split(r"&&|\|\||;|\|", line):
            try:
                words = shlex.split(segment, comments=True)
            except ValueError as e:
                raise AssertionError(f"cannot read the shell line {line!r}: {e}") from None
            while words and "=" in words[0] and not words[0].startswith("-"):
                words = words[1:]  # VAR=value prefixes
            if words and (words[0] == "rlhf" or words[0].endswith("/bin/rlhf")):
                found.append(words[1:])
    return found


def _sources():
    return [REPO / "README.md", *PAGES]


def test_commands_are_found_in_the_docs():
    commands = [c for p in _sources() for c in shown_commands(p.read_text(encoding="utf-8"))]
    assert {c[0] for c in commands} >= {"train", "sft", "plan", "config", "export-hf",
                                        "verify-model", "make-dataset", "doctor"}
    assert shown_commands("```bash\nA=1 .venv/bin/rlhf train c.yaml x=1  # note\n```") == \
        [["train", "c.yaml", "x=1"]]


@pytest.mark.parametrize("source", _sources(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_rlhf_command_shown_parses(source, capsys):
    """A renamed flag or sub-command, or a config key that no longer exists, fails here."""
    for argv in shown_commands(source.read_text(encoding="utf-8")):
        try:
            parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{source.name}: `rlhf {shlex.join(argv)}` does not parse: "
                        f"{capsys.readouterr().err.strip()}")
        command = tuple(w for w in argv[:2] if not w.startswith("-") and "=" not in w)
        if command in JOB_COMMANDS or command[:1] in JOB_COMMANDS:
            for word in argv:
                if "=" in word and not word.startswith("-"):
                    key = word.split("=", 1)[0]
                    assert key in CONFIG_KEYS, f"{source.name}: `rlhf {shlex.join(argv)}` " \
                                               f"sets {key!r}, which is not a config key"


def _config_snippets(page: Path) -> list[str]:
    return re.findall(r"^```yaml\n(.*?)^```", page.read_text(encoding="utf-8"), re.S | re.M)


GUIDES = sorted((DOCS / "guides").glob("*.md"))


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: p.name)
def test_config_snippets_load_on_top_of_the_quickstart(page, tmp_path):
    """Each YAML snippet of a guide is a valid change to configs/quickstart.yaml, read as a
    config file is (YAML 1.2 scalars: `1e-6` is a float, `yes` a string), whose algorithm
    entries (a user file's too, relative to the repository) are found in their registries."""
    base = read_config_tree(REPO / "configs" / "quickstart.yaml")
    # Not the checkout's outputs/quickstart/sft_model, which a quickstart run leaves behind and
    # whose shape would then decide the checks: the snippet's own model, or model.tiny.
    base["model"]["path"] = str(tmp_path / "model")
    for snippet in _config_snippets(page):
        cfg = config_from_dict(merge_trees(base, parse_yaml(snippet)))
        algorithm_needs(resolve_paths(cfg, base=REPO))


def test_the_algorithm_guide_has_a_config_for_each_algorithm():
    text = (DOCS / "guides" / "algorithms.md").read_text(encoding="utf-8")
    for name in ("PPO", "GRPO", "RLOO", "REINFORCE++", "DAPO", "GSPO", "CISPO",
                 "Rollout correction"):
        section = text.split(f"\n## {name}\n", 1)
        assert len(section) == 2, f"algorithms.md has no section {name!r}"
        assert "```yaml" in section[1].split("\n## ", 1)[0], f"{name}: no config snippet"


def test_metric_names_logged_by_the_quickstart_are_documented():
    """Every name a real quickstart run wrote (tests/unit/quickstart_metric_names.txt, the keys
    of its metrics.jsonl) is on the metrics page, by name or by a `<...>` pattern."""
    text = (DOCS / "reference" / "metrics.md").read_text(encoding="utf-8")
    names = set(re.findall(r"`([a-z_]+/[a-z0-9_<>/@]+)`", text))
    patterns = [re.compile(re.sub(r"<[^>]+>", "[a-z_]+", n) + "$") for n in names if "<" in n]
    for name in (REPO / "tests" / "unit" / "quickstart_metric_names.txt").read_text().split():
        assert name in names or any(p.match(name) for p in patterns), \
            f"metric {name} is not on docs/reference/metrics.md"
