"""Plans: a contraction tree laid out as pairwise steps, and how each step runs as one matrix product.

A Plan is what the search returns and what the layers execute.  Each step carries a Recipe: the sums,
permutes and reshapes that turn its two operands into (batched) matrices and the GEMM's result into the
intermediate's layout.  A program is the plan reduced to Contraction records (which two operands, which
recipe): plain hashable constants, so torch.compile can take a whole program as one traced constant and
run_program writes it into a graph with no planner code in the trace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import torch

from .cost import contraction_cost, copy_cost, input_copy
from .network import Network, Tree, pairwise_flops

__all__ = ["Step", "Plan", "Operand", "Recipe", "Contraction", "Program", "plan_from_tree", "contract_pair",
           "fuses_bias", "run_program", "execute"]

# A size as (factor, times_rows): factor times the row count given at run time when times_rows, else factor.
Dim = Tuple[int, bool]


class Operand(NamedTuple):
    """How one operand becomes a (batch, rows, cols) matrix: sum the axes in pre_sum, permute by perm (None:
    no permute), reshape to dims ((batch, rows, cols), the batch dim left out of unbatched products) and
    transpose the last two axes when transposed."""

    pre_sum: Tuple[int, ...]
    perm: Optional[Tuple[int, ...]]
    dims: Tuple[Dim, Dim, Dim]
    transposed: bool


class Recipe(NamedTuple):
    """One pairwise contraction as a matmul: operands a and b, whether it is batched, the shape the product
    is reshaped to, and the permute (None: none) that brings it into the intermediate's index order."""

    a: Operand
    b: Operand
    batched: bool
    out_shape: Tuple[Dim, ...]
    final: Optional[Tuple[int, ...]]


class Contraction(NamedTuple):
    """One step of a program: pop the operands at positions i and j, contract them by recipe, append."""

    i: int
    j: int
    recipe: Recipe


Program = Tuple[Contraction, ...]


@dataclass(frozen=True)
class Step:
    """One pairwise contraction of a plan: its einsum equation, forward FLOPs, how many of its operands need
    a gradient, the element counts of its operands and result, and the recipe contract_pair runs; copied:
    elements of the network's input permuted first (cost.input_permuted), copied_grad: whether that input
    needs a gradient."""

    equation: str
    flops: int
    grads: int
    a_size: int
    b_size: int
    out_size: int
    per_row: bool
    recipe: Recipe
    copied: int = 0
    copied_grad: bool = False

    @property
    def train_flops(self) -> int:
        """Forward plus backward FLOPs: one more contraction of the same size per operand gradient."""
        return self.flops * (1 + self.grads)

    def cost(self, training: bool = True) -> int:
        return (contraction_cost(self.a_size, self.b_size, self.out_size, self.flops, self.grads, training)
                + copy_cost(self.copied, self.copied_grad, training))


@dataclass(frozen=True)
class Plan:
    """A contraction tree with its costs.

    path: (i, j) pairs in opt_einsum's convention (both popped, result appended), with the einsum
    equation of each step; flops: forward FLOPs; training_flops: forward plus backward; memory: elements
    of the intermediates kept for the backward; cost(training): the cost model's total."""

    network: Network
    tree: Tree
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

    @property
    def program(self) -> Program:
        """The steps as run_program's Contraction records."""
        return tuple(Contraction(i, j, step.recipe) for (i, j), step in zip(self.path, self.steps))

    def cost(self, training: bool = True) -> int:
        """The cost model's total for this tree (cost.tree_cost of it, from the steps)."""
        return sum(s.cost(training) for s in self.steps)

    def describe(self) -> str:
        """One line per pairwise contraction with its forward and training FLOPs."""
        lines = []
        for s in self.steps:
            tag = "rows" if s.per_row else "cores only"
            lines.append(f"{s.equation:<28} {s.flops:>14,} fwd {s.train_flops:>14,} train  ({tag})")
        lines.append(f"{'total':<28} {self.flops:>14,} fwd {self.training_flops:>14,} train")
        return "\n".join(lines)


def _leaves(tree: Tree) -> list[int]:
    return [tree] if isinstance(tree, int) else _leaves(tree[0]) + _leaves(tree[1])


def plan_from_tree(net: Network, tree: Tree) -> Plan:
    """Cost a contraction tree (nested pairs of tensor positions) and lay it out as a path.

    Steps are ordered so cores-only subtrees come first (they do not depend on the rows and can be computed
    once per step and shared)."""
    sizes = net.size_of
    tensors = net.tensors
    ops: list[tuple[str, frozenset[int]]] = [(t.indices, frozenset([i])) for i, t in enumerate(tensors)]
    all_ids = frozenset(range(len(tensors)))

    def size(indices: str) -> int:
        return math.prod(sizes[c] for c in indices)

    internal: list[tuple] = []

    def collect(t: Tree) -> None:
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
        out = _natural_order(a, b, net.needed_outside(members))
        if members == all_ids:
            out = net.output
        grads = sum(any(tensors[m].requires_grad for m in side) for side in (left, right))
        eq = f"{a},{b}->{out}"
        recipe = _recipe(eq, net.sizes, size(a) >= size(b), net.rows_index)
        copied, copied_grad = input_copy(net, t, out)
        steps.append(Step(eq, pairwise_flops(a, b, out, sizes), grads, size(a), size(b), size(out), per_row_of[t],
                          recipe, copied, copied_grad))
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


@lru_cache(maxsize=65536)
def _recipe(equation: str, sizes: tuple[tuple[str, int], ...], a_bigger: bool, rows_index: str = "") -> Recipe:
    """How to run one pairwise contraction as a (batched) matrix product on views.

    Indices split into batch (in both, kept), contracted (in both, summed), a's own and b's own (kept);
    indices found in one operand only and not kept are summed first.  Each operand is brought to
    (batch, rows, cols) by a reshape when its layout allows (a view), else by a permute first.  The shared
    indices follow the bigger operand's order, so the big tensor is never copied.  Every size is a Dim, so
    one recipe serves any number of rows, symbolic ones included."""
    size = dict(sizes)
    lhs, out = equation.split("->")
    a, b = lhs.split(",")
    big, small = (a, b) if a_bigger else (b, a)
    batch = [c for c in big if c in small and c in out]
    contract = [c for c in big if c in small and c not in out]
    a_keep = [c for c in a if c not in b and c in out]
    b_keep = [c for c in b if c not in a and c in out]

    def dim(group) -> Dim:
        return math.prod(size[c] for c in group if c != rows_index), rows_index in group

    def side(idx: str, first: list[str], second: list[str]) -> Operand:
        pre_sum = tuple(k for k, c in enumerate(idx) if c not in out and c not in contract)
        rest = "".join(c for c in idx if c in out or c in contract)
        dims = (dim(batch), dim(first), dim(second))
        if rest == "".join(batch + first + second):
            return Operand(pre_sum, None, dims, False)
        if rest == "".join(batch + second + first):
            return Operand(pre_sum, None, (dims[0], dims[2], dims[1]), True)
        perm = tuple(rest.index(c) for c in batch + first + second)
        return Operand(pre_sum, perm, dims, False)

    natural = "".join(batch + a_keep + b_keep)
    final = None if natural == out else tuple(natural.index(c) for c in out)
    out_shape = tuple(dim(c) for c in natural)
    return Recipe(side(a, a_keep, contract), side(b, contract, b_keep), bool(batch), out_shape, final)


def _sizes(dims: Sequence[Dim], rows) -> tuple:
    return tuple(f * rows if scaled else f for f, scaled in dims)


def _operand(t: torch.Tensor, op: Operand, batched: bool, rows) -> torch.Tensor:
    if op.pre_sum:
        t = t.sum(dim=op.pre_sum)
    if op.perm is not None:
        t = t.permute(*op.perm)
    t = t.reshape(_sizes(op.dims if batched else op.dims[1:], rows))
    return t.transpose(-1, -2) if op.transposed else t


def fuses_bias(recipe: Recipe, out_features: int) -> bool:
    """Whether a final step can add a bias inside its GEMM (torch.addmm): a plain 2-D product whose
    result is already in output order, with a column count equal to the bias length."""
    b = recipe.b
    cols = b.dims[1] if b.transposed else b.dims[2]
    return not recipe.batched and recipe.final is None and cols == (out_features, False)


def contract_pair(a: torch.Tensor, b: torch.Tensor, recipe: Recipe, rows, bias: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """One pairwise contraction as reshapes/permutes and one matmul (batched when indices are shared
    and kept), following a Recipe, for `rows` rows (an int, or a SymInt under dynamic shapes).  A bias
    (only where fuses_bias holds) is added by the GEMM itself."""
    x = _operand(a, recipe.a, recipe.batched, rows)
    y = _operand(b, recipe.b, recipe.batched, rows)
    z = (torch.matmul(x, y) if bias is None else torch.addmm(bias, x, y)).reshape(_sizes(recipe.out_shape, rows))
    return z if recipe.final is None else z.permute(*recipe.final)


def run_program(program: Sequence[Contraction], operands: Sequence[torch.Tensor], rows,
                bias: torch.Tensor | None = None,
                on_step: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
    """Execute a program (Contraction records) on the operands (network tensor order), for `rows` rows.
    A bias is fused into the last GEMM where fuses_bias allows (the caller checks; else None).  Works on
    FX proxies too; on_step(k, result) sees each contraction's result."""
    ops = list(operands)
    last = len(program) - 1
    for k, step in enumerate(program):
        i, j = step.i, step.j
        a, b = ops[i], ops[j]
        for pos in sorted((i, j), reverse=True):
            ops.pop(pos)
        c = contract_pair(a, b, step.recipe, rows, bias if k == last else None)
        if on_step is not None:
            on_step(k, c)
        ops.append(c)
    return ops[0]


def execute(plan: Plan, operands: Sequence[torch.Tensor],
            on_step: Callable[[int, Step, torch.Tensor], None] | None = None,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """Run a plan's pairwise contractions on the operands, each a matmul on reshaped views (see
    contract_pair); passes.fx.contraction writes the same ops into a graph this way, through FX proxies.
    on_step(k, step, result) sees each result."""
    hook = None if on_step is None else (lambda k, c: on_step(k, plan.steps[k], c))
    return run_program(plan.program, operands, plan.rows, bias, hook)
