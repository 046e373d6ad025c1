"""RMSNorm that keeps its output and the per-row 1/rms for the backward, not its input; SiLU-gated product
(SwiGLU's ``silu(gate) * up``) that keeps its two inputs, not silu's output besides.

The decoder LMs people pretrain (Llama, Qwen2, Mistral, ...) normalise with RMSNorm and gate their MLP with
SiLU.  Under autograd an RMSNorm keeps its input and the normalised input (two activations), although the
projections after it keep its output anyway; ``rms_norm`` keeps only that output (shared with them) and
rebuilds the normalised input as output / weight.  Features whose weight is 0, not finite or too small to
divide by keep their normalised column instead.  float32 and float64 only: other dtypes, mixed dtypes and
no-grad, torch.export or torch.compile calls run torch's ops (the first two with a warning, once).
``upcast_rms_norm``, transformers' form, keeps a 16-bit input alone and recomputes the norm in the backward.

``silu_mul`` keeps gate and up and recomputes silu(gate) in the backward (one elementwise op): the same
operations as autograd's backward of ``F.silu(gate) * up``, so the same gradients bit for bit, at any dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from comera_compile.ops.buffers import FLOATS, dtype_fallback, first_order, plain_ops

__all__ = ["rms_norm", "rms_norm_reference", "scaled_rms_norm", "silu_mul", "upcast_rms_norm", "cast_rms_norm"]

# |weight| below this (or 0, or not finite): the normalised input is kept for that feature, not rebuilt
_TINY_WEIGHT = 1e-20


def rms_norm_reference(x: torch.Tensor, dims: int, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)) over x's last `dims` dims, with torch's ops (as transformers'
    Llama RMSNorm writes it)."""
    axes = tuple(range(-dims, 0))
    y = x * torch.rsqrt(x.pow(2).mean(axes, keepdim=True) + eps)
    return y if weight is None else weight * y


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dims: int, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        axes = tuple(range(-dims, 0))
        rstd = torch.rsqrt(x.pow(2).mean(axes, keepdim=True) + eps)
        x_hat = x * rstd
        y = x_hat if weight is None else weight * x_hat
        cols = x.new_zeros(0, dtype=torch.int64)
        x_hat_cols = x.new_zeros(0)
        if weight is not None:
            w = weight.detach().reshape(-1)
            cols = (~(w.abs() >= _TINY_WEIGHT)).nonzero().view(-1)   # also catches NaN
            if cols.numel():
                x_hat_cols = x_hat.reshape(-1, w.numel())[:, cols]
        ctx.dims = dims
        ctx.save_for_backward(y, rstd, weight, cols, x_hat_cols)
        return y

    @staticmethod
    @first_order
    def backward(ctx, grad: torch.Tensor):
        y, rstd, weight, cols, x_hat_cols = ctx.saved_tensors
        axes = tuple(range(-ctx.dims, 0))
        if weight is None:
            x_hat, g_hat = y, grad
        else:
            x_hat = y / weight
            if cols.numel():
                d = weight.numel()
                x_hat = x_hat.reshape(-1, d)
                x_hat[:, cols] = x_hat_cols
                x_hat = x_hat.reshape(y.shape)
            g_hat = grad * weight
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = (g_hat - x_hat * (g_hat * x_hat).mean(axes, keepdim=True)) * rstd
        if weight is not None and ctx.needs_input_grad[2]:
            dw = (grad * x_hat).reshape(-1, *weight.shape).sum(0)
        return dx, None, dw, None


def rms_norm(x: torch.Tensor, dims: int = 1, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """rms_norm_reference(x, dims, weight, eps) that keeps its output and per-row 1/rms for backward instead
    of its input (torch's ops where no gradient is needed, under torch.export and torch.compile, and at other
    dtypes: see the module docstring)."""
    if plain_ops(x, weight):
        return rms_norm_reference(x, dims, weight, eps)
    dtypes = {t.dtype for t in (x, weight) if t is not None}
    if x.dtype not in FLOATS or len(dtypes) > 1:
        if x.is_floating_point():
            dtype_fallback("rms_norm", x.dtype, "it takes float32 and float64 inputs and a weight of the same "
                           "dtype" + (f"; got {', '.join(sorted(str(d).replace('torch.', '') for d in dtypes))}"
                                      if len(dtypes) > 1 else ""))
        return rms_norm_reference(x, dims, weight, eps)
    if weight is not None and tuple(weight.shape) != tuple(x.shape[x.dim() - dims:]):
        raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} for the last {dims} dim(s) of an input "
                         f"of shape {tuple(x.shape)}; give a weight of shape {tuple(x.shape[x.dim() - dims:])}")
    return _RMSNorm.apply(x, dims, weight, eps)


def scaled_rms_norm(h: torch.Tensor, weight: torch.Tensor | None, eps: float,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """weight * (h normalised over its last dim, at h's dtype, then cast to dtype): RMSNorm as transformers'
    decoders write it out (h is their float32 copy of the input, dtype the input's).  rms_norm where h, the
    cast and the weight share a float32 or float64 dtype; torch's ops otherwise (with a warning, once, where a
    gradient is needed).  A "weight" that is not one per feature (code that multiplies the normalised rows by
    another activation) multiplies rms_norm's output: the product keeps that output, as rms_norm does."""
    if h.dtype in FLOATS and dtype in (None, h.dtype) and (weight is None or weight.dtype == h.dtype):
        if weight is None or tuple(weight.shape) == (h.shape[-1],):
            return rms_norm(h, 1, weight, eps)
        return weight * rms_norm(h, 1, None, eps)
    if h.is_floating_point() and not plain_ops(h, weight):
        got = sorted({str(t.dtype).replace("torch.", "") for t in (h, weight) if t is not None} |
                     {str(dtype or h.dtype).replace("torch.", "")})
        dtype_fallback("rms_norm", dtype or h.dtype,
                       f"it takes float32 or float64 input, output and weight of one dtype; got {', '.join(got)}")
    y = rms_norm_reference(h, 1, None, eps)
    y = y if dtype is None else y.to(dtype)
    return y if weight is None else weight * y


def _upcast_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """transformers' decoder RMSNorm as it writes it: normalised in float32, cast back to x's dtype, scaled."""
    y = rms_norm_reference(x.to(torch.float32), 1, None, eps).to(x.dtype)
    return y if weight is None else weight * y


class _RecomputedUpcast(torch.autograd.Function):
    """_upcast_reference keeping x and the weight only: the backward runs the same ops again under autograd
    (at the forward's autocast setting), so its gradients are autograd's own."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        kind = x.device.type
        ctx.eps, ctx.autocast = eps, (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        ctx.save_for_backward(x, weight)
        return _upcast_reference(x, weight, eps)

    @staticmethod
    @first_order
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        kind, enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(kind, dtype, enabled=enabled):
            leaves = [None if t is None else t.detach().requires_grad_(need)
                      for t, need in zip((x, weight), ctx.needs_input_grad)]
            y = _upcast_reference(leaves[0], leaves[1], ctx.eps)
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(y, wanted, grad))
        return (*(next(grads) if t is not None and t.requires_grad else None for t in leaves), None)


def upcast_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """_upcast_reference(x, weight, eps), keeping less for backward.  float32 input: scaled_rms_norm (the
    output and 1/rms per row).  Other dtypes (a bfloat16 model): x (and the weight) alone are kept and the norm
    recomputed from x in the backward, not a float32 copy and the 16-bit normalised rows; the gradients are
    autograd's own, bit for bit (rebuilding the rows from a 16-bit output would not give them)."""
    if plain_ops(x, weight):
        return _upcast_reference(x, weight, eps)
    if x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
        return scaled_rms_norm(x, weight, eps)
    return _RecomputedUpcast.apply(x, weight, eps)


def cast_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                  dtype: torch.dtype | None) -> torch.Tensor:
    """weight * (x's float32 copy normalised, cast to dtype; None: back to x's dtype), the RMSNorm code
    writes out from a float32 copy of its input (``x.float()`` or ``x.to(torch.float32)``, then ``.to(dtype)``
    or ``.type_as(x)``): upcast_rms_norm where the cast goes back to x's dtype, else scaled_rms_norm."""
    if dtype is not None and dtype != x.dtype:
        return scaled_rms_norm(x.to(torch.float32), weight, eps, dtype)
    return upcast_rms_norm(x, weight, eps)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    @first_order
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        d_gate = d_up = None
        if ctx.needs_input_grad[0]:   # autograd's own steps: mul's gradient, then silu's
            d_gate = torch.ops.aten.silu_backward(grad * up, gate)
        if ctx.needs_input_grad[1]:
            d_up = grad * F.silu(gate)
        return _reduce_to(d_gate, gate), _reduce_to(d_up, up)


def _reduce_to(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """grad summed down to like's shape (the product broadcast its inputs), as autograd reduces it."""
    if grad is None or grad.shape == like.shape:
        return grad
    lead = grad.dim() - like.dim()
    grad = grad.sum(tuple(range(lead))) if lead else grad
    keep = tuple(i for i, (g, s) in enumerate(zip(grad.shape, like.shape)) if s == 1 and g != 1)
    return grad.sum(keep, keepdim=True) if keep else grad


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up keeping gate and up for backward, not silu's output besides (torch's ops where no
    gradient is needed and under torch.export and torch.compile)."""
    if plain_ops(gate, up):
        return F.silu(gate) * up
    return _SiluMul.apply(gate, up)
