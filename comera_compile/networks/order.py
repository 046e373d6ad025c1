"""The contraction-order search: the tree of least cost for a network's real shapes.

An exact dynamic programme over subsets of tensors (forward plus backward, by cost.contraction_cost), so
the order adapts to the number of rows: merged cores for large batches, a chain through the activation for
small ones.  Beyond its size limit a greedy pass minimises the same cost one pair at a time.
TrainingPathOptimizer offers the search to any opt_einsum user as a path optimizer.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from functools import lru_cache
from typing import Any, Callable, Hashable, Iterable, List, Mapping, Sequence, Tuple

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


def _linear_path(tree: Tree, n: int) -> list[tuple[int, int]]:
    """A tree as opt_einsum's linear path: each step the positions of its two operands among those left
    (both removed, the result appended), in ascending order as opt_einsum's optimizers give them
    (paths.ssa_to_linear sorts); children before parents, left subtree first, the step order plan_from_tree
    takes for a network with no row-dependent tensor (its pairs keep the tree's operand order instead)."""
    ops: list[Tree] = list(range(n))
    path: list[tuple[int, int]] = []

    def visit(t: Tree) -> None:
        if isinstance(t, int):
            return
        visit(t[0])
        visit(t[1])
        i, j = sorted((ops.index(t[0]), ops.index(t[1])))
        path.append((i, j))
        del ops[j], ops[i]
        ops.append(t)

    visit(tree)
    return path


def _symbols(labels: Iterable[Hashable]) -> dict[Hashable, str]:
    """One character per index label, as the network needs.  opt_einsum hands its optimizers one-character
    strings (its own get_symbol characters for interleaved input), kept as they are; any other hashable
    labels, which opt_einsum's own optimizers also accept, are renamed by get_symbol in sorted order."""
    labels = list(labels)
    if all(isinstance(c, str) and len(c) == 1 for c in labels):
        return {c: c for c in labels}
    try:
        ordered = sorted(labels)
    except TypeError:  # labels of mixed types: a fixed order all the same
        ordered = sorted(labels, key=lambda c: (type(c).__qualname__, repr(c)))
    return {c: opt_einsum.get_symbol(k) for k, c in enumerate(ordered)}


def _memory_limit(memory_limit: float | None) -> int | None:
    """opt_einsum's memory_limit as this module reads it: None, -1 and infinity mean no limit (as in
    opt_einsum.paths), anything else a number of elements."""
    if memory_limit is None or memory_limit == -1 or memory_limit == math.inf:
        return None
    return int(memory_limit)


PathType = List[Tuple[int, ...]]


class TrainingPathOptimizer(opt_einsum.paths.PathOptimizer):
    """An opt_einsum path optimizer running this module's search on any einsum expression:

        opt_einsum.contract(eq, *arrays, optimize=TrainingPathOptimizer())

    It minimises the cost model's forward cost plus, when `training`, the gradient contractions of the
    inputs flagged in `requires_grad` (default: all), and follows opt_einsum's conventions for path
    optimizers:

    - the path is a list of tuples of Python ints in ascending order, positions among the operands left
      (all removed, the result appended), as opt_einsum.paths.ssa_to_linear writes them; one input: [(0,)];
    - inputs are any iterables of hashable index labels (strings, sets, frozensets; letters, opt_einsum's
      unicode symbols or any other hashables), the output likewise; an input's repeated labels (a trace or
      diagonal) count once, as opt_einsum's own optimizers count them, so the same expression gets the same
      path whether given as strings or as the frozensets contract_path passes;
    - None, -1 and infinity as memory_limit mean no limit, as in opt_einsum.paths; a real limit sends the
      expression to `fallback`: the search does not model the size of intermediates, while opt_einsum's
      optimizers keep to the limit (contracting several operands at once where no pair fits);
    - with more than EXACT_CONNECTED inputs, the expression goes to `fallback` too (an opt_einsum optimizer
      name or a PathOptimizer), whose heuristics are built for large expressions.

    Paths are memoised per instance (up to `cache_size` expressions, least recently used dropped first):
    opt_einsum calls its optimizer on every contract(), and a second call of the same expression (same index
    sets, output, sizes and limit) returns the stored path without searching.  Answers of a `fallback`
    given as an object are not stored: such optimizers keep their own state (opt_einsum's random optimizers
    improve on, or refuse, repeated calls)."""

    def __init__(self, training: bool = True, requires_grad: Sequence[bool] | None = None,
                 fallback: str | Callable[..., Any] = "auto", cache_size: int = 1024) -> None:
        if isinstance(fallback, str):
            opt_einsum.paths.get_path_fn(fallback)  # an unknown name fails now, with opt_einsum's KeyError
        elif not callable(fallback):
            raise TypeError(f"fallback must be an opt_einsum optimizer name or a path optimizer, not {fallback!r}")
        self.training = bool(training)
        self.requires_grad = None if requires_grad is None else tuple(bool(g) for g in requires_grad)
        self.fallback = fallback
        self.cache_size = int(cache_size)
        self._cache: OrderedDict[tuple, tuple[tuple[int, ...], ...]] = OrderedDict()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(training={self.training!r}, requires_grad={self.requires_grad!r}, "
                f"fallback={self.fallback!r})")

    def clear_cache(self) -> None:
        """Forget every memoised path."""
        self._cache.clear()

    def __call__(self, inputs: Sequence[Iterable[Hashable]], output: Iterable[Hashable],
                 size_dict: Mapping[Hashable, int], memory_limit: float | None = None) -> PathType:
        """The contraction path of the expression `inputs -> output` with index sizes `size_dict`, no
        intermediate larger than `memory_limit` elements."""
        n = len(inputs)
        if n == 0:
            raise ValueError("an einsum expression needs at least one input")
        if self.requires_grad is not None and len(self.requires_grad) != n:
            raise ValueError(f"requires_grad has {len(self.requires_grad)} entries for {n} inputs")
        if n == 1:
            return [(0,)]
        sets = tuple(frozenset(idx) for idx in inputs)
        out = frozenset(output)
        sizes = {c: int(size_dict[c]) for c in frozenset().union(*sets, out)}
        limit = _memory_limit(memory_limit)
        key = (sets, out, frozenset(sizes.items()), limit, self.training, self.requires_grad,
               self.fallback if isinstance(self.fallback, str) else None)
        path = self._cache.get(key)
        if path is not None:
            try:
                self._cache.move_to_end(key)
            except KeyError:  # dropped meanwhile by another thread's call
                pass
            return list(path)
        path, searched = self._path(sets, out, sizes, limit)
        if self.cache_size > 0 and (searched or isinstance(self.fallback, str)):
            self._cache[key] = path
            while len(self._cache) > self.cache_size:
                try:
                    self._cache.popitem(last=False)
                except KeyError:
                    break
        return list(path)

    def _path(self, sets: tuple[frozenset, ...], out: frozenset, sizes: dict[Hashable, int], limit: int | None
              ) -> tuple[tuple[tuple[int, ...], ...], bool]:
        """(path, whether this module's search chose it rather than the fallback)."""
        if limit is None and len(sets) <= EXACT_CONNECTED:
            symbol = _symbols(sizes)
            net = einsum_network(["".join(symbol[c] for c in s) for s in sets], "".join(symbol[c] for c in out),
                                 {symbol[c]: v for c, v in sizes.items()}, self.requires_grad)
            return tuple(_linear_path(optimal_tree(net, self.training)[0], len(sets))), True
        # A memory limit, or too many inputs for the exact search.  The fallback gets what contract_path would
        # pass (frozensets, int sizes, the limit as an int or None), whatever form the caller used.
        fallback = opt_einsum.paths.get_path_fn(self.fallback) if isinstance(self.fallback, str) else self.fallback
        path = fallback(list(sets), out, dict(sizes), limit)
        return tuple(tuple(int(k) for k in step) for step in path), False
