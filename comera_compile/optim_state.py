"""Optimizer-state surgery: new parameters put in place of old ones in an optimizer, each one's state
carried through a transform.  ``replace`` is the one place in the package that edits an optimizer's
groups or state; the transforms beside it say how a rank cut, a gauge change or a rounding moves the
moments (docs/method.md section 4 has the reasons)."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["replace", "replace_pruned", "rescale", "rescale_all", "restart", "restart_all", "index_select", "retire",
           "reshaped", "SECOND_MOMENTS", "SCALE_POWERS"]

# state[param] -> (state, old, new) -> the state `new` starts from
Transform = Callable[[dict, torch.Tensor, torch.Tensor], dict]

# Optimizer state entries that are running averages of a square (the gradient's; Adadelta's acc_delta, of
# the update's): a rounding averages them over the rotated axes instead of zeroing them.
SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "variance", "acc_delta")

# How torch's optimizers' per-element state scales when a parameter is multiplied by f (its gradient by 1/f):
# the state is multiplied by f ** power.  Gradient averages -1, squared-gradient averages -2, quantities in the
# parameter's units +1 (ASGD's average, Rprop's step sizes), squared updates +2 (Adadelta).  Per optimizer
# where one key means two things: RMSprop's momentum buffer holds grad / sqrt(square_avg), which has no scale.
# A key not listed is taken for a gradient average.
SCALE_POWERS: dict[str, int] = {
    "exp_avg": -1, "exp_inf": -1, "momentum_buffer": -1, "grad_avg": -1, "prev": -1,
    "exp_avg_sq": -2, "max_exp_avg_sq": -2, "square_avg": -2, "sum": -2, "variance": -2,
    "acc_delta": 2, "ax": 1, "step_size": 1}
_SCALE_POWERS_BY_OPTIMIZER: dict[str, dict[str, int]] = {"RMSprop": {"momentum_buffer": 0}}


def replace(optimizer: torch.optim.Optimizer | None, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]],
            transform: Transform | None = None) -> None:
    """Put every `new` in its `old`'s place in the optimizer's param groups and move its state there, through
    ``transform(state, old, new)`` when given.  `old` may be `new`: the state is then transformed where it is
    (a transform that edits its tensors in place keeps them: a compiled optimizer step guards on them).
    Parameters the optimizer has no state for are only swapped."""
    if optimizer is None:
        return
    pairs = list(pairs)
    swap = {id(old): new for old, new in pairs if old is not new}
    if swap:   # the group's own list edited, not replaced: LBFGS keeps a reference to it
        for group in optimizer.param_groups:
            group["params"][:] = [swap.get(id(p), p) for p in group["params"]]
        if isinstance(optimizer, torch.optim.LBFGS):   # its history spans all parameters, flattened: restarted
            optimizer.state.clear()
            optimizer._numel_cache = None   # its count of the parameters' elements, recounted
            return
    state = optimizer.state
    for old, new in pairs:
        st = state.get(old) if old is new else state.pop(old, None)
        if st is None:
            continue
        state[new] = st if transform is None else transform(st, old, new)


def _per_element(value: object, p: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == p.shape and value.dim() > 0


def rescale(factors: dict[int, torch.Tensor], optimizer: torch.optim.Optimizer | None = None) -> Transform:
    """The state of a gate multiplied by f = factors[id(gate)], carried into the new scale in place: its
    gradient is 1/f the old one, so first moments are divided by f, second moments by f^2, and so on as
    SCALE_POWERS says for `optimizer`'s kind (Adam's by default)."""
    powers = {**SCALE_POWERS, **_SCALE_POWERS_BY_OPTIMIZER.get(type(optimizer).__name__, {})}

    def transform(st: dict, old: torch.Tensor, new: torch.Tensor) -> dict:
        f = factors[id(old)]
        for key, value in st.items():
            power = powers.get(key, -1)
            if power and _per_element(value, new):
                value.copy_((value.double() * f ** power).to(value.dtype))
        return st
    return transform


def rescale_all(optimizer: torch.optim.Optimizer | None, params: list[torch.Tensor],
                factors: dict[int, torch.Tensor]) -> None:
    """``rescale`` applied where the parameters are (``replace(optimizer, [(p, p) ...], rescale(...))``), every
    parameter's state entry of one kind in one concatenated operation: the same arithmetic, a few kernels
    for hundreds of gates."""
    if optimizer is None:
        return
    powers = {**SCALE_POWERS, **_SCALE_POWERS_BY_OPTIMIZER.get(type(optimizer).__name__, {})}
    entries: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for p in params:
        for key, value in (optimizer.state.get(p) or {}).items():
            if powers.get(key, -1) and _per_element(value, p):
                entries.setdefault((key, value.dtype, value.device), []).append((value, factors[id(p)]))
    for (key, dtype, _), items in entries.items():
        values = [v for v, _ in items]
        scaled = torch.cat([v.reshape(-1) for v in values]).double() * torch.cat(
            [f.reshape(-1) for _, f in items]) ** powers.get(key, -1)
        torch._foreach_copy_(values, [part.view_as(v) for part, v in
                                      zip(scaled.to(dtype).split([v.numel() for v in values]), values)])


def replace_pruned(optimizer: torch.optim.Optimizer | None,
                   pruned: Iterable[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]]) -> list[torch.Tensor]:
    """Put a layer's cut Parameters (``prune_ranks``'s (old, new, dim, index), a core cut on both bonds coming
    twice) in place of the old ones, the optimizer's state cut alike (index_select); returns the old ones."""
    pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    steps: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for old, new, dim, idx in pruned:
        pairs.setdefault(id(old), (old, new))
        steps.setdefault(id(old), []).append((dim, idx))
    replace(optimizer, pairs.values(), index_select(steps))
    return [old for old, _ in pairs.values()]


def restart(st: dict, old: torch.Tensor, new: torch.Tensor) -> dict:
    """The state of a TT core or gate a rounding rotated (in place).  Under Adam (a bias-corrected second
    moment and a step count) a core's moments restart from nothing, step included; a gate keeps its step and
    its bond's average second moment, its first moment restarts at zero.  Other optimizers: first moments
    zero, second moments and Rprop's step sizes averaged over the rotated axes, ASGD's average of the parameter
    the rotated parameter; NAdam's momentum product restarts with its step."""
    for key, action, axes in _restart_plan(st, new):
        value = st[key]
        if action == "fresh":
            fresh = 0 if key == "step" else 1
            st[key] = value.fill_(fresh) if isinstance(value, torch.Tensor) else type(value)(fresh)
        elif action == "param":
            value.copy_(new.detach())
        elif action == "average":
            value.copy_(value.mean(axes, keepdim=True).expand_as(value))
        else:
            value.zero_()
    return st


def restart_all(optimizer: torch.optim.Optimizer | None, params: list[torch.Tensor]) -> None:
    """``restart`` applied where the parameters are (``replace(optimizer, [(p, p) ...], restart)``), each kind
    of change batched over all of them (zeroed, averaged by shape, set to the parameter): the same arithmetic,
    a few operations for a model's hundreds of cores and gates, as the check's rounding needs."""
    if optimizer is None:
        return
    zeros, ones, to_param = [], [], ([], [])
    average: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        st = optimizer.state.get(p) or {}
        for key, action, axes in _restart_plan(st, p):
            value = st[key]
            if action == "fresh" and not isinstance(value, torch.Tensor):
                st[key] = type(value)(0 if key == "step" else 1)
            elif action == "fresh":
                (zeros if key == "step" else ones).append(value)
            elif action == "param":
                to_param[0].append(value)
                to_param[1].append(p.detach())
            elif action == "average":
                average.setdefault((tuple(value.shape), axes, value.dtype, value.device), []).append(value)
            else:
                zeros.append(value)
    for values in (zeros, ones):
        if values:
            torch._foreach_zero_(values)
    if ones:
        torch._foreach_add_(ones, 1)
    if to_param[0]:
        torch._foreach_copy_(*to_param)
    for (_, axes, _, _), values in average.items():
        stacked = torch.stack(values)
        means = stacked.mean([a + 1 for a in axes], keepdim=True).expand_as(stacked)
        torch._foreach_copy_(values, list(means.unbind(0)))


def _restart_plan(st: dict, p: torch.Tensor) -> list[tuple[str, str, tuple[int, ...]]]:
    """What ``restart`` does to each state entry of `p`: (key, "fresh" | "param" | "average" | "zero", the
    rotated axes an average runs over)."""
    from_nothing = p.dim() > 1 and "exp_avg_sq" in st and "step" in st
    axes = (0,) if p.dim() == 1 else (0, p.dim() - 1)
    plan = []
    for key, value in st.items():
        if key in ("step", "mu_product") and from_nothing:
            plan.append((key, "fresh", axes))
        elif _per_element(value, p):
            average = key in (*SECOND_MOMENTS, "step_size") and not from_nothing
            plan.append((key, "param" if key == "ax" else "average" if average else "zero", axes))
    return plan


def index_select(cuts: dict[int, list[tuple[int, torch.Tensor]]]) -> Transform:
    """The state of a parameter cut to `index` along `dim`, for each (dim, index) in cuts[id(old)] in turn:
    state laid out as the parameter along `dim` (AdamW's moments) cut alike, state of size 1 there (a factored
    second moment's, as torch's Adafactor keeps) and scalars kept.  State of another layout (factored moments
    of fewer dimensions) cannot be cut without knowing the optimizer: the parameter's state is then emptied,
    and the optimizer starts it afresh at its next step, as for a parameter it has not stepped yet."""
    def transform(st: dict, old: torch.Tensor, new: torch.Tensor) -> dict:
        shape = list(old.shape)
        for dim, idx in cuts[id(old)]:
            for key, value in st.items():
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    continue
                if value.dim() != len(shape) or value.shape[dim] not in (shape[dim], 1):
                    return {}
                if value.shape[dim] == shape[dim]:
                    st[key] = value.index_select(dim, idx.to(value.device)).contiguous()
            shape[dim] = idx.numel()
        return st
    return transform


# Parameters marked for the process-wide step pre-hook below (by id, with a weak reference: tensors do not
# compare by identity), with what the mark says: None for a parameter a cut replaced (retire), the shape
# before for one a load reshaped in place (reshaped).  A dead one's mark is dropped by eager code only (a new
# mark, an eager step), never by the garbage collector: torch.compile traces the hook and guards on the marks
# it read, and one dropped while a compile was under way failed the compile (KeyError building its guards).
_MARKS: dict[int, tuple["weakref.ref[torch.Tensor]", tuple[int, ...] | None]] = {}
_CHECKING: list[Any] = []   # the hook's handle, once registered


def _check_marked(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Before any optimizer's step: it must not hold a retired parameter (it would train a tensor the model no
    longer uses, silently), nor state of a reshaped one's old shape (torch's fused kernels read it without a
    check); a reshaped one whose state fits is unmarked."""
    if not _MARKS:
        return
    if not torch.compiler.is_compiling():
        _drop_dead_marks()
    for group in optimizer.param_groups:
        for p in group["params"]:
            mark = _MARKS.get(id(p))
            if mark is None or mark[0]() is not p:
                continue
            old = mark[1]
            if old is None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds a TT core or gate that RankAdaptive cut and replaced "
                    f"(shape {tuple(p.shape)}); it would train a tensor the model no longer uses.  Give "
                    f"RankAdaptive the optimizer (RankAdaptive(model, optimizer=opt) or ra.attach(opt)) so cuts "
                    f"update it, or build it again from the model's parameters after each cut (a second "
                    f"optimizer: in a function given to ra.on_reallocate)")
            stale = [k for k, v in optimizer.state.get(p, {}).items()
                     if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) == old != tuple(p.shape)]
            if stale:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds state ({', '.join(stale)}) of shape {old} for a TT core or "
                    f"gate that load_state_dict gave other ranks ({tuple(p.shape)} now): load the optimizer's "
                    f"state saved with those weights (opt.load_state_dict) or build the optimizer anew before "
                    f"it steps")
            _MARKS.pop(id(p), None)   # its state fits: checked once


def _drop_dead_marks() -> None:
    for key in [key for key, (ref, _) in _MARKS.items() if ref() is None]:
        del _MARKS[key]


def _mark(p: torch.Tensor, old: tuple[int, ...] | None) -> None:
    if not _CHECKING:
        _CHECKING.append(register_optimizer_step_pre_hook(_check_marked))
    _drop_dead_marks()
    _MARKS[id(p)] = (weakref.ref(p), old)


def retire(params: list[torch.Tensor]) -> None:
    """Mark parameters a cut replaced: from now on an optimizer that still holds one raises at its step (a
    process-wide step pre-hook, registered at the first mark; it looks only while a marked one is alive)."""
    for p in params:
        _mark(p, None)


def reshaped(params: list[tuple[torch.Tensor, tuple[int, ...]]]) -> None:
    """Mark parameters a load reshaped in place, each with its shape before: an optimizer stepping one with
    state of the old shape raises, until its state fits (loaded, or started anew)."""
    for p, old in params:
        _mark(p, tuple(old))
