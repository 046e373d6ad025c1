"""Every dropout of a GraphModule (F.dropout / torch.dropout calls, nn.Dropout submodules) swapped for
hash dropout (comera_compile.ops.hash_dropout), whose mask Inductor computes inside its kernels.  The
dropout calls of one graph share one draw of their random words: one small kernel per graph, not one per
dropout."""

from __future__ import annotations

import operator
from typing import Sequence

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from comera_compile.ops.hash_dropout import HashDropout, draw_words, hash_dropout
from comera_compile.passes import GraphPassResult, node_value

__all__ = ["fast_dropout"]


_FUNCTIONAL = (F.dropout, torch.dropout)


def fast_dropout(gm: torch.fx.GraphModule, example_inputs: Sequence[object] | None = None) -> GraphPassResult:
    """Replace gm's dropouts -- F.dropout / torch.dropout calls and nn.Dropout submodules -- by hash
    dropout, in place; the count is how many calls were replaced (a module called twice counts twice).
    example_inputs is accepted, as by every fx pass, and not needed."""
    count, calls, swapped = 0, [], set()   # swapped: the modules replaced here (one may be called twice)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _FUNCTIONAL:
            if node.target is torch.dropout and "train" in node.kwargs:  # torch.dropout(input, p, train)
                kwargs = dict(node.kwargs)
                kwargs["training"] = kwargs.pop("train")
                node.kwargs = kwargs
            node.target = hash_dropout
            calls.append(node)
            count += 1
        elif node.op == "call_module" and node.target in swapped:
            count += 1
        elif node.op == "call_module":
            mod = gm.get_submodule(node.target)
            if type(mod) is nn.Dropout:
                swapped.add(node.target)
                new = HashDropout(mod.p, mod.inplace)
                new.train(mod.training)
                parent, _, name = node.target.rpartition(".")
                setattr(gm.get_submodule(parent) if parent else gm, name, new)
                count += 1
    _share_words(gm.graph, calls)
    if count:
        gm.recompile()
    return GraphPassResult(gm, count)


def _may_drop(node: torch.fx.Node) -> bool:
    """False for a hash_dropout call that draws nothing: p 0 or 1, or training False, as constants."""
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    training = node.args[2] if len(node.args) > 2 else node.kwargs.get("training", True)
    return not (training is False or (isinstance(p, (int, float)) and p in (0, 1)))


def _share_words(graph: torch.fx.Graph, calls: list[torch.fx.Node]) -> None:
    """Give the hash-dropout calls one draw of words, call i words[2i:2i+2], when there are several and
    the graph's metadata says they run on one device (else each draws its own)."""
    calls = [node for node in calls if _may_drop(node)]   # an eval graph draws nothing, as eager does
    values = [node_value(node.args[0] if node.args else node.kwargs.get("input")) for node in calls]
    devices = {v.device for v in values if isinstance(v, torch.Tensor)}
    if len(calls) < 2 or len(devices) != 1 or not all(isinstance(v, torch.Tensor) for v in values):
        return
    with graph.inserting_before(calls[0]):
        words = graph.call_function(draw_words, (len(calls), devices.pop()))
    for i, node in enumerate(calls):
        with graph.inserting_before(node):
            mine = graph.call_function(operator.getitem, (words, slice(2 * i, 2 * i + 2)))
        node.kwargs = {**node.kwargs, "words": mine}
