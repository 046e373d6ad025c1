"""TT layers sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``): what RankAdaptive needs to work on
them, and distributed checkpoints of a tensorized model whose ranks were cut.

Under FSDP2 every parameter of a sharded module is a DTensor sharded on dim 0, TT cores and rank gates
included: they shard like any parameter.  A core is small, so its shards are small (the first core's dim 0
is its boundary rank, 1, so one process holds it whole and the others hold empty shards; a gate of length r
is split r / world ways).  Nothing is replicated on purpose: FSDP2 all-gathers a module's parameters for its
forward and backward, TT cores with the rest, in one collective per module.

RankAdaptive's elementwise work (the proximal step on the gates, the masks) runs on each process's own
shard.  Its whole-layer work (the balanced gauge every few steps; rounding, switching off and cutting every
``cut_every`` steps) runs inside ``unsharded``: the cores, gates and their optimizer state are gathered
into plain full tensors, every process computes on the same values, and on exit each process keeps its
shard of rank 0's result.  A cut makes new, smaller Parameters; on exit they are sharded anew in the FSDP2
parameter group that held the old ones, and the optimizer's state is sharded alike, so training goes on
with no call from the user.  That last step rebuilds FSDP2's per-parameter record (``FSDPParam``) for the
new shape: torch has no public call that re-shards one parameter of a sharded module.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
from torch import nn

__all__ = ["is_sharded", "local", "local_masks", "shard_like", "unsharded", "check_resharding", "save_checkpoint",
           "load_checkpoint", "checkpoint_ranks", "resize_ranks"]


@functools.cache
def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def is_sharded(t: Any) -> bool:
    """True for a DTensor (a parameter FSDP2 sharded, or its optimizer state)."""
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor (the same storage: in-place changes reach the parameter), else t."""
    return t.to_local() if is_sharded(t) else t


def _check_mesh(t: Any) -> None:
    if t.device_mesh.ndim != 1:
        raise NotImplementedError(
            f"RankAdaptive supports FSDP2 on a 1-D device mesh; this TT parameter is sharded on a "
            f"{t.device_mesh.ndim}-D mesh ({t.placements}).  Shard the model with fully_shard(module) or "
            f"fully_shard(module, mesh=init_device_mesh(device, (world_size,)))")


def shard_like(full: torch.Tensor, like: Any) -> torch.Tensor:
    """This process's shard of `full` placed as DTensor `like` is, taken from rank 0's `full` (so every
    process keeps one consistent tensor even if their copies differed in the last bit)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.detach(), like.device_mesh, like.placements).to_local()


def local_masks(masks: list[torch.Tensor], like: list[Any]) -> list[torch.Tensor]:
    """Each full mask cut to the shard of its (sharded) gate."""
    return [shard_like(m.to(torch.uint8), g).bool() if is_sharded(g) else m for m, g in zip(masks, like)]


def _fsdp_param_groups(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    groups = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            found = getattr(state, "_fsdp_param_groups", None)
            if found is None:  # torch 2.11: one group per module
                found = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
            groups += found
    return groups


def check_resharding(model: nn.Module, layers: dict[str, Any]) -> None:
    """Raise a clear error unless every sharded TT parameter of `layers` is held by an FSDP2 parameter group
    of `model` (which is what lets a cut re-shard it)."""
    held = {id(fp.sharded_param) for group in _fsdp_param_groups(model) for fp in group.fsdp_params}
    for name, layer in layers.items():
        for pname, p in layer.named_parameters():
            if is_sharded(p):
                _check_mesh(p)
                if id(p) not in held:
                    raise ValueError(
                        f"{name}.{pname} is a DTensor that no FSDP2 group of the model holds (sharded by something "
                        f"other than fully_shard, or RankAdaptive got a submodule of the sharded model).  Give "
                        f"RankAdaptive the module fully_shard was applied to, or pass realloc_at=None and call "
                        f"cut() only after gathering the model")


def _reshard(model: nn.Module, replaced: dict[int, tuple[Any, nn.Parameter]]) -> dict[int, nn.Parameter]:
    """Shard the new plain Parameters in `replaced` (id of the old DTensor parameter -> (old, new)) in the
    FSDP2 parameter group that held the old one, which registers the new sharded Parameter on the module in
    its place.  Returns id(new plain) -> new sharded Parameter."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    out: dict[int, nn.Parameter] = {}
    for group in _fsdp_param_groups(model):
        changed = False
        for i, fp in enumerate(group.fsdp_params):
            hit = replaced.get(id(fp.sharded_param))
            if hit is None or hit[0] is not fp.sharded_param:
                continue
            _, new = hit
            placement = fp.fsdp_placement
            fn = None if placement.dim == 0 else (lambda p, placement=placement: placement)
            handle = getattr(fp, "_post_load_hook_handle", None)
            if handle is not None:
                handle.remove()
            fresh = FSDPParam(new, fp._module_info, fp.mesh_info, fp.post_forward_mesh_info, fp.device, fn,
                              fp.mp_policy, group.offload_policy)
            fresh._param_fqn = fp._param_fqn
            group.fsdp_params[i] = fresh
            out[id(new)] = fresh.sharded_param
            changed = True
        if changed:
            group._init_mp_dtypes()
    missing = [new for old, new in replaced.values() if id(new) not in out]
    if missing:
        raise RuntimeError(f"RankAdaptive cut {len(missing)} sharded TT parameter(s) that no FSDP2 parameter group "
                           f"of this model holds; shard the model with fully_shard before building RankAdaptive")
    return out


@contextlib.contextmanager
def unsharded(model: nn.Module, layers: dict[str, Any], optimizer: torch.optim.Optimizer | None = None,
              ) -> Iterator[bool]:
    """Inside the block every DTensor core and gate of `layers` is a plain full Parameter registered in its
    place (and the optimizer holds it, with full state).  On exit each is sharded back: values from rank 0,
    and a tensor the block replaced (a cut) sharded anew in its FSDP2 group.  Yields whether anything was
    sharded; a model FSDP2 did not shard passes through untouched."""
    entries = []  # (parameter list, index, sharded Parameter, full Parameter)
    for layer in layers.values():
        for plist in (layer.cores, layer.gates):
            for i, p in enumerate(plist):
                if is_sharded(p):
                    _check_mesh(p)
                    full = nn.Parameter(p.detach().full_tensor().clone(), requires_grad=p.requires_grad)
                    entries.append((plist, i, p, full))
    if not entries:
        yield False
        return
    to_full = {id(p): full for _, _, p, full in entries}
    state = optimizer.state if optimizer is not None else {}
    for _, _, p, full in entries:
        st = state.pop(p, None)
        if st is not None:
            state[full] = {k: v.full_tensor() if is_sharded(v) else v for k, v in st.items()}
    if optimizer is not None:
        for group in optimizer.param_groups:
            group["params"] = [to_full.get(id(q), q) for q in group["params"]]
    for plist, i, _, full in entries:
        plist[i] = full
    try:
        yield True
    finally:
        _shard_back(model, entries, optimizer)


def _shard_back(model: nn.Module, entries: list, optimizer: torch.optim.Optimizer | None) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    pairs: list[tuple[nn.Parameter, Any]] = []   # (plain Parameter now in the model, its sharded Parameter)
    replaced: dict[int, tuple[Any, nn.Parameter]] = {}
    with torch.no_grad():
        for plist, i, sharded, full in entries:
            now = plist[i]
            if now is full:
                local(sharded).copy_(shard_like(full, sharded))
                plist[i] = sharded
                pairs.append((full, sharded))
            else:  # a cut: every process takes rank 0's new tensor, then FSDP2 shards it
                if dist.is_initialized():
                    dist.broadcast(now.data, 0)
                replaced[id(sharded)] = (sharded, now)
        if replaced:
            fresh = _reshard(model, replaced)
            pairs += [(new, fresh[id(new)]) for _, new in replaced.values()]
        if optimizer is None:
            return
        swap = {id(plain): sharded for plain, sharded in pairs}
        for group in optimizer.param_groups:
            group["params"] = [swap.get(id(q), q) for q in group["params"]]
        state = optimizer.state
        for plain, sharded in pairs:
            st = state.pop(plain, None)
            if st is None:
                continue
            state[sharded] = {k: (distribute_tensor(v, sharded.device_mesh, sharded.placements)
                                  if isinstance(v, torch.Tensor) and v.shape == sharded.shape and v.dim() > 0
                                  else v)
                              for k, v in st.items()}


# -- distributed checkpoints ------------------------------------------------------------------------------
_MODEL, _OPTIM, _RA = "model", "optimizer", "rank_adaptive"


def save_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    ra: Any = None) -> None:
    """Save a training checkpoint with ``torch.distributed.checkpoint`` (one file per process; any number
    of processes, or one without a process group): the model and optimizer state as torch's
    ``get_state_dict`` gives them (FSDP2 shards saved as shards), and ``RankAdaptive``'s state.  Call it on
    every process.  ``load_checkpoint`` restores it at any world size, cut ranks included."""
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {_MODEL: model_sd, _OPTIM: optim_sd}
    else:
        state = {_MODEL: get_model_state_dict(model)}
    if ra is not None:  # kept whole (its masks have the checkpoint's shapes, which the loader reads first)
        buf = io.BytesIO()
        torch.save(ra.state_dict(), buf)
        state[_RA] = buf.getvalue()
    dcp.save(state, checkpoint_id=path)


def checkpoint_ranks(path: str, model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The TT ranks each of `model`'s TT layers has in the checkpoint at `path` (read from the shapes the
    checkpoint records for its cores)."""
    import torch.distributed.checkpoint as dcp

    from .optim import tt_layers

    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    out = {}
    for name, layer in tt_layers(model).items():
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
    rank slices, FSDP2-sharded or not; the optimizer, if given, holds the new Parameters.  A model about to
    load a checkpoint taken after cuts needs its shapes first; the values come from the checkpoint."""
    from .optim import tt_layers

    layers = tt_layers(model)
    if optimizer is not None and optimizer.state:
        raise ValueError("give load_checkpoint a fresh optimizer (no state yet): its state comes from the "
                         "checkpoint, and a stateful one may hold parameters the checkpoint's ranks replace")
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
            swap = {id(old): new for old, new, _, _ in layer.prune_ranks(keep)}
            if optimizer is not None:
                for group in optimizer.param_groups:
                    group["params"] = [swap.get(id(p), p) for p in group["params"]]


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    ra: Any = None) -> None:
    """Restore what ``save_checkpoint`` saved, at any world size (call it on every process, after
    ``fully_shard`` and with a fresh optimizer built on the model's parameters).  TT layers are first
    re-allocated at the checkpoint's ranks (a model built at larger ranks is cut to them; one at smaller
    ranks is an error), then the model, optimizer and ``RankAdaptive`` state are loaded in place."""
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                         set_state_dict)

    resize_ranks(model, checkpoint_ranks(path, model), optimizer)
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {_MODEL: model_sd, _OPTIM: optim_sd}
    else:
        state = {_MODEL: get_model_state_dict(model)}
    if ra is not None:
        state[_RA] = b""
    dcp.load(state, checkpoint_id=path)
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state[_MODEL], optim_state_dict=state[_OPTIM])
    else:
        set_model_state_dict(model, state[_MODEL])
    if ra is not None:
        if not state[_RA]:
            raise ValueError(f"the checkpoint at {path} holds no RankAdaptive state (saved without ra=)")
        ra.load_state_dict(torch.load(io.BytesIO(state[_RA]), weights_only=True))
