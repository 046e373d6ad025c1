"""The optimizer side of TT training: CoMERA's learning-rate groups, the optimizer's fast implementation,
float16 loss scaling's GradScaler and its steps, and parameters retired by a rank cut (an optimizer that
still holds one raises instead of training a stale copy).  Hooks are registered per optimizer handed to the
package, but for the retired-parameter check: one process-wide step pre-hook, registered at the first cut, that
looks only while a retired parameter is alive."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from .distributed import is_sharded
from .layers import tt_layers

__all__ = ["param_groups", "prefer_fast_implementation", "fused_takes_the_scale", "loss_scaler", "scaled_step",
           "retire", "unwrapped", "skipped_step", "watch_overflow", "tt_layers", "CORE_LR_FACTOR",
           "GATE_LR_FACTOR", "FAST_KEY"]

# CoMERA's learning rates relative to the rest of the model (5e-5 / 1e-4 / 1e-3): cores 2x, gates 20x.
CORE_LR_FACTOR = 2.0
GATE_LR_FACTOR = 20.0


def param_groups(model: nn.Module, lr: float = 5e-5, core_lr: float | None = None, gate_lr: float | None = None,
                 weight_decay: float | None = None) -> list[dict[str, Any]]:
    """CoMERA's three optimizer groups: TT cores (core_lr, default 2 x lr), rank gates (gate_lr, default
    20 x lr) and everything else (lr).  One lr sets all three; RankAdaptive's defaults are tuned for these
    ratios.  weight_decay, when given, is the cores' and the rest's; left out, they take the optimizer's own
    (``AdamW(param_groups(model), weight_decay=0.1)``, torch's convention for a key a group omits).  The gates
    are never decayed: the rank penalty is their regularizer, and a decay beside it would cut ranks the loss
    needs.  The groups are marked (FAST_KEY) for the optimizer's fast implementation, which an optimizer
    built from them takes when handed to RankAdaptive or compile_step (prefer_fast_implementation); pass
    foreach= or fused= to the optimizer to choose yourself."""
    core_lr = CORE_LR_FACTOR * lr if core_lr is None else core_lr
    gate_lr = GATE_LR_FACTOR * lr if gate_lr is None else gate_lr
    cores, gates = [], []
    for layer in tt_layers(model).values():
        cores += list(layer.cores)
        gates += list(layer.gates)
    ids = {id(p) for p in cores + gates}
    rest = [p for p in model.parameters() if id(p) not in ids]
    decay = {} if weight_decay is None else {"weight_decay": weight_decay}
    groups = [{"params": cores, "lr": core_lr, **decay, "name": "tt_cores"},
              {"params": gates, "lr": gate_lr, "weight_decay": 0.0, "name": "rank_gates"},
              {"params": rest, "lr": lr, **decay, "name": "other"}]
    return [{**g, FAST_KEY: True} for g in groups if g["params"]]


# A param group key set by param_groups: the group asks for the optimizer's fast implementation (taken, and
# the key removed, by prefer_fast_implementation).
FAST_KEY = "prefer_fast_implementation"


def prefer_fast_implementation(optimizer: torch.optim.Optimizer, model: nn.Module | None = None) -> None:
    """Switch param groups left at torch's default implementation (neither foreach nor fused chosen) to
    the fused one where the optimizer has it (Adam, AdamW, SGD, Adagrad: one vectorised kernel per
    tensor) and the parameters suit it, else to the multi-tensor (foreach) one.  Both compute the same
    update as the default.  Groups naming an implementation (fused=False too) are left alone, and so are
    groups holding a parameter of `model`'s embeddings with sparse gradients (sparse=True), which the fused
    kernels refuse.  RankAdaptive does this to the optimizer it is given: hundreds of small TT cores make
    torch's default per-tensor loop the slow part of an optimizer step.  The groups' FAST_KEY marks
    (param_groups) are removed."""
    from torch.optim.optimizer import _device_dtype_check_for_fused

    fresh = not optimizer.state
    sparse = {id(p) for m in (model.modules() if model is not None else ()) if getattr(m, "sparse", False) is True
              for p in m.parameters(recurse=False)}
    for group in optimizer.param_groups:
        group.pop(FAST_KEY, None)
        if group.get("foreach") is not None or group.get("fused") is not None:
            continue
        if any(id(p) in sparse for p in group["params"]):
            continue
        # fused kernels have no DTensor sharding rule (FSDP2's parameters): foreach there
        fused = (fresh and "fused" in group and not group.get("differentiable")
                 and not any(is_sharded(p) for p in group["params"]))
        if fused:
            try:
                for p in group["params"]:
                    _device_dtype_check_for_fused(p)
            except (RuntimeError, ValueError):
                fused = False
        if fused:
            group["fused"], group["foreach"] = True, False
        elif "foreach" in group:
            group["foreach"] = True


def fused_takes_the_scale(optimizer: torch.optim.Optimizer) -> None:
    """Where every param group is fused (as prefer_fast_implementation may have made them), let a GradScaler
    hand the kernels its scale and overflow flag as tensors, as it does for an optimizer built with
    fused=True, instead of reading the flag on the host.  Not done by prefer_fast_implementation itself:
    accelerate tells a skipped step by the optimizer's step() not being called, which this would hide."""
    if optimizer.param_groups and all(group.get("fused") for group in optimizer.param_groups):
        optimizer._step_supports_amp_scaling = True


def loss_scaler(scaler: Any, autocast: torch.dtype | None, device_type: str, cuda_graphs: str | None,
                 compile_optimizer: bool | None, optimizer: Any) -> Any:
    """compile_step's GradScaler: the one given, the one an accelerate wrapper steps with (fp16 mixed precision),
    a new one for float16 autocast, else None; refused with a whole-step graph (its overflow check is a host
    read) or a compiled optimizer step (the scaler steps the optimizer)."""
    owned = getattr(optimizer, "scaler", None)
    if isinstance(owned, torch.amp.GradScaler) and owned.is_enabled():
        if scaler is not None and scaler is not owned:
            raise ValueError("compile_step(scaler=...) with an optimizer wrapper that steps through a GradScaler of "
                             "its own (accelerate's, under mixed_precision='fp16'): the loss must be scaled by the "
                             "scaler that unscales the gradients; leave scaler= unset and the step uses the wrapper's")
        scaler = owned
    if scaler is None and autocast == torch.float16:
        scaler = torch.amp.GradScaler(device_type)
    if scaler is None or not scaler.is_enabled():
        return scaler
    if cuda_graphs == "step":
        raise ValueError("cuda_graphs='step' with a loss scaler (float16 autocast makes one): the scaler reads its "
                         "overflow check on the host at every step, which one CUDA graph cannot capture; use "
                         "autocast=torch.bfloat16 (no scaling needed), or cuda_graphs='compiled'")
    if compile_optimizer:
        raise ValueError("compile_optimizer=True with a loss scaler (float16 autocast makes one): the scaler steps "
                         "the optimizer itself, skipping steps whose gradients overflowed; leave compile_optimizer "
                         "at its default")
    return scaler


def scaled_step(scaler: Any, optimizer: Any, scale_before: float) -> bool:
    """The optimizer step through a GradScaler: gradients unscaled first (so step pre-hooks, gradient clipping
    among them, see the true ones), the step skipped where they overflowed, the scale updated.  A wrapper that
    steps through this scaler itself (accelerate's under fp16) is stepped, as its loops do, after the optimizer
    inside is unscaled.  Returns whether the step was skipped: the scale falls only then (GradScaler's backoff
    factor is below 1), against `scale_before`, read before the step's kernels were queued."""
    if getattr(optimizer, "scaler", None) is scaler:
        scaler.unscale_(unwrapped(optimizer))
        optimizer.step()   # the wrapper's scaler.step and scaler.update
    else:
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
    return scaler.get_scale() < scale_before


def unwrapped(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer a wrapper holds as ``.optimizer`` (accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``), or `optimizer` itself: the object whose param groups and state a cut
    must change and whose step hooks run.  Anything else without param groups is a TypeError."""
    inner = optimizer   # accelerate's wrapper subclasses Optimizer without its state: unwrap it all the same
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer) and inner.optimizer is not inner:
        inner = inner.optimizer
    if not hasattr(inner, "param_groups") or not hasattr(inner, "register_step_pre_hook"):
        raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer and holds none as .optimizer; "
                        f"give the torch optimizer the training loop steps")
    return inner


def check_holds(optimizer: Any, model: nn.Module, required: dict[str, nn.Parameter] | None = None,
                who: str = "compile_step") -> None:
    """Raise where `optimizer` cannot be the one training `model` as it is now: it lacks a trainable parameter
    of `required` (RankAdaptive's TT cores), or, with required None, it lacks some of the model's trainable
    parameters and holds others the model does not have: an optimizer built before ``cc.tensorize`` (or
    before a re-allocation) holds the replaced dense weights, and the TT layers would never train."""
    held = {id(p) for group in unwrapped(optimizer).param_groups for p in group["params"]}
    named = dict(model.named_parameters())
    foreign = len(held - {id(p) for p in named.values()})
    wanted = named if required is None else required
    missing = [n for n, p in wanted.items() if p.requires_grad and id(p) not in held]
    if not missing or (required is None and not foreign):
        return
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    also = f" and holds {foreign} parameter(s) the model does not have" if foreign else ""
    raise ValueError(f"{who}: the optimizer does not hold {len(missing)} trainable parameter(s) of the model "
                     f"({shown}){also}; was it built before cc.tensorize, or before a re-allocation? Build it "
                     f"from the model as it is now, e.g. torch.optim.AdamW(cc.param_groups(model, lr=...))")


def skipped_step(optimizer: Any) -> bool:
    """Whether the last ``step()`` left the parameters unchanged: accelerate's optimizer inside
    ``accelerator.accumulate`` before the last micro-batch (gradients not yet synchronized), or after a
    float16 overflow (accelerate's flag, or the flag a GradScaler handed a fused optimizer under
    watch_overflow).  What follows an optimizer step (an LR scheduler's, RankAdaptive's) skips then too."""
    found_inf = _FOUND_INF.pop(unwrapped(optimizer), None) if optimizer is not None else None
    state = getattr(optimizer, "gradient_state", None)
    if state is not None and not getattr(state, "sync_gradients", True):
        return True
    if getattr(optimizer, "step_was_skipped", False):
        return True
    return found_inf is not None and bool(found_inf.item())


# The overflow flag a GradScaler handed each watched optimizer at its last step.  A scaler steps an optimizer
# built with fused=True (the Trainer's default AdamW) even when the gradients overflowed: the kernel skips the
# update, so neither "step() was not called" (accelerate's test) nor anything after the step tells a skipped
# step.  The flag is set on the optimizer for that call only; a step pre-hook keeps it for skipped_step.
_FOUND_INF: "weakref.WeakKeyDictionary[torch.optim.Optimizer, torch.Tensor]" = weakref.WeakKeyDictionary()
_OVERFLOW_WATCHED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, Any]" = weakref.WeakKeyDictionary()


def watch_overflow(optimizer: torch.optim.Optimizer) -> None:
    """From now on skipped_step sees the steps of `optimizer` that a GradScaler skipped inside its fused kernels
    (its own step pre-hook, registered once; read at the next skipped_step, one host read then)."""
    if optimizer not in _OVERFLOW_WATCHED:
        _OVERFLOW_WATCHED[optimizer] = optimizer.register_step_pre_hook(_record_found_inf)


def _record_found_inf(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    found_inf = getattr(optimizer, "found_inf", None)
    if isinstance(found_inf, torch.Tensor):
        _FOUND_INF[optimizer] = found_inf
    else:
        _FOUND_INF.pop(optimizer, None)


def learning_rates(optimizer: torch.optim.Optimizer | None) -> dict[int, float]:
    """Each parameter's learning rate in `optimizer` (by id), as its group holds it now."""
    groups = optimizer.param_groups if optimizer is not None else []
    return {id(p): float(g["lr"]) for g in groups for p in g["params"]}


def step_learning_rates(ra: Any, optimizer: torch.optim.Optimizer | None) -> None:
    """Record the learning rates of the optimizer step just taken, for ra's next step (its proximal step's
    size) where a scheduler steps before it: the Trainer's order."""
    if optimizer is not None:
        ra._step_lrs = learning_rates(optimizer)
