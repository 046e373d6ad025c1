"""Tensor networks of TT products, their cost model, and the contraction-order search.

A network is a set of tensors with named indices (a networkx graph: tensors are nodes, shared indices are
edges).  A plan is a contraction tree.  Its training cost counts the forward pairwise contractions and, for
each of them, one gradient contraction per child that needs a gradient (dA = dC . B costs what C = A . B
costs), each weighed by its FLOPs plus the elements it moves; forward intermediates are kept for the
backward, which is its memory.  The search is an exact
dynamic programme over subsets of tensors minimising that cost for the real shapes, so the order adapts to
the number of rows: merged cores for large batches, a chain through the activation for small ones.
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import networkx as nx
import torch

from .tt import TTSpec, gemm_spec

__all__ = [
    "TensorSpec",
    "Network",
    "Plan",
    "tt_linear_network",
    "ttm_embedding_network",
    "pairwise_flops",
    "search",
    "plan_from_tree",
    "plan_tt_linear",
    "reference_tree",
    "contract_pair",
    "fuses_bias",
    "execute",
    "tt_linear_program",
    "tt_linear_segments",
    "run_program",
]

_LETTERS = string.ascii_letters
EXACT_ALL_SUBSETS = 9  # up to this many tensors the search also considers outer products
EXACT_CONNECTED = 14  # up to this many, connected subsets only; beyond, greedy
# The search minimises FLOPs plus this many per element read or written: on these CPUs a GEMM runs about
# 16 FLOPs in the time memory moves one float, so narrow GEMMs over big activations (small ranks) are not
# as cheap as their FLOPs say.  At the paper's shapes (r = 30) the plans are the FLOP-optimal ones.
TRAFFIC_WEIGHT = 16


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a network: its indices, whether it needs a gradient, whether it depends on the rows."""

    name: str
    indices: str
    requires_grad: bool = True
    per_row: bool = False


@dataclass(frozen=True)
class Network:
    """Tensors with named indices (one letter each), the size of every index and the output's indices."""

    tensors: tuple[TensorSpec, ...]
    sizes: tuple[tuple[str, int], ...]
    output: str
    rows_index: str = ""  # the index that counts rows, if any: executed with the actual row count

    @property
    def size_of(self) -> dict[str, int]:
        return dict(self.sizes)

    def graph(self) -> nx.MultiGraph:
        """Tensors as nodes, one edge per shared index (attribute `index`, `size`)."""
        g = nx.MultiGraph()
        sizes = self.size_of
        for i, t in enumerate(self.tensors):
            g.add_node(i, name=t.name, indices=t.indices)
        for i, a in enumerate(self.tensors):
            for j in range(i + 1, len(self.tensors)):
                for c in set(a.indices) & set(self.tensors[j].indices):
                    g.add_edge(i, j, index=c, size=sizes[c])
        return g


def pairwise_flops(a: str, b: str, out: str, sizes: dict[str, int]) -> int:
    """FLOPs of contracting two tensors: 2 per multiply-add when an index is summed, else 1 per product."""
    involved = set(a) | set(b)
    n = math.prod(sizes[i] for i in involved)
    return 2 * n if involved - set(out) else n


def tt_linear_network(spec: TTSpec, rows: int, input_requires_grad: bool = True) -> Network:
    """X[b, i_1..i_d] and the 2d cores of a TT linear map; output Y[b, j_1..j_d].

    Boundary ranks (always 1) are dropped, so the first core is (i_1, a_1) and the last (a_{2d-1}, j_d)."""
    d_in = len(spec.in_modes)
    n = d_in + len(spec.out_modes)
    letters = iter(_LETTERS)
    batch = next(letters)
    phys = [next(letters) for _ in range(n)]
    bonds = [next(letters) for _ in range(n - 1)]
    sizes = {batch: rows}
    sizes.update(zip(phys, spec.in_modes + spec.out_modes))
    sizes.update(zip(bonds, spec.ranks[1:-1]))
    tensors = [TensorSpec("x", batch + "".join(phys[:d_in]), input_requires_grad, per_row=True)]
    for k in range(n):
        idx = (bonds[k - 1] if k > 0 else "") + phys[k] + (bonds[k] if k < n - 1 else "")
        tensors.append(TensorSpec(f"core{k}", idx))
    return Network(tuple(tensors), tuple(sizes.items()), batch + "".join(phys[d_in:]), batch)


def ttm_embedding_network(spec: TTSpec, rows: int) -> Network:
    """The gathered core slices S_k[b, a_{k-1}, e_k, a_k] of `rows` TTM lookups; output E[b, e_1..e_d].

    The row index b is shared by every slice (a hyperedge): each lookup contracts its own chain."""
    d = len(spec.in_modes)
    letters = iter(_LETTERS)
    batch = next(letters)
    cols = [next(letters) for _ in range(d)]
    bonds = [next(letters) for _ in range(d - 1)]
    sizes = {batch: rows}
    sizes.update(zip(cols, spec.out_modes))
    sizes.update(zip(bonds, spec.ranks[1:-1]))
    tensors = []
    for k in range(d):
        idx = batch + (bonds[k - 1] if k > 0 else "") + cols[k] + (bonds[k] if k < d - 1 else "")
        tensors.append(TensorSpec(f"slice{k}", idx, per_row=True))
    return Network(tuple(tensors), tuple(sizes.items()), batch + "".join(cols), batch)


# ---------------------------------------------------------------------------------------------------------
# Plans


Tree = "int | tuple[Tree, Tree]"


@dataclass(frozen=True)
class Step:
    """One pairwise contraction of a plan."""

    equation: str
    flops: int
    train_flops: int
    out_size: int
    per_row: bool
    recipe: tuple = ()  # how contract_pair runs it (see _recipe)


@dataclass(frozen=True)
class Plan:
    """A contraction tree with its costs.

    path: (i, j) pairs in opt_einsum's convention (both popped, result appended), with the einsum
    equation of each step; flops: forward FLOPs; training_flops: forward plus backward; memory: elements
    of the intermediates kept for the backward."""

    network: Network
    tree: object
    path: tuple[tuple[int, int], ...]
    steps: tuple[Step, ...]

    @property
    def rows(self) -> int:
        """The row count the plan was searched for (1 when the network has no row index)."""
        return self.network.size_of.get(self.network.rows_index, 1)

    @property
    def equations(self) -> tuple[str, ...]:
        return tuple(s.equation for s in self.steps)

    @property
    def flops(self) -> int:
        return sum(s.flops for s in self.steps)

    @property
    def training_flops(self) -> int:
        return sum(s.train_flops for s in self.steps)

    @property
    def memory(self) -> int:
        return sum(s.out_size for s in self.steps[:-1])

    def describe(self) -> str:
        """One line per pairwise contraction with its forward and training FLOPs."""
        lines = []
        for s in self.steps:
            tag = "rows" if s.per_row else "cores only"
            lines.append(f"{s.equation:<28} {s.flops:>14,} fwd {s.train_flops:>14,} train  ({tag})")
        lines.append(f"{'total':<28} {self.flops:>14,} fwd {self.training_flops:>14,} train")
        return "\n".join(lines)


def _leaves(tree) -> list[int]:
    return [tree] if isinstance(tree, int) else _leaves(tree[0]) + _leaves(tree[1])


def plan_from_tree(net: Network, tree) -> Plan:
    """Cost a contraction tree (nested pairs of tensor positions) and lay it out as a path.

    Steps are ordered so cores-only subtrees come first (they do not depend on the rows and can be computed
    once per step and shared)."""
    sizes = net.size_of
    tensors = net.tensors
    ops: list[tuple[str, frozenset[int]]] = [(t.indices, frozenset([i])) for i, t in enumerate(tensors)]
    all_ids = frozenset(range(len(tensors)))

    def needed_outside(members: frozenset[int]) -> set[str]:
        keep = set(net.output)
        for i in all_ids - members:
            keep.update(tensors[i].indices)
        return keep

    internal: list[tuple] = []

    def collect(t):
        if isinstance(t, int):
            return
        collect(t[0])
        collect(t[1])
        internal.append(t)

    collect(tree)
    # Cores-only subtrees first, keeping children before parents.
    per_row_of = {}
    for t in internal:
        per_row_of[t] = any(tensors[i].per_row for i in _leaves(t))
    order = [t for t in internal if not per_row_of[t]] + [t for t in internal if per_row_of[t]]

    path, steps = [], []
    for t in order:
        left, right = frozenset(_leaves(t[0])), frozenset(_leaves(t[1]))
        i = next(k for k, (_, m) in enumerate(ops) if m == left)
        j = next(k for k, (_, m) in enumerate(ops) if m == right)
        a, b = ops[i][0], ops[j][0]
        members = left | right
        keep = needed_outside(members)
        out = _natural_order(a, b, keep)
        if members == all_ids:
            out = net.output
        fl = pairwise_flops(a, b, out, sizes)
        grads = sum(any(tensors[m].requires_grad for m in side) for side in (left, right))
        eq = f"{a},{b}->{out}"
        a_bigger = math.prod(sizes[c] for c in a) >= math.prod(sizes[c] for c in b)
        steps.append(Step(eq, fl, fl * (1 + grads), math.prod(sizes[c] for c in out), per_row_of[t],
                          _recipe(eq, net.sizes, a_bigger, net.rows_index)))
        path.append((i, j))
        for k in sorted((i, j), reverse=True):
            ops.pop(k)
        ops.append((out, members))
    return Plan(net, tree, tuple(path), tuple(steps))


def _natural_order(a: str, b: str, keep: set[str]) -> str:
    """Index order of an intermediate as a batched GEMM produces it: shared kept indices (batch), then
    a's own, then b's own, so executing the contraction needs no permute of its result."""
    shared = [c for c in a if c in b and c in keep]
    return "".join(shared + [c for c in a if c in keep and c not in b] + [c for c in b if c in keep and c not in a])


def search(net: Network, training: bool = True) -> Plan:
    """The contraction tree of least cost: per pairwise contraction its FLOPs plus TRAFFIC_WEIGHT per
    element of its operands and result, counted for the forward and, when `training`, once more per child
    needing a gradient; ties broken by the memory kept for backward.

    Exact dynamic programme over all subsets up to EXACT_ALL_SUBSETS tensors (outer products included),
    over connected subsets up to EXACT_CONNECTED, greedy beyond."""
    n = len(net.tensors)
    if n == 1:
        return plan_from_tree(net, 0)
    if n > EXACT_CONNECTED:
        return plan_from_tree(net, _greedy(net))
    sizes = net.size_of
    letters = sorted(sizes)
    bit = {c: 1 << k for k, c in enumerate(letters)}
    logsize = [sizes[c] for c in letters]
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

    # For every subset: union of its indices, and the indices its intermediate keeps.
    union = [0] * (full + 1)
    grad = [False] * (full + 1)
    for s in range(1, full + 1):
        low = s & -s
        k = low.bit_length() - 1
        union[s] = union[s ^ low] | tensor_bits[k]
        grad[s] = grad[s ^ low] or net.tensors[k].requires_grad
    # indices appearing outside subset s: union of the complement, plus the output
    kept = [0] * (full + 1)
    for s in range(1, full + 1):
        kept[s] = union[s] & (union[full ^ s] | out_bits)

    def prod(mask: int) -> int:
        p, k = 1, 0
        while mask:
            if mask & 1:
                p *= logsize[k]
            mask >>= 1
            k += 1
        return p

    size_cache: dict[int, int] = {}

    def size(mask: int) -> int:
        v = size_cache.get(mask)
        if v is None:
            v = size_cache[mask] = prod(mask)
        return v

    connected_only = n > EXACT_ALL_SUBSETS
    best: dict[int, tuple[int, int, object]] = {}
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
                        involved = kept[sub] | kept[other]
                        out = kept[s] if s != full else out_bits
                        fl = size(involved) * (2 if involved & ~out else 1)
                        mult = 1 + (grad[sub] + grad[other] if training else 0)
                        c1, m1, t1 = best[sub]
                        c2, m2, t2 = best[other]
                        traffic = size(kept[sub]) + size(kept[other]) + size(out)
                        cost = c1 + c2 + (fl + TRAFFIC_WEIGHT * traffic) * mult
                        mem = m1 + m2 + (size(out) if s != full else 0)
                        if cand is None or (cost, mem) < (cand[0], cand[1]):
                            cand = (cost, mem, (t1, t2))
            sub = (sub - 1) & s
        if cand is not None:
            best[s] = cand
    if full not in best:  # a disconnected network with the connected-only search: fall back
        return plan_from_tree(net, _greedy(net))
    return plan_from_tree(net, best[full][2])


def _greedy(net: Network):
    """Repeatedly contract the pair whose contraction is cheapest (connected pairs first)."""
    sizes = net.size_of
    items = [(t.indices, i, t.requires_grad) for i, t in enumerate(net.tensors)]
    while len(items) > 1:
        best = None
        for x in range(len(items)):
            for y in range(x + 1, len(items)):
                a, b = items[x][0], items[y][0]
                others = set(net.output).union(*(it[0] for k, it in enumerate(items) if k not in (x, y)))
                out = "".join(c for c in dict.fromkeys(a + b) if c in others)
                key = (not (set(a) & set(b)), pairwise_flops(a, b, out, sizes))
                if best is None or key < best[0]:
                    best = (key, x, y, out)
        _, x, y, out = best
        merged = (out, (items[x][1], items[y][1]), items[x][2] or items[y][2])
        items = [it for k, it in enumerate(items) if k not in (x, y)] + [merged]
    return items[0][1]


def reference_tree(spec: TTSpec):
    """The reference implementation's fixed order: merge the input cores left to right into an N x r
    matrix, merge the output cores into an r x M matrix, then two GEMMs: (X A) B."""
    d_in, n = len(spec.in_modes), len(spec.in_modes) + len(spec.out_modes)
    a = 1
    for k in range(2, d_in + 1):
        a = (a, k)
    b = d_in + 1
    for k in range(d_in + 2, n + 1):
        b = (b, k)
    return ((0, a), b)


@lru_cache(maxsize=4096)
def plan_tt_linear(spec: TTSpec, rows: int, training: bool = True, input_requires_grad: bool = True) -> Plan:
    """The best plan of a TT linear map on `rows` rows, searched once per shape and cached."""
    return search(tt_linear_network(spec, int(rows), input_requires_grad), training)


@lru_cache(maxsize=65536)
def _recipe(equation: str, sizes: tuple[tuple[str, int], ...], a_bigger: bool, rows_index: str = "") -> tuple:
    """How to run one pairwise contraction as a (batched) matrix product on views.

    Indices split into batch (in both, kept), contracted (in both, summed), a's own and b's own (kept);
    indices found in one operand only and not kept are summed first.  Each operand is brought to
    (batch, rows, cols) by a reshape when its layout allows (a view), else by a permute first.  The shared
    indices follow the bigger operand's order, so the big tensor is never copied.  Every size is a pair
    (factor, times_rows): a group holding rows_index is factor * (the row count given at run time), so one
    recipe serves any number of rows, symbolic ones included."""
    size = dict(sizes)
    lhs, out = equation.split("->")
    a, b = lhs.split(",")
    big, small = (a, b) if a_bigger else (b, a)
    batch = [c for c in big if c in small and c in out]
    contract = [c for c in big if c in small and c not in out]
    a_keep = [c for c in a if c not in b and c in out]
    b_keep = [c for c in b if c not in a and c in out]

    def dim(group) -> tuple[int, bool]:
        return math.prod(size[c] for c in group if c != rows_index), rows_index in group

    def side(idx: str, first: list[str], second: list[str]):
        pre_sum = tuple(k for k, c in enumerate(idx) if c not in out and c not in contract)
        rest = "".join(c for c in idx if c in out or c in contract)
        dims = tuple(dim(g) for g in (batch, first, second))
        if rest == "".join(batch + first + second):
            return pre_sum, None, dims, False
        if rest == "".join(batch + second + first):
            return pre_sum, None, (dims[0], dims[2], dims[1]), True
        perm = tuple(rest.index(c) for c in batch + first + second)
        return pre_sum, perm, dims, False

    natural = "".join(batch + a_keep + b_keep)
    final = None if natural == out else tuple(natural.index(c) for c in out)
    out_shape = tuple(dim(c) for c in natural)
    return side(a, a_keep, contract), side(b, contract, b_keep), bool(batch), out_shape, final


def _sizes(dims: tuple[tuple[int, bool], ...], rows) -> tuple:
    return tuple(f * rows if scaled else f for f, scaled in dims)


def _operand(t: torch.Tensor, recipe: tuple, batched: bool, rows) -> torch.Tensor:
    pre_sum, perm, dims, transposed = recipe
    if pre_sum:
        t = t.sum(dim=pre_sum)
    if perm is not None:
        t = t.permute(*perm)
    t = t.reshape(_sizes(dims if batched else dims[1:], rows))
    return t.transpose(-1, -2) if transposed else t


def fuses_bias(recipe: tuple, out_features: int) -> bool:
    """Whether a final step can add a bias inside its GEMM (torch.addmm): a plain 2-D product whose
    result is already in output order, with a column count equal to the bias length."""
    ra, rb, batched, out_shape, final = recipe
    cols = rb[2][1] if rb[3] else rb[2][2]
    return not batched and final is None and cols == (out_features, False)


def contract_pair(a: torch.Tensor, b: torch.Tensor, recipe: tuple, rows, bias: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """One pairwise contraction as reshapes/permutes and one matmul (batched when indices are shared
    and kept), following a recipe from _recipe, for `rows` rows (an int, or a SymInt under dynamic
    shapes).  A bias (only where fuses_bias holds) is added by the GEMM itself."""
    ra, rb, batched, out_shape, final = recipe
    x, y = _operand(a, ra, batched, rows), _operand(b, rb, batched, rows)
    z = (torch.matmul(x, y) if bias is None else torch.addmm(bias, x, y)).reshape(_sizes(out_shape, rows))
    return z if final is None else z.permute(*final)


def _program(plan: Plan) -> tuple:
    return tuple((i, j, step.recipe) for (i, j), step in zip(plan.path, plan.steps))


@lru_cache(maxsize=4096)
def tt_linear_program(spec: TTSpec, rows: int, training: bool = True, input_requires_grad: bool = True) -> tuple:
    """The plan of plan_tt_linear at gemm_spec(spec)'s ranks as plain nested tuples, ((i, j, recipe), ...),
    for run_program on cores padded by tt.gemm_core_padding."""
    return _program(plan_tt_linear(gemm_spec(spec), rows, training, input_requires_grad))


MAX_SEGMENT_ROWS = 1 << 24
MIN_SEGMENT_START = 8
MIN_SEGMENT_WIDTH = 4


@torch.compiler.assume_constant_result
def tt_linear_segments(spec: TTSpec | tuple, training: bool = True,
                       input_requires_grad: bool = True) -> tuple[tuple[int, ...], tuple[tuple, ...]]:
    """Every row count's best plan, as (thresholds, programs): rows < thresholds[0] use programs[0],
    thresholds[0] <= rows < thresholds[1] programs[1], and so on.

    A fixed tree's cost is affine in the row count, so each tree is optimal on one interval and the
    intervals are found exactly by bisection between sampled row counts.  Under torch.compile this is a
    constant, and comparing the (possibly symbolic) row count with the thresholds picks the program: a
    dynamic batch dimension recompiles only where the best plan changes, never per size.  Like
    tt_linear_program, the programs run at gemm_spec(spec)'s ranks.  spec may be a TTSpec.key()."""
    return _segments(gemm_spec(TTSpec.of(spec)), training, input_requires_grad)


@lru_cache(maxsize=1024)
def _segments(spec: TTSpec, training: bool, input_requires_grad: bool) -> tuple[tuple[int, ...], tuple[tuple, ...]]:
    def tree(rows: int):
        return plan_tt_linear(spec, rows, training, input_requires_grad).tree

    samples = [1 << k for k in range(MAX_SEGMENT_ROWS.bit_length())]
    starts = [1]

    def refine(lo: int, hi: int) -> None:  # tree(lo) != tree(hi): find where the optimum changes
        if hi - lo == 1:
            starts.append(hi)
            return
        mid = (lo + hi) // 2
        t = tree(mid)
        if t != tree(lo):
            refine(lo, mid)
        if t != tree(hi):
            refine(mid, hi)

    for lo, hi in zip(samples, samples[1:]):
        if tree(lo) != tree(hi):
            refine(lo, hi)
    starts = sorted(set(starts))
    # Dynamo guards the comparisons; a segment one or two row counts wide would pin a dynamic size to a
    # constant, so narrow segments (and all below MIN_SEGMENT_START) join the segment before them.
    kept = [starts[0]]
    for k, start in enumerate(starts[1:], start=1):
        end = starts[k + 1] if k + 1 < len(starts) else MAX_SEGMENT_ROWS
        if start >= MIN_SEGMENT_START and end - start >= MIN_SEGMENT_WIDTH:
            kept.append(start)
    programs = tuple(_program(plan_tt_linear(spec, r, training, input_requires_grad)) for r in kept)
    return tuple(kept[1:]), programs


def run_program(program: tuple, operands: Sequence[torch.Tensor], rows, bias: torch.Tensor | None = None,
                on_step=None) -> torch.Tensor:
    """Execute a program ((i, j, recipe), ...) on the operands (network tensor order), for `rows` rows.
    A bias is fused into the last GEMM where fuses_bias allows (the caller checks; else None).  Works on
    FX proxies too; on_step(k, result) sees each contraction's result."""
    ops = list(operands)
    last = len(program) - 1
    for k, (i, j, recipe) in enumerate(program):
        a, b = ops[i], ops[j]
        if i > j:
            ops.pop(i)
            ops.pop(j)
        else:
            ops.pop(j)
            ops.pop(i)
        c = contract_pair(a, b, recipe, rows, bias if k == last else None)
        if on_step is not None:
            on_step(k, c)
        ops.append(c)
    return ops[0]


def execute(plan: Plan, operands: Sequence[torch.Tensor], on_step=None,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """Run a plan's pairwise contractions on the operands, each a matmul on reshaped views (see
    contract_pair); passes.contraction writes the same ops into a graph this way, through FX proxies.
    on_step(k, step, result) sees each result."""
    hook = None if on_step is None else (lambda k, c: on_step(k, plan.steps[k], c))
    return run_program(_program(plan), operands, plan.rows, bias, hook)


# ---------------------------------------------------------------------------------------------------------
# TTM embedding lookups: which cores to merge, and how


LOOKUP_HOWS = ("rows", "table", "dedupe")


@dataclass(frozen=True)
class LookupPlan:
    """How a batch of TTM lookups runs: the cores split into consecutive groups of one or two, each group
    turned into one tensor per looked-up row, then one batched contraction over the groups.

    groups: (first core, last core + 1, how) per group; how is "rows" (gather the core slices of every
    row; a pair is multiplied row by row), "table" (a pair merged into one table over all its v_a * v_b
    digit pairs, then gathered) or "dedupe" (a pair multiplied only for the distinct digit pairs of the
    batch, then gathered).  program: run_program's contraction of the group tensors (empty for one
    group).  cost: the planner's training cost (FLOPs plus TRAFFIC_WEIGHT per element moved)."""

    spec: TTSpec
    rows: int
    groups: tuple[tuple[int, int, str], ...]
    program: tuple
    cost: float
    flops: int

    def describe(self) -> str:
        parts = []
        for a, b, how in self.groups:
            cores = f"core {a}" if b - a == 1 else f"cores {a}-{b - 1}"
            parts.append(cores if b - a == 1 else f"{cores} ({how})")
        return f"{' | '.join(parts)}; {self.flops:,} fwd FLOPs, cost {self.cost:,.0f} for {self.rows} rows"


def _expected_distinct(draws: int, bins: int) -> float:
    """Expected number of distinct bins hit by `draws` uniform draws (an estimate of a pair's distinct
    digit pairs among the batch's distinct rows)."""
    if bins <= 0:
        return 0.0
    return bins * -math.expm1(draws * math.log1p(-1.0 / bins)) if bins > 1 else float(min(draws, 1))


def _groupings(d: int) -> list[tuple[tuple[int, int], ...]]:
    """Every split of cores 0..d-1 into consecutive groups of one or two cores."""
    if d == 0:
        return [()]
    out = [((0, 1), *((a + 1, b + 1) for a, b in rest)) for rest in _groupings(d - 1)]
    if d >= 2:
        out += [((0, 2), *((a + 2, b + 2) for a, b in rest)) for rest in _groupings(d - 2)]
    return out


def _chain_cost(plan: Plan, training: bool) -> float:
    """A plan's cost in search()'s model: per step FLOPs plus TRAFFIC_WEIGHT per element of its operands
    and result, once forward and once more per child needing a gradient when training."""
    sizes = plan.network.size_of
    total = 0.0
    for step in plan.steps:
        lhs, out = step.equation.split("->")
        traffic = sum(math.prod(sizes[c] for c in t) for t in (*lhs.split(","), out))
        mult = step.train_flops / step.flops if training and step.flops else 1
        total += (step.flops + TRAFFIC_WEIGHT * traffic) * mult
    return total


def _group_spec(spec: TTSpec, groups: Sequence[tuple[int, int]]) -> TTSpec:
    """The TTM spec of the group tensors: one core per group, its row and column modes the products."""
    v = tuple(math.prod(spec.in_modes[a:b]) for a, b in groups)
    e = tuple(math.prod(spec.out_modes[a:b]) for a, b in groups)
    ranks = tuple(spec.ranks[a] for a, _ in groups) + (1,)
    return TTSpec("ttm", spec.in_features, spec.out_features, v, e, ranks, ranks)


def _lookup_candidates(spec: TTSpec, rows: int, training: bool, dedupe: bool) -> list[LookupPlan]:
    w = TRAFFIC_WEIGHT
    grad_mult = 3 if training else 1  # a product's two operand gradients each cost what it does
    copy_mult = 2 if training else 1  # a gather (or copy) forward, its scatter-add backward
    d = len(spec.in_modes)
    hows = ("rows", "table", "dedupe") if dedupe else ("rows", "table")
    out: list[LookupPlan] = []
    for groups in _groupings(d):
        pairs = [k for k, (a, b) in enumerate(groups) if b - a == 2]
        for choice in _product(len(pairs), hows):
            how_of = dict(zip(pairs, choice))
            if len(groups) == 1 and how_of.get(0) == "table":
                continue  # a table over all cores is the dense V x D table: never
            cost, flops = 0.0, 0
            labelled = []
            for k, (a, b) in enumerate(groups):
                r, t = spec.ranks[a], spec.ranks[b]
                if b - a == 1:
                    labelled.append((a, b, "rows"))
                    slice_ = r * spec.out_modes[a] * t
                    cost += w * (rows * slice_ * copy_mult + (math.prod(spec.core_shapes[a]) if training else 0))
                    continue
                how = how_of[k]
                labelled.append((a, b, how))
                s = spec.ranks[a + 1]
                ea, eb, va, vb = spec.out_modes[a], spec.out_modes[a + 1], spec.in_modes[a], spec.in_modes[a + 1]
                left, right, merged = r * ea * s, s * eb * t, r * ea * eb * t
                if how == "table":
                    n = va * vb
                elif how == "dedupe":
                    n = _expected_distinct(rows, va * vb)
                    cost += w * (4 * rows + rows * merged * copy_mult)  # the unique's sort, the re-gather
                else:
                    n = rows
                f = 2 * n * r * ea * s * eb * t
                flops += int(f)
                if how == "table":
                    # one GEMM of the two cores, the permute into row-major table order, the gather of rows
                    traffic = va * left + vb * right + n * merged
                    cost += (f + w * traffic) * grad_mult + w * n * merged * copy_mult
                    cost += w * rows * merged * copy_mult + (w * n * merged if training else 0)
                else:
                    cost += w * n * (left + right) * copy_mult + (f + w * n * (left + right + merged)) * grad_mult
            if len(groups) > 1:
                net = ttm_embedding_network(_group_spec(spec, groups), rows)
                chain = search(net, training)
                program = _program(chain)
                cost += _chain_cost(chain, training)
                flops += chain.flops
            else:
                program = ()
            out.append(LookupPlan(spec, rows, tuple(labelled), program, cost, flops))
    return out


def _product(n: int, options: Sequence[str]) -> list[tuple[str, ...]]:
    if n == 0:
        return [()]
    return [(o, *rest) for o in options for rest in _product(n - 1, options)]


@lru_cache(maxsize=4096)
def plan_ttm_lookup(spec: TTSpec, rows: int, training: bool = True, dedupe: bool = True) -> LookupPlan:
    """The cheapest way to look up `rows` distinct rows of a TTM table: which core pairs to merge (into a
    full table or only for the batch's digit pairs) and the order of the batched contraction over the
    groups, by the same cost model as search().  dedupe=False leaves out plans that need torch.unique
    (under torch.compile).  Searched once per (spec, rows) and cached."""
    rows = max(int(rows), 1)
    return min(_lookup_candidates(spec, rows, training, dedupe), key=lambda p: (p.cost, len(p.groups)))


def lookup_bucket(rows: int) -> int:
    """The row count a lookup of `rows` distinct rows is planned for: rows rounded up to 2^(k/2), so plans
    are cached for a few dozen sizes and not one per batch."""
    if rows <= 16:
        return max(rows, 1)
    k = math.ceil(2 * math.log2(rows))
    return int(math.ceil(2 ** (k / 2)))


@torch.compiler.assume_constant_result
def ttm_lookup_program(spec: TTSpec | tuple, rows: int, training: bool = True, dedupe: bool = True
                       ) -> tuple[tuple[tuple[int, int, str], ...], tuple]:
    """(groups, program) of plan_ttm_lookup, as a constant under torch.compile (spec may be a
    TTSpec.key())."""
    plan = plan_ttm_lookup(TTSpec.of(spec), lookup_bucket(rows), training, dedupe)
    return plan.groups, plan.program
