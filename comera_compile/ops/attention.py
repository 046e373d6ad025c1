"""softmax -> dropout -> matmul (attention) keeping the softmax output once and the mask as bits; the
softmax backward is computed from its output."""

from __future__ import annotations


import torch

from comera_compile.ops.bit_dropout import check_p, dropout, dropout_into
from comera_compile.ops.bits import unpack
from comera_compile.ops.buffers import FLOATS, Scratch, first_order

__all__ = ["softmax_dropout_matmul"]


# ---------------------------------------------------------------------------------------------------------
# Attention: softmax -> dropout -> matmul


class _SoftmaxDropoutMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: torch.Tensor, v: torch.Tensor, p: float,
                generator: torch.Generator | None) -> torch.Tensor:
        probs = torch.softmax(scores, dim=-1)
        dropped = torch.empty_like(probs)
        bits = dropout_into(probs, dropped, p, generator, Scratch(probs.device))
        out = torch.matmul(dropped, v)
        ctx.p = p
        ctx.save_for_backward(probs, bits, v)
        return out

    @staticmethod
    @first_order
    def backward(ctx, grad: torch.Tensor):
        probs, bits, v = ctx.saved_tensors
        scale = 1.0 / (1.0 - ctx.p)
        keep = unpack(bits, probs.numel()).view(probs.shape)   # 0/1 bytes
        d_scores = d_v = None
        if ctx.needs_input_grad[1]:
            dropped = torch.mul(probs, scale).mul_(keep)
            d_v = torch.matmul(dropped.transpose(-1, -2), grad)
            del dropped
            if d_v.shape != v.shape:
                d_v = d_v.sum_to_size(v.shape)
        if ctx.needs_input_grad[0]:
            d_dropped = torch.matmul(grad, v.transpose(-1, -2))
            d_dropped.mul_(scale).mul_(keep)
            if d_dropped.shape != probs.shape:   # scores broadcast against v: the softmax backward is linear
                d_dropped = d_dropped.sum_to_size(probs.shape)
            d_scores = torch._softmax_backward_data(d_dropped, probs, -1, probs.dtype)
        return d_scores, d_v, None, None


def softmax_dropout_matmul(scores: torch.Tensor, v: torch.Tensor, p: float = 0.1, training: bool = True,
                           dim: int = -1, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """dropout(softmax(scores, dim), p) @ v, keeping the softmax output once and the mask as bits."""
    p = check_p(p)
    last = dim in (-1, scores.dim() - 1)
    fusable = (training and 0.0 < p < 1.0 and last and scores.dtype in FLOATS and v.dtype == scores.dtype
               and v.dim() >= 2 and scores.dim() >= 2 and not torch.is_autocast_enabled(scores.device.type))
    if not fusable or not (torch.is_grad_enabled() and (scores.requires_grad or v.requires_grad)):
        return torch.matmul(dropout(torch.softmax(scores, dim=dim), p, training, generator=generator), v)
    return _SoftmaxDropoutMatmul.apply(scores, v, p, generator)
