"""Dropout whose keep-mask is an integer hash of the element index, computed inside the compiled kernel.

Torch draws a dropout mask element by element from a stateful generator: eagerly from mt19937 behind a lock,
under Inductor from Philox, both far slower per element than the multiply they feed (a third of a
tensorized six-encoder training step on CPU).  ``hash_dropout`` keeps element i when a fixed 32-bit mix of
(i * a + b) is at least p * 2^32, where a (odd) and b are drawn once per call from torch's generator.  The
mask is then plain integer arithmetic on an iota: Inductor fuses it into the elementwise kernel around it,
vectorised, and AOTAutograd may recompute it in the backward instead of saving it.  Each element is kept
with probability 1 - p (to 2^-32), scaled by 1 / (1 - p), as torch's dropout does; ``torch.manual_seed``
reproduces the masks; the bits differ from eager's (as Inductor's Philox bits already do).

``fast_dropout(gm)`` swaps every dropout of a GraphModule (functional calls and nn.Dropout modules) for it;
the "comera" backend runs it by default (option ``fast_dropout``).
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

__all__ = ["hash_dropout", "HashDropout", "fast_dropout"]

_M32 = 0xFFFFFFFF
# Two odd multipliers below 2^31, so every product of a 32-bit value stays below 2^63 in int64 arithmetic
# (no overflow, no undefined behaviour in generated C++).  The first is from Wellons' "lowbias32" search.
_C1 = 0x7FEB352D
_C2 = 0x2C1B3C6D


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit finaliser (xor-shift-multiply, three rounds) on int64 values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = (h * _C1) & _M32
    h = h ^ (h >> 15)
    h = (h * _C2) & _M32
    return h ^ (h >> 16)


def hash_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.dropout`` with hash-based masks (see the module docstring)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return input
    if p == 1.0:
        return input.zero_() if inplace else input * 0.0
    words = torch.randint(0, 2**30, (2,), device=input.device, dtype=torch.int64)
    a, b = words[0] * 2 + 1, words[1]
    idx = torch.arange(input.numel(), device=input.device, dtype=torch.int64)
    if input.numel() > _M32:
        idx = idx & _M32
    keep = _mix32((idx * a + b) & _M32) >= round(p * 2**32)
    scale = 1.0 / (1.0 - p)
    mask = keep.view(input.shape)
    if inplace:
        return input.mul_(mask).mul_(scale)
    return input * mask * scale


class HashDropout(nn.Dropout):
    """nn.Dropout with hash_dropout's masks; same p, inplace and train/eval behaviour."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return hash_dropout(input, self.p, self.training, self.inplace)


_FUNCTIONAL = (F.dropout, torch.dropout, torch.nn.functional.dropout)


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
