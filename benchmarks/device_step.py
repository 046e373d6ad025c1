"""The six-encoder training step (the paper's shapes, r = 30, AdamW) on a chosen device -- CUDA by default --
at batch 1, 8 and 32 x 128 (32: the paper's MNLI batch), in float32 (TF32 matmuls on CUDA) and under
bfloat16 autocast.  Variants, all in one process:

- dense eager; dense under torch.compile (Inductor; mode "reduce-overhead" on CUDA, i.e. CUDA Graphs: the
  fair dense baseline on a GPU), through the same cc.compile_step as CoMERA;
- on CUDA, dense with the whole step captured as one CUDA graph (cuda_graphs="step"), as CoMERA's best
  variant is: the ratio against it is what the TT layers gain when both sides launch one graph per step;
- GaLore (dense + GaLore's AdamW, rank 128 projections of the encoder weights), eager;
- CoMERA: tensorized, cc.compile_step with backend "comera": per-block graphs (cuda_graphs="compiled": each
  compiled block replayed by Inductor's CUDA Graph trees, the rest launched kernel by kernel), the whole step
  one CUDA graph ("step"; again with Inductor's combo kernels; again with batch_siblings off), CUDA Graphs
  off, and per-block with every TT linear contracted in the reference implementation's fixed order; on CUDA
  also the whole step compiled as one function, its backward traced by compiled autograd
  (common.compiled_autograd_step).  GaLore and the variants named in common.EXTRAS run only in the rows
  common.row_plan gives them (each costs a compile per row; the headline row runs first).
A variant whose first call fails is reported in the row ("<variant> error") and left out.  First, each
variant alone: its first call (compiles included) and its peak device memory over its first three steps
(step_peak_bytes).  Then step times, interleaved, medians after warm-up, from CUDA events (on the CPU: the
host clock).  Last, each variant's cc.breakdown (launches, kernels, idle share, matmul share, FLOP rate
against the matmul peak measured in the row's precision).  ``comera-compile bench --device cuda`` runs
this with the embedding and TT-linear benches; ``--device cpu`` the same code at reduced sizes."""

from __future__ import annotations

import contextlib
import gc
import platform
import statistics
import time
from typing import Any, Callable, Collection, Iterator

import torch
from torch import nn

import comera_compile as cc
from comera_compile.examples import six_encoder
from comera_compile.memory import peak_bytes
from comera_compile.step_time import call_ms

from .common import EXTRAS, compiled_autograd_step, eager_step, rounds, row_plan, table_shape
from .galore import galore_optimizer, persistent_bytes
from .six_encoder_step import _comera_fixed_order, _in_fixed_order, fixed_order

__all__ = ["run", "format_rows", "ratio_text", "device_compare", "step_peak_bytes", "precision", "PRECISIONS",
           "breakdown_cells"]

MIB = 2.0**20
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


@contextlib.contextmanager
def precision(name: str, device: torch.device) -> Iterator[torch.dtype | None]:
    """fp32: float32 with TF32 matmuls on CUDA (torch.set_float32_matmul_precision("high")), as GPU training
    runs float32; bf16: yields torch.bfloat16 for the steps' autocast.  Restores the setting after."""
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}; choose from {sorted(PRECISIONS)}")
    before = torch.get_float32_matmul_precision()
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    try:
        yield PRECISIONS[name]
    finally:
        torch.set_float32_matmul_precision(before)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_compare(cases: dict[str, Callable[[], object]], device: torch.device, *, warmup: int = 3,
                   repeat: int = 10) -> dict[str, float]:
    """Median milliseconds of each case, the cases interleaved in rounds (common.rounds), after `warmup`
    calls each: CUDA events around each call on CUDA (device time, launch gaps included), the host clock
    after a synchronize elsewhere."""
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for order in rounds(list(cases), repeat):
        for name in order:
            samples[name].append(call_ms(cases[name], device))
    return {name: statistics.median(v) for name, v in samples.items()}


def step_peak_bytes(step: Callable[[], object], model: nn.Module, optimizer: torch.optim.Optimizer,
                    device: torch.device, steps: int = 3) -> int:
    """Peak device bytes of training `model` with `step`: the model's parameters, buffers and optimizer state
    (each storage once), plus the most the steps allocate above that.  On CUDA the latter is
    torch.cuda.max_memory_allocated over `steps` calls above what was allocated before them (the calls that
    record CUDA Graphs included: their memory pool is what the replays reuse); elsewhere the peak live
    tensor bytes of one call as comera_compile.memory tracks them (eager steps only: a compiled step's
    kernels allocate out of its sight).  A first step runs unmeasured when the optimizer has no state yet."""
    if not optimizer.state:
        step()
    gc.collect()
    if device.type != "cuda":
        return persistent_bytes(model, optimizer) + peak_bytes(step)
    _sync(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(steps):
        step()
    _sync(device)
    return torch.cuda.max_memory_allocated(device) - base + persistent_bytes(model, optimizer)


def _variants(layers: int, device: torch.device, dtype: torch.dtype | None, extras: Collection[str]
              ) -> dict[str, tuple[nn.Module, torch.optim.Optimizer, Callable[..., torch.Tensor]]]:
    """name -> (model, optimizer, step(*batch)) of every variant, built from one seed: those of every row and
    the `extras` named (common.EXTRAS)."""
    loss_fn = nn.CrossEntropyLoss()
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    dense = six_encoder.build(layers=layers).to(device)
    out: dict[str, tuple[nn.Module, torch.optim.Optimizer, Callable[..., torch.Tensor]]] = {}

    def adamw(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.0)

    def copy_of(m: nn.Module) -> nn.Module:
        other = six_encoder.build(layers=layers).to(device)
        other.load_state_dict(m.state_dict())
        return other

    opt = adamw(dense)
    out["dense eager"] = (dense, opt, eager_step(dense, opt, loss_fn, dtype))
    compiled_dense = copy_of(dense)
    opt = adamw(compiled_dense)
    out["dense compiled"] = (compiled_dense, opt, cc.compile_step(
        compiled_dense, loss_fn, opt, backend="inductor", mode="reduce-overhead" if cuda else None,
        autocast=dtype))
    if cuda:   # the same capture for dense: what the whole-step graph gains without TT layers
        whole = copy_of(dense)
        opt = adamw(whole)
        out["dense, whole-step graph"] = (whole, opt, cc.compile_step(
            whole, loss_fn, opt, backend="inductor", cuda_graphs="step", autocast=dtype))
    galore = "GaLore" in extras
    if galore:
        try:
            import galore_torch  # noqa: F401  (it imports bitsandbytes too)
        except Exception:
            galore = False
    if galore:
        g = copy_of(dense)
        opt = galore_optimizer(g)
        out["GaLore"] = (g, opt, eager_step(g, opt, loss_fn, dtype))

    def tensorized() -> nn.Module:
        return cc.tensorize(copy_of(dense), preset="comera-six-encoder", inplace=True)

    if cuda and "CoMERA, compiled autograd" in extras:
        m = tensorized()
        opt = adamw(m)
        out["CoMERA, compiled autograd"] = (m, opt, compiled_autograd_step(m, loss_fn, opt, dtype))
    combo = {"inductor": {"combo_kernels": True}}   # Inductor's horizontal fusion of independent kernels
    apart = {"batch_siblings": False}   # each TT layer's GEMMs its own (the default on CPU)
    for name, backend, graphs, options in (("CoMERA", "comera", "compiled", None),
                                           ("CoMERA, whole-step graph", "comera", "step", None),
                                           ("CoMERA, whole-step graph, combo kernels", "comera", "step", combo),
                                           ("CoMERA, whole-step graph, siblings apart", "comera", "step", apart),
                                           ("CoMERA, CUDA Graphs off", "comera", "off", None),
                                           ("CoMERA, fixed order", _comera_fixed_order, "compiled", None)):
        if (graphs != "compiled" and not cuda) or (name in EXTRAS and name not in extras):
            continue   # the same graphs as "CoMERA" where there are no CUDA Graphs; an extra not asked for
        m = tensorized()
        opt = adamw(m)
        step = cc.compile_step(m, loss_fn, opt, backend=backend, cuda_graphs=graphs, autocast=dtype, options=options)
        out[name] = (m, opt, _in_fixed_order(step) if name.endswith("fixed order") else step)
    return out


def step_row(batch: int, seq: int, layers: int, device: torch.device, precision_name: str, quick: bool,
             extras: Collection[str] = EXTRAS) -> dict[str, Any]:
    """One row: every variant's first-call seconds, peak MiB and median step ms at one batch and precision
    (the variants of every row and the `extras` named)."""
    torch._dynamo.reset()
    galore = "GaLore" in extras
    with precision(precision_name, device) as dtype:
        variants = _variants(layers, device, dtype, extras)
        any_model = next(iter(variants.values()))[0]
        ids, seg, mask = (t.to(device) for t in six_encoder.example_inputs(any_model, batch=batch, seq=seq))
        target = torch.randint(0, 3, (batch,), generator=torch.Generator().manual_seed(batch)).to(device)
        args = (ids, seg, mask, target)
        row: dict[str, Any] = {"benchmark": f"device_step_{device.type}_{precision_name}_b{batch}x{seq}_l{layers}",
                               "device": _device_name(device), "precision": precision_name}
        if galore and "GaLore" not in variants:
            row["note"] = ("GaLore left out: galore_torch does not import here (pip install galore-torch, which "
                           "needs bitsandbytes)")
        for name, (model, opt, step) in list(variants.items()):
            _sync(device)
            t0 = time.perf_counter()
            try:
                step(*args)
                _sync(device)
            except Exception as e:   # reported in the row: the other variants' figures still come
                if name in ("dense compiled", "CoMERA"):
                    raise
                row[f"{name} error"] = f"{type(e).__name__}: {str(e)[:300]}"
                del variants[name]
                torch._dynamo.reset()
                continue
            row[f"{name} first s"] = time.perf_counter() - t0
            if device.type == "cuda":
                peak = step_peak_bytes(lambda s=step: s(*args), model, opt, device)
                row[f"{name} MiB"] = peak / MIB
        ms = device_compare({k: (lambda s=s: s(*args)) for k, (_, _, s) in variants.items()}, device,
                            warmup=2, repeat=3 if quick else 20)
        row.update({f"{k} ms": v for k, v in ms.items()})
        row.update(_breakdowns(variants, args, ms, layers, device, dtype))
    best = row["best CoMERA"] = min((k for k in ms if k.startswith("CoMERA") and k != "CoMERA, fixed order"),
                                    key=ms.__getitem__)
    comera = ms[best]
    row["CoMERA vs dense compiled"] = ms["dense compiled"] / comera
    row["CoMERA vs dense eager"] = ms["dense eager"] / comera
    if "dense, whole-step graph" in ms:
        row["CoMERA vs dense whole-step graph"] = ms["dense, whole-step graph"] / comera
    if "GaLore" in ms:
        row["CoMERA vs GaLore"] = ms["GaLore"] / comera
        if "GaLore MiB" in row:
            row["GaLore / CoMERA memory"] = row["GaLore MiB"] / row["CoMERA MiB"]
    for key, slower, faster in (("whole-step vs per-block graphs", "CoMERA", "CoMERA, whole-step graph"),
                                ("whole-step graph vs graphs off", "CoMERA, CUDA Graphs off",
                                 "CoMERA, whole-step graph"),
                                ("whole-step graph vs compiled autograd", "CoMERA, compiled autograd",
                                 "CoMERA, whole-step graph"),
                                ("whole-step graph, combo kernels vs without", "CoMERA, whole-step graph",
                                 "CoMERA, whole-step graph, combo kernels"),
                                ("whole-step graph, siblings shared vs apart",
                                 "CoMERA, whole-step graph, siblings apart", "CoMERA, whole-step graph"),
                                ("per-block graphs vs graphs off", "CoMERA, CUDA Graphs off", "CoMERA"),
                                ("fixed order vs ours", "CoMERA, fixed order", "CoMERA")):
        if slower in ms and faster in ms:
            row[key] = ms[slower] / ms[faster]
    row["dense params"] = sum(p.numel() for p in variants["dense eager"][0].parameters())
    row["CoMERA params"] = sum(p.numel() for p in variants["CoMERA"][0].parameters())
    del variants
    gc.collect()
    return row


def _step_flops(layers: int, device: torch.device, dtype: torch.dtype | None, args: tuple
                ) -> dict[str, Any]:
    """Matrix-product FLOPs of one forward + backward (torch's flop counter, eager models built as the
    variants are): dense, CoMERA in its searched order and in the fixed order."""
    from comera_compile.step_time import count_flops

    loss_fn = nn.CrossEntropyLoss()
    *inputs, target = args
    torch.manual_seed(0)
    dense = six_encoder.build(layers=layers).to(device)
    tt = cc.tensorize(six_encoder.build(layers=layers), preset="comera-six-encoder").to(device)

    def train(model: nn.Module) -> Callable[[], None]:
        def run() -> None:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = loss_fn(model(*inputs), target)
            loss.backward()
        return run

    out = {"dense": count_flops(train(dense)), "CoMERA": count_flops(train(tt), model=tt)}
    with fixed_order():
        out["CoMERA, fixed order"] = count_flops(train(tt), model=tt)
    return out


def _breakdowns(variants: dict, args: tuple, ms: dict[str, float], layers: int, device: torch.device,
                dtype: torch.dtype | None) -> dict[str, Any]:
    """Each variant's cc.breakdown (kernels, host launches, busy and idle device time, time in matrix
    products, FLOP rate against the measured matmul peak) as "<variant> breakdown", at its step time above;
    "<variant> launches" (kernel + graph launches from the host) on CUDA."""
    from comera_compile.step_time import breakdown, matmul_peak

    flops = _step_flops(layers, device, dtype, args)
    peak = matmul_peak(device, dtype)
    out: dict[str, Any] = {"matmul peak TFLOP/s": peak / 1e12}
    for name, (_, _, step) in variants.items():
        count = flops["CoMERA, fixed order"] if name.endswith("fixed order") else (
            flops["CoMERA"] if name.startswith("CoMERA") else flops["dense"])
        b = breakdown(lambda s=step: s(*args), device=device, steps=3, warmup=0, flops=count, peak_flops=peak,
                      step_ms=ms[name])
        out[f"{name} breakdown"] = b.to_dict()
        if device.type == "cuda":
            out[f"{name} launches"] = b.launches + b.graphs
    return out


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def resolve_device(name: str | torch.device) -> torch.device:
    """A torch.device from --device, with a clear error where CUDA is asked for and absent."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to torch "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None}); "
                         "use --device cpu to run the same code paths on the CPU")
    return device


def run(quick: bool = False, device: str | torch.device = "cuda", batches: tuple[int, ...] | None = None,
        seq: int | None = None, layers: int | None = None, precisions: tuple[str, ...] = ("bf16", "fp32"),
        on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """A row per (precision, batch) in common.row_plan's order and with its extra variants, each handed to
    `on_row` as soon as it is measured; sizes not given are common.table_shape's."""
    device = resolve_device(device)
    cuda = device.type == "cuda"
    shape = table_shape(quick, cuda)
    batches, seq, layers = batches or shape[0], seq or shape[1], layers or shape[2]
    rows = []
    for p, b, extras in row_plan(tuple(batches), tuple(precisions)):
        rows.append(step_row(b, seq, layers, device, p, quick or not cuda, extras))
        if on_row is not None:
            on_row(rows[-1])
    return rows


RATIO_KEYS = ("CoMERA vs", "whole-step", "per-block", "fixed order vs", "GaLore /")


def ratio_text(row: dict) -> str:
    """The row's ratios, "name 1.23x" each (above 1: the first named is faster or smaller)."""
    return ", ".join(f"{k} {row[k]:.2f}x" for k in row if k.startswith(RATIO_KEYS))


def breakdown_cells(b: dict | None) -> dict[str, str]:
    """A variant's breakdown (StepBreakdown.to_dict) as table cells: kernels per step, idle share of the step,
    matrix products' share of the busy time, TFLOP/s and their share of the measured matmul peak."""
    if not b:
        return {}
    busy = b["busy_ms"] or float("nan")
    cells = {"kernels": f"{b['kernels']:.0f}", "idle": f"{100 * b['idle_ms'] / b['step_ms']:.0f}%",
             "matmul": f"{100 * b['categories']['matmul']['ms'] / busy:.0f}%"}
    if b.get("flops_per_s") is not None:
        cells["TFLOP/s"] = f"{b['flops_per_s'] / 1e12:.2f}"
    if b.get("peak_share") is not None:
        cells["of peak"] = f"{100 * b['peak_share']:.1f}%"
    return cells


def breakdown_text(b: dict | None) -> str:
    cells = breakdown_cells(b)
    if not cells:
        return ""
    unit = "operators" if b.get("device") == "cpu" else "kernels"
    text = f"; {cells['kernels']} {unit}, idle {cells['idle']}, matmul {cells['matmul']} of busy"
    if "TFLOP/s" in cells:
        text += f", {cells['TFLOP/s']} TFLOP/s ({cells.get('of peak', '-')} of peak)"
    return text


def format_rows(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        names = [k[:-3] for k in r if k.endswith(" ms")]
        lines.append(f"{r['benchmark']} on {r['device']}:")
        for n in names:
            mem = f", peak {r[n + ' MiB']:.1f} MiB" if f"{n} MiB" in r else ""
            launches = f", {r[n + ' launches']:.0f} launches" if f"{n} launches" in r else ""
            lines.append(f"  {n:<26} {r[n + ' ms']:9.2f} ms{mem}{launches}, first call {r[n + ' first s']:.1f} s"
                         + breakdown_text(r.get(f"{n} breakdown")))
        lines += [f"  {k[:-6]} failed: {v}" for k, v in r.items() if k.endswith(" error")]
        lines.append(f"  {ratio_text(r)}; best CoMERA: {r['best CoMERA']}; "
                     f"params {r['dense params']:,} -> {r['CoMERA params']:,}")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse
    import json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--precisions", nargs="+", default=["bf16", "fp32"], choices=sorted(PRECISIONS))
    p.add_argument("--batches", nargs="+", type=int, default=None, help="batch sizes (default: 1 8 32 on CUDA)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file (after each row, so a "
                                                   "run cut short keeps the rows it finished)")
    args = p.parse_args()
    done: list[dict] = []

    def write(row: dict) -> None:
        done.append(row)
        print(format_rows([row]), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(done, f, indent=1, default=str)

    run(quick=args.quick, device=args.device, batches=tuple(args.batches) if args.batches else None,
        precisions=tuple(args.precisions), on_row=write)
