"""Writes the generated parts of the docs: the CLI reference (every parser's --help), the
configuration reference (from the config dataclasses) and the verl key table (from
rlhf.config.from_verl). tests/unit/test_docs.py fails when a page differs from what this
prints, so the pages cannot drift from the code.

    PYTHONPATH=. python docs/scripts/generate.py          # rewrite the generated blocks
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1]
# page -> the function that makes the text between its markers
START, END = "<!-- generated:start -->\n", "<!-- generated:end -->"
HELP_WIDTH = "100"


@contextmanager
def _help_width() -> Iterator[None]:
    # argparse wraps help text at the terminal's width (COLUMNS); pin it so output is stable.
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH
    try:
        yield
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def parsers(parser: argparse.ArgumentParser, name: str = "rlhf"
            ) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(command line, parser) of `parser` and every sub-command below it, depth first."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                yield from parsers(subparser, f"{name} {sub}")


def cli_reference() -> str:
    """Every command's --help output, one section per command."""
    from rlhf.cli import build_parser

    parts = []
    with _help_width():
        for name, parser in parsers(build_parser()):
            level = "##" if name.count(" ") <= 1 else "###"
            parts.append(f"{level} `{name}`\n\n```text\n{parser.format_help().rstrip()}\n```\n")
    return "\n".join(parts)


def config_reference() -> str:
    """`rlhf config docs`, with the page's own title instead of its first heading."""
    from rlhf.config import reference_markdown

    text = reference_markdown()
    first, rest = text.split("\n", 1)
    assert first.startswith("### "), first
    return rest.lstrip("\n").replace("\n#### ", "\n## ")


def verl_key_table() -> str:
    """The verl key table `rlhf config from-verl` translates by."""
    from rlhf.config.from_verl import key_table_markdown

    return key_table_markdown()


GENERATED = {"reference/cli.md": cli_reference, "reference/config.md": config_reference,
             "guides/coming-from-verl.md": verl_key_table}


def expected(page: str) -> str:
    """The page's text with its generated block as the code makes it now."""
    text = (DOCS / page).read_text(encoding="utf-8")
    i, j = text.index(START) + len(START), text.index(END)
    return text[:i] + GENERATED[page]() + text[j:]


def main() -> None:
    for page in GENERATED:
        (DOCS / page).write_text(expected(page), encoding="utf-8")
        print(f"wrote docs/{page}")


if __name__ == "__main__":
    main()
