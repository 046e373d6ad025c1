"""Rank-adaptive training (the "RA" of CoMERA): rank gates between TT cores, a two-stage schedule that
trains them toward zero, and rank slices cut out of the cores for real.  One concern per file: the penalty
(penalty.py), the masks and sizes (allocation.py), the cuts (cuts.py), the divergence check
(divergence.py), the reports (reports.py), and RankAdaptive, which runs them (schedule.py)."""

from __future__ import annotations

from .divergence import DIVERGED_GROWTH
from .schedule import BALANCE_EVERY, REBUILD_STEPS, RankAdaptive, _Record, host_state, rank_adaptive_of  # noqa: F401  (_Record: checkpoints)

__all__ = ["RankAdaptive", "BALANCE_EVERY", "REBUILD_STEPS", "DIVERGED_GROWTH", "rank_adaptive_of", "host_state"]
