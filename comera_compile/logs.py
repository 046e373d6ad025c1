"""What the backend's passes did to each graph torch.compile hands it, through torch's own logging.

Nothing is printed unless asked, as with torch's logs:

- ``TORCH_LOGS="comera_compile"``: one summary per compiled graph (TT layers and their contractions,
  dropouts made hash dropout, casts materialized, where the graph goes next);
- ``TORCH_LOGS="+comera_compile"``: that, and the graph's code after each pass, each TT layer's contraction
  steps with their FLOPs (the ``comera_graphs`` artifact);
- ``TORCH_TRACE=DIR``: the same as artifacts of torch's structured trace (``comera_summary``,
  ``comera_graph_<stage>``), on each compile's page of the report ``tlparse`` makes of DIR.

torch checks ``TORCH_LOGS`` when torch is imported, before any other package can register a name with it;
module names are the names it accepts from any package, so the environment variable takes the package's
module name.  From Python, after ``import comera_compile``, the registered names work too:
``torch._logging.set_logs(modules={"comera": logging.INFO, "comera_graphs": True})``.
"""

from __future__ import annotations

import logging
import math
import operator
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

__all__ = ["LOG_NAME", "GRAPHS_ARTIFACT", "GraphReport", "LayerContraction", "ContractionStep", "register",
           "tt_contractions", "emit", "listing"]

LOG_NAME = "comera"                 # torch._logging alias of the package's loggers
GRAPHS_ARTIFACT = "comera_graphs"   # torch._logging artifact: the graph after each pass

log = logging.getLogger(__name__)
_graphs_log: logging.Logger | None = None


def register() -> None:
    """Register the ``comera`` log and the ``comera_graphs`` artifact with torch._logging (once)."""
    global _graphs_log
    if _graphs_log is not None:
        return
    from torch._logging import _internal

    if not _internal.log_registry.is_log(LOG_NAME):
        _internal.register_log(LOG_NAME, "comera_compile")
    if not _internal.log_registry.is_artifact(GRAPHS_ARTIFACT):
        _internal.register_artifact(GRAPHS_ARTIFACT, "comera's graph after each of its passes, with each TT "
                                                     "layer's contraction steps and FLOPs")
    _graphs_log = torch._logging.getArtifactLogger(__name__, GRAPHS_ARTIFACT)


@dataclass
class ContractionStep:
    """One product a TT layer's contraction runs: the node, its operands' shapes, its FLOPs."""

    node: str
    equation: str
    flops: int
    planned: bool = False   # figures from the contraction pass's own plan


@dataclass
class LayerContraction:
    """A TT layer as it appears in a graph: its path, class, rows and the contraction steps it runs."""

    layer: str
    kind: str
    rows: int | None
    steps: list[ContractionStep] = field(default_factory=list)

    @property
    def flops(self) -> int:
        return sum(s.flops for s in self.steps)


@dataclass
class GraphReport:
    """One compiled graph: what each of the backend's passes did, and the graph's code after each."""

    graph_module: torch.fx.GraphModule
    devices: tuple[str, ...]
    compile_id: str | None = None
    passes: dict[str, int] = field(default_factory=dict)       # pass -> sites rewritten
    stages: list[tuple[str, str]] = field(default_factory=list)  # (stage, code after it)
    layers: list[LayerContraction] = field(default_factory=list)
    then: str = "Inductor"

    @property
    def code(self) -> str:
        """The graph after the last pass, one line per op (see listing)."""
        return self.stages[-1][1] if self.stages else listing(self.graph_module)

    def summary(self) -> str:
        """A few lines: the graph, the passes' counts, each TT layer's rows, steps and FLOPs."""
        where = f"graph {self.compile_id}" if self.compile_id else "graph"
        nodes = sum(1 for n in self.graph_module.graph.nodes if n.op not in ("placeholder", "output"))
        did = ", ".join(f"{name} {count}" for name, count in self.passes.items())
        flops = sum(layer.flops for layer in self.layers)
        out = [f"comera {where}: {nodes} ops on {'/'.join(self.devices) or 'no tensors'}; "
               f"{len(self.layers)} TT layers, {sum(len(layer.steps) for layer in self.layers)} contraction "
               f"steps, {_si(flops)}FLOP forward; passes: {did or 'none'}; then {self.then}"]
        for layer in self.layers:
            rows = "?" if layer.rows is None else f"{layer.rows}"
            out.append(f"  {layer.layer}: {layer.kind}, {rows} rows, {len(layer.steps)} steps, "
                       f"{_si(layer.flops)}FLOP")
        return "\n".join(out)

    def contractions(self) -> str:
        """Each TT layer's steps, one line each: node, operand shapes or equation, FLOPs."""
        out = []
        for layer in self.layers:
            out.append(f"{layer.layer} ({layer.kind}, {layer.rows} rows): {_si(layer.flops)}FLOP")
            out += [f"  {s.node}: {s.equation}, {_si(s.flops)}FLOP" for s in layer.steps]
        return "\n".join(out)

    def __str__(self) -> str:
        return f"{self.summary()}\n\n{self.code.strip()}\n\n{self.contractions()}".rstrip()


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} "


_PATH_PARTS = re.compile(r"\.?_(?:modules|parameters|buffers)\[['\"]([^'\"]+)['\"]\]|\[['\"]([^'\"]+)['\"]\]|\[(\d+)\]")


def _clean_path(path: str) -> str:
    """dynamo's module or tensor source (``L['self'].layers[0]._modules['ffn']``) as a qualified name
    (``layers.0.ffn``), relative to the compiled module."""
    path = re.sub(r"^L\[['\"][^'\"]+['\"]\](\[\d+\])?\.?", "", path)   # L['self'], or L['args'][0] (a wrapped forward)
    path = _PATH_PARTS.sub(lambda m: "." + next(g for g in m.groups() if g is not None), path)
    return path.strip(".")


def listing(gm: torch.fx.GraphModule) -> str:
    """The graph one op per line, shorter than its Python code: inputs named by the module path they come
    from (dynamo names them after their source, hundreds of characters for a transformers model), each op
    with its output shape and dtype and, inside a TT layer, the layer's name."""
    from comera_compile.layers import TTLayer

    names: dict[torch.fx.Node, str] = {}
    inputs: list[str] = []
    lines: list[str] = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            grapharg = node.meta.get("grapharg")
            source = getattr(grapharg, "source", None)
            name = getattr(source, "name", None)
            name = name() if callable(name) else name
            names[node] = (_clean_path(name) or _local_name(name)) if isinstance(name, str) else node.name
            if "." not in names[node]:   # the module's own parameters and buffers are counted, not listed
                inputs.append(names[node] + _describe(node))
            continue
        names[node] = node.name
        if node.op == "output":
            lines.append(f"return {_args(node.args[0], names)}")
            continue
        owner = _owner(node, TTLayer)
        note = _describe(node) + (f"  [{owner[0]}]" if owner else "")
        args = list(node.args)
        target = _target(node)
        if node.op == "call_method" and args:
            target = _args(args.pop(0), names) + target
        call = ", ".join([_args(a, names) for a in args]
                         + [f"{k}={_args(v, names)}" for k, v in node.kwargs.items()])
        lines.append(f"{node.name} = {target}({call}){'  #' + note if note else ''}")
    held = sum(1 for n in gm.graph.nodes if n.op == "placeholder") - len(inputs)
    head = f"inputs: {', '.join(inputs) or 'none'}; and {held} parameters and buffers, named by module path"
    return "\n".join([head, *lines])


def _describe(node: torch.fx.Node) -> str:
    from comera_compile.passes import node_value

    val = node_value(node)
    if val is None:
        return ""
    return " " + "x".join(str(s) for s in val.shape) + " " + str(val.dtype).replace("torch.", "")


def _target(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return f".{node.target}"
    if node.op in ("call_module", "get_attr"):
        return f"{node.op}[{node.target}]"
    name = getattr(node.target, "__name__", str(node.target))
    module = getattr(node.target, "__module__", None) or ""
    return f"{module.replace('torch._C._nn', 'F').replace('torch.nn.functional', 'F')}.{name}".lstrip(".")


def _args(value: Any, names: dict) -> str:
    if isinstance(value, torch.fx.Node):
        return names.get(value, value.name)
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_args(v, names) for v in value)
        return f"({inner}{',' if len(value) == 1 and isinstance(value, tuple) else ''})" if isinstance(
            value, tuple) else f"[{inner}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_args(v, names)}" for k, v in value.items()) + "}"
    return repr(value)


def _local_name(source: str) -> str:
    """The argument a source names: ``L['x']`` -> x, ``L['args'][0]`` -> args[0]."""
    m = re.match(r"^L\[['\"]([^'\"]+)['\"]\](\[\d+\])?", source)
    return source if m is None else m.group(1) + (m.group(2) or "")


_MATMULS = {torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.einsum, operator.matmul,
            torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default}


def _shape(node: Any) -> tuple[int, ...] | None:
    """A node's shape as ints: a symbolic size (a dynamic dimension) by the value it was traced with."""
    from comera_compile.passes import node_shape

    shape = node_shape(node)
    if shape is None:
        return None
    sizes = tuple(_hint(s) for s in shape)
    return None if None in sizes else sizes


def _hint(value: Any) -> int | None:
    """An int, or a SymInt's example value, read without a guard: int() on a SymInt would specialize the
    graph being compiled to this one size, and every other size would then compile a graph of its own."""
    if isinstance(value, int):
        return value
    hint = getattr(getattr(value, "node", None), "hint", None)
    return hint if isinstance(hint, int) else None


def _step(node: torch.fx.Node) -> ContractionStep | None:
    """A product node as a step: the contraction pass's own figures where it left them, else the operand
    shapes and 2 * (product of every index's size) FLOPs of the product they describe."""
    if "comera_contraction" in node.meta:
        return ContractionStep(node.name, node.meta["comera_contraction"], _hint(node.meta["comera_flops"]) or 0,
                               True)
    is_call = node.op == "call_function" and node.target in _MATMULS
    if not (is_call or (node.op == "call_method" and node.target == "matmul")):
        return None
    if node.target is torch.einsum:
        return ContractionStep(node.name, str(node.args[0]), _einsum_flops(node))
    operands = [a for a in node.args if isinstance(a, torch.fx.Node)]
    if node.target in (torch.addmm, torch.baddbmm, torch.ops.aten.addmm.default):
        operands = operands[1:]
    shapes = [_shape(a) for a in operands[:2]]
    out = _shape(node)
    if len(shapes) < 2 or None in shapes or out is None:
        return ContractionStep(node.name, "matmul", 0)
    a, b = shapes
    inner = a[-1] if a else 1
    return ContractionStep(node.name, " @ ".join("x".join(map(str, s)) for s in shapes),
                           2 * math.prod(out) * inner)


def _einsum_flops(node: torch.fx.Node) -> int:
    sizes: dict[str, int] = {}
    equation = str(node.args[0]).replace(" ", "")
    inputs = equation.split("->")[0].split(",")
    for letters, arg in zip(inputs, node.args[1:]):
        shape = _shape(arg)
        if shape is None:
            return 0
        sizes.update(zip(letters, shape))
    return 2 * math.prod(sizes.values())


def tt_contractions(gm: torch.fx.GraphModule) -> list[LayerContraction]:
    """The TT layers a graph computes, found by the module each node came from (dynamo records it in
    ``nn_module_stack``; the contraction pass names its nodes after the layer), with their product steps."""
    from comera_compile.layers import TTLayer

    layers: dict[str, LayerContraction] = {}
    last: dict[str, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        owner = _owner(node, TTLayer)
        if owner is None:
            continue
        path, kind = owner
        layer = layers.setdefault(path, LayerContraction(path, kind, None))
        last[path] = node
        step = _step(node)
        if step is not None:
            layer.steps.append(step)
    for path, node in last.items():
        layer = layers[path]
        shape = _shape(node)
        layer.rows = node.meta.get("comera_rows", math.prod(shape[:-1]) if shape else None)
        planned = [s for s in layer.steps if s.planned]
        if planned:   # the contraction pass marked its steps' results: the other products are parts of them
            layer.steps = planned
    return list(layers.values())


def _owner(node: torch.fx.Node, tt_class: type) -> tuple[str, str] | None:
    """(qualified name, class name) of the innermost TT layer a node belongs to, or None."""
    if "comera_layer" in node.meta:
        return node.meta["comera_layer"]
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    for path, cls in reversed(list(stack.values())):
        if isinstance(cls, type) and issubclass(cls, tt_class):
            return _clean_path(str(path)), cls.__name__
    return None


def emit(report: GraphReport) -> None:
    """Send a report where it was asked for: the ``comera`` log (INFO: the summary), the ``comera_graphs``
    artifact (DEBUG: the code after each pass and the contraction steps), torch's structured trace."""
    register()
    if log.isEnabledFor(logging.INFO):
        log.info("%s", report.summary())
    if _graphs_log is not None and _graphs_log.isEnabledFor(logging.DEBUG):
        for stage, code in report.stages:
            _graphs_log.debug("comera graph after %s:\n%s", stage, code.strip())
        if report.layers:
            _graphs_log.debug("comera contractions:\n%s", report.contractions())
    _trace(report)


def _trace(report: GraphReport) -> None:
    from torch._logging import trace_structured

    def artifact(name: str, payload: str) -> None:
        trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": "string"},
                         payload_fn=lambda: payload)

    artifact("comera_summary", report.summary() + ("\n\n" + report.contractions() if report.layers else ""))
    for stage, code in report.stages:
        artifact(f"comera_graph_{stage}", code)

