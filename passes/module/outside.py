"""What holds a model's layers from outside its module tree, which a module swap cannot reach: a plain
container or bound method inside the model (``held_outside``), or a module outside the model given sharing a
layer's weight (``tied_outside``: a language model's head tied to the embedding of the body passed alone)."""

from __future__ import annotations

import gc
import inspect
from typing import Any

from torch import nn

__all__ = ["held_outside", "tied_outside"]


_MODULE_INTERNALS = frozenset(vars(nn.Module()))   # nn.Module's own attributes: submodules, hooks, ...


def held_outside(model: nn.Module) -> dict[int, str]:
    """The modules that one of the model's modules holds outside the module tree -- in a plain list, tuple,
    set or dict attribute, directly, or as a bound method's owner -- by id, with where (the first place).
    tensorize replaces submodules only, so a forward calling a layer from there would run the dense one."""
    held: dict[int, str] = {}

    def visit(value: Any, where: str, depth: int) -> None:
        if isinstance(value, nn.Module):
            held.setdefault(id(value), where)
        elif inspect.ismethod(value) and isinstance(value.__self__, nn.Module):
            held.setdefault(id(value.__self__), where)
        elif depth < 3 and isinstance(value, (list, tuple, set, frozenset)):
            for i, item in enumerate(value):
                visit(item, f"{where}[{i}]", depth + 1)
        elif depth < 3 and isinstance(value, dict):
            for key, item in value.items():
                visit(item, f"{where}[{key!r}]", depth + 1)

    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if attr not in _MODULE_INTERNALS:
                visit(value, f"{name}.{attr}" if name else attr, 0)
    return held


def tied_outside(model: nn.Module) -> set[int]:
    """The modules of `model` (by id) whose weight or bias a module outside `model` also holds as a parameter:
    a TT layer in their place would leave that module training the dense tensor alone.  One scan of the
    garbage collector's objects for the referrers of all weights, one for those dicts' owners."""
    inside = {id(m._parameters) for m in model.modules()}
    tensors = {id(p): m for m in model.modules() for n, p in m._parameters.items()
               if n in ("weight", "bias") and isinstance(p, nn.Parameter)}
    if not tensors:
        return set()
    held = gc.get_referrers(*(p for m in model.modules() for n, p in m._parameters.items() if id(p) in tensors))
    dicts = {id(d): d for d in held if type(d) is dict and id(d) not in inside}
    if not dicts:
        return set()
    found: set[int] = set()
    for owner in gc.get_referrers(*dicts.values()):
        params = owner._parameters if isinstance(owner, nn.Module) else (
            owner.get("_parameters") if type(owner) is dict else None)
        if type(params) is dict and id(params) in dicts:
            found.update(id(tensors[id(p)]) for p in params.values() if id(p) in tensors)
    return found
