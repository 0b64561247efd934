"""`rlhf bench NAME ...`: one subcommand per benchmark module of this package.

A benchmark module has a one-line docstring (the help text), `add_arguments(parser)` and
`run(args) -> int`; it prints one JSON object per line and nothing else on stdout.
"""

from __future__ import annotations

import argparse
import importlib

# name -> module under rlhf.bench; imported only when the parser is built.
BENCHMARKS: dict[str, str] = {"pipeline": "pipeline", "sync": "sync", "rollout": "rollout",
                               "engine": "engine", "attention": "attention",
                               "step": "step", "fixed-memory": "fixed_memory", "gap": "gap",
                               "data": "data", "cost-model": "cost_model",
                               "experts": "experts", "checkpoint": "checkpoint",
                               "cp-attention": "cp_attention"}


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Register `bench` and its benchmarks on the top-level subparsers."""
    bench = commands.add_parser("bench", help="measure speed and memory; prints JSON lines")
    names = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(f"rlhf.bench.{module_name}")
        parser = names.add_parser(name, help=module.__doc__.strip().splitlines()[0])
        module.add_arguments(parser)
        parser.set_defaults(run=module.run)
