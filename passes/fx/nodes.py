"""Reading torch.fx call nodes the same way in every graph pass: an argument by position or keyword, the
first input, the one user, the module a call_module node runs (Tempo's own and hooked modules excepted)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch import nn

from comera_compile.ops.tempo_modules import TEMPO_MODULES

__all__ = ["arg", "first_input", "single_user", "called_module", "hooked"]

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def arg(node: torch.fx.Node, i: int, name: str, default: Any) -> Any:
    """The call's argument at position i, or given as keyword `name`, else default."""
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def first_input(node: torch.fx.Node) -> Any:
    """The first argument of a call, given by position or as `input`."""
    return arg(node, 0, "input", None)


def single_user(node: torch.fx.Node) -> torch.fx.Node | None:
    """The node's only user, or None when it has none or several."""
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def hooked(mod: nn.Module) -> bool:
    """Whether mod has hooks of its own or an instance-level forward (accelerate's device hooks patch it): a
    pass that replaces the module, or its call, would run without them."""
    return "forward" in vars(mod) or any(getattr(mod, h, None) for h in _HOOKS)


def called_module(gm: torch.fx.GraphModule, node: torch.fx.Node) -> nn.Module | None:
    """The module a call_module node runs, unless it is one of Tempo's own (already replaced) or hooked (its
    call must stay a call); else None."""
    if node.op != "call_module":
        return None
    mod = gm.get_submodule(node.target)
    return None if isinstance(mod, TEMPO_MODULES) or hooked(mod) else mod
