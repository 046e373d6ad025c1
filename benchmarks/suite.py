"""Run the benchmark suite (every module's ``run``), print each figure beside its baseline, save a JSON."""

from __future__ import annotations

import datetime as _dt
import importlib
import importlib.util
import inspect
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

__all__ = ["SUITE", "OPT_IN", "DEVICE_SUITE", "available", "run_suite"]

# In the order they run: the cheap per-layer figures first, the compiled whole-model steps after.
SUITE = ("tt_linear", "embeddings", "memory_passes", "rank_adaptive", "six_encoder_step", "galore")
# Run only when named (--only): long training runs rather than timings; what the profiler hooks cost; and the
# device step, which runs by default under --device.
OPT_IN = ("ra_control", "ra_teachers", "device_step", "profiling")
# What --device runs (each module's run takes device=): per-layer figures, then the six-encoder step.
DEVICE_SUITE = ("tt_linear", "embeddings", "device_step")


def available(opt_in: bool = False) -> list[str]:
    """The suite's benchmarks present in this installation (with opt_in, the opt-in ones too)."""
    names = SUITE + OPT_IN if opt_in else SUITE
    return [n for n in names if importlib.util.find_spec(f"{__package__}.{n}") is not None]


def _machine() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def _takes_device(module: object) -> bool:
    return "device" in inspect.signature(module.run).parameters


def run_suite(quick: bool = False, only: Sequence[str] | None = None, json_path: str | Path | None = None,
              out: Callable[[str], object] = print, device: str | None = None) -> dict:
    """Run the chosen benchmarks (default: all but the opt-in ones; with a device, DEVICE_SUITE on it),
    printing each one's figures as it finishes; return (and write to json_path when given) every figure
    with the command, date and machine."""
    names = [n for n in available(opt_in=True) if n in DEVICE_SUITE] if device else available()
    if only:
        every = available(opt_in=True)
        unknown = sorted(set(only) - set(every))
        if unknown:
            raise ValueError(f"unknown benchmark(s) {unknown}; choose from {every}")
        names = [n for n in every if n in only]
    if device is not None:
        from .device_step import resolve_device

        resolve_device(device)   # a clear error before anything runs
        cpu_only = [n for n in names if not _takes_device(importlib.import_module(f"{__package__}.{n}"))]
        if cpu_only:
            raise ValueError(f"{cpu_only} run on the CPU only; with --device choose from "
                             f"{[n for n in available(opt_in=True) if n in DEVICE_SUITE]}")
    report = {"command": " ".join(["comera-compile", *sys.argv[1:]]) if sys.argv else "comera-compile bench",
              "date": _dt.datetime.now().isoformat(timespec="seconds"), "quick": quick, "machine": _machine(),
              "device": device or "cpu", "results": {}}
    t_all = time.perf_counter()
    for i, name in enumerate(names, 1):
        out(f"[{i}/{len(names)}] {name} ...")
        mod = importlib.import_module(f"{__package__}.{name}")
        t0 = time.perf_counter()
        rows = mod.run(quick=quick, device=device) if device is not None else mod.run(quick=quick)
        seconds = time.perf_counter() - t0
        out(mod.format_rows(rows))
        out(f"  ({seconds:.1f} s)")
        report["results"][name] = {"rows": rows, "seconds": seconds}
    report["seconds"] = time.perf_counter() - t_all
    out(f"suite done in {report['seconds']:.1f} s")
    if json_path is not None:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        out(f"wrote {path}")
    return report
