"""The contraction-order search: the tree of least cost for a network's real shapes.

An exact dynamic programme over subsets of tensors (forward plus backward, by cost.contraction_cost), so
the order adapts to the number of rows: merged cores for large batches, a chain through the activation for
small ones.  Beyond its size limit a greedy pass minimises the same cost one pair at a time.
TrainingPathOptimizer offers the search to any opt_einsum user as a path optimizer.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Iterable, Sequence

import opt_einsum

from ..tt import TTSpec
from .cost import contraction_cost, copy_cost, input_copy, tree_cost
from .network import Network, Tree, einsum_network, pairwise_flops, tt_linear_network
from .plan import Plan, plan_from_tree

__all__ = ["EXACT_ALL_SUBSETS", "EXACT_CONNECTED", "optimal_tree", "greedy_tree", "search", "reference_tree",
           "plan_tt_linear", "TrainingPathOptimizer"]

EXACT_ALL_SUBSETS = 9  # up to this many tensors the search also considers outer products
EXACT_CONNECTED = 14  # up to this many, connected subsets only; beyond, greedy


def optimal_tree(net: Network, training: bool = True) -> tuple[Tree, int]:
    """The contraction tree of least total contraction_cost (forward, and when `training` the gradient
    contractions too) and that cost; ties broken by the memory kept for backward.

    Exact over all subsets up to EXACT_ALL_SUBSETS tensors (outer products included), over connected subsets
    up to EXACT_CONNECTED; beyond, or when a disconnected network leaves the connected search without a tree,
    greedy_tree's tree."""
    n = len(net.tensors)
    if n == 1:
        return 0, 0
    if n > EXACT_CONNECTED:
        return _greedy_with_cost(net, training)
    sizes = net.size_of
    letters = sorted(sizes)
    bit = {c: 1 << k for k, c in enumerate(letters)}
    extent = [sizes[c] for c in letters]
    tensor_bits = []
    for t in net.tensors:
        m = 0
        for c in t.indices:
            m |= bit[c]
        tensor_bits.append(m)
    out_bits = 0
    for c in net.output:
        out_bits |= bit[c]
    full = (1 << n) - 1

    # For every subset: union of its indices, whether it needs a gradient, and the indices its
    # intermediate keeps (those also found in the complement or the output).
    union = [0] * (full + 1)
    grad = [False] * (full + 1)
    for s in range(1, full + 1):
        low = s & -s
        k = low.bit_length() - 1
        union[s] = union[s ^ low] | tensor_bits[k]
        grad[s] = grad[s ^ low] or net.tensors[k].requires_grad
    kept = [0] * (full + 1)
    for s in range(1, full + 1):
        kept[s] = union[s] & (union[full ^ s] | out_bits)
    # An operand's indices: an intermediate's kept ones, an input tensor's own (with any it alone holds).
    operand = list(kept)
    for k, bits in enumerate(tensor_bits):
        operand[1 << k] = bits

    size_cache: dict[int, int] = {}

    def size(mask: int) -> int:
        v = size_cache.get(mask)
        if v is None:
            v, k, rest = 1, 0, mask
            while rest:
                if rest & 1:
                    v *= extent[k]
                rest >>= 1
                k += 1
            size_cache[mask] = v
        return v

    # The input's copy charge depends only on which of its indices a split keeps (cost.input_permuted).
    x_bit = -1 if net.input_position is None else 1 << net.input_position
    x_letters = [] if net.input_position is None else net.tensors[net.input_position].indices

    connected_only = n > EXACT_ALL_SUBSETS
    best: dict[int, tuple[int, int, Tree]] = {}  # subset -> (cost, memory, tree)
    for k in range(n):
        best[1 << k] = (0, 0, k)
    for s in sorted(range(1, full + 1), key=lambda m: bin(m).count("1")):
        if s & (s - 1) == 0:
            continue
        cand = None
        low = s & -s
        sub = (s - 1) & s
        while sub:
            if sub & low:  # each unordered split once: the part holding the lowest tensor
                other = s ^ sub
                if sub in best and other in best:
                    shared = kept[sub] & kept[other]
                    if shared or not connected_only:
                        involved = operand[sub] | operand[other]
                        out = kept[s] if s != full else out_bits
                        flops = size(involved) * (2 if involved & ~out else 1)  # as pairwise_flops
                        c1, m1, t1 = best[sub]
                        c2, m2, t2 = best[other]
                        step = contraction_cost(size(operand[sub]), size(operand[other]), size(out), flops,
                                                grad[sub] + grad[other], training)
                        if sub == x_bit or other == x_bit:
                            kept_x = {c for c in x_letters if bit[c] & out}
                            step += copy_cost(*input_copy(net, (t1, t2), kept_x), training)
                        cost = c1 + c2 + step
                        mem = m1 + m2 + (size(out) if s != full else 0)
                        if cand is None or (cost, mem) < (cand[0], cand[1]):
                            cand = (cost, mem, (t1, t2))
            sub = (sub - 1) & s
        if cand is not None:
            best[s] = cand
    if full not in best:
        return _greedy_with_cost(net, training)
    return best[full][2], best[full][0]


def greedy_tree(net: Network, training: bool = True) -> Tree:
    """Repeatedly contract the pair of least contraction_cost, pairs sharing an index first."""
    sizes = net.size_of

    def size(indices: str) -> int:
        return math.prod(sizes[c] for c in indices)

    items: list[tuple[str, Tree, bool]] = [(t.indices, i, t.requires_grad) for i, t in enumerate(net.tensors)]
    while len(items) > 1:
        best = None
        for x in range(len(items)):
            for y in range(x + 1, len(items)):
                (a, _, ga), (b, _, gb) = items[x], items[y]
                others = set(net.output).union(*(it[0] for k, it in enumerate(items) if k not in (x, y)))
                out = "".join(c for c in dict.fromkeys(a + b) if c in others)
                cost = contraction_cost(size(a), size(b), size(out), pairwise_flops(a, b, out, sizes), ga + gb,
                                        training)
                cost += copy_cost(*input_copy(net, (items[x][1], items[y][1]), out), training)
                key = (not (set(a) & set(b)), cost)
                if best is None or key < best[0]:
                    best = (key, x, y, out)
        _, x, y, out = best
        merged = (out, (items[x][1], items[y][1]), items[x][2] or items[y][2])
        items = [it for k, it in enumerate(items) if k not in (x, y)] + [merged]
    return items[0][1]


def _greedy_with_cost(net: Network, training: bool) -> tuple[Tree, int]:
    tree = greedy_tree(net, training)
    return tree, tree_cost(net, tree, training)


def search(net: Network, training: bool = True) -> Plan:
    """The plan of optimal_tree's tree."""
    return plan_from_tree(net, optimal_tree(net, training)[0])


def reference_tree(spec: TTSpec) -> Tree:
    """The fixed order of a plain TT layer, the baseline plans are compared with: merge the input cores
    left to right into an N x r matrix, the output cores into an r x M matrix, then two GEMMs: (X A) B."""
    d_in, n = len(spec.in_modes), len(spec.in_modes) + len(spec.out_modes)
    a: Tree = 1
    for k in range(2, d_in + 1):
        a = (a, k)
    b: Tree = d_in + 1
    for k in range(d_in + 2, n + 1):
        b = (b, k)
    return ((0, a), b)


@lru_cache(maxsize=4096)
def plan_tt_linear(spec: TTSpec, rows: int, training: bool = True, input_requires_grad: bool = True) -> Plan:
    """The best plan of a TT linear map on `rows` rows, searched once per shape and cached."""
    return search(tt_linear_network(spec, int(rows), input_requires_grad), training)


class TrainingPathOptimizer(opt_einsum.paths.PathOptimizer):
    """An opt_einsum path optimizer running this module's search on any einsum expression:

        opt_einsum.contract(eq, *arrays, optimize=TrainingPathOptimizer())

    It minimises the cost model's forward cost plus, when `training`, the gradient contractions of the
    inputs flagged in `requires_grad` (default: all).  With more than EXACT_CONNECTED inputs, or with a
    memory limit (which the search does not model), it hands the expression to opt_einsum's `fallback`
    optimizer, whose heuristics are built for large expressions."""

    def __init__(self, training: bool = True, requires_grad: Sequence[bool] | None = None,
                 fallback: str = "auto") -> None:
        self.training = training
        self.requires_grad = None if requires_grad is None else tuple(requires_grad)
        self.fallback = fallback

    def __call__(self, inputs: list[Iterable[str]], output: Iterable[str], size_dict: dict[str, int],
                 memory_limit: int | None = None) -> list[tuple[int, ...]]:
        if len(inputs) == 1:
            return [(0,)]
        if memory_limit is not None or len(inputs) > EXACT_CONNECTED:
            return opt_einsum.paths.get_path_fn(self.fallback)(inputs, output, size_dict, memory_limit)
        net = einsum_network(inputs, output, size_dict, self.requires_grad)
        return list(search(net, self.training).path)
