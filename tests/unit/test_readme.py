"""The README stays true: its config reference and its commands match the code."""

import re
import subprocess
from pathlib import Path

from rlhf.cli import build_parser
from rlhf.config import reference_markdown

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def test_config_reference_matches_the_dataclasses():
    start, end = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"
    embedded = README[README.index(start) + len(start):README.index(end)]
    assert embedded == reference_markdown(), (
        "README's configuration reference is stale: replace the text between the "
        "config-reference markers with the output of `rlhf config docs`")


def test_every_cli_command_is_documented():
    commands = build_parser()._subparsers._group_actions[0].choices
    for name in commands:
        assert f"`rlhf {name}" in README, f"README's Commands table does not mention rlhf {name}"


def test_ci_runs_exactly_the_readme_test_command():
    fence = re.search(r"## Two commands.*?```bash\n(.*?)```", README, re.S).group(1)
    main_line, test_line = [line.split("#")[0].strip() for line in fence.strip().splitlines()]
    assert main_line == "bash examples/quickstart.sh"
    ci = (REPO / ".ci" / "run").read_text()
    assert test_line in ci.splitlines(), f".ci/run must run the README's test command {test_line!r}"


def test_installer_and_scripts_are_valid_bash():
    for script in ("examples/install.sh", "examples/quickstart.sh", "examples/job.sh", ".ci/run"):
        result = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script}: {result.stderr}"


def test_multi_node_section_sets_the_network_variables_before_ray_start():
    section = README[README.index("### Several nodes"):README.index("## Commands")]
    ray_start = section.index("ray start --head")
    for variable in ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_DEBUG", "GLOO_SOCKET_IFNAME"):
        assert -1 < section.find(f"export {variable}=") < ray_start, variable


def test_install_section_describes_every_line_doctor_adds():
    section = README[README.index("### What `rlhf doctor` prints"):README.index("### Several")]
    for key in ("vllm range", "flash-attn", "nccl", "ray gpus"):  # rlhf/doctor.py's checks
        assert f"- `{key}`:" in section, f"README does not say what doctor's {key!r} line means"
