"""Time per TT layer, from torch's profiler: ``print(cc.profile(step, *args, model=model))``.

TT layers open a profiler range ``comera.<kind>[<name>]`` around their forward while the profiler records
(layers.profiled).  Their backward runs later, outside any range, but autograd records each backward op
with the sequence number of the forward op it differentiates; the table adds the backward ops whose
numbers fall in a layer's range to that layer.

Inside a graph Inductor compiled there are no layers to see: Inductor removes profiler ranges from the
graphs it compiles (they would block fusion).  The backend's ``profile`` option
(``torch.compile(model, backend="comera", options={"profile": True})``) therefore compiles each TT layer's
part of a graph as a graph of its own (split_by_layer) and calls it inside the layer's range; each part is
one autograd node, whose backward carries the forward's sequence number as above.  The price is the fusion
across layer boundaries, which is why it is an option for profiling runs.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["profile", "LayerTime", "LayerProfile", "name_layers", "split_by_layer", "launches_per_step"]

_PREFIX = "comera."
_BACKWARD = "autograd::engine::evaluate_function: "


@dataclass
class LayerTime:
    """One TT layer's share of the profiled steps (milliseconds per step): CPU time as the profiler counts
    it, and on CUDA the time of the kernels the layer's forward and backward launched (device_ms,
    backward_device_ms)."""

    name: str
    kind: str
    calls: int
    forward_ms: float
    backward_ms: float
    device_ms: float = 0.0
    backward_device_ms: float = 0.0

    @property
    def total_ms(self) -> float:
        return self.forward_ms + self.backward_ms

    @property
    def total_device_ms(self) -> float:
        return self.device_ms + self.backward_device_ms


@dataclass
class LayerProfile:
    """Per-layer times of the profiled steps; ``str()`` is a table, ``to_dict()`` the data, ``trace`` the
    torch.profiler.profile object for anything else (``trace.export_chrome_trace(path)``)."""

    layers: list[LayerTime]
    steps: int
    step_ms: float
    trace: Any = field(default=None, repr=False)
    device_busy_ms: float = 0.0   # CUDA: time per step some kernel ran (all kernels, not only the layers')

    def to_dict(self) -> dict:
        return {"steps": self.steps, "step_ms": self.step_ms, "device_busy_ms": self.device_busy_ms,
                "layers": [dict(asdict(t), total_ms=t.total_ms, total_device_ms=t.total_device_ms)
                           for t in self.layers]}

    def __str__(self) -> str:
        device = self.device_busy_ms > 0
        head = ("layer", "kind", "calls/step", "forward ms", "backward ms", "total ms", "% of step")
        if device:   # on CUDA the host's time says little: the kernels' time is what the step waits for
            head = ("layer", "kind", "calls/step", "forward kernel ms", "backward kernel ms", "total kernel ms",
                    "% of device busy")
        key = (lambda t: -t.total_device_ms) if device else (lambda t: -t.total_ms)
        rows = []
        for t in sorted(self.layers, key=key):
            fwd, bwd, tot = ((t.device_ms, t.backward_device_ms, t.total_device_ms) if device
                             else (t.forward_ms, t.backward_ms, t.total_ms))
            whole = self.device_busy_ms if device else self.step_ms
            rows.append((t.name, t.kind, f"{t.calls / self.steps:g}", f"{fwd:.3f}", f"{bwd:.3f}", f"{tot:.3f}",
                         f"{100 * tot / whole:.1f}" if whole else "-"))
        widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
        line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
        if device:
            total = sum(t.total_device_ms for t in self.layers)
            summary = (f"TT layers: {total:.3f} ms of kernel time of the {self.device_busy_ms:.3f} ms the device "
                       f"was busy per step (step {self.step_ms:.3f} ms on the host clock; {self.steps} profiled)")
        else:
            total = sum(t.total_ms for t in self.layers)
            summary = (f"TT layers: {total:.3f} ms of a {self.step_ms:.3f} ms step (per step, {self.steps} "
                       f"profiled; CPU time under the profiler)")
        out = [line(head), line(["-" * w for w in widths]), *map(line, rows), "", summary]
        if not self.layers:
            out.append("no TT layer was seen: inside a graph Inductor compiled the layers are not visible to the "
                       "profiler (Inductor removes profiler ranges); compile with "
                       "options={'profile': True} (each TT layer its own graph, inside its range) or profile "
                       "the eager model")
        return "\n".join(out)


def name_layers(model: nn.Module) -> int:
    """Give every TT layer of `model` its qualified name for profiler ranges; returns how many."""
    from comera_compile.layers import TTLayer

    count = 0
    for name, module in model.named_modules():
        if isinstance(module, TTLayer):
            module.comera_name = name or type(module).__name__
            module.claim_parameters()
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
    backward_device_us: dict[int, float] = {}
    for e in events:
        if e.name.startswith(_BACKWARD) and getattr(e, "sequence_nr", -1) >= 0:
            backward_us[e.sequence_nr] = backward_us.get(e.sequence_nr, 0.0) + e.cpu_time_total
            backward_device_us[e.sequence_nr] = (backward_device_us.get(e.sequence_nr, 0.0)
                                                 + getattr(e, "device_time_total", 0.0))
    table: dict[str, LayerTime] = {}
    for e in events:
        if not e.name.startswith(_PREFIX) or "[" not in e.name:
            continue
        kind, _, rest = e.name[len(_PREFIX):].partition("[")
        name = rest[:-1]
        t = table.setdefault(name, LayerTime(name, kind, 0, 0.0, 0.0))
        numbers = _sequence_numbers(e)
        t.calls += 1
        t.forward_ms += e.cpu_time_total / 1e3 / steps
        t.backward_ms += sum(backward_us.get(n, 0.0) for n in numbers) / 1e3 / steps
        t.device_ms += getattr(e, "device_time_total", 0.0) / 1e3 / steps
        t.backward_device_ms += sum(backward_device_us.get(n, 0.0) for n in numbers) / 1e3 / steps
    busy = 0.0
    if torch.cuda.is_available():
        from comera_compile.step_time import summarize

        busy = summarize(events, "cuda", steps)["busy_ms"]
    return LayerProfile(list(table.values()), steps, step_us / 1e3 / steps, prof, busy)


def _range_kind(layer_class: type) -> str:
    """The kind a TT layer class's eager ranges carry (``tt_linear``, ...): its forward's."""
    return getattr(layer_class.forward, "comera_kind", layer_class.__name__)


def split_by_layer(gm: torch.fx.GraphModule, compile_part: Callable[[torch.fx.GraphModule, list], Callable]
                   ) -> torch.fx.GraphModule:
    """`gm` cut into parts, one per run of nodes of one TT layer (found as logs.tt_contractions finds them)
    and one per run of other nodes between, each compiled on its first call by ``compile_part(part,
    inputs)`` and again for inputs of another shape, dtype or stride.  A layer's part runs inside
    ``record_function("comera.<kind>[<name>]")`` while the profiler records, named after the layer whose
    parameters it is handed (a graph shared by several blocks serves each under its own name), else after
    the module path dynamo recorded.  The parts run in the graph's order, so results equal the graph's."""
    from torch.fx.passes.split_module import split_module

    from comera_compile.layers import TTLayer
    from comera_compile.logs import _owner

    part_of: dict[torch.fx.Node, int] = {}
    owners: list[tuple[str, str] | None] = []
    frame = _frame_owner(gm)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        owner = _owner(node, TTLayer) or frame
        if owner is None and owners and getattr(node.target, "__name__", None) in _MODE_SWITCHES:
            owner = owners[-1]   # a layer's own `with torch.autocast(...)`: dynamo records no module for it
        if not owners or owner != owners[-1]:
            owners.append(owner)
        part_of[node] = len(owners) - 1
    kinds = {cls.__name__: _range_kind(cls) for cls in _subclasses(TTLayer)}
    split = split_module(gm, None, lambda node: part_of[node], keep_original_order=True)
    for name, part in list(split.named_children()):
        owner = owners[int(name.rsplit("_", 1)[-1])]
        label = None if owner is None else (kinds.get(owner[1], owner[1]), owner[0])
        setattr(split, name, _Part(part, compile_part, label))
    return split


# Nodes that enter or leave an autocast or grad-mode region: they belong to the layer around them.
_MODE_SWITCHES = ("_enter_autocast", "_exit_autocast", "_set_grad_enabled")


def _frame_owner(gm: torch.fx.GraphModule) -> tuple[str, str] | None:
    """(name, class name) of the TT layer whose own forward is the graph's frame (a TT layer compiled on its
    own, or reached after a graph break), found by the parameters dynamo captured; else None."""
    from comera_compile.layers import TTLayer, layer_of
    from comera_compile.logs import _owner
    from comera_compile.passes import lifted_tensor

    if any(_owner(n, TTLayer) for n in gm.graph.nodes):
        return None
    layers = set()
    for node in gm.graph.find_nodes(op="placeholder"):
        example = lifted_tensor(node)
        layer = layer_of(example) if example is not None else None
        if layer is not None:
            layers.add(layer)
    if len(layers) != 1:
        return None
    layer = layers.pop()
    return layer.comera_name or type(layer).__name__, type(layer).__name__


def _subclasses(cls: type) -> list[type]:
    out, stack = [], [cls]
    while stack:
        c = stack.pop()
        out.append(c)
        stack.extend(c.__subclasses__())
    return out


class _Part(nn.Module):
    """One part of a split graph: compiled per input signature, run inside its TT layer's range."""

    def __init__(self, part: torch.fx.GraphModule, compile_part: Callable[[torch.fx.GraphModule, list], Callable],
                 label: tuple[str, str] | None) -> None:
        super().__init__()
        output = next(n for n in reversed(part.graph.nodes) if n.op == "output")
        self.single = not isinstance(output.args[0], (tuple, list))
        if self.single:   # AOTAutograd's compilers take graphs that return a tuple
            output.args = ((output.args[0],),)
            part.recompile()
        self.part = part
        self.compile_part = compile_part
        self.label = label
        self.compiled: dict[tuple, Callable] = {}
        # Inputs the part reads only as Python numbers (x.item(): a float attribute such as LayerNorm's eps,
        # which dynamo passes as a tensor under dynamic=True): their values are baked into each compile, as
        # a fresh shape environment would make them unbacked symbols that layer_norm cannot guard on.
        inputs = list(part.graph.find_nodes(op="placeholder"))
        self.items = [i for i, n in enumerate(inputs) if n.users and all(
            u.op == "call_method" and u.target == "item" for u in n.users)]

    def _name(self, args: tuple) -> str:
        from comera_compile.layers import layer_of

        kind, path = self.label
        for a in args:
            layer = layer_of(a) if isinstance(a, torch.Tensor) else None
            if layer is not None and layer.comera_name:
                return f"{_PREFIX}{kind}[{layer.comera_name}]"
        return f"{_PREFIX}{kind}[{path}]"

    def forward(self, *args: Any) -> Any:
        values = tuple(args[i].item() for i in self.items)
        key = tuple((tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad)
                    if isinstance(a, torch.Tensor) else a for a in args) + values
        fn = self.compiled.get(key)
        if fn is None:
            part = _baked_items(self.part, self.items, values)
            fn = self.compiled[key] = _compile_with_fake_inputs(self.compile_part, part, args)
        if self.label is not None and torch.autograd.profiler._is_profiler_enabled:
            with torch.profiler.record_function(self._name(args)):
                out = fn(*args)
        else:
            out = fn(*args)
        return out[0] if self.single else out


def _baked_items(part: torch.fx.GraphModule, items: list[int], values: tuple) -> torch.fx.GraphModule:
    """A copy of `part` whose x.item() calls on the inputs at `items` are the constants `values`."""
    if not items:
        return part
    baked = torch.fx.GraphModule(part, copy.deepcopy(part.graph))
    inputs = list(baked.graph.find_nodes(op="placeholder"))
    for i, value in zip(items, values):
        for user in list(inputs[i].users):
            user.replace_all_uses_with(value)   # (a number where the item was used)
            baked.graph.erase_node(user)
    baked.recompile()
    return baked


def _compile_with_fake_inputs(compile_part: Callable[[torch.fx.GraphModule, list], Callable],
                              part: torch.fx.GraphModule, args: tuple) -> Callable:
    """compile_part(part, inputs) as dynamo calls a backend: static fake inputs under a tracing context with
    a shape environment, which Inductor's and AOTAutograd's caches need (real inputs bypass both)."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    fake = [mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a for a in args]
    with tracing(TracingContext(mode)):
        return compile_part(part, fake)


def launches_per_step(step: Callable[[], Any], steps: int = 5) -> dict[str, float]:
    """What one call of ``step()`` asks of the GPU, from the CUDA runtime and driver calls torch's profiler
    records: ``kernels`` (kernel launches from the host, each one a launch gap), ``graphs`` (CUDA graph
    launches: their kernels cost no launch each), ``copies`` (memcpy/memset calls) and ``device_kernels``
    (kernels that ran on the GPU, inside graphs included), averaged over ``steps`` calls.  Warm the step up
    first: compiles and captures would be counted.  All zero without CUDA."""
    counts = {"kernels": 0.0, "graphs": 0.0, "copies": 0.0, "device_kernels": 0.0}
    if not torch.cuda.is_available():
        return counts
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from comera_compile.step_time import _GRAPH_LAUNCHES, _KERNEL_LAUNCHES

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    for event in prof.events():
        name = event.name
        if name in _KERNEL_LAUNCHES:
            counts["kernels"] += 1
        elif name in _GRAPH_LAUNCHES:
            counts["graphs"] += 1
        elif name.startswith(("cudaMemcpy", "cuMemcpy", "cudaMemset", "cuMemset")):
            counts["copies"] += 1
        elif event.device_type == DeviceType.CUDA and not name.startswith(("Memcpy", "Memset")):
            counts["device_kernels"] += 1
    return {k: v / steps for k, v in counts.items()}
