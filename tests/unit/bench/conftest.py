"""`rlhf bench NAME ...` run in the test's own process, for benchmarks whose work all happens
there or in ranks it launches: a fresh interpreter would spend seconds of CPU importing what
this one already holds."""

import json

import pytest
import torch


@pytest.fixture
def bench_lines(capsys):
    """`bench_lines(NAME, *ARGV)`: run `rlhf bench NAME ARGV...` through the CLI's parser here;
    return its stdout's JSON lines (every line must be one)."""
    from rlhf.cli import main

    def run(*argv: str) -> list[dict]:
        capsys.readouterr()
        with torch.random.fork_rng():  # the benchmark seeds torch; later tests keep their RNG
            rc = main(["bench", *argv])
        out = capsys.readouterr().out
        assert rc == 0, out[-3000:]
        return [json.loads(line) for line in out.strip().splitlines()]
    return run
