"""Distributed checkpoints of a tensorized model whose ranks were cut (``torch.distributed.checkpoint``):
saved at one world size, loaded at any other, the layers re-allocated at the checkpoint's ranks first."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..layers import tt_layers
from ..optim_state import replace_pruned, retire
from .fsdp import unsharded
from .replicas import replica_mean

__all__ = ["save_checkpoint", "load_checkpoint", "checkpoint_ranks", "resize_ranks", "state_dict_layers"]

_MODEL, _OPTIM, _RA = "model", "optimizer", "rank_adaptive"


def save_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    ra: Any = None) -> None:
    """Save a training checkpoint with ``torch.distributed.checkpoint`` (one file per process; any number
    of processes, or one without a process group): the model and optimizer state as torch's
    ``get_state_dict`` gives them (FSDP2 shards saved as shards), and ``RankAdaptive``'s state.  Call it on
    every process (of ``ra.process_group`` where it has one: a group of one saves its process's own model).
    ``load_checkpoint`` restores it at any world size, cut ranks included."""
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {_MODEL: model_sd, _OPTIM: optim_sd}
    else:
        state = {_MODEL: get_model_state_dict(model)}
    if ra is not None:  # kept whole (its masks have the checkpoint's shapes, which the loader reads first)
        # One copy is kept for all processes: the one every process holds once the loss average is the
        # processes' mean (the late stage's decisions are taken on it).
        ra._loss_ema = replica_mean(ra._loss_ema, ra._penalty_t.device, ra.process_group)
        buf = io.BytesIO()
        torch.save(ra.state_dict(), buf)
        state[_RA] = buf.getvalue()
    dcp.save(state, checkpoint_id=path, process_group=getattr(ra, "process_group", None))


_WRAPPERS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def state_dict_layers(model: nn.Module) -> dict[str, Any]:
    """`model`'s TT layers by the names torch's get_model_state_dict gives their parameters: a wrapper's own
    name (DistributedDataParallel's ``module``, torch.compile's ``_orig_mod``, activation checkpointing's)
    left out, so a checkpoint saved through a wrapper loads into the bare model and back (RankAdaptive names
    its layers so too)."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    out = {}
    for name, layer in tt_layers(model).items():
        parts, parent = [], model
        for part in name.split(".") if name else []:
            wrapper = part in _WRAPPERS or (part == "module" and isinstance(parent, (DistributedDataParallel,
                                                                                     DataParallel)))
            parent = parent.get_submodule(part)
            if not wrapper:
                parts.append(part)
        out[".".join(parts)] = layer
    return out


def checkpoint_ranks(path: str, model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The TT ranks each of `model`'s TT layers has in the checkpoint at `path` (read from the shapes the
    checkpoint records for its cores)."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    out = {}
    for name, layer in state_dict_layers(model).items():
        shapes = []
        for k in range(len(layer.cores)):
            key = f"{_MODEL}.{name}.cores.{k}"
            if key not in meta:
                raise ValueError(f"the checkpoint at {path} has no {key}: it was saved from another model "
                                 f"(its TT layers differ from this model's)")
            shapes.append(tuple(meta[key].size))
        out[name] = (*(s[0] for s in shapes), shapes[-1][-1])
    return out


@torch.no_grad()
def resize_ranks(model: nn.Module, ranks: dict[str, tuple[int, ...]],
                 optimizer: torch.optim.Optimizer | None = None) -> None:
    """Allocate each named TT layer at the given ranks (no larger than it has now) by keeping its leading
    rank slices, FSDP2-sharded or not; the optimizer, if given, holds the new Parameters (its state cut
    alike) and the old ones are retired.  A model about to load a checkpoint taken after cuts needs its shapes
    first; the values come from the checkpoint.  Layers are named as in torch's get_model_state_dict (without
    the names of DDP's and torch.compile's wrappers)."""
    layers = state_dict_layers(model)
    retired: list[torch.Tensor] = []
    for name, r in ranks.items():
        have = layers[name].spec.ranks
        if len(r) != len(have) or any(a > b for a, b in zip(r, have)):
            raise ValueError(f"{name} has ranks {have} and the checkpoint {tuple(r)}: a layer cannot grow to load "
                             f"it; build the model at ranks at least the checkpoint's (e.g. tensorize(..., "
                             f"rank={max(r)}))")
    with unsharded(model, layers, optimizer):
        for name, r in ranks.items():
            layer = layers[name]
            keep = [None if n == layer.gates[k].numel() else torch.arange(n) for k, n in enumerate(r[1:-1])]
            if all(k is None for k in keep):
                continue
            retired += replace_pruned(optimizer, layer.prune_ranks(keep))   # state the optimizer has, cut alike
    retire(retired)   # another optimizer still holding one raises at its step instead of training it


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    ra: Any = None) -> None:
    """Restore what ``save_checkpoint`` saved, at any world size (call it on every process, after
    ``fully_shard`` and with a fresh optimizer built on the model's parameters).  TT layers are first
    re-allocated at the checkpoint's ranks (a model built at larger ranks is cut to them; one at smaller
    ranks is an error), then the model, optimizer and ``RankAdaptive`` state are loaded in place; where that
    cut the layers, ``ra``'s ``on_reallocate`` callbacks run, as after a re-allocation in training."""
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                         set_state_dict)

    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    group = getattr(ra, "process_group", None)   # a RankAdaptive of its own group: that group's checkpoint
    if optimizer is not None and not any(k.startswith(f"{_OPTIM}.") for k in saved):
        raise ValueError(f"the checkpoint at {path} holds no optimizer state (saved without the optimizer): "
                         f"load it without one, and RankAdaptive's optimizer, if it has one, takes the cut cores")
    ra_state = None
    if ra is not None:   # read and checked before anything is cut: a failed load leaves the model as it was
        if _RA not in saved:
            raise ValueError(f"the checkpoint at {path} holds no RankAdaptive state (saved without ra=)")
        ra_state = {_RA: b""}
        dcp.load(ra_state, checkpoint_id=path, process_group=group)
        ra_state = torch.load(io.BytesIO(ra_state[_RA]), weights_only=True)
        if set(ra_state["masks"]) != set(ra.layers):
            raise ValueError(f"the checkpoint's RankAdaptive state adapts TT layers "
                             f"{sorted(set(ra_state['masks']) ^ set(ra.layers))[:6]} that this RankAdaptive "
                             f"does not, or the other way round: build it on the same model as the saved one")
    before = {name: layer.spec.ranks for name, layer in state_dict_layers(model).items()}
    # cut cores go into the optimizer given, else into the one RankAdaptive steps (a stale one would train
    # the old cores)
    resize_ranks(model, checkpoint_ranks(path, model), optimizer if optimizer is not None else
                 getattr(ra, "optimizer", None))
    resized = any(layer.spec.ranks != before[name] for name, layer in state_dict_layers(model).items())
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {_MODEL: model_sd, _OPTIM: optim_sd}
    else:
        state = {_MODEL: get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path, process_group=group)
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state[_MODEL], optim_state_dict=state[_OPTIM])
    else:
        set_model_state_dict(model, state[_MODEL])
    if ra is not None:
        ra.load_state_dict(ra_state)
        if resized:   # new, smaller Parameters: what ra.on_reallocate(...) rebuilds (a DDP wrapper) is stale
            ra._reallocated()
