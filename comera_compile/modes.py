"""How a layer's sizes are split into TT modes: the most balanced split of a size, and when to pad a size up to
one that splits better (docs/method.md, "Modes and ranks")."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Iterable, Sequence

__all__ = ["balanced_factors", "choose_modes"]

# A size is split as it is when its most balanced split's largest factor is at most _EXACT_LIMIT times its d-th
# root (every power of two is); otherwise it is padded up to the first size whose split is within _BALANCE_LIMIT.
# Padding costs more than imbalance: a padded 1024 (13x10x8 of 1040) trains 1.24x slower than 16x8x8
# (docs/method.md, "Modes and ranks").
_EXACT_LIMIT = 2.0
_BALANCE_LIMIT = 1.5


@lru_cache(maxsize=4096)
def _factorizations(n: int, d: int, max_factor: int) -> tuple[tuple[int, ...], ...]:
    """All ways to write n as a product of d factors, non-increasing, each at most max_factor."""
    if d == 1:
        return ((n,),) if n <= max_factor else ()
    return tuple((f,) + rest for f in range(min(n, max_factor), 0, -1) if n % f == 0
                 for rest in _factorizations(n // f, d - 1, f))


def _balance_key(factors: Sequence[int]) -> tuple[int, float]:
    logs = [math.log(f) for f in factors]
    mean = sum(logs) / len(logs)
    return (max(factors), sum((x - mean) ** 2 for x in logs))


def _largest_factors(n: int, d: int, cap: int) -> Iterable[int]:
    """The divisors of n that can be the largest of d factors (at least its d-th root) up to cap, increasing:
    over that range, or by trial division up to sqrt(n) when the range is longer."""
    low = max(1, int(n ** (1.0 / d)) - 1)   # one below, for rounding; the caller skips f ** d < n
    if cap - low <= 2 * math.isqrt(n):
        return (f for f in range(low, cap + 1) if n % f == 0)
    small = [f for f in range(1, math.isqrt(n) + 1) if n % f == 0]
    return (f for f in sorted(set(small + [n // f for f in small])) if low <= f <= cap)


@lru_cache(maxsize=4096)
def _split(n: int, d: int, cap: int) -> tuple[int, ...] | None:
    """The most balanced split of n into d non-increasing factors each at most cap (the smallest largest
    factor, then the smallest log-variance), or None when there is none."""
    if d == 1:
        return (n,) if n <= cap else None
    for f in _largest_factors(n, d, min(n, cap)):
        if f ** d < n:
            continue
        rests = _factorizations(n // f, d - 1, f)
        if rests:   # the smallest largest factor: the first f that completes
            return min(((f,) + rest for rest in rests), key=_balance_key)
    return None


def balanced_factors(n: int, d: int) -> tuple[int, ...]:
    """The most balanced split of n into d factors (smallest largest factor, then smallest log-variance),
    in non-increasing order.  Factors of 1 are allowed."""
    if n < 1 or d < 1:
        raise ValueError(f"balanced_factors needs n >= 1 and d >= 1, got n={n}, d={d}")
    return _split(n, d, n)


@lru_cache(maxsize=1024)
def choose_modes(n: int, d: int) -> tuple[int, ...]:
    """Split a dimension n into d modes: its own most balanced split when that is balanced enough (largest
    factor at most twice the d-th root: every power of two), else n padded up to the first size with a
    well-balanced split (a prime such as 30522 = 2 * 3 * 5087 is padded to a nearby size with small factors).

    Returns the modes in non-increasing order; their product is the padded size (>= n)."""
    if n < 1:
        raise ValueError(f"cannot factor a dimension of size {n}")
    if d == 1:
        return (n,)
    exact = balanced_factors(n, d)
    if max(exact) <= _EXACT_LIMIT * n ** (1.0 / d):
        return exact
    for candidate in range(n + 1, 2 * n + 9):
        found = _split(candidate, d, math.floor(_BALANCE_LIMIT * candidate ** (1.0 / d)))
        if found is not None:
            return found
    # small sizes with no balanced split nearby: the best-balanced of them all
    return min((balanced_factors(m, d) for m in range(n, 2 * n + 9)),
               key=lambda modes: max(modes) / math.prod(modes) ** (1.0 / d))
