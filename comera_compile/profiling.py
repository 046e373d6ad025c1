"""Time per TT layer, from torch's profiler: ``print(cc.profile(step, *args, model=model))``.

TT layers open a profiler range ``comera.<kind>[<name>]`` around their forward while the profiler records
(layers.profiled).  Their backward runs later, outside any range, but autograd records each backward op
with the sequence number of the forward op it differentiates; the table adds the backward ops whose
numbers fall in a layer's range to that layer.  Inside a graph Inductor compiled there are no layers to
see: Inductor removes profiler ranges from the graphs it compiles (they would block fusion), so a compiled
region shows as Inductor's own events; run the model eagerly to attribute time to layers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["profile", "LayerTime", "LayerProfile", "name_layers"]

_PREFIX = "comera."
_BACKWARD = "autograd::engine::evaluate_function: "


@dataclass
class LayerTime:
    """One TT layer's share of the profiled steps (milliseconds per step, CPU time as the profiler counts)."""

    name: str
    kind: str
    calls: int
    forward_ms: float
    backward_ms: float
    device_ms: float = 0.0

    @property
    def total_ms(self) -> float:
        return self.forward_ms + self.backward_ms


@dataclass
class LayerProfile:
    """Per-layer times of the profiled steps; ``str()`` is a table, ``to_dict()`` the data, ``trace`` the
    torch.profiler.profile object for anything else (``trace.export_chrome_trace(path)``)."""

    layers: list[LayerTime]
    steps: int
    step_ms: float
    trace: Any = field(default=None, repr=False)

    def to_dict(self) -> dict:
        return {"steps": self.steps, "step_ms": self.step_ms,
                "layers": [dict(asdict(t), total_ms=t.total_ms) for t in self.layers]}

    def __str__(self) -> str:
        head = ("layer", "kind", "calls/step", "forward ms", "backward ms", "total ms", "% of step")
        rows = [(t.name, t.kind, f"{t.calls / self.steps:g}", f"{t.forward_ms:.3f}", f"{t.backward_ms:.3f}",
                 f"{t.total_ms:.3f}", f"{100 * t.total_ms / self.step_ms:.1f}" if self.step_ms else "-")
                for t in sorted(self.layers, key=lambda t: -t.total_ms)]
        widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
        line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
        total = sum(t.total_ms for t in self.layers)
        out = [line(head), line(["-" * w for w in widths]), *map(line, rows), "",
               f"TT layers: {total:.3f} ms of a {self.step_ms:.3f} ms step (per step, {self.steps} profiled; "
               f"CPU time under the profiler)"]
        if not self.layers:
            out.append("no TT layer ran eagerly: layers inside a graph Inductor compiled are not visible to the "
                       "profiler by name (Inductor removes profiler ranges); profile the eager model")
        return "\n".join(out)


def name_layers(model: nn.Module) -> int:
    """Give every TT layer of `model` its qualified name for profiler ranges; returns how many."""
    from comera_compile.layers import TTLayer

    count = 0
    for name, module in model.named_modules():
        if isinstance(module, TTLayer):
            module.comera_name = name or type(module).__name__
            count += 1
    return count


def _sequence_numbers(event: Any) -> set[int]:
    out: set[int] = set()
    stack = list(event.cpu_children)
    while stack:
        e = stack.pop()
        if getattr(e, "sequence_nr", -1) >= 0:
            out.add(e.sequence_nr)
        stack.extend(e.cpu_children)
    return out


def profile(step: Callable[..., Any], *args: Any, model: nn.Module | None = None, steps: int = 3,
            warmup: int = 1, **kwargs: Any) -> LayerProfile:
    """Run ``step(*args, **kwargs)`` `warmup` times, then `steps` times under torch.profiler, and return
    the time per TT layer: forward (the layer's range), backward (autograd's ops for the forward ops in
    that range), per step.  `model` (optional) names its TT layers first (name_layers); layers made by
    tensorize are named already."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if model is not None:
        name_layers(model)
    for _ in range(warmup):
        step(*args, **kwargs)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("comera.step"):
                step(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    events = prof.events()
    step_us = sum(e.cpu_time_total for e in events if e.name == "comera.step")
    backward_us: dict[int, float] = {}
    for e in events:
        if e.name.startswith(_BACKWARD) and getattr(e, "sequence_nr", -1) >= 0:
            backward_us[e.sequence_nr] = backward_us.get(e.sequence_nr, 0.0) + e.cpu_time_total
    table: dict[str, LayerTime] = {}
    for e in events:
        if not e.name.startswith(_PREFIX) or "[" not in e.name:
            continue
        kind, _, rest = e.name[len(_PREFIX):].partition("[")
        name = rest[:-1]
        t = table.setdefault(name, LayerTime(name, kind, 0, 0.0, 0.0))
        t.calls += 1
        t.forward_ms += e.cpu_time_total / 1e3 / steps
        t.backward_ms += sum(backward_us.get(n, 0.0) for n in _sequence_numbers(e)) / 1e3 / steps
        t.device_ms += getattr(e, "device_time_total", 0.0) / 1e3 / steps
    return LayerProfile(list(table.values()), steps, step_us / 1e3 / steps, prof)
