"""LayerNorm that keeps its output and the per-row 1/std for the backward, not its input.

Backward rebuilds the normalised input from the output, (y - bias) / weight.  Features whose weight is 0 or
small next to the bias (|bias| > 8 |weight|, where that division would lose digits) keep their normalised
input column instead.  float32 and float64 only: other dtypes, and inputs whose dtypes differ (autocast hands
a bfloat16 input with float32 weights), run torch's op with a warning (once); no-grad, torch.export and
torch.compile do too.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from comera_compile.ops.buffers import FLOATS, dtype_fallback, first_order, plain_ops

__all__ = ["layer_norm"]


# ---------------------------------------------------------------------------------------------------------
# LayerNorm from its output

_BIAS_RATIO = 8.0  # features with |bias| > this * |weight| keep their normalised input (see module docstring)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None,
                bias: torch.Tensor | None, eps: float) -> torch.Tensor:
        x = x.contiguous()
        y, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        d = math.prod(shape)
        cols = x.new_zeros(0, dtype=torch.int64)
        if weight is not None:
            w = weight.detach().reshape(-1)
            bad = (w == 0) | ~torch.isfinite(w)
            if bias is not None:
                bad |= bias.detach().reshape(-1).abs() > _BIAS_RATIO * w.abs()
            cols = bad.nonzero().view(-1)
        x_hat_cols = ((x.view(-1, d)[:, cols] - mean.view(-1, 1)) * rstd.view(-1, 1)) if cols.numel() else \
            x.new_zeros(0)
        ctx.shape, ctx.d = shape, d
        ctx.save_for_backward(y, rstd, weight, bias, cols, x_hat_cols)
        return y

    @staticmethod
    @first_order
    def backward(ctx, grad: torch.Tensor):
        y, rstd, weight, bias, cols, x_hat_cols = ctx.saved_tensors
        if weight is None and bias is None:
            x_hat = y
        else:
            x_hat = y - bias if bias is not None else y.clone()
            if weight is not None:
                x_hat.div_(weight)
            if cols.numel():
                x_hat.view(-1, ctx.d)[:, cols] = x_hat_cols
        # The normalised input has mean 0 and std 1 per row: ATen's kernel with mean 0 and rstd 1 gives the
        # gradient with respect to it (and exact weight and bias gradients); the chain rule adds rstd.
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[2],
                bias is not None and ctx.needs_input_grad[3]]
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            grad.contiguous(), x_hat, list(ctx.shape), torch.zeros_like(rstd), torch.ones_like(rstd),
            weight, bias, mask)
        if dx is not None:
            dx.mul_(rstd)
        return dx, None, dw, db, None


def layer_norm(x: torch.Tensor, normalized_shape: int | tuple[int, ...] | torch.Size,
               weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """F.layer_norm that keeps its output and per-row 1/std for backward instead of its input (torch's op
    where no gradient is needed, under torch.export and torch.compile, and at other dtypes: see the module
    docstring)."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if plain_ops(x, weight, bias):
        return F.layer_norm(x, shape, weight, bias, eps)
    dtypes = {t.dtype for t in (x, weight, bias) if t is not None}
    if x.dtype not in FLOATS or len(dtypes) > 1:
        if x.is_floating_point():
            dtype_fallback("layer_norm", x.dtype, "it takes float32 and float64 inputs, weight and bias of one "
                           "dtype" + (f"; got {', '.join(sorted(str(d).replace('torch.', '') for d in dtypes))}"
                                      if len(dtypes) > 1 else ""))
        return F.layer_norm(x, shape, weight, bias, eps)
    return _LayerNorm.apply(x, shape, weight, bias, eps)
