"""What the training commands (demo, pretrain) share: threads, a preset built from the options given, and
`--nproc N`, which starts the same command under torchrun on N local processes."""

from __future__ import annotations

import argparse
import os
import sys
from types import ModuleType
from typing import Any

import torch


def set_threads(command: str, threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise SystemExit(f"comera-compile {command}: --threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)


def given_options(args: argparse.Namespace, names: tuple[str, ...]) -> dict[str, Any]:
    """The config fields the command line set (None: the preset's value); --steps alone makes the budget a
    step count, not the preset's time budget with a step cap."""
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.no_progress:
        given["progress"] = False
    if args.steps is not None and args.minutes is None:
        given["minutes"] = None
    return given


def _shown(value: Any) -> str:
    return "none" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def add_config_options(parser: argparse.ArgumentParser, options: tuple[tuple[str, type, str], ...],
                       defaults: Any = None, presets: dict[str, dict[str, Any]] | None = None) -> None:
    """Options that each set one config field of the same name, from (flag, type, help) rows, default None
    (the preset's value).  With `defaults` (the default preset's config), a help that names no default ends
    with the field's; with `presets` (name: the fields it sets), each other preset's value of the field too."""
    for flag, kind, what in options:
        field = flag[2:].replace("-", "_")
        value = getattr(defaults, field) if defaults is not None else None
        others = "; ".join(f"--preset {name}: {_shown(fields[field])}" for name, fields in (presets or {}).items()
                           if field in fields and fields[field] != value)
        if value is not None and "default" not in what:
            what += f" (default {_shown(value)}" + (f"; {others})" if others else ")")
        elif others:
            what += f" ({others})"
        parser.add_argument(flag, type=kind, default=None, help=what)


def launch(nproc: int, argv: list[str], device: str, command: str) -> int:
    """The same command under torchrun on `nproc` local processes (its options but --nproc)."""
    import subprocess

    if device == "cuda" and torch.cuda.device_count() < nproc:
        raise SystemExit(f"comera-compile {command}: --nproc {nproc} --device cuda needs {nproc} GPUs, this machine "
                         f"shows {torch.cuda.device_count()}")
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    cmd = [sys.executable, "-m", "comera_compile.cli.torchrun", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "comera_compile", *rest]
    print(f"comera-compile {command}: " + " ".join(["torchrun", *cmd[3:]]), flush=True)
    return subprocess.call(cmd)


def train(command: str, job: ModuleType, args: argparse.Namespace, argv: list[str], given: dict[str, Any],
          threads: int | None = None) -> int:
    """Build `job`'s preset with the options given and run it here, or under torchrun when --nproc asks for
    processes and this is not one of them yet.  `job` is an example module with preset(), run() and DemoError."""
    try:
        cfg = job.preset(args.preset, **given)
        if args.nproc is not None and "WORLD_SIZE" not in os.environ:  # not yet under torchrun: start it
            if args.nproc < 1:
                raise SystemExit(f"comera-compile {command}: --nproc must be at least 1, got {args.nproc}")
            cfg.check(args.nproc)
            return launch(args.nproc, argv, cfg.device, command)
        set_threads(command, threads)
        job.run(cfg)
    except job.DemoError as e:
        raise SystemExit(f"comera-compile {command}: {e}") from e
    return 0
