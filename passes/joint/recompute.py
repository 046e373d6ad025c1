"""Inductor joint-graph pass: hash-dropout masks recomputed in the backward instead of saved."""

from __future__ import annotations

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.checkpoint import CheckpointPolicy

from comera_compile.ops.materialize import OPAQUE_COPY
from comera_compile.passes import node_value

__all__ = ["recompute_hash_masks", "RecomputeHashMasks"]


def _integral(node: torch.fx.Node) -> bool:
    val = node_value(node)
    return isinstance(val, torch.Tensor) and not (val.is_floating_point() or val.is_complex())


def recompute_hash_masks(graph: torch.fx.Graph) -> int:
    """Tag the integer/bool nodes of every hash-dropout mask in a joint forward-backward graph
    MUST_RECOMPUTE, so AOTAutograd's partitioner saves the two random words for the backward and
    recomputes the mask there instead of saving it; returns how many nodes were tagged.

    Recomputing costs a few integer operations per element inside a kernel the backward runs anyway; a
    saved mask costs a byte per element of memory and, on CPU, Inductor's bool stores are slow (about
    10 ns per element, several times the cost of the rest of the dropout's kernel)."""
    words = [n for n in graph.nodes
             if n.op == "call_function" and n.target is OPAQUE_COPY and _integral(n)]
    tagged: set[torch.fx.Node] = set()
    todo = [u for w in words for u in w.users]
    while todo:                                   # everything integral computed from the words
        node = todo.pop()
        if node in tagged or node.op != "call_function" or not _integral(node):
            continue
        tagged.add(node)
        todo.extend(node.users)
    todo = [a for n in tagged for a in n.all_input_nodes]
    while todo:                                   # and the integral inputs beside them (the iota)
        node = todo.pop()
        if node in tagged or node.op != "call_function" or not _integral(node):
            continue
        if node.target is OPAQUE_COPY:
            continue
        tagged.add(node)
        todo.extend(node.all_input_nodes)
    for node in tagged:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return len(tagged)


class RecomputeHashMasks(CustomGraphPass):
    """recompute_hash_masks as an Inductor joint-graph pass (config ``joint_custom_pre_pass``)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        recompute_hash_masks(graph)

    def uuid(self) -> str:
        return "comera.passes.joint.recompute.recompute_hash_masks/1"
