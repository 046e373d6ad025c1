"""Cutting switched-off rank slices out of the cores for real: new, smaller Parameters (the layer's
``prune_ranks``), the optimizer's state cut alike, the old Parameters retired."""

from __future__ import annotations

import torch

from ..optim_state import replace_pruned, retire
from .allocation import Allocation

__all__ = ["cut"]


@torch.no_grad()
def cut(allocation: Allocation, optimizer: torch.optim.Optimizer | None, share: bool) -> int:
    """Re-allocate every layer at ``allocation.allocation(share)``: its active slices, and when sharing as many
    switched-off ones (zero gates, still masked) as keep layers of equal shape at equal ranks.  Returns the
    number of TT parameters removed."""
    layers = allocation.layers
    before = sum(m.tt_params() for m in layers.values())
    ranks = allocation.allocation(share)
    retired: list[torch.Tensor] = []
    for name, layer in layers.items():
        keep = []
        for k, (g, m) in enumerate(zip(layer.gates, allocation.masks[name])):
            idx = torch.nonzero(m).flatten()
            if idx.numel() == 0:
                idx = g.abs().argmax().reshape(1)
            extra = ranks[name][k + 1] - idx.numel()
            if extra > 0:  # switched-off slices kept (zero gates, masked) so equal shapes stay equal
                idx = torch.cat([idx, torch.nonzero(~m).flatten()[:extra]]).sort().values
            keep.append(None if idx.numel() == g.numel() else idx)
        retired += replace_pruned(optimizer, layer.prune_ranks(keep))
        allocation.keep(name, keep)
    retire(retired)
    allocation.update()
    return before - sum(m.tt_params() for m in layers.values())
