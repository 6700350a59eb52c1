"""Benchmarks: each module registers one ``blitz bench <name>`` subcommand."""
from __future__ import annotations

import importlib

_COMMANDS = ("latency", "serve")


def register_bench_commands(sub, add_engine_args) -> None:
    for name in _COMMANDS:
        mod = importlib.import_module(f".{name}", __name__)
        p = sub.add_parser(name, help=mod.__doc__.strip().splitlines()[0] if mod.__doc__ else None)
        mod.add_args(p, add_engine_args)
        p.set_defaults(bench_func=mod.run)
