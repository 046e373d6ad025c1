"""The divergence check before each rounding: NaN or inf in a TT parameter, or a layer's weight grown more
than DIVERGED_GROWTH-fold since the last check, is named as diverged training rather than trained on (or
left to fail deep inside an eigensolver, or to look like replicas that disagree)."""

from __future__ import annotations

from typing import Any

import torch

from ..gauge import frobenius_norm

__all__ = ["DIVERGED_GROWTH", "check_finite"]

# A layer whose weight's norm grows by more than this between two cut checks has diverged.
DIVERGED_GROWTH = 1e3

_ADVICE = ("Lower the learning rate (param_groups(model, lr=...) sets cores at 2x and gates at 20x it) or clip "
           "gradients")


def check_finite(layers: dict[str, Any], norms: dict[str, tuple[int, float]], step: int) -> None:
    """Raise FloatingPointError on a diverged layer; record each layer's weight norm at `step` in `norms`."""
    bad = [f"{name}.{pname}" for name, layer in layers.items() for pname, p in layer.named_parameters()
           if not bool(torch.isfinite(p).all())]
    if bad:
        raise FloatingPointError(
            f"RankAdaptive at step {step}: {len(bad)} TT parameter(s) hold NaN or inf ({bad[0]}, ...): "
            f"training diverged.  {_ADVICE}")
    for name, layer in layers.items():
        norm = frobenius_norm(layer)
        at, before = norms.get(name, (step, norm))
        if before > 0 and norm > DIVERGED_GROWTH * before:
            raise FloatingPointError(
                f"RankAdaptive at step {step}: the weight of TT layer {name or '(the model)'} grew "
                f"{norm / before:.3g}-fold since step {at} (Frobenius norm {before:.3g} -> {norm:.3g}): "
                f"training diverged.  {_ADVICE}")
        norms[name] = (step, norm)
