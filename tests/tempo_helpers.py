"""Helpers shared by the Tempo tests (test_tempo_ops, test_tempo_passes, test_tempo_fixes): tolerances and references
computed with the original torch ops."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck
from torch import nn

from comera_compile.ops.bit_dropout import dropout_mask

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
SETTINGS = dict(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got, ref, rtol=TOL[dtype], atol=TOL[dtype], equal_nan=True)


def grads_of(fn, inputs: list[torch.Tensor], grad_out: torch.Tensor) -> list[torch.Tensor]:
    """Output and input gradients of fn(*inputs) for the upstream gradient grad_out (a fresh graph)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in leaves]


def same_mask_dropout(p: float, seed: int):
    """Reference dropout: the mask dropout_mask draws from a generator seeded `seed`, applied as eager
    dropout does (x * (mask / (1 - p))), differentiated by ordinary autograd."""

    def drop(x: torch.Tensor) -> torch.Tensor:
        mask = dropout_mask(x.shape, p, generator=torch.Generator().manual_seed(seed))
        return x * (mask.to(x.dtype) * (1.0 / (1.0 - p)))

    return drop


class MaskReplayDropout(nn.Module):
    """Dropout applying the masks the Tempo ops draw from the default generator, in call order (a reference
    for a model whose dropouts the Tempo ops replaced, run with the same seed)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        return x * (dropout_mask(x.shape, self.p).to(x.dtype) * (1.0 / (1.0 - self.p)))
