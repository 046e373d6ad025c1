"""Dropout whose keep-mask is an integer hash of the element index, computed inside the compiled kernel.

Torch draws a dropout mask element by element from a stateful generator: eagerly from mt19937 behind a lock,
under Inductor from Philox, both far slower per element than the multiply they feed (a third of a
tensorized six-encoder training step on CPU).  ``hash_dropout`` keeps element i when a fixed 32-bit
mix of (i * a + b), read as 31 bits, is at least p * 2^31, where a (odd) and b are drawn once per call from
torch's generator.  The mask is then plain integer arithmetic on an iota: Inductor fuses it into the
elementwise kernel around it, vectorised, and AOTAutograd may recompute it in the backward instead of
saving it.  Each element is kept with probability 1 - p (to 2^-31), scaled by 1 / (1 - p), as torch's
dropout does; ``torch.manual_seed`` reproduces the masks; the bits differ from eager's (as Inductor's
Philox bits already do).

``fast_dropout(gm)`` swaps every dropout of a GraphModule (functional calls and nn.Dropout modules) for it;
the "comera" backend runs it by default (option ``fast_dropout``).
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.checkpoint import CheckpointPolicy

from comera_compile.passes.materialize import materialize

__all__ = ["hash_dropout", "HashDropout", "fast_dropout", "recompute_hash_masks", "RecomputeHashMasks"]

_M32 = 0xFFFFFFFF
_INT32_INDICES = 2**31   # tensors with fewer elements: int32 random words, 31 bits of the mix compared
# Odd multipliers below 2^31 (the first from Wellons' "lowbias32" search).
_C1 = 0x7FEB352D
_C2 = 0x2C1B3C6D


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit finaliser (xor-shift-multiply) on 32-bit words held in int64, in [0, 2^32): each product
    (below 2^63) is reduced mod 2^32 by a mask, so no signed type overflows -- signed int32 overflow is
    undefined behaviour in the C++ Inductor generates.  The same bits as the wrapping int32 computation
    (unsigned arithmetic mod 2^32) of earlier versions."""
    h = h ^ (h >> 16)
    h = (h * _C1) & _M32
    h = h ^ (h >> 15)
    h = (h * _C2) & _M32
    return h ^ (h >> 16)


def _mix64(h: torch.Tensor) -> torch.Tensor:
    """The same finaliser on int64 values in [0, 2^32), with no wrap-around (for tensors of 2^31 elements
    or more, whose indices do not fit in int32)."""
    h = h ^ (h >> 16)
    h = (h * _C1) & _M32
    h = h ^ (h >> 15)
    h = (h * _C2) & _M32
    return h ^ (h >> 16)


def _draw_words(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Two random words in [0, 2^30) from torch's generator, in a buffer of their own: Inductor would
    otherwise inline the torch.randint into the elementwise kernel and run Philox again for every vector
    of elements (three times the cost of the whole mask)."""
    return materialize(torch.randint(0, 2**30, (2,), device=device, dtype=dtype))


def _keep(n: int, p: float, device: torch.device) -> torch.Tensor:
    """Bool keep flags for n elements: element i is kept when mix(i * a + b) >= p * 2^32 (as 32-bit
    unsigned words), a odd and b drawn from torch's generator."""
    if n < _INT32_INDICES:
        words = _draw_words(device, torch.int32).to(torch.int64)   # int32 saved for the backward
        idx = torch.arange(n, device=device, dtype=torch.int64)
        h = _mix32((idx * (words[0] * 2 + 1) + words[1]) & _M32)      # below 2^62 before the mask
        return (h & 0x7FFFFFFF) >= round(p * 2**31)   # 31 of the 32 bits
    words = _draw_words(device, torch.int64)
    idx = torch.arange(n, device=device, dtype=torch.int64) & _M32
    return _mix64((idx * (words[0] * 2 + 1) + words[1]) & _M32) >= round(p * 2**32)


def _integral(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and not (val.is_floating_point() or val.is_complex())


def recompute_hash_masks(graph: torch.fx.Graph) -> int:
    """Tag the integer/bool nodes of every hash-dropout mask in a joint forward-backward graph
    MUST_RECOMPUTE, so AOTAutograd's partitioner saves the two random words for the backward and
    recomputes the mask there instead of saving it; returns how many nodes were tagged.

    Recomputing costs a few integer operations per element inside a kernel the backward runs anyway; a
    saved mask costs a byte per element of memory and, on CPU, Inductor's bool stores are slow (about
    10 ns per element, several times the cost of the rest of the dropout's kernel)."""
    words = [n for n in graph.nodes
             if n.op == "call_function" and n.target is torch.ops.comera.opaque_copy.default and _integral(n)]
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
        if node.target is torch.ops.comera.opaque_copy.default:
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
        return "comera.passes.dropout.recompute_hash_masks/1"


def hash_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.dropout`` with hash-based masks (see the module docstring)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return input
    if p == 1.0:
        return input.zero_() if inplace else input * 0.0
    mask = _keep(input.numel(), p, input.device).view(input.shape)
    scale = 1.0 / (1.0 - p)
    if inplace:
        return input.mul_(mask).mul_(scale)
    return input * mask * scale


class HashDropout(nn.Dropout):
    """nn.Dropout with hash_dropout's masks; same p, inplace and train/eval behaviour."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return hash_dropout(input, self.p, self.training, self.inplace)


_FUNCTIONAL = (F.dropout, torch.dropout)


def fast_dropout(gm: torch.fx.GraphModule) -> int:
    """Replace gm's dropouts -- F.dropout / torch.dropout calls and nn.Dropout submodules -- by hash
    dropout, in place; returns how many were replaced."""
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
    return count
