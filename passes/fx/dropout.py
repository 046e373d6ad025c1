"""Every dropout of a GraphModule (F.dropout / torch.dropout calls, nn.Dropout submodules) swapped for
hash dropout (comera_compile.ops.hash_dropout), whose mask Inductor computes inside its kernels."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from comera_compile.ops.hash_dropout import HashDropout, hash_dropout
from comera_compile.passes import GraphPassResult

__all__ = ["fast_dropout"]


_FUNCTIONAL = (F.dropout, torch.dropout)


def fast_dropout(gm: torch.fx.GraphModule, example_inputs: Sequence[object] | None = None) -> GraphPassResult:
    """Replace gm's dropouts -- F.dropout / torch.dropout calls and nn.Dropout submodules -- by hash
    dropout, in place; the count is how many were replaced.  example_inputs is accepted, as by every fx
    pass, and not needed."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _FUNCTIONAL:
            if node.target is torch.dropout and "train" in node.kwargs:  # torch.dropout(input, p, train)
                kwargs = dict(node.kwargs)
                kwargs["training"] = kwargs.pop("train")
                node.kwargs = kwargs
            node.target = hash_dropout
            count += 1
        elif node.op == "call_module":
            mod = gm.get_submodule(node.target)
            if type(mod) is nn.Dropout:
                new = HashDropout(mod.p, mod.inplace)
                new.train(mod.training)
                parent, _, name = node.target.rpartition(".")
                setattr(gm.get_submodule(parent) if parent else gm, name, new)
                count += 1
    if count:
        gm.recompile()
    return GraphPassResult(gm, count)
