"""Inductor joint-graph pass: hash-dropout masks, and the dropouts' outputs, recomputed in the backward
instead of saved."""

from __future__ import annotations

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.checkpoint import CheckpointPolicy

from comera_compile.ops.materialize import OPAQUE_COPY
from comera_compile.passes import node_value

__all__ = ["recompute_hash_masks", "RecomputeHashMasks"]


def _integral(node: torch.fx.Node) -> bool:
    val = node_value(node)
    return isinstance(val, torch.Tensor) and not (val.is_floating_point() or val.is_complex())


# The ops of input x mask x scale as AOTAutograd traces hash_dropout (a cast where the mask is converted).
_PRODUCT_OPS = (torch.ops.aten.mul.Tensor, torch.ops.aten.mul.Scalar, torch.ops.prims.convert_element_type.default,
                torch.ops.aten._to_copy.default)


def _product(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in _PRODUCT_OPS


def _backward_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes of a joint graph that depend on a tangent (the backward's)."""
    todo = [n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    seen: set[torch.fx.Node] = set()
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(node.users)
    return seen


def recompute_hash_masks(graph: torch.fx.Graph) -> int:
    """Tag the integer/bool nodes of every hash-dropout mask in a joint forward-backward graph
    MUST_RECOMPUTE, so AOTAutograd's partitioner saves the two random words for the backward and
    recomputes the mask there instead of saving it; and tag the dropout's output too (the forward's
    input x mask x scale, nothing computed from it), so that when the backward needs it (attention's
    dropped probabilities, for the gradient of the values) it is recomputed from the input, which the
    backward mostly keeps anyway (the softmax's gradient needs it).  Returns how many nodes were tagged.

    Recomputing costs a few integer operations per element inside a kernel the backward runs anyway; a
    saved mask costs a byte per element of memory and, on CPU, Inductor's bool stores are slow (about
    10 ns per element, several times the cost of the rest of the dropout's kernel).  A saved output costs
    four bytes per element: attention's probabilities are a batch x heads x sequence^2 tensor per layer."""
    words = [n for n in graph.nodes
             if n.op == "call_function" and n.target is OPAQUE_COPY and _integral(n)]
    tagged: set[torch.fx.Node] = set()
    todo = [u for w in words for u in w.users]
    while todo:                                   # everything integral computed from the words
        node = todo.pop()
        if node in tagged or node.op != "call_function" or not _integral(node):
            continue
        tagged.add(node)
        todo.extend(node.users)
    todo = [a for n in tagged for a in n.all_input_nodes]
    while todo:                                   # and the integral inputs beside them (the iota)
        node = todo.pop()
        if node in tagged or node.op != "call_function" or not _integral(node):
            continue
        if node.target is OPAQUE_COPY:
            continue
        tagged.add(node)
        todo.extend(node.all_input_nodes)
    backward = _backward_nodes(graph)
    outputs: set[torch.fx.Node] = set()
    todo = [u for n in tagged for u in n.users if u not in backward]
    while todo:                                   # the forward's float products with the mask, and scale
        node = todo.pop()
        if node in tagged or node in outputs or node in backward or _integral(node) or not _product(node):
            continue
        inputs = node.all_input_nodes
        if not any(a in tagged or a in outputs for a in inputs) or len(inputs) > 2:
            continue
        outputs.add(node)
        todo.extend(u for u in node.users if len(u.all_input_nodes) == 1)
    for node in tagged | outputs:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return len(tagged) + len(outputs)


class RecomputeHashMasks(CustomGraphPass):
    """recompute_hash_masks as an Inductor joint-graph pass (config ``joint_custom_pre_pass``)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        recompute_hash_masks(graph)

    def uuid(self) -> str:
        return "comera.passes.joint.recompute.recompute_hash_masks/3"
