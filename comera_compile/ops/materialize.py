"""``materialize(t)``: a copy Inductor cannot see through (a custom op), so a value lands in its own
buffer instead of being recomputed inside every kernel that reads it (see passes.fx.materialize)."""

from __future__ import annotations

import torch

__all__ = ["materialize", "OPAQUE_COPY"]


@torch.library.custom_op("comera::opaque_copy", mutates_args=())
def materialize(t: torch.Tensor) -> torch.Tensor:
    """A copy of t that Inductor keeps as a buffer (see the module docstring).  No gradient: for integer
    tensors and values computed from them."""
    return t.clone()


@materialize.register_fake
def _(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t)


OPAQUE_COPY = torch.ops.comera.opaque_copy.default   # the op as graph nodes name it
