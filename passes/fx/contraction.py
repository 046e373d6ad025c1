"""Expand TT-layer nodes of an FX graph into their planned pairwise contractions.

Each ``call_module`` node of a TTLinear becomes: get_attr of its cores and gates, the gates folded into
the cores, a reshape of the activation into its modes, then per pairwise contraction, in the order the
planner chose for the node's real shapes (from node metadata, or from example inputs run through fake
tensors), the reshape / permute / matmul nodes that compute it -- the very ops the eager layer runs
(networks.execute, here applied to FX proxies) -- then the padding cut and bias.  ``print(gm.code)`` shows
the order, each contraction commented with its equation and FLOPs; the figures are also in node.meta.
"""

from __future__ import annotations

import math
import operator
from typing import Sequence

import torch
import torch.fx
import torch.nn.functional as F

from comera_compile import networks
from comera_compile.layers import TTLinear
from comera_compile.passes import GraphPassResult, node_shape, propagate_values
from comera_compile.tt import gemm_core_padding

__all__ = ["expand_contractions"]


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}FLOP"
    return f"{x:.0f} FLOP"


def _comment_transformer(comments: dict[str, str]):
    """A code transformer (Graph.on_generate_code) appending a comment to the lines defining given names."""

    def make(prev):
        def transform(body: list[str]) -> list[str]:
            body = prev(body) if prev is not None else body
            lines = "".join(body).split("\n")
            out = []
            for line in lines:
                name = line.strip().split(" = ", 1)[0]
                out.append(f"{line}  # {comments[name]}" if " = " in line and name in comments else line)
            return ["\n".join(out)]

        return transform

    return make


def expand_contractions(gm: torch.fx.GraphModule, example_inputs: Sequence[object] | None = None, *,
                        training: bool | None = None) -> GraphPassResult:
    """Replace every TTLinear call in `gm` by its planned pairwise contractions, in place; returns
    GraphPassResult(gm, count of expanded layers).

    Shapes come from the nodes' metadata (dynamo and AOTAutograd graphs carry them) or, when missing, from
    running `example_inputs` through fake tensors.  The expanded graph serves those shapes only (each layer's
    plan is its row count's): it checks its inputs' shapes and says so otherwise.  `training` picks the
    plan's objective: forward + backward FLOPs (True) or forward FLOPs (False); default: gm.training."""
    if not isinstance(gm, torch.fx.GraphModule):
        raise TypeError(f"expand_contractions takes a torch.fx.GraphModule, got {type(gm).__name__}; "
                        f"get one from comera_compile.tensorize(model, trace=True) (torch.fx.symbolic_trace "
                        f"cannot trace a TT layer's shape check)")
    training = gm.training if training is None else training
    tt_nodes = [n for n in gm.graph.nodes if n.op == "call_module"
                and isinstance(gm.get_submodule(n.target), TTLinear)]
    if not tt_nodes:
        return GraphPassResult(gm, 0)
    if any(node_shape(n.args[0]) is None for n in tt_nodes):
        if example_inputs is None:
            raise ValueError("expand_contractions needs the input shapes: pass example_inputs (real or fake "
                             "tensors, as for gm(*example_inputs)), or a graph whose nodes carry "
                             "meta['val'] as dynamo's and AOTAutograd's do")
        propagate_values(gm, example_inputs)
    graph = gm.graph
    comments: dict[str, str] = {}
    for node in tt_nodes:
        mod: TTLinear = gm.get_submodule(node.target)
        spec = mod.gemm_spec
        (x,) = node.args
        shape = node_shape(x)
        lead = shape[:-1]
        rows = math.prod(lead)
        plan = mod.plan(rows, training, training)
        prefix = node.target.replace(".", "_")
        before = set(graph.nodes)
        with graph.inserting_before(node):

            def emit(op: str, target, args, suffix: str) -> torch.fx.Node:
                return graph.create_node(op, target, args, name=f"{prefix}_{suffix}")

            ops = []
            paddings = gemm_core_padding(mod.spec.token)
            for k, shape_k in enumerate(spec.core_shapes):
                core = graph.get_attr(f"{node.target}.cores.{k}")
                if k < len(spec.gate_sizes):
                    gate = graph.get_attr(f"{node.target}.gates.{k}")
                    core = emit("call_function", operator.mul, (core, gate), f"gated{k}")
                if paddings[k] is not None:
                    core = emit("call_function", F.pad, (core, paddings[k]), f"padded_core{k}")
                if k == 0:
                    core = emit("call_method", "reshape", (core, shape_k[1], shape_k[2]), f"core{k}")
                elif k == len(spec.core_shapes) - 1:
                    core = emit("call_method", "reshape", (core, shape_k[0], shape_k[1]), f"core{k}")
                ops.append(core)
            # The plan and the reshapes are this shape's: another input shape is an error, not a wrong row
            same = emit("call_function", operator.eq, (emit("call_function", getattr, (x, "shape"), "shape"),
                                                       torch.Size(shape)), "same_shape")
            emit("call_function", torch._assert, (same, f"{node.target}: expand_contractions planned this graph "
                 f"for inputs of shape {tuple(shape)}; expand it again for other shapes (or compile the model "
                 f"with backend='comera', which plans each shape it sees)"), "shape_check")
            h = emit("call_method", "reshape", (x, rows, spec.in_features), "rows")
            if spec.in_padded != spec.in_features:
                h = emit("call_function", F.pad, (h, (0, spec.in_padded - spec.in_features)), "padded")
            ops.insert(0, emit("call_method", "reshape", (h, rows, *spec.in_modes), "modes"))
            tracer = torch.fx.proxy.GraphAppendingTracer(graph)

            def annotate(k: int, step, result: torch.fx.Proxy) -> None:
                result.node.meta["comera_flops"] = step.flops
                result.node.meta["comera_train_flops"] = step.train_flops
                result.node.meta["comera_contraction"] = step.equation
                comments[result.node.name] = (
                    f"{node.target} contraction {k}: {step.equation}, {_si(step.flops)} fwd, "
                    f"{_si(step.train_flops)} fwd+bwd" + ("" if step.per_row else ", cores only"))

            fused = mod.bias is not None and networks.fuses_bias(plan.steps[-1].recipe, spec.out_features)
            bias = torch.fx.Proxy(graph.get_attr(f"{node.target}.bias"), tracer) if fused else None
            result = networks.execute(plan, [torch.fx.Proxy(o, tracer) for o in ops], on_step=annotate, bias=bias)
            y = emit("call_method", "reshape", (result.node, rows, spec.out_padded), "flat")
            if spec.out_padded != spec.out_features:
                y = emit("call_function", operator.getitem, (y, (slice(None), slice(0, spec.out_features))),
                         "unpadded")
            if mod.bias is not None and not fused:
                # in y's dtype, as nn.Linear's output under autocast (the eager TTLinear adds it so too)
                dtype = emit("call_function", getattr, (y, "dtype"), "dtype")
                b = emit("call_method", "to", (graph.get_attr(f"{node.target}.bias"), dtype), "bias")
                y = emit("call_function", operator.add, (y, b), "biased")
            y = emit("call_method", "reshape", (y, *lead, spec.out_features), "out")
        for new in graph.nodes:   # which layer each new node computes, for comera_compile.logs
            if new not in before:
                new.meta["comera_layer"] = (node.target, type(mod).__name__)
                new.meta["comera_rows"] = rows
        node.replace_all_uses_with(y)
        graph.erase_node(node)
    graph.on_generate_code(_comment_transformer(comments))
    graph.lint()
    gm.recompile()
    return GraphPassResult(gm, len(tt_nodes))
