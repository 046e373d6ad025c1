"""The cost model of a contraction: one function every planner in this package minimises.

A pairwise contraction costs its FLOPs plus TRAFFIC_WEIGHT per element of its two operands and its result.
Training runs it once forward and once more per operand needing a gradient (dA = dC . B costs what
C = A . B costs).  Where the network's input (the tensor holding the row index) must be permuted before its
GEMM, because the indices it keeps and those it sums interleave, the copy is charged too (input_copy,
copy_cost).  The exact search, the greedy fallback, plans and the embedding lookup planner all cost through
these functions, so their numbers agree on the same tree.
"""

from __future__ import annotations

import math
from typing import Container, Sequence

from .network import Network, Tree, pairwise_flops

__all__ = ["TRAFFIC_WEIGHT", "contraction_cost", "input_permuted", "input_copy", "copy_cost", "tree_cost"]

# FLOPs charged per element read or written: on these CPUs a GEMM runs about 16 FLOPs in the time memory
# moves one float, so narrow GEMMs over big activations (small ranks) are not as cheap as their FLOPs say.
# At rank 30 the cheapest plans are the FLOP-optimal ones.
TRAFFIC_WEIGHT = 16


def contraction_cost(a_size: int, b_size: int, out_size: int, flops: int, grads: int, training: bool) -> int:
    """The cost of one pairwise contraction with operands of a_size and b_size elements and a result of
    out_size: (flops + TRAFFIC_WEIGHT * elements moved), once forward and, when training, once more for each
    of the `grads` operands (0, 1 or 2) that need a gradient."""
    mult = 1 + (grads if training else 0)
    return (flops + TRAFFIC_WEIGHT * (a_size + b_size + out_size)) * mult


def input_permuted(indices: str, kept: Container[str]) -> bool:
    """Whether a tensor with these indices must be copied into another order before its GEMM: the indices
    it keeps and those it sums interleave (three or more runs), so no reshape of it is a matrix.  Decided
    by the tensor's own index order and the result's index set alone, which keeps the subset search exact."""
    runs = sum(1 for k, c in enumerate(indices) if k == 0 or (c in kept) != (indices[k - 1] in kept))
    return runs > 2


def input_copy(net: Network, children: Sequence[Tree], kept: Container[str]) -> tuple[int, bool]:
    """(elements, needs a gradient) of the network's input when it is one of a contraction's two children and
    must be permuted for it (input_permuted, given the indices the result keeps); (0, False) otherwise."""
    k = net.input_position
    if k is None or k not in children or not input_permuted(net.tensors[k].indices, kept):
        return 0, False
    x = net.tensors[k]
    return math.prod(net.size_of[c] for c in x.indices), x.requires_grad


def copy_cost(elements: int, requires_grad: bool, training: bool) -> int:
    """The cost of permuting the network's input of this many elements before its contraction: a read and a
    write per element, and when training with an input needing a gradient, the same again for the
    gradient's way back."""
    return TRAFFIC_WEIGHT * 2 * elements * (1 + (requires_grad if training else 0))


def tree_cost(net: Network, tree: Tree, training: bool = True) -> int:
    """The total contraction_cost of a contraction tree (nested pairs of tensor positions) of `net`."""
    sizes = net.size_of
    everything = frozenset(range(len(net.tensors)))

    def size(indices: str) -> int:
        return math.prod(sizes[c] for c in indices)

    def visit(t: Tree) -> tuple[str, bool, frozenset[int], int]:  # indices, needs a gradient, members, cost
        if isinstance(t, int):
            spec = net.tensors[t]
            return spec.indices, spec.requires_grad, frozenset([t]), 0
        a, ga, ma, ca = visit(t[0])
        b, gb, mb, cb = visit(t[1])
        members = ma | mb
        if members == everything:
            out = net.output
        else:
            keep = net.needed_outside(members)
            out = "".join(c for c in dict.fromkeys(a + b) if c in keep)
        step = contraction_cost(size(a), size(b), size(out), pairwise_flops(a, b, out, sizes), ga + gb, training)
        step += copy_cost(*input_copy(net, t, out), training)
        return out, ga or gb, members, ca + cb + step

    return visit(tree)[3]
