"""Tensor networks of TT products and the plans that contract them.

A plan is a sequence of pairwise contractions (opt_einsum's path convention) with the einsum equation of
every step precomputed, so executing it is a handful of plain tensor ops.  Plans depend only on the
shapes, so they are cached per (spec, rows).
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass
from functools import lru_cache

import opt_einsum
import torch

from .tt import TTSpec

__all__ = ["Plan", "tt_linear_network", "plan_tt_linear", "execute"]

_LETTERS = string.ascii_letters


@dataclass(frozen=True)
class Plan:
    """An ordered list of pairwise contractions.

    inputs: index string of each operand; output: index string of the result; sizes: size of each index;
    path: (i, j) pairs in opt_einsum's convention (both popped, result appended); equations: the einsum
    equation of each step; flops: the forward FLOPs (2 per multiply-add)."""

    inputs: tuple[str, ...]
    output: str
    sizes: tuple[tuple[str, int], ...]
    path: tuple[tuple[int, int], ...]
    equations: tuple[str, ...]
    flops: int

    def describe(self) -> str:
        """One line per step: the contraction and its FLOPs."""
        return "\n".join(f"{eq}" for eq in self.equations)


def pairwise_flops(a: str, b: str, out: str, sizes: dict[str, int]) -> int:
    """FLOPs of contracting two operands: 2 per multiply-add when an index is summed, else 1 per product."""
    involved = set(a) | set(b)
    n = math.prod(sizes[i] for i in involved)
    summed = involved - set(out)
    return 2 * n if summed else n


def tt_linear_network(spec: TTSpec, rows: int) -> tuple[tuple[str, ...], str, dict[str, int]]:
    """Index strings of X[b, i_1..i_d] and the 2d cores of a TT linear map, and of the output Y[b, j_1..j_d].

    Boundary ranks (always 1) are dropped, so the first core is (i_1, a_1) and the last (a_{2d-1}, j_d)."""
    d_in, d_out = len(spec.in_modes), len(spec.out_modes)
    n = d_in + d_out
    letters = iter(_LETTERS)
    batch = next(letters)
    phys = [next(letters) for _ in range(n)]
    bonds = [next(letters) for _ in range(n - 1)]
    sizes = {batch: rows}
    for p, s in zip(phys, spec.in_modes + spec.out_modes):
        sizes[p] = s
    for b, r in zip(bonds, spec.ranks[1:-1]):
        sizes[b] = r
    cores = []
    for k in range(n):
        idx = (bonds[k - 1] if k > 0 else "") + phys[k] + (bonds[k] if k < n - 1 else "")
        cores.append(idx)
    x = batch + "".join(phys[:d_in])
    y = batch + "".join(phys[d_in:])
    return (x, *cores), y, sizes


def _equations(inputs: tuple[str, ...], output: str, path) -> tuple[str, ...]:
    ops = list(inputs)
    eqs = []
    for i, j in path:
        a, b = ops[i], ops[j]
        for k in sorted((i, j), reverse=True):
            ops.pop(k)
        keep = set(output).union(*ops) if ops else set(output)
        out = "".join(c for c in dict.fromkeys(a + b) if c in keep)
        eqs.append(f"{a},{b}->{out}")
        ops.append(out)
    return tuple(eqs)


def make_plan(inputs: tuple[str, ...], output: str, sizes: dict[str, int], path) -> Plan:
    """A Plan for an explicit path; the FLOPs are counted with pairwise_flops."""
    eqs = _equations(inputs, output, path)
    flops = 0
    for eq in eqs:
        lhs, out = eq.split("->")
        a, b = lhs.split(",")
        flops += pairwise_flops(a, b, out, sizes)
    final = eqs[-1].split("->")[1] if eqs else inputs[0]
    if final != output:  # the last step's natural index order may differ from the requested output
        eqs = eqs[:-1] + (eqs[-1].split("->")[0] + "->" + output,)
    return Plan(tuple(inputs), output, tuple(sorted(sizes.items())), tuple(tuple(p) for p in path), eqs, flops)


@lru_cache(maxsize=4096)
def plan_tt_linear(spec: TTSpec, rows: int) -> Plan:
    """The forward plan of a TT linear map applied to `rows` rows: the FLOP-optimal pairwise order
    (opt_einsum's dynamic programming over connected subsets), computed once per (spec, rows)."""
    inputs, output, sizes = tt_linear_network(spec, max(int(rows), 1))
    shapes = [tuple(sizes[c] for c in idx) for idx in inputs]
    eq = ",".join(inputs) + "->" + output
    path, _ = opt_einsum.contract_path(eq, *shapes, shapes=True, optimize="dp")
    return make_plan(inputs, output, sizes, path)


def execute(plan: Plan, operands: list[torch.Tensor]) -> torch.Tensor:
    """Run a plan's pairwise contractions on the operands (given in the plan's input order)."""
    ops = list(operands)
    for (i, j), eq in zip(plan.path, plan.equations):
        a, b = ops[i], ops[j]
        for k in sorted((i, j), reverse=True):
            ops.pop(k)
        ops.append(torch.einsum(eq, a, b))
    return ops[0]
