"""Where a training step's time goes on its device: ``print(cc.breakdown(step, flops=cc.count_flops(...)))``.

The step time (CUDA events, no profiler) set against what torch's profiler saw the device do in the same
step: the time some kernel was running (``busy``; the rest of the step the device sat idle, waiting for the
host: launch gaps, Python, synchronizations), kernels per step and host launches per step, the time in
matrix-product kernels against the rest, and, given the step's FLOPs (count_flops) and the device's measured
matrix-product rate (matmul_peak), the FLOP rate achieved and its share of that peak.

On the CPU the units are torch's operators as the profiler records them (the outermost aten operator of each
call), not kernels: an Inductor-compiled graph's own C++ kernels are not recorded one by one, so their time
counts as idle there.  The figures are per step, averaged over the profiled steps.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

__all__ = ["breakdown", "StepBreakdown", "count_flops", "FlopCount", "matmul_peak", "kernel_category",
           "busy_time", "call_ms", "summarize"]

# Kernel and operator names of matrix products: cuBLAS (gemm, gemv, xmma/wgmma tensor-core kernels, nvjet,
# cutlass templates, split-K reductions), Inductor's Triton matmul templates, and aten's product operators.
_MATMUL = re.compile(r"gemm|gemv|xmma|wgmma|nvjet|cutlass|splitKreduce|triton_tem_fused_(?:b)?mm|"
                     r"^aten::(?:linear|matmul|mm|bmm|addmm|baddbmm|addbmm|einsum|_addmm_activation)$", re.I)
_ATTENTION = re.compile(r"flash|fmha|attention|^aten::_scaled_dot_product", re.I)
_COPY = re.compile(r"^(?:Memcpy|Memset)|^aten::(?:copy_|_to_copy|to|clone|contiguous)$")
CATEGORIES = ("matmul", "attention", "copy", "other")

_KERNEL_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                    "cudaLaunchCooperativeKernel", "cudaLaunchCooperativeKernelMultiDevice")
_GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")


def kernel_category(name: str) -> str:
    """"matmul", "attention", "copy" or "other", from a kernel's (or, on the CPU, an operator's) name."""
    if _ATTENTION.search(name):
        return "attention"
    if _MATMUL.search(name):
        return "matmul"
    if _COPY.search(name):
        return "copy"
    return "other"


def busy_time(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: the time at least one of them was running."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


@dataclass
class FlopCount:
    """Matrix-product FLOPs of one call as torch's FlopCounterMode counts them (forward and backward),
    and the part inside TT layers."""

    total: int
    tt_layers: int = 0


def count_flops(fn: Callable[[], Any], model: nn.Module | None = None) -> FlopCount:
    """FLOPs of one eager call of `fn` (run it: a training step's optimizer moves the weights), from
    torch.utils.flop_counter (matrix products and attention; elementwise work is not counted).  With
    `model`, also the FLOPs inside its TT layers.  Count an eager step: a compiled one hides its operators.

    The TT layers' share is counted by calling each layer again, alone, on an input like the one it had
    (shape, dtype, grad and autocast modes, whether it needed a gradient), forward and backward: the flop
    counter's own split by module misplaces backward work between sibling layers that share an input."""
    from torch.utils.flop_counter import FlopCounterMode

    from comera_compile.layers import TTLayer

    calls: list[tuple[nn.Module, torch.Tensor, bool, torch.dtype | None]] = []
    handles = []
    if model is not None:
        def record(module: nn.Module, args: tuple) -> None:
            x = args[0]
            kind = x.device.type
            autocast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
            # the FLOPs of a float input do not depend on its values (a new tensor, not a kept copy of every
            # activation); an embedding's indices choose its plan, so those are kept
            like = (torch.randn_like(x) if x.is_floating_point() else x.detach().clone())
            calls.append((module, like.requires_grad_(x.requires_grad), torch.is_grad_enabled(), autocast))
        handles = [m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, TTLayer)]
    try:
        with FlopCounterMode(display=False) as counter:
            fn()
    finally:
        for h in handles:
            h.remove()
    tt = 0
    for module, x, grad, autocast in calls:
        params = list(module.parameters())
        kept = [p.grad for p in params]   # the replay's backward must leave the user's gradients alone
        try:
            for p in params:
                p.grad = None
            with FlopCounterMode(display=False) as layer_counter, torch.set_grad_enabled(grad), \
                    torch.autocast(x.device.type, dtype=autocast, enabled=autocast is not None):
                y = module(x)
                if grad and y.requires_grad:
                    y.backward(torch.ones_like(y))
        finally:
            for p, g in zip(params, kept):
                p.grad = g
        tt += layer_counter.get_total_flops()
    return FlopCount(int(counter.get_total_flops()), int(tt))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def call_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Milliseconds of one call of `fn`: CUDA events around it on CUDA (device time, launch gaps included),
    the host clock elsewhere."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _median_ms(fn: Callable[[], Any], device: torch.device, repeat: int) -> float:
    return statistics.median(call_ms(fn, device) for _ in range(repeat))


def matmul_peak(device: str | torch.device = "cuda", dtype: torch.dtype | None = None, size: int | None = None,
                repeat: int = 10) -> float:
    """FLOP/s of a square matrix product measured on `device`: `dtype` operands (default float32, at the
    current torch.set_float32_matmul_precision, so TF32 where that is "high"), `size` rows (default 8192 on
    CUDA, 512 elsewhere), median of `repeat` after a warm-up.  The ceiling a step's rate is set against."""
    device = torch.device(device)
    size = size or (8192 if device.type == "cuda" else 512)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=gen).to(dtype or torch.float32)
    b = torch.randn(size, size, device=device, generator=gen).to(dtype or torch.float32)
    for _ in range(3):
        a @ b
    _sync(device)
    ms = _median_ms(lambda: a @ b, device, repeat)
    return 2.0 * size**3 / (ms / 1e3)


@dataclass
class StepBreakdown:
    """One step's figures (per step); ``str()`` is a short report, ``to_dict()`` the data."""

    device: str
    step_ms: float                 # median step time, CUDA events (host clock on the CPU), profiler off
    busy_ms: float                 # time some kernel (operator, on the CPU) was running, under the profiler
    kernels: float                 # kernels and copies that ran (inside CUDA graphs too); CPU: outermost operators
    launches: float = 0.0          # kernel launches from the host (each a launch gap); CUDA only
    graphs: float = 0.0            # CUDA graph launches; CUDA only
    categories: dict[str, dict[str, float]] = field(default_factory=dict)   # category -> {"ms", "count"}
    flops: FlopCount | None = None
    peak_flops: float | None = None   # matmul_peak's FLOP/s
    steps: int = 0

    @property
    def idle_ms(self) -> float:
        """Step time with no kernel running: launch gaps and host work the device waits for."""
        return max(0.0, self.step_ms - self.busy_ms)

    @property
    def flops_per_s(self) -> float | None:
        return None if self.flops is None or self.step_ms <= 0 else self.flops.total / (self.step_ms / 1e3)

    @property
    def peak_share(self) -> float | None:
        rate = self.flops_per_s
        return None if rate is None or not self.peak_flops else rate / self.peak_flops

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(idle_ms=self.idle_ms, flops_per_s=self.flops_per_s, peak_share=self.peak_share)
        return out

    def __str__(self) -> str:
        unit = "kernels" if self.device != "cpu" else "operators"
        lines = [f"step {self.step_ms:.3f} ms on {self.device}: busy {self.busy_ms:.3f} ms, idle "
                 f"{self.idle_ms:.3f} ms ({100 * self.idle_ms / self.step_ms:.0f}%)" if self.step_ms else
                 f"step {self.step_ms:.3f} ms on {self.device}",
                 f"{self.kernels:.0f} {unit} per step" + (f", {self.launches:.0f} kernel launches and "
                                                           f"{self.graphs:.0f} graph launches from the host"
                                                           if self.device != "cpu" else "")]
        for name in CATEGORIES:
            c = self.categories.get(name)
            if c and c["count"]:
                share = f" ({100 * c['ms'] / self.busy_ms:.0f}% of busy)" if self.busy_ms else ""
                lines.append(f"  {name:<9} {c['ms']:8.3f} ms{share}, {c['count']:.0f} {unit}")
        if self.flops is not None:
            line = (f"{self.flops.total / 1e9:.3f} GFLOP per step ({self.flops.tt_layers / 1e9:.3f} in TT layers), "
                    f"{self.flops_per_s / 1e12:.3f} TFLOP/s")
            if self.peak_share is not None:
                line += (f", {100 * self.peak_share:.1f}% of the measured matmul peak "
                         f"({self.peak_flops / 1e12:.1f} TFLOP/s)")
            lines.append(line)
        return "\n".join(lines)


def _is_cpu_unit(event: Any) -> bool:
    """An aten operator with no aten operator around it (the outermost one of a call)."""
    if event.device_type != torch.autograd.DeviceType.CPU or not event.name.startswith("aten::"):
        return False
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    return True


def summarize(events: Iterable[Any], device_type: str, steps: int) -> dict[str, Any]:
    """busy_ms, kernels, launches, graphs and categories per step from a profiler's events."""
    from torch.autograd import DeviceType

    units, launches, graphs = [], 0, 0
    for e in events:
        if device_type == "cuda":
            if e.name in _KERNEL_LAUNCHES:
                launches += 1
            elif e.name in _GRAPH_LAUNCHES:
                graphs += 1
            elif e.device_type == DeviceType.CUDA:
                units.append(e)
        elif _is_cpu_unit(e):
            units.append(e)
    categories = {name: {"ms": 0.0, "count": 0.0} for name in CATEGORIES}
    for e in units:
        c = categories[kernel_category(e.name)]
        c["ms"] += (e.time_range.end - e.time_range.start) / 1e3 / steps
        c["count"] += 1 / steps
    busy = busy_time((e.time_range.start, e.time_range.end) for e in units) / 1e3 / steps
    return {"busy_ms": busy, "kernels": len(units) / steps, "launches": launches / steps,
            "graphs": graphs / steps, "categories": categories}


def breakdown(step: Callable[[], Any], *, device: str | torch.device | None = None, steps: int = 5,
              warmup: int = 2, repeat: int = 10, flops: FlopCount | int | None = None,
              peak_flops: float | None = None, step_ms: float | None = None) -> StepBreakdown:
    """Call ``step()`` `warmup` times, time `repeat` calls (median, no profiler), then profile `steps`
    calls: what the device did per step (StepBreakdown).  `device` defaults to CUDA when available;
    `flops` (count_flops of the same step run eagerly) and `peak_flops` (matmul_peak) add the achieved rate;
    `step_ms` (a median timed elsewhere, beside other steps) replaces the timed calls.  Warm-up must cover
    compiles and CUDA graph captures, or the profiled steps count them."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    if steps < 1 or repeat < 1:
        raise ValueError(f"steps and repeat must be at least 1, got steps={steps}, repeat={repeat}")
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("breakdown(device='cuda'): torch sees no CUDA device; pass device='cpu'")
    for _ in range(warmup):
        step()
    _sync(device)
    if step_ms is None:
        step_ms = _median_ms(step, device, repeat)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    figures = summarize(prof.events(), device.type, steps)
    if device.type == "cuda" and not figures["kernels"]:
        raise ValueError("breakdown(device='cuda'): no kernel ran on the GPU during the profiled steps (or torch's "
                         "profiler recorded no CUDA activity here); a step on the CPU is broken down with "
                         "device='cpu'")
    if isinstance(flops, int):
        flops = FlopCount(flops)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return StepBreakdown(device=name, step_ms=step_ms, flops=flops, peak_flops=peak_flops, steps=steps, **figures)
