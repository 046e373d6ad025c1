"""Which rank slices are active and how many are allocated: the masks (one boolean per gate entry), the
active ranks and size that follow from them, the slices' importance, and the decisions that switch slices
off.  The one owner of the masks: everything else reads them here."""

from __future__ import annotations

import bisect
import itertools
import math
from typing import Any, Sequence

import torch

__all__ = ["Allocation", "gates_of"]


def gates_of(layer: Any) -> list[torch.Tensor]:
    """A TT layer's gates, in bond order, as a list (read once per step per layer: iterating the
    ParameterList looks each one up by its string index, a few microseconds a gate)."""
    return list(layer.gates._parameters.values())


def _segments(tensors: list[torch.Tensor]) -> list[tuple[list[int], list[int]]]:
    """The tensors grouped by device, each group's indices with the offset each starts at once flattened
    and concatenated: the whole model's gates or masks read in a few operations, not a few per gate."""
    groups: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, []).append(i)
    return [(members, [0, *itertools.accumulate(tensors[i].numel() for i in members)][:-1])
            for members in groups.values()]


def _counts(tensors: list[torch.Tensor]) -> list[int]:
    """Each tensor's count of nonzero (True) entries, one transfer to the host per device."""
    out = [0] * len(tensors)
    for members, offsets in _segments(tensors):
        flat = torch.cat([tensors[i].reshape(-1) for i in members]).to(torch.long)
        ends = torch.cat([flat.new_zeros(1), flat.cumsum(0)])
        sums = ends[torch.tensor([*offsets[1:], flat.numel()], device=flat.device)].tolist()
        for i, start, end in zip(members, ends[torch.tensor(offsets, device=flat.device)].tolist(), sums):
            out[i] = end - start
    return out


class Allocation:
    """Masks, active ranks and sizes of a model's TT layers.  ``size`` is S(g), the TT parameters of the
    active slices; ``size_t`` the same as a 0-d tensor (read by compiled code without a graph break)."""

    def __init__(self, layers: dict[str, Any], device: torch.device) -> None:
        self.layers = layers
        self.masks = {name: [torch.ones(g.shape, dtype=torch.bool, device=device) for g in m.gates]
                      for name, m in layers.items()}
        self.importance: dict[str, list[torch.Tensor]] = {}   # each slice's share of its layer's weight
        self.size_t = torch.zeros((), dtype=torch.float64, device=device)
        self.update()

    def stale(self) -> str | None:
        """The first layer whose gates are no longer the masks' size (the model's ranks changed under them, as
        loading a checkpoint of other ranks does), else None."""
        return next((name for name, m in self.layers.items()
                     if any(k.shape != g.shape for k, g in zip(self.masks[name], gates_of(m)))), None)

    def update(self) -> None:
        """Refresh what follows from the masks (size, ranks, the masked bonds) after they change."""
        counts = iter(_counts([m for name in self.layers for m in self.masks[name]]))
        self.ranks = {name: (1, *(next(counts) for _ in self.masks[name]), 1) for name in self.layers}
        self.masked = [(name, k) for name in self.layers for k, m in enumerate(self.masks[name])
                       if self.ranks[name][k + 1] < m.numel()]
        self.size = sum(self.core_params_at(name, r) for name, r in self.ranks.items())
        self.size_t.fill_(float(self.size))

    def core_params_at(self, name: str, ranks: Sequence[int]) -> int:
        """TT core parameters of layer `name` at the given ranks."""
        shapes = self.layers[name].spec.core_shapes
        return sum(math.prod(shape[1:-1]) * ranks[k] * ranks[k + 1] for k, shape in enumerate(shapes))

    def allocation(self, share: bool) -> dict[str, tuple[int, ...]]:
        """The ranks a cut allocates each layer at: its active ranks, or when sharing the largest active ranks
        among the layers of its shape (bond by bond), so that equal shapes stay equal."""
        if not share:
            return dict(self.ranks)
        groups: dict[tuple, list[str]] = {}
        for name, layer in self.layers.items():
            s = layer.spec
            groups.setdefault((type(layer), s.kind, s.in_features, s.out_features, s.in_modes, s.out_modes),
                              []).append(name)
        out = {}
        for names in groups.values():
            ranks = tuple(max(rs) for rs in zip(*(self.ranks[n] for n in names)))
            out.update((n, ranks) for n in names)
        return out

    def reallocation_due(self, realloc_at: float | None, share: bool) -> bool:
        """The allocated TT parameters reached realloc_at times what a cut would allocate."""
        if realloc_at is None:
            return False
        allocated = sum(m.spec.core_params() for m in self.layers.values())
        needed = sum(self.core_params_at(name, r) for name, r in self.allocation(share).items())
        return allocated >= realloc_at * max(needed, 1)

    @torch.no_grad()
    def switch(self, name: str, k: int, j: int) -> None:
        """Switch off slice j of bond k of a layer (its gate zeroed), keeping ranks and size current; a bond's
        last active slice stays (a rank-0 bond would remove the layer)."""
        m = self.masks[name][k]
        if not m[j] or self.ranks[name][k + 1] <= 1:
            return
        m[j] = False
        self.layers[name].gates[k][j] = 0.0
        shapes = self.layers[name].spec.core_shapes
        r = self.ranks[name]
        self.size -= math.prod(shapes[k][1:-1]) * r[k] + math.prod(shapes[k + 1][1:-1]) * r[k + 2]
        self.ranks[name] = (*r[:k + 1], r[k + 1] - 1, *r[k + 2:])

    @torch.no_grad()
    def switch_off(self, tau: float, floor: float | None = None) -> None:
        """Mask the active gates under tau, weakest first; with a `floor`, only while the size is above it."""
        where = [(name, k) for name, layer in self.layers.items() for k in range(len(layer.gates))]
        gates = [g.detach() for layer in self.layers.values() for g in gates_of(layer)]
        masks = [m for name in self.layers for m in self.masks[name]]
        off = []
        for members, offsets in _segments(gates):
            size = torch.cat([gates[i].reshape(-1) for i in members]).abs()
            live = torch.cat([masks[i].reshape(-1) for i in members])
            hits = torch.nonzero(live & (size < tau)).flatten()
            for at, value in zip(hits.tolist(), size[hits].tolist()):
                seg = bisect.bisect_right(offsets, at) - 1
                off.append((value, *where[members[seg]], at - offsets[seg]))
        for _, name, k, j in sorted(off):
            if floor is not None and self.size <= floor:
                break
            self.switch(name, k, j)
        self.update()

    @torch.no_grad()
    def prune_toward(self, target: float) -> None:
        """Switch off the least important active slices (smallest share of their layer's weight, never a
        bond's last) until the size has closed a quarter of its gap to `target`."""
        if self.size <= target:
            return
        goal = self.size - max(1.0, 0.25 * (self.size - target))
        candidates = []
        for name in self.layers:
            for k, (imp, m) in enumerate(zip(self.importance.get(name, []), self.masks[name])):
                if int(m.sum()) <= 1:
                    continue
                order = [j for j in imp.argsort().tolist() if m[j]]
                candidates += [(float(imp[j]), name, k, j) for j in order[:-1]]
        for _, name, k, j in sorted(candidates):
            if self.size <= goal:
                break
            self.switch(name, k, j)
        self.update()

    def keep(self, name: str, keep: Sequence[torch.Tensor | None]) -> None:
        """A cut kept slices keep[k] of each bond k (None: all): the masks and importance follow."""
        self.masks[name] = [m[k] if k is not None else m for m, k in zip(self.masks[name], keep)]
        if name in self.importance:
            self.importance[name] = [v[k] if k is not None else v for v, k in zip(self.importance[name], keep)]

    def load(self, masks: dict[str, list[torch.Tensor]], devices: dict[str, list[torch.device]]) -> None:
        """Take saved masks (checked against the layers' allocated ranks); the importance is recomputed at
        the next balance."""
        missing = set(self.layers) ^ set(masks)
        if missing:
            raise ValueError(f"the checkpoint's TT layers differ from the model's: {sorted(missing)}")
        for n, ms in masks.items():
            have = tuple(g.numel() for g in self.layers[n].gates)
            if tuple(m.numel() for m in ms) != have:
                raise ValueError(
                    f"the RankAdaptive state was saved with {n} allocated at bond ranks "
                    f"{tuple(m.numel() for m in ms)}, the model has {have}: load the model's checkpoint first "
                    f"(comera_compile.load_checkpoint re-allocates the layers, then loads this state)")
        self.masks = {n: [m.clone().to(devices[n][k]) for k, m in enumerate(ms)] for n, ms in masks.items()}
        self.importance = {}
        self.update()
