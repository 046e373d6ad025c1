"""The rank penalty on the gates, as pure functions of gates, masks and learning rates: its value (the mean
over active entries, l1 or mcp) and the proximal step that applies it after each optimizer step.  Both work
on every gate of the model at once, concatenated into one vector: a few kernels per step whatever the number
of layers (a 12-layer decoder has over a hundred gates)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["KINDS", "penalty", "flat_penalty", "proximal_step"]

KINDS = ("mcp", "l1")


def penalty(gates: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], kind: str, pull_below: float,
            mean: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The penalty of every active gate entry, |g| for l1, m - m**2 / (2 a) for mcp (m = min(|g|, a),
    a = pull_below: its derivative is the proximal step's pull), summed with the count of active entries and
    handed to ``mean`` (which may reduce across processes).  Tensor ops only: no graph break when compiled;
    differentiable in the gates."""
    return flat_penalty(torch.cat(list(gates)), torch.cat(list(masks)), kind, pull_below, mean)   # vectors


def flat_penalty(gates: torch.Tensor, masks: torch.Tensor, kind: str, pull_below: float,
                 mean: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``penalty`` of the gates and masks concatenated into one vector each."""
    a = gates.abs()
    if kind == "mcp":
        a = a.clamp_max(pull_below)
        a = a - a * a / (2 * pull_below)
    m = masks.to(a.dtype)
    return mean((a * m).sum(), m.sum())


@torch.no_grad()
def proximal_step(gates: list[torch.Tensor], masks: list[torch.Tensor], steps: list[float] | None, kind: str,
                  pull_below: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Shrink every gate toward zero by its step (gamma x its learning rate) times the penalty's pull, clamped
    at zero (a soft threshold; mcp's pull is 1 - |g| / pull_below, none above pull_below); `steps` None
    shrinks nothing.  Then zero the masked entries, and write the gates back in place.  Works on the gates
    concatenated (16-bit ones in float32, rounded once at the end); returns them and the masks so
    concatenated, for flat_penalty."""
    if not gates:
        return torch.zeros(0), torch.zeros(0, dtype=torch.bool)
    flat = torch.cat(gates)   # gates and masks are vectors
    flat = flat.to(torch.promote_types(flat.dtype, torch.float32))
    mask = torch.cat(masks)
    if steps is not None:
        step = torch.tensor(steps, dtype=flat.dtype).to(flat.device, non_blocking=True)
        step = step.repeat_interleave(torch.tensor([g.numel() for g in gates]).to(flat.device, non_blocking=True),
                                      output_size=flat.numel())
        magnitude = flat.abs()
        if kind == "mcp":
            pull = (magnitude / -pull_below).add_(1.0).clamp_min_(0.0).mul_(step)
            magnitude.sub_(pull)
        else:
            magnitude.sub_(step)
        flat = magnitude.clamp_min_(0.0).mul_(flat.sign())
    flat.mul_(mask)   # a new tensor (cat's), never the gates' own memory
    torch._foreach_copy_(gates, list(flat.split([g.numel() for g in gates])))
    return flat, mask
