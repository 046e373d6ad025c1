"""Graph passes, grouped by the graph they rewrite; installed as comera_compile.passes.

Each kind has one signature:

- ``passes.module``: an nn.Module -> the same nn.Module (or, for ``tempo``, the GraphModule it traced),
  keyword options only: ``tensorize``, ``densify``, ``tempo_modules``, ``tempo``.
- ``passes.fx``: a torch.fx GraphModule -- a torch.fx trace, or dynamo's graph whose nodes carry fake values
  -- rewritten in place: ``pass(gm, example_inputs=None, **options) -> GraphPassResult``, torch.fx's
  PassResult (graph_module, modified) with the number of rewritten sites: ``expand_contractions``,
  ``tempo_graph``, ``fast_dropout``, ``materialize_int_casts``, ``batch_siblings``.
- ``passes.joint``: Inductor's joint forward + backward graph (a torch.fx.Graph), as Inductor's
  ``joint_custom_pre_pass`` calls it: ``pass(graph) -> int`` (sites tagged), with a CustomGraphPass
  wrapper: ``recompute_hash_masks`` / ``RecomputeHashMasks``.
"""

from __future__ import annotations

import inspect
import operator
import warnings
from typing import Any, Sequence

import torch
from torch.fx.passes.infra.pass_base import PassResult

__all__ = ["GraphPassResult", "node_value", "node_shape", "lifted_tensor", "calls_in_place", "propagate_values",
           "ensure_values"]


class GraphPassResult(PassResult):
    """torch.fx's PassResult (graph_module, modified), with ``count``: how many sites the pass rewrote, and
    ``summary``: the pass's own report, if it keeps one."""

    def __new__(cls, graph_module: torch.fx.GraphModule, count: int, summary: Any = None) -> GraphPassResult:
        self = super().__new__(cls, graph_module, count > 0)
        self.count = count
        self.summary = summary
        return self


def node_value(node: object) -> torch.Tensor | None:
    """The (fake) tensor a graph node computes, as tracing recorded it: ``meta["val"]`` (AOTAutograd,
    FakeTensorProp, torch.export), else ``meta["example_value"]`` (dynamo); None for non-tensors."""
    if not isinstance(node, torch.fx.Node):
        return None
    val = node.meta.get("val", node.meta.get("example_value"))
    return val if isinstance(val, torch.Tensor) else None


def node_shape(node: object) -> tuple[int, ...] | None:
    """The shape of a graph node's value: from node_value, else from ``meta["tensor_meta"]`` (torch.fx's
    ShapeProp); None when neither is recorded."""
    val = node_value(node)
    if val is not None:
        return tuple(val.shape)
    tm = node.meta.get("tensor_meta") if isinstance(node, torch.fx.Node) else None
    return tuple(tm.shape) if tm is not None and hasattr(tm, "shape") else None


def propagate_values(gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> None:
    """Record every node's fake value (meta["val"]) by running example_inputs through the graph as fake
    tensors.  Without grad: only shapes and dtypes are wanted, and there Tempo's ops run torch's (their
    saved-tensor bookkeeping has sizes that depend on values, which fake tensors cannot give)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    with torch.no_grad():
        FakeTensorProp(gm, mode).propagate(*fake)


def ensure_values(gm: torch.fx.GraphModule, example_inputs: Sequence[object] | None, name: str) -> bool:
    """Whether gm's nodes carry the fake values a pass reads: dynamo's graphs do; a torch.fx trace gets them
    from example_inputs (propagate_values).  Without either, warns that the pass `name` rewrote nothing."""
    if any(node_value(n) is not None for n in gm.graph.nodes):
        return True
    if example_inputs is not None:
        propagate_values(gm, example_inputs)
        return True
    warnings.warn(f"{name}: the graph's nodes carry no values (a torch.fx trace), so it rewrote nothing; pass "
                  f"example_inputs (as for gm(*example_inputs)) to have them propagated", stacklevel=3)
    return False


def lifted_tensor(node: torch.fx.Node) -> torch.Tensor | None:
    """The real tensor a placeholder of dynamo's graph lifted (a parameter, a buffer, an input), as dynamo
    recorded it; None for other nodes, graphs not from dynamo, and a tensor that no longer exists."""
    try:
        example = node.meta["grapharg"].example
    except Exception:   # no record, or its weak reference is dead
        return None
    return example if isinstance(example, torch.Tensor) else None


# h += 1 and the like in a dynamo graph: in-place on tensors, though their names do not end in "_"
_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
                      operator.irshift, operator.imatmul, operator.setitem}


def calls_in_place(node: torch.fx.Node) -> bool:
    """Whether a call_function / call_method node writes its first argument: ``h += 1`` (operator.iadd and
    kin, or ``h.__iadd__``), ``h[i] = v``, a name with a trailing underscore (``torch.relu_``, ``h.mul_``), or
    an ``inplace`` argument that is True, by keyword or by position (dynamo keeps the user's
    ``F.relu(h, True)`` and ``F.dropout(h, p, True, True)``, and fast_dropout's ``hash_dropout(inplace=True)``)."""
    if node.op not in ("call_function", "call_method"):
        return False
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if target in _INPLACE_OPERATORS or (name.endswith("_") and not name.endswith("__")) or name.startswith("__i"):
        return True
    if node.kwargs.get("inplace") is True:
        return True
    if isinstance(target, str):
        return False
    try:
        params = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):   # a builtin without a signature: its name said it
        return False
    return "inplace" in params and len(node.args) > params.index("inplace") \
        and node.args[params.index("inplace")] is True
