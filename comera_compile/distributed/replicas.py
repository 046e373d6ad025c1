"""Replicas under torch.distributed (DDP, or FSDP2's whole-tensor work): every process must make RankAdaptive's
decisions on the same numbers, so rank 0's TT parameters and masks are taken everywhere before a cut, and the
late stage weighs the loss averaged over the processes (replica_mean), not each process's own."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .fsdp import is_sharded

__all__ = ["distributed", "synchronize", "agree_on_masks", "replica_mean"]


def distributed(group: Any = None) -> bool:
    """More than one process in `group` (default: the default process group), initialized."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _first(group: Any) -> int:
    """The global rank of `group`'s first process, whose decisions the others take."""
    import torch.distributed as dist

    return 0 if group is None else dist.get_global_rank(group, 0)


def _flat_masks(masks: dict[str, list[torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([m.to(dtype) for ms in masks.values() for m in ms])


def _copy_masks(masks: dict[str, list[torch.Tensor]], flat: torch.Tensor, threshold: float) -> None:
    offset = 0
    for ms in masks.values():
        for m in ms:
            m.copy_(flat[offset:offset + m.numel()] > threshold)
            offset += m.numel()


def replica_mean(value: float | None, device: torch.device, group: Any = None) -> float | None:
    """The mean of `value` over the processes that have one (every process calls it; None where none has).
    RankAdaptive's loss average is linear in the losses, so the mean of the processes' averages is the average
    of the global losses: the late stage decides on the whole batch's loss, the same on every process."""
    if not distributed(group):
        return value
    import torch.distributed as dist

    t = torch.tensor([0.0 if value is None else value, float(value is not None)], dtype=torch.float64,
                     device=device)
    dist.all_reduce(t, group=group)
    return float(t[0] / t[1]) if t[1] > 0 else None


@torch.no_grad()
def agree_on_masks(layers: dict[str, Any], masks: dict[str, list[torch.Tensor]], group: Any = None) -> bool:
    """Every process takes rank 0's masks (its decision of what to switch off) and gates, the gates they
    switch off zeroed: a process whose own decision differed (it pruned a slice rank 0 kept) holds rank 0's
    model again.  Returns whether anything was exchanged (several processes)."""
    if not distributed(group):
        return False
    import torch.distributed as dist

    flat = _flat_masks(masks, torch.uint8)
    dist.broadcast(flat, _first(group), group=group)
    _copy_masks(masks, flat, 0)
    gates = [g for name in masks for g in layers[name].gates]
    values = torch.cat([g.detach().reshape(-1) for g in gates])
    dist.broadcast(values, _first(group), group=group)
    offset = 0
    for name, ms in masks.items():
        for k, m in enumerate(ms):
            g = layers[name].gates[k]
            g.copy_(values[offset:offset + g.numel()].reshape(g.shape) * m.to(g.dtype))
            offset += g.numel()
    return True


@torch.no_grad()
def synchronize(model: nn.Module, layers: dict[str, Any], masks: dict[str, list[torch.Tensor]],
                group: Any = None) -> bool:
    """Check that the replicas still hold the same model (the parameters each process holds whole; FSDP2's
    shards have one owner each), then take rank 0's TT parameters and masks everywhere.  Returns whether
    anything was exchanged (several processes)."""
    if not distributed(group):
        return False
    import torch.distributed as dist

    params = [p for p in model.parameters() if not is_sharded(p)]
    device = next(iter(model.parameters()), torch.empty(0)).device
    count = torch.tensor([len(params), -len(params)], dtype=torch.float64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)   # one length of fingerprint, or the error below
    same = bool(count[0] == -count[1])
    fp = torch.stack([torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
                      for p in params]).flatten() if params and same else torch.zeros(2, dtype=torch.float64,
                                                                                    device=device)
    hi, lo = fp.clone(), -fp
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MAX, group=group)
    if not same or not torch.allclose(hi, -lo, rtol=1e-6, atol=1e-9):
        raise RuntimeError(
            "RankAdaptive: the data-parallel replicas hold different parameters.  After a re-allocation the "
            "cores are new Parameters: rebuild the wrapper (ddp = DistributedDataParallel(model, ...)) before "
            "the next forward (in ra.on_reallocate(...), or when ra.step() returns True), or pass "
            "realloc_at=None to keep the allocation until the end.  Processes that each train a model of their "
            "own are not replicas: give RankAdaptive(..., process_group=torch.distributed.new_subgroups(1)[0])")
    tensors = [p for layer in layers.values() for p in (*layer.cores, *layer.gates)]
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    flat_masks = _flat_masks(masks, flat.dtype)
    dist.broadcast(flat, _first(group), group=group)
    dist.broadcast(flat_masks, _first(group), group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].reshape(t.shape))
        offset += t.numel()
    _copy_masks(masks, flat_masks, 0.5)
    return True
