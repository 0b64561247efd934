"""The README stays short and true: its test command is CI's, its links lead to pages, and its
multi-node lines set the network variables first. The docs' own checks are in test_docs.py."""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
INSTALL_PAGE = (REPO / "docs" / "getting-started" / "install.md").read_text()


def test_readme_is_short():
    lines = len(README.splitlines())
    assert lines <= 250, f"README.md has {lines} lines; move detail into a page under docs/"


def test_readme_links_lead_to_files():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith("http"):
            assert (REPO / target).exists(), f"README links to {target}, which does not exist"


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


def test_multi_node_lines_set_the_network_variables_before_ray_start():
    for name, text in (("README.md", README), ("install.md", INSTALL_PAGE)):
        section = text[text.index("## Several nodes"):]
        ray_start = section.index("ray start --head")
        for variable in ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_DEBUG", "GLOO_SOCKET_IFNAME"):
            assert -1 < section.find(f"export {variable}=") < ray_start, (name, variable)


def test_install_page_describes_every_line_doctor_adds():
    section = INSTALL_PAGE[INSTALL_PAGE.index("## What `rlhf doctor` prints"):
                           INSTALL_PAGE.index("## Several")]
    for key in ("vllm range", "flash-attn", "nccl", "ray gpus"):  # rlhf/doctor.py's checks
        assert f"- `{key}`:" in section, f"install.md does not say what doctor's {key!r} line means"
