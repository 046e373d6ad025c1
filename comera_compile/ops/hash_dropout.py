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

import functools
import hashlib
from pathlib import Path

import torch
from torch import nn

from comera_compile.ops.materialize import materialize

__all__ = ["hash_dropout", "HashDropout", "draw_words", "cache_marks"]


_M32 = 0xFFFFFFFF
_INT32_INDICES = 2**31   # tensors with fewer elements hash in int32
# Odd multipliers below 2^31 of a well-mixing 32-bit xor-shift-multiply finaliser.
_C1 = 0x7FEB352D
_C2 = 0x2C1B3C6D


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit finaliser (xor-shift-multiply) on int32 words; the masks after each right shift make the
    shifts logical.  int32 products wrap around (two's complement), as torch's kernels and Inductor's
    vectorised code (a 32-bit vector multiply) compute them.  In the scalar C++ Inductor generates for a
    loop's tail, a wrapping signed product is formally undefined; the compilers it uses emit the wrapping
    multiply, and test_int32_path_masks_are_the_documented_hash checks the bits, eager and compiled,
    against the hash in Python integers.  The same mix in int64 with masking is defined everywhere but
    3.5x slower on AVX2 (no 64-bit vector multiply), so the int32 form stays."""
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _C1
    h = h ^ ((h >> 15) & 0x1FFFF)
    h = h * _C2
    return h ^ ((h >> 16) & 0xFFFF)


def _mix64(h: torch.Tensor) -> torch.Tensor:
    """The same finaliser on int64 values in [0, 2^32), with no wrap-around (for tensors of 2^31 elements
    or more, whose indices do not fit in int32)."""
    h = h ^ (h >> 16)
    h = (h * _C1) & _M32
    h = h ^ (h >> 15)
    h = (h * _C2) & _M32
    return h ^ (h >> 16)


def draw_words(sites: int, device: torch.device | str) -> torch.Tensor:
    """2 x sites random words in [0, 2^30) (int32) from torch's generator, in a buffer of their own: Inductor
    would otherwise inline the torch.randint into the elementwise kernel and run Philox again for every
    vector of elements (three times the cost of the whole mask).  One draw serves every dropout of a graph
    (passes.fx.dropout hands site i words[2i:2i+2]); on the CPU generator it gives the words one draw per
    site would, in the same order, when no other draw from the generator comes between the sites."""
    return materialize(torch.randint(0, 2**30, (2 * sites,), device=device, dtype=torch.int32))


def _keep(n: int, p: float, device: torch.device, words: torch.Tensor | None = None) -> torch.Tensor:
    """Bool keep flags for n elements: element i is kept when mix(i * a + b) >= p * 2^32 (as 32-bit
    unsigned words), a odd and b the two words (drawn from torch's generator when not given)."""
    if words is None:
        words = draw_words(1, device)
    if n < _INT32_INDICES:
        idx = torch.arange(n, device=device, dtype=torch.int32)
        h = _mix32(idx * (words[0] * 2 + 1) + words[1])
        return (h & 0x7FFFFFFF) >= round(p * 2**31)   # 31 of the 32 bits
    words = words.to(torch.int64)
    idx = torch.arange(n, device=device, dtype=torch.int64) & _M32
    return _mix64((idx * (words[0] * 2 + 1) + words[1]) & _M32) >= round(p * 2**32)


def hash_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False,
                 words: torch.Tensor | None = None) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.dropout`` with hash-based masks (see the module docstring); words,
    when given, are the mask's two random words (else drawn here)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return input
    if p == 1.0:
        return input.zero_() if inplace else input * 0.0
    mask = _keep(input.numel(), p, input.device, words).view(input.shape)
    scale = 1.0 / (1.0 - p)
    if inplace:
        return input.mul_(mask).mul_(scale)
    return input * mask * scale


class HashDropout(nn.Dropout):
    """nn.Dropout with hash_dropout's masks; same p, inplace and train/eval behaviour."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return hash_dropout(input, self.p, self.training, self.inplace)


@functools.cache
def cache_marks() -> dict[str, str]:
    """The functions passes.fx.dropout puts into dynamo's graph, by the names AOTAutograd's cache checks, each
    with a hash of this module's source (Inductor's ``unsafe_marked_cacheable_functions``).  Unmarked, a
    graph holding them bypasses that cache, so every process and every new run traces its joint graph again;
    the hash makes an edit here a new cache key."""
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    return {f"{f.__module__}.{f.__name__}": f"comera-hash-dropout-{digest}" for f in (hash_dropout, draw_words)}
