"""The rank penalty on the gates, as pure functions of gates, masks and learning rates: its value (the mean
over active entries, l1 or mcp) and the proximal step that applies it after each optimizer step."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["KINDS", "penalty", "proximal_step"]

KINDS = ("mcp", "l1")


def penalty(gates: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], kind: str, pull_below: float,
            mean: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The penalty of every active gate entry, |g| for l1, m - m**2 / (2 a) for mcp (m = min(|g|, a),
    a = pull_below: its derivative is the proximal step's pull), summed with the count of active entries and
    handed to ``mean`` (which may reduce across processes).  Tensor ops only: no graph break when compiled."""
    total, active = None, None
    for g, m in zip(gates, masks):
        a = g.abs()
        if kind == "mcp":
            a = a.clamp_max(pull_below)
            a = a - a * a / (2 * pull_below)
        term, n = (a * m).sum(), m.sum()
        total = term if total is None else total + term
        active = n if active is None else active + n
    return mean(total, active)


@torch.no_grad()
def proximal_step(gates: list[torch.Tensor], steps: list[float], kind: str, pull_below: float) -> None:
    """Shrink every gate toward zero by its step (gamma x its learning rate) times the penalty's pull, clamped
    at zero (a soft threshold; mcp's pull is 1 - |g| / pull_below, none above pull_below), as multi-tensor
    ops in place."""
    magnitude = torch._foreach_abs(gates)
    if kind == "mcp":
        pull = torch._foreach_div(magnitude, -pull_below)
        torch._foreach_add_(pull, 1.0)
        torch._foreach_clamp_min_(pull, 0.0)
        torch._foreach_mul_(pull, steps)
        torch._foreach_sub_(magnitude, pull)
    else:
        torch._foreach_sub_(magnitude, steps)
    torch._foreach_clamp_min_(magnitude, 0.0)
    torch._foreach_mul_(magnitude, torch._foreach_sign(gates))
    torch._foreach_copy_(gates, magnitude)
