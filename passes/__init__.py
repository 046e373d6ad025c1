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

from typing import Any

import torch
from torch.fx.passes.infra.pass_base import PassResult

__all__ = ["GraphPassResult", "node_value", "node_shape", "lifted_tensor"]


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


def lifted_tensor(node: torch.fx.Node) -> torch.Tensor | None:
    """The real tensor a placeholder of dynamo's graph lifted (a parameter, a buffer, an input), as dynamo
    recorded it; None for other nodes, graphs not from dynamo, and a tensor that no longer exists."""
    try:
        example = node.meta["grapharg"].example
    except Exception:   # no record, or its weak reference is dead
        return None
    return example if isinstance(example, torch.Tensor) else None
