"""TT linear programs for every row count, as few constants as possible.

The best tree changes with the number of rows.  tt_linear_segments splits all row counts into intervals
with one program each, so a compiled layer picks its program by comparing the (maybe symbolic) row count
with a handful of thresholds instead of recompiling per batch size.
"""

from __future__ import annotations

from functools import lru_cache

from ..tt import TTSpec, constant_under_compile, gemm_spec
from .cost import tree_cost
from .network import tt_linear_network
from .order import plan_tt_linear
from .plan import Program

__all__ = ["tt_linear_program", "tt_linear_segments", "MAX_SEGMENT_ROWS"]

MAX_SEGMENT_ROWS = 1 << 24
MIN_SEGMENT_START = 8
MIN_SEGMENT_WIDTH = 4


@lru_cache(maxsize=4096)
def tt_linear_program(spec: TTSpec, rows: int, training: bool = True, input_requires_grad: bool = True) -> Program:
    """The program of plan_tt_linear at gemm_spec(spec)'s ranks, for run_program on cores padded by
    tt.gemm_core_padding."""
    return plan_tt_linear(gemm_spec(spec), rows, training, input_requires_grad).program


@constant_under_compile
def tt_linear_segments(spec: TTSpec | tuple | str, training: bool = True,
                       input_requires_grad: bool = True) -> tuple[tuple[int, ...], tuple[Program, ...]]:
    """Every row count's best plan, as (thresholds, programs): rows < thresholds[0] use programs[0],
    thresholds[0] <= rows < thresholds[1] programs[1], and so on.

    A fixed tree's cost is affine in the row count, so each tree is optimal on one interval and the
    intervals are found exactly by bisection between sampled row counts.  Under torch.compile this is a
    constant, and comparing the (possibly symbolic) row count with the thresholds picks the program: a
    dynamic batch dimension recompiles only where the best plan changes, never per size.  Like
    tt_linear_program, the programs run at gemm_spec(spec)'s ranks.  spec may be a TTSpec.key() or its token."""
    return _segments(gemm_spec(TTSpec.of(spec)), training, input_requires_grad)


@lru_cache(maxsize=1024)
def _segments(spec: TTSpec, training: bool, input_requires_grad: bool) -> tuple[tuple[int, ...], tuple[Program, ...]]:
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
    # constant, so no threshold lies below MIN_SEGMENT_START (a segment starting lower starts there) and a
    # segment narrower than MIN_SEGMENT_WIDTH from there joins the segment before it.
    kept = [starts[0]]
    for k, start in enumerate(starts[1:], start=1):
        end = starts[k + 1] if k + 1 < len(starts) else MAX_SEGMENT_ROWS
        start = max(start, MIN_SEGMENT_START)
        if end - start >= MIN_SEGMENT_WIDTH and start > kept[-1]:
            kept.append(start)
    first = _least_worst_rows(spec, starts, kept[1], training, input_requires_grad) if len(kept) > 1 else \
        MIN_SEGMENT_START
    at = [first, *kept[1:]]
    programs = tuple(plan_tt_linear(spec, r, training, input_requires_grad).program for r in at)
    return tuple(kept[1:]), programs


def _least_worst_rows(spec: TTSpec, starts: list[int], end: int, training: bool, input_requires_grad: bool) -> int:
    """The row count whose plan the first segment (rows below `end`) runs: of the plans best somewhere from
    MIN_SEGMENT_START up, the one whose cost is least above the best plan's at its worst row count there (its
    rows below 8 cost little whichever plan runs).  A fixed tree's cost is affine in the rows, so against the
    best plan of one range its ratio is monotone: the worst lies at a range's end."""
    inner = [t for t in starts if MIN_SEGMENT_START < t < end]
    if not inner:   # one plan is best from 8 up to the end
        return end - 1
    points = sorted({MIN_SEGMENT_START, end - 1, *inner, *(t - 1 for t in inner)})
    best = {r: plan_tt_linear(spec, r, training, input_requires_grad).cost() for r in points}

    def worst(rows: int) -> float:
        tree = plan_tt_linear(spec, rows, training, input_requires_grad).tree
        return max(tree_cost(tt_linear_network(spec, r, input_requires_grad), tree, training) / best[r]
                   for r in points)

    return min([MIN_SEGMENT_START, *inner], key=lambda rows: (worst(rows), -rows))
