"""The `comera-compile` command line: train dense vs CoMERA side by side (demo: a masked LM; pretrain: a
Llama-style causal LM, GaLore beside them), inspect a model's TT rewrite, run the benchmark suite."""


from __future__ import annotations

import argparse
import sys
from typing import Sequence

from comera_compile.cli import bench, demo, inspect_model, pretrain

__all__ = ["main", "build_parser"]

_COMMANDS = {"demo": demo, "pretrain": pretrain, "inspect": inspect_model, "bench": bench}


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (its subcommands demo, pretrain, inspect and bench)."""
    parser = argparse.ArgumentParser(prog="comera-compile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in _COMMANDS.values():
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv) if argv is not None else sys.argv[1:]
    args = build_parser().parse_args(argv)
    command = _COMMANDS[args.command]
    return command.run(args, argv) if command in (demo, pretrain) else command.run(args)
