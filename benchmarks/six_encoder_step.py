"""One AdamW training step of the six-encoder model (the paper's shapes, r = 30), batch 8 x 128 and 1 x 128:
dense eager, dense under torch.compile (Inductor), tensorized eager, tensorized under backend "comera"
(cc.compile_step), and the same compiled step with every TT linear layer contracted in the reference
implementation's fixed order (merge the input cores, merge the output cores, two GEMMs), so the planner's
lead over that order is measured in the same run; in full runs, again with the backend's batch_siblings
on (q, k and v sharing their GEMMs; off on CPU by default), with both compiled steps' GEMM calls per step.
Then the first call of the compiled step, each in a fresh process: with Inductor's caches empty (cold)
and again with the caches the first left (warm).

All variants of one batch size run in one process, interleaved, medians after warm-up.  The compiled steps
come from compile_step, which sets keep_freed_memory() for the whole process before any variant is timed,
so all of them run with the same allocator settings."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Iterator

import torch
from torch import nn

import comera_compile as cc
from comera_compile import networks
from comera_compile.backend import comera_backend
from comera_compile.report import times_faster
from comera_compile.examples import six_encoder
from comera_compile.tt import TTSpec, constant_under_compile

from .common import compare, eager_step, fixed_order_plan, gemm_calls

__all__ = ["run", "format_rows", "fixed_order", "first_call_seconds"]


def _fixed_program(spec: TTSpec, rows: int, training: bool = True, input_requires_grad: bool = True):
    return fixed_order_plan(spec, rows, input_requires_grad).program


@constant_under_compile
def _fixed_segments(spec: TTSpec | tuple, training: bool = True, input_requires_grad: bool = True):
    return (), (_fixed_program(TTSpec.of(spec), 128, training, input_requires_grad),)


@contextlib.contextmanager
def fixed_order() -> Iterator[None]:
    """While active, TT linear layers run (and compile) the reference implementation's fixed order
    (networks.reference_tree) instead of the searched plans: the baseline the planner is measured against."""
    saved = networks.tt_linear_program, networks.tt_linear_segments
    networks.tt_linear_program, networks.tt_linear_segments = _fixed_program, _fixed_segments
    try:
        yield
    finally:
        networks.tt_linear_program, networks.tt_linear_segments = saved


def _comera_fixed_order(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
    """backend "comera" under another name: dynamo keeps this variant's compiled blocks apart from the
    searched variant's (its cache checks the backend), so each runs the order it was traced with."""
    return comera_backend(gm, example_inputs)


def _step_fn(model: nn.Module, compiled_backend: Any, options: dict | None = None) -> Callable[..., torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    loss_fn = nn.CrossEntropyLoss()
    if compiled_backend is None:
        return eager_step(model, opt, loss_fn)
    return cc.compile_step(model, loss_fn, opt, backend=compiled_backend, options=options)


def _in_fixed_order(step: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def run(*args: torch.Tensor) -> torch.Tensor:
        with fixed_order():
            return step(*args)
    return run


def _tensorized(layers: int) -> nn.Module:
    return cc.tensorize(six_encoder.build(layers=layers), preset="comera-six-encoder", inplace=True)


def step_times(batch: int, seq: int, layers: int, quick: bool) -> dict:
    """Median step times (ms) of every variant at one batch size, the speedups, parameter counts."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    dense = six_encoder.build(layers=layers)
    variants = {"dense eager": _step_fn(dense, None)}
    if not quick and batch > 1:   # dense Inductor: no ratio uses it; its compile alone takes about 25 s
        variants["dense inductor"] = _step_fn(six_encoder.build(layers=layers), "inductor")
    tt = _tensorized(layers)
    variants["tensorized eager"] = _step_fn(tt, None)
    variants["tensorized comera"] = _step_fn(_tensorized(layers), "comera")
    variants["comera, fixed order"] = _in_fixed_order(_step_fn(_tensorized(layers), _comera_fixed_order))
    if not quick:   # q, k and v sharing their GEMMs (the backend's batch_siblings, on CPU off by default)
        variants["comera, siblings shared"] = _step_fn(_tensorized(layers), "comera", {"batch_siblings": True})
    ids, seg, mask = six_encoder.example_inputs(dense, batch=batch, seq=seq)
    target = torch.randint(0, 3, (batch,))
    batch_args = (ids, seg, mask, target)
    m = compare({k: (lambda f=f: f(*batch_args)) for k, f in variants.items()},
                warmup=2, repeat=3 if quick else (15 if batch == 1 else 7))
    ms = {k: v.median * 1e3 for k, v in m.items()}
    gemms = {k: gemm_calls(lambda f=variants[k]: f(*batch_args))
             for k in ("tensorized comera", "comera, siblings shared") if k in variants}
    return {
        "benchmark": f"six_encoder_step_b{batch}x{seq}_l{layers}", **{f"{k} ms": v for k, v in ms.items()},
        "comera vs dense eager": ms["dense eager"] / ms["tensorized comera"],
        "comera vs tensorized eager": ms["tensorized eager"] / ms["tensorized comera"],
        "comera vs fixed order": ms["comera, fixed order"] / ms["tensorized comera"],
        **({"siblings shared vs apart": ms["tensorized comera"] / ms["comera, siblings shared"]}
           if "comera, siblings shared" in ms else {}),
        **{f"{k} GEMMs": n for k, n in gemms.items()},
        "dense params": sum(p.numel() for p in dense.parameters()),
        "tensorized params": sum(p.numel() for p in tt.parameters()),
        "threads": torch.get_num_threads(),
    }


def _first_call(batch: int, seq: int, layers: int) -> float:
    torch.manual_seed(0)
    model = _tensorized(layers)
    step = _step_fn(model, "comera")
    ids, seg, mask = six_encoder.example_inputs(model, batch=batch, seq=seq)
    t0 = time.perf_counter()
    step(ids, seg, mask, torch.randint(0, 3, (batch,)))
    return time.perf_counter() - t0


def first_call_seconds(batch: int = 8, seq: int = 128, layers: int = 6) -> dict[str, float]:
    """Seconds of the compiled step's first call (compile included), each in a fresh process at this
    process's thread count: 'cold' with empty caches, as on a machine that never compiled before, 'warm'
    with the caches the cold run left.  Empty means a fresh Inductor cache directory and a fresh temporary
    directory: Inductor keeps its precompiled kernel header under the temporary directory's default cache,
    whatever TORCHINDUCTOR_CACHE_DIR says."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="comera-bench-cache-") as cache:
        tmp = os.path.join(cache, "tmp")
        os.makedirs(tmp)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"), "TMPDIR": tmp}
        for kind in ("cold", "warm"):
            cmd = [sys.executable, "-m", __name__, "--first-call", "--batch", str(batch), "--seq", str(seq),
                   "--layers", str(layers), "--threads", str(torch.get_num_threads())]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"first-call run failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
            out[kind] = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
    return out


def run(quick: bool = False, batches: tuple[int, ...] = (8, 1), seq: int = 128, layers: int | None = None
        ) -> list[dict]:
    """A row of step times per batch size, then (not when quick) the first-call row.  layers defaults to
    the paper's 6, or 1 when quick."""
    layers = layers if layers is not None else (1 if quick else 6)
    rows = [step_times(b, seq, layers, quick) for b in batches]
    if not quick:
        first = first_call_seconds(batches[0], seq, layers)
        rows.append({"benchmark": f"six_encoder_first_call_b{batches[0]}x{seq}_l{layers}",
                     "cold cache s": first["cold"], "warm cache s": first["warm"],
                     "threads": torch.get_num_threads()})
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        if "cold cache s" in r:
            lines.append(f"{r['benchmark']}: first call of the compiled step {r['cold cache s']:.1f} s with "
                         f"empty caches, {r['warm cache s']:.1f} s warm ({r['threads']} threads)")
            continue
        times = ", ".join(f"{k[:-3]} {v:.1f} ms" for k, v in r.items() if k.endswith(" ms"))
        lines.append(f"{r['benchmark']} ({r['threads']} threads, medians): {times}; comera "
                     f"{times_faster(r['comera vs dense eager'], 2)} than dense eager, "
                     f"{times_faster(r['comera vs tensorized eager'], 2)} than tensorized eager, "
                     f"{times_faster(r['comera vs fixed order'], 2)} than the fixed order; params "
                     f"{r['dense params']:,} -> {r['tensorized params']:,}" + _gemms(r))
    return "\n".join(lines)


def _gemms(row: dict) -> str:
    """The GEMM calls per step of the compiled step, with and without siblings sharing, where counted."""
    if "comera, siblings shared GEMMs" not in row:
        return ""
    return (f"; GEMM calls per step {row['tensorized comera GEMMs']:,} -> {row['comera, siblings shared GEMMs']:,} "
            f"with siblings shared ({row['siblings shared vs apart']:.2f}x the step time)")


def _main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--first-call", action="store_true", help="time the compiled step's first call, print JSON")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.first_call:
        print(json.dumps({"seconds": _first_call(args.batch, args.seq, args.layers)}))
    else:
        print(format_rows(run(batches=(args.batch,), seq=args.seq, layers=args.layers)))


if __name__ == "__main__":
    _main()
