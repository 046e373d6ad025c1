"""TT layers sharded by FSDP2 (``fully_shard``): every core and gate is a DTensor sharded on dim 0.  What
RankAdaptive needs of them: the per-process view of its gates and masks (``view``), and whole tensors for its
whole-layer work (``unsharded``), after which a cut's new Parameters are sharded anew in place."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
from torch import nn

from ..optim_state import replace

__all__ = ["is_sharded", "local", "local_masks", "shard_like", "unsharded", "check_resharding", "view", "PlainView",
           "ShardedView", "wrapped_for_data_parallel"]


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


def wrapped_for_data_parallel(model: nn.Module, ddp: bool = True) -> str | None:
    """What in `model` is already wrapped or sharded for data parallelism (a DistributedDataParallel wrapper,
    unless ddp is False; FullyShardedDataParallel; FSDP2's fully_shard; a DTensor parameter), said for an
    error message, or None.  Rewrites that swap modules or parameters belong before it: the wrapper holds the
    parameters (and FSDP2 the modules) it was given."""
    import torch.distributed as dist

    kinds: list[tuple[type, str]] = []
    if ddp:
        kinds.append((nn.parallel.DistributedDataParallel, "is a DistributedDataParallel wrapper"))
    if dist.is_available():
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        kinds += [(FullyShardedDataParallel, "is a FullyShardedDataParallel wrapper"),
                  (FSDPModule, "is sharded by fully_shard (FSDP2)")]
    for name, module in model.named_modules():
        for cls, what in kinds:
            if isinstance(module, cls):
                return f"{name or type(model).__name__} {what}"
    for name, param in model.named_parameters():
        if is_sharded(param):
            return f"its parameter {name} is a DTensor (sharded or distributed already)"
    return None


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
    replace(optimizer, [(p, full) for _, _, p, full in entries],
            lambda st, old, new: {k: v.full_tensor() if is_sharded(v) else v for k, v in st.items()})
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
            else:  # a cut: every process of the mesh takes its first one's new tensor, then FSDP2 shards it
                if dist.is_initialized():
                    group = sharded.device_mesh.get_group()
                    dist.broadcast(now.data, dist.get_global_rank(group, 0), group=group)
                replaced[id(sharded)] = (sharded, now)
        if replaced:
            fresh = _reshard(model, replaced)
            pairs += [(new, fresh[id(new)]) for _, new in replaced.values()]

        def shard(st: dict, plain: nn.Parameter, sharded: Any) -> dict:
            return {k: (distribute_tensor(v, sharded.device_mesh, sharded.placements)
                        if isinstance(v, torch.Tensor) and v.shape == sharded.shape and v.dim() > 0 else v)
                    for k, v in st.items()}

        replace(optimizer, pairs, shard)


class PlainView:
    """RankAdaptive's per-process view of its TT layers when FSDP2 did not shard them: the gates and masks
    as they are, the penalty's mean taken here, whole-layer work in place."""

    def __init__(self, model: nn.Module, layers: dict[str, Any]) -> None:
        self.model, self.layers = model, layers

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """The part of a gate (or core) this process updates elementwise."""
        return t

    def masks(self, masks: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
        """The masks matching ``local``'s gates."""
        return masks

    def refresh(self, masks: dict[str, list[torch.Tensor]]) -> None:
        """The masks (or the gates' shapes) changed."""

    def mean(self, total: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """The penalty's mean from this process's sum over active entries and their count."""
        return total / active.clamp_min(1)

    def unsharded(self, optimizer: torch.optim.Optimizer | None) -> contextlib.AbstractContextManager:
        """A block in which the cores and gates are whole plain Parameters (and the optimizer's state whole)."""
        return contextlib.nullcontext(False)


class ShardedView(PlainView):
    """The same under FSDP2: each process's shards of the gates and of the masks, the penalty's sums
    all-reduced, and whole-layer work inside ``unsharded``."""

    def __init__(self, model: nn.Module, layers: dict[str, Any]) -> None:
        check_resharding(model, layers)
        super().__init__(model, layers)
        self._local: dict[str, list[torch.Tensor]] = {}

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return local(t)

    def masks(self, masks: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
        if not self._local:
            self.refresh(masks)
        return self._local

    def refresh(self, masks: dict[str, list[torch.Tensor]]) -> None:
        self._local = {name: local_masks(masks[name], list(layer.gates)) for name, layer in self.layers.items()}

    def mean(self, total: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        both = torch.stack([total.to(torch.float64), active.to(torch.float64)])
        dist.all_reduce(both, group=next(iter(self.layers.values())).gates[0].device_mesh.get_group())
        return (both[0] / both[1].clamp_min(1)).to(total.dtype)

    def unsharded(self, optimizer: torch.optim.Optimizer | None) -> contextlib.AbstractContextManager:
        return unsharded(self.model, self.layers, optimizer)


def view(model: nn.Module, layers: dict[str, Any]) -> PlainView:
    """The view RankAdaptive works through: ShardedView when FSDP2 sharded any TT parameter, else PlainView."""
    sharded = any(is_sharded(p) for m in layers.values() for p in m.parameters())
    return ShardedView(model, layers) if sharded else PlainView(model, layers)
