"""Values Inductor should compute once into a buffer rather than inline into every kernel that reads them.

Inductor inlines pointwise producers into their consumers.  That is right for most ops, but wrong for a
small tensor broadcast into a large kernel whose computation is expensive per element: an attention
mask cast from int64 to float (AVX2 has no vector int64 -> float conversion, so the cast runs scalar for
each of the scores it is broadcast over), or random words drawn with Philox.  ``materialize(t)`` is a
copy Inductor cannot see through (a custom op), so the value lands in its own buffer;
``materialize_int_casts(gm)`` applies it to every integer -> floating cast of a dynamo graph.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.fx

from comera_compile.ops.materialize import OPAQUE_COPY
from comera_compile.passes import GraphPassResult, ensure_values, node_value

__all__ = ["materialize_int_casts"]


_CAST_METHODS = {"to", "float", "double", "half", "bfloat16", "type", "type_as"}
_CAST_FUNCTIONS = {torch.Tensor.to, torch.Tensor.float, torch.Tensor.type_as}


def materialize_int_casts(gm: torch.fx.GraphModule, example_inputs: Sequence[object] | None = None
                          ) -> GraphPassResult:
    """Route every cast of an integer or bool tensor to a floating dtype through materialize, in place,
    so Inductor converts each element once instead of in every kernel the result is broadcast into.
    Reads the fake values dynamo records (node.meta["example_value"]); a torch.fx trace gets them from
    example_inputs (without either it warns and rewrites nothing).  The count is how many were routed."""
    if not ensure_values(gm, example_inputs, "materialize_int_casts"):
        return GraphPassResult(gm, 0)
    count = 0
    for node in list(gm.graph.nodes):
        is_cast = ((node.op == "call_method" and node.target in _CAST_METHODS)
                   or (node.op == "call_function" and node.target in _CAST_FUNCTIONS))
        out, src = node_value(node), node_value(node.args[0] if node.args else None)
        if not is_cast or out is None or src is None:
            continue
        if src.is_floating_point() or src.is_complex() or not out.is_floating_point() or out.requires_grad:
            continue
        users = list(node.users)
        if users and all(u.op == "call_function" and u.target is OPAQUE_COPY for u in users):
            continue   # routed by an earlier run of this pass
        with gm.graph.inserting_after(node):
            copy = gm.graph.call_function(OPAQUE_COPY, (node,))
        copy.meta.update({k: v for k, v in node.meta.items() if k in ("example_value", "val", "stack_trace")})
        for user in users:
            user.replace_input_with(node, copy)
        count += 1
    if count:
        gm.recompile()
    return GraphPassResult(gm, count)
