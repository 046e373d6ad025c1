"""softmax -> dropout -> matmul (attention) keeping the softmax output once and the mask as bits; the
softmax backward is computed from its output, as torch's is.  Any floating dtype the matmul takes (float32,
float64, bfloat16, float16; scores and v of one dtype).  Under autocast each op runs at the dtype autocast
gives it (the softmax at float32 on CUDA, the matmul at the autocast dtype) and the same things are kept,
plus the matmul's cast of v where torch keeps one too."""

from __future__ import annotations


import torch
import torch.nn.functional as F

from comera_compile.ops.bit_dropout import check_p, dropout, dropout_into
from comera_compile.ops.bits import unpack
from comera_compile.ops.buffers import (FLOATS, HALF_FLOATS, Scratch, autocast_dtype, dtype_fallback,
                                         first_order, plain_ops, traced)

__all__ = ["softmax_dropout_matmul"]


# ---------------------------------------------------------------------------------------------------------
# Attention: softmax -> dropout -> matmul


class _SoftmaxDropoutMatmul(torch.autograd.Function):
    """Runs with autocast off: its caller casts scores to the softmax's dtype and v to the matmul's."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, v: torch.Tensor, p: float,
                generator: torch.Generator | None) -> torch.Tensor:
        probs = torch.softmax(scores, dim=-1)
        dropped = torch.empty_like(probs)
        bits = dropout_into(probs, dropped, p, generator, Scratch(probs.device))
        out = torch.matmul(dropped.to(v.dtype), v)
        ctx.p = p
        ctx.save_for_backward(probs, bits, v)
        return out

    @staticmethod
    @first_order
    def backward(ctx, grad: torch.Tensor):
        probs, bits, v = ctx.saved_tensors
        with torch.autocast(grad.device.type, enabled=False):
            return _SoftmaxDropoutMatmul._backward(ctx, grad, probs, bits, v)

    @staticmethod
    def _backward(ctx, grad: torch.Tensor, probs: torch.Tensor, bits: torch.Tensor, v: torch.Tensor):
        scale = 1.0 / (1.0 - ctx.p)
        keep = unpack(bits, probs.numel()).view(probs.shape)   # 0/1 bytes
        d_scores = d_v = None
        if ctx.needs_input_grad[1]:
            dropped = torch.mul(probs, scale).mul_(keep).to(v.dtype)
            d_v = torch.matmul(dropped.transpose(-1, -2), grad.to(v.dtype))
            del dropped
            if d_v.shape != v.shape:
                d_v = d_v.sum_to_size(v.shape)
        if ctx.needs_input_grad[0]:
            d_dropped = torch.matmul(grad.to(v.dtype), v.transpose(-1, -2)).to(probs.dtype)
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
    wanted = training and 0.0 < p < 1.0 and last and v.dim() >= 2 and scores.dim() >= 2 \
        and not plain_ops(scores, v)
    kind = scores.device.type
    autocast = torch.is_autocast_enabled(kind)
    if autocast and torch.float64 in (scores.dtype, v.dtype):   # autocast leaves float64 as it is
        wanted = False
    if wanted and not autocast and (scores.dtype not in FLOATS + HALF_FLOATS or v.dtype != scores.dtype):
        if scores.is_floating_point():
            dtype_fallback("attention", scores.dtype, "it takes scores and v of one floating dtype")
        wanted = False
    if not wanted:
        probs = torch.softmax(scores, dim=dim)
        dropped = F.dropout(probs, p, training) if traced() else dropout(probs, p, training, generator=generator)
        return torch.matmul(dropped, v)
    if autocast:   # the dtypes autocast would run the softmax and the matmul at
        soft, low = autocast_dtype("softmax", scores), torch.get_autocast_dtype(kind)
        scores, v = scores.to(soft), v.to(low)
        with torch.autocast(kind, enabled=False):
            return _SoftmaxDropoutMatmul.apply(scores, v, p, generator)
    return _SoftmaxDropoutMatmul.apply(scores, v, p, generator)
