"""Inductor joint-graph passes: what the backward recomputes instead of saving.  recompute_hash_masks:
hash-dropout masks and the dropouts' outputs; recompute_gelu: GELU outputs."""

from __future__ import annotations

import math

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.checkpoint import CheckpointPolicy

from comera_compile.ops.materialize import OPAQUE_COPY
from comera_compile.passes import node_value

__all__ = ["recompute_hash_masks", "RecomputeHashMasks", "recompute_gelu", "RecomputeGelu"]


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


_aten = torch.ops.aten
# Ops that only re-lay out a tensor: a GELU output reshaped or permuted for the next GEMM is recomputed with it.
_LAYOUT_OPS = (_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.permute.default,
               _aten.transpose.int, _aten.t.default, _aten.clone.default)


def _scalar_mul(node: torch.fx.Node, value: float) -> torch.fx.Node | None:
    """The tensor operand of node when node is aten.mul(tensor, value), else None."""
    if node.op == "call_function" and node.target is _aten.mul.Tensor and len(node.args) == 2:
        a, b = node.args
        if isinstance(b, float) and math.isclose(b, value) and isinstance(a, torch.fx.Node):
            return a
    return None


def _gelu_nodes(erf: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The nodes of an exact GELU around this erf, as the decomposition writes it: x * 0.5 * (1 + erf(x /
    sqrt(2))), i.e. mul(mul(x, 0.5), add(erf(mul(x, M_SQRT1_2)), 1)); None when erf is not part of one."""
    x = _scalar_mul(erf.args[0], math.sqrt(0.5))
    if x is None or len(erf.users) != 1:
        return None
    (add,) = erf.users
    if add.target is not _aten.add.Tensor or add.args[1] != 1 or len(add.users) != 1:
        return None
    (out,) = add.users
    if out.target is not _aten.mul.Tensor or len(out.args) != 2 or add not in out.args:
        return None
    half = out.args[1] if out.args[0] is add else out.args[0]
    if not isinstance(half, torch.fx.Node) or _scalar_mul(half, 0.5) is not x:
        return None
    return [erf.args[0], erf, add, half, out]


def _exact_gelu(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target is _aten.gelu.default
            and node.kwargs.get("approximate", "none") == "none")


def recompute_gelu(graph: torch.fx.Graph) -> int:
    """Tag the forward's exact GELUs in a joint forward-backward graph MUST_RECOMPUTE (aten.gelu, or its
    decomposition as Inductor's joint graph holds it), with the reshapes and
    permutes of their outputs, so AOTAutograd's partitioner saves each GELU's input only and the backward
    recomputes the output from it.  Returns how many nodes were tagged.

    A GELU between two linear layers (a transformer's FFN) otherwise saves both its input, which its own
    gradient needs, and its output, which the next layer's weight gradient needs: two activations of the
    FFN's width per layer.  Recomputing the output costs one more GELU in the backward, about what a save and
    a load of it cost on CPU.  The tanh approximation is left alone."""
    backward = _backward_nodes(graph)
    tagged: list[torch.fx.Node] = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node in backward:
            continue
        if _exact_gelu(node):
            gelu = [node]
        elif node.target is _aten.erf.default:
            gelu = _gelu_nodes(node)
        else:
            continue
        if gelu is None or any(n in backward for n in gelu):
            continue
        todo = [gelu[-1]]
        while todo:
            for user in todo.pop().users:
                if user.op == "call_function" and user.target in _LAYOUT_OPS and user not in backward:
                    gelu.append(user)
                    todo.append(user)
        tagged.extend(gelu)
    for node in tagged:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return len(tagged)


class RecomputeGelu(CustomGraphPass):
    """recompute_gelu as an Inductor joint-graph pass (config ``joint_custom_pre_pass``)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        recompute_gelu(graph)

    def uuid(self) -> str:
        return "comera.passes.joint.recompute.recompute_gelu/1"
