"""The divergence check before each rounding: NaN or inf in a TT parameter, or a layer's weight grown more
than DIVERGED_GROWTH-fold since the last check, is named as diverged training rather than trained on (or
left to fail deep inside an eigensolver, or to look like replicas that disagree)."""

from __future__ import annotations

from typing import Any

import torch

from ..distributed.fsdp import is_sharded
from ..gauge import frobenius_norms

__all__ = ["DIVERGED_GROWTH", "check_finite"]

# A layer whose weight's norm grows by more than this between two cut checks has diverged.
DIVERGED_GROWTH = 1e3

_ADVICE = ("Lower the learning rate (param_groups(model, lr=...) sets cores at 2x and gates at 20x it) or clip "
           "gradients")


def check_finite(layers: dict[str, Any], norms: dict[str, tuple[int, float]], step: int) -> None:
    """Raise FloatingPointError on a diverged layer; record each layer's weight norm at `step` in `norms`.
    A few batched operations for all layers (the parameters' norms, then the weights' norms by shape): it
    runs before every rounding, outside every compiled region."""
    named = [(f"{name}.{pname}", p.detach()) for name, layer in layers.items()
             for pname, p in layer.named_parameters()]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, p in named:
        if not is_sharded(p):   # FSDP2's sharded ones (a bias) each in a check of its own: a collective
            by_device.setdefault(p.device, []).append(p)
    # a NaN or inf makes its tensor's norm one; the few flagged are then looked at entry by entry
    if not all(bool(torch.stack(torch._foreach_norm(ps)).isfinite().all()) for ps in by_device.values() if ps) or \
            not all(bool(torch.isfinite(p).all()) for _, p in named if is_sharded(p)):
        bad = [name for name, p in named if not bool(torch.isfinite(p).all())]
        if bad:
            raise FloatingPointError(
                f"RankAdaptive at step {step}: {len(bad)} TT parameter(s) hold NaN or inf ({bad[0]}, ...): "
                f"training diverged.  {_ADVICE}")
    for name, norm in zip(layers, frobenius_norms(list(layers.values())).tolist()):
        at, before = norms.get(name, (step, norm))
        if before > 0 and norm > DIVERGED_GROWTH * before:
            raise FloatingPointError(
                f"RankAdaptive at step {step}: the weight of TT layer {name or '(the model)'} grew "
                f"{norm / before:.3g}-fold since step {at} (Frobenius norm {before:.3g} -> {norm:.3g}): "
                f"training diverged.  {_ADVICE}")
        norms[name] = (step, norm)
