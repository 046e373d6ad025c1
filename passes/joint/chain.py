"""Several joint-graph passes as one: Inductor's ``joint_custom_pre_pass`` takes a single pass on every
torch release (a list only from 2.13 on), so the backend hands it one pass that runs the user's and its own
in order."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

__all__ = ["ChainedJointPass", "chain_joint_passes"]


class ChainedJointPass(CustomGraphPass):
    """Runs each pass on the graph in turn.  Its uuid is the tuple of theirs, so Inductor's FX graph cache
    keys on every member; None (no caching, as Inductor does for a bare callable) if any member has none."""

    def __init__(self, passes: Sequence[Callable[[torch.fx.Graph], Any]]) -> None:
        self.passes = tuple(passes)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> Any:
        ids = tuple(p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.passes)
        return None if any(i is None for i in ids) else ("comera.chain", *ids)


def chain_joint_passes(user: Any, *ours: Callable[[torch.fx.Graph], Any]) -> Callable[[torch.fx.Graph], Any]:
    """The one pass to set as ``joint_custom_pre_pass``: the user's (None, a pass, or a list or tuple of
    passes, as torch 2.13+ takes them), then ours.  A single pass when nothing else is set."""
    given = list(user) if isinstance(user, (list, tuple)) else [] if user is None else [user]
    members = [*given, *ours]
    return members[0] if len(members) == 1 else ChainedJointPass(members)
