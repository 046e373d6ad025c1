"""Timing helpers: interleaved repetitions, medians after warm-up, ratios against a baseline."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from comera_compile import networks
from comera_compile.tt import TTSpec, gemm_spec

__all__ = ["Measurement", "compare", "rounds", "gemm_calls", "format_flat_rows", "eager_step", "compiled_autograd_step",
           "fixed_order_plan", "table_shape", "EXTRAS", "row_plan"]

GEMM_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")


@dataclass
class Measurement:
    """Median seconds of each case, with every sample kept."""

    name: str
    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


def rounds(names: list[str], repeat: int) -> list[list[str]]:
    """The order of the cases in each of `repeat` timing rounds: all of them, each round starting one case
    further on, so no case always runs after the same other (whose freed memory or evicted caches it would
    inherit) and a slow drift of the machine hits every case alike."""
    return [names[r % len(names):] + names[:r % len(names)] for r in range(repeat)]


def compare(cases: dict[str, Callable[[], object]], *, warmup: int = 3, repeat: int = 10,
            min_time: float = 0.0, device: torch.device | str | None = None) -> dict[str, Measurement]:
    """Time each case `repeat` times after `warmup` calls, the cases interleaved in rounds (rounds()).  A
    case is repeated within one sample until min_time has passed.  On a CUDA `device` every call ends with a
    synchronize, so the host clock sees the device's work."""
    sync = torch.cuda.synchronize if device is not None and torch.device(device).type == "cuda" else None
    if sync is not None:
        cases = {name: (lambda fn=fn: (fn(), sync())) for name, fn in cases.items()}
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    out = {name: Measurement(name) for name in cases}
    for order in rounds(list(cases), repeat):
        for name in order:
            fn = cases[name]
            n, t0 = 0, time.perf_counter()
            while True:
                fn()
                n += 1
                elapsed = time.perf_counter() - t0
                if elapsed >= min_time:
                    break
            out[name].samples.append(elapsed / n)
    return out


def gemm_calls(fn: Callable[[], object]) -> int:
    """How many GEMMs (matrix and batched matrix products, with or without an added bias) one call of fn
    runs, counted by torch's profiler on the host: inside compiled graphs too, not inside CUDA graphs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key in GEMM_OPS)


def format_flat_rows(rows: list[dict]) -> str:
    """One line per row: its 'benchmark' name, then every other figure as "key value"."""
    return "\n".join(f"{r['benchmark']}: " + ", ".join(
        f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}"
        for k, v in r.items() if k != "benchmark")
        for r in rows)


def eager_step(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: nn.Module,
               autocast: torch.dtype | None = None) -> Callable[..., torch.Tensor]:
    """An eager training step, step(*inputs, target) -> detached loss: forward, loss (under torch.autocast to
    `autocast` on the model's device type when given), backward, optimizer step."""
    device_type = next((p.device.type for p in model.parameters()), "cpu")

    def step(*batch: torch.Tensor) -> torch.Tensor:
        *inputs, target = batch
        with torch.autocast(device_type, dtype=autocast, enabled=autocast is not None):
            loss = loss_fn(model(*inputs), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def compiled_autograd_step(model: nn.Module, loss_fn: nn.Module, optimizer: torch.optim.Optimizer,
                           dtype: torch.dtype | None) -> Callable[..., torch.Tensor]:
    """The third mechanism for replaying a whole step: the step (forward, loss, backward, optimizer step,
    zero_grad) as one torch.compile'd function with backend "comera", its backward traced by compiled
    autograd, so that Inductor's CUDA Graph trees (the backend's default on CUDA) cover the forward, the
    backward and the optimizer graphs.  The model is compiled whole, not block by block."""
    from comera_compile.optim import prefer_fast_implementation

    prefer_fast_implementation(optimizer)
    compiled = torch.compile(eager_step(model, optimizer, loss_fn, dtype), backend="comera")

    def run(*args: torch.Tensor) -> torch.Tensor:
        with torch._dynamo.config.patch(compiled_autograd=True):
            return compiled(*args).clone()   # a copy: a later replay may overwrite the graph's output
    return run


def fixed_order_plan(spec: TTSpec, rows: int, input_requires_grad: bool = True) -> networks.Plan:
    """A TT linear layer's plan in the reference implementation's fixed order (networks.reference_tree), at
    the GEMM-padded ranks the layer runs at, so only the order differs from the searched plan."""
    padded = gemm_spec(spec)
    net = networks.tt_linear_network(padded, int(rows), input_requires_grad)
    return networks.plan_from_tree(net, networks.reference_tree(padded))


def table_shape(quick: bool, cuda: bool) -> tuple[tuple[int, ...], int, int]:
    """The device step table's batches, sequence length and layers: on CUDA batches 1, 8, 32 x 128 and 6
    layers (quick: 1 and 8, 2 layers); on the CPU batches 1 and 2 x 32, 1 layer (the code paths only)."""
    if cuda:
        return ((1, 8) if quick else (1, 8, 32)), 128, 2 if quick else 6
    return (1, 2), 32, 1


# The device step's variants beyond those of every row (dense eager, compiled and whole-step; CoMERA per-block,
# whole-step and graphs off), each measured only in the rows row_plan gives it.
EXTRAS = ("GaLore", "CoMERA, compiled autograd", "CoMERA, whole-step graph, siblings apart",
          "CoMERA, whole-step graph, combo kernels", "CoMERA, fixed order")


def row_plan(batches: tuple[int, ...], precisions: tuple[str, ...] = ("bf16", "fp32")
             ) -> list[tuple[str, int, frozenset[str]]]:
    """The device step table's rows in the order they run, (precision, batch, extra variants) each.  The
    headline row (the first precision at the middle batch) runs first, so a run cut short by a lent GPU's time
    limit still has it.  Extras go where they answer their question, and a compile each is saved elsewhere:
    GaLore at the smallest batch (its claim is at batch 1); the whole step compiled with compiled autograd (one
    long compile) at the first precision's smallest batch; the siblings apart in every row of the first
    precision (they decide batch_siblings' CUDA default); combo kernels and the fixed order in the headline row."""
    head = batches[len(batches) // 2]
    order = sorted(((p, b) for p in precisions for b in batches),
                   key=lambda pb: (precisions.index(pb[0]), pb[1] != head, pb[1]))
    plan = []
    for p, b in order:
        first = p == precisions[0]
        extras = {"GaLore"} if b == min(batches) else set()
        extras |= {"CoMERA, compiled autograd"} if first and b == min(batches) else set()
        extras |= {"CoMERA, whole-step graph, siblings apart"} if first else set()
        extras |= set(EXTRAS[3:]) if (p, b) == order[0] else set()
        plan.append((p, b, frozenset(extras)))
    return plan
