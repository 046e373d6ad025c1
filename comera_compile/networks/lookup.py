"""The TTM embedding lookup planner: which cores to merge before a lookup, and how.

A batch of TTM lookups gathers one slice per core and row and contracts them.  Merging a pair of cores
first (into a table over all its digit pairs, or only for the batch's distinct digit pairs) trades a
bigger gather for fewer row-wise products; which pays depends on the batch.  The planner costs every
choice by the same cost model as the contraction search and returns the cheapest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple, Sequence

from ..tt import TTSpec, constant_under_compile
from .cost import TRAFFIC_WEIGHT
from .network import ttm_embedding_network
from .order import search
from .plan import Plan, Program

__all__ = ["LOOKUP_HOWS", "Group", "LookupPlan", "plan_ttm_lookup", "lookup_bucket", "ttm_lookup_program"]

LOOKUP_HOWS = ("rows", "table", "dedupe")


class Group(NamedTuple):
    """Cores first..stop-1 (one or two), turned into one tensor per looked-up row as `how` says."""

    first: int
    stop: int
    how: str


@dataclass(frozen=True)
class LookupPlan:
    """How a batch of TTM lookups runs: the cores split into consecutive groups of one or two, each group
    turned into one tensor per looked-up row, then one batched contraction over the groups.

    groups: a Group per group; how is "rows" (gather the core slices of every row; a pair is multiplied row
    by row), "table" (a pair merged into one table over all its v_a * v_b digit pairs, then gathered) or
    "dedupe" (a pair multiplied only for the distinct digit pairs of the batch, then gathered).  program:
    run_program's contraction of the group tensors (empty for one group).  cost: the planner's training
    cost (FLOPs plus TRAFFIC_WEIGHT per element moved)."""

    spec: TTSpec
    rows: int
    groups: tuple[Group, ...]
    program: Program
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


def _group_spec(spec: TTSpec, groups: Sequence[tuple[int, int]]) -> TTSpec:
    """The TTM spec of the group tensors: one core per group, its row and column modes the products."""
    v = tuple(math.prod(spec.in_modes[a:b]) for a, b in groups)
    e = tuple(math.prod(spec.out_modes[a:b]) for a, b in groups)
    ranks = tuple(spec.ranks[a] for a, _ in groups) + (1,)
    return TTSpec("ttm", spec.in_features, spec.out_features, v, e, ranks, ranks)


def _chain(spec: TTSpec, groups: Sequence[tuple[int, int]], rows: int, training: bool) -> Plan:
    """The searched plan of the batched contraction over the group tensors."""
    return search(ttm_embedding_network(_group_spec(spec, groups), rows), training)


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
                    labelled.append(Group(a, b, "rows"))
                    slice_ = r * spec.out_modes[a] * t
                    cost += w * (rows * slice_ * copy_mult + (math.prod(spec.core_shapes[a]) if training else 0))
                    continue
                how = how_of[k]
                labelled.append(Group(a, b, how))
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
                chain = _chain(spec, groups, rows, training)
                program = chain.program
                cost += chain.cost(training)
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


@constant_under_compile
def ttm_lookup_program(spec: TTSpec | tuple | str, rows: int, training: bool = True, dedupe: bool = True
                       ) -> tuple[tuple[Group, ...], Program]:
    """(groups, program) of plan_ttm_lookup, as a constant under torch.compile (spec may be a
    TTSpec.key() or its token)."""
    plan = plan_ttm_lookup(TTSpec.of(spec), lookup_bucket(rows), training, dedupe)
    return plan.groups, plan.program
