"""Dropout that keeps its mask as bits, drawn from a counter-based splitmix64 stream.

Masks come from a counter-based splitmix64 stream, 31 bits per element, seeded by one draw from the default
generator (or the one given): reproducible under torch.manual_seed, and 3-5x cheaper on CPU than torch's
Bernoulli sampling, but not the masks torch would draw for the same seed.  The keep probability is the same
up to 2^-31 and the scaling the same 1 / (1 - p).  ``dropout_mask`` redraws a mask, e.g. to check results
against a reference that applies the same mask.  Eager CPU PyTorch keeps a float mask instead.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from comera_compile.ops.bits import bit_slice, pack_into
from comera_compile.ops.buffers import (FLOATS, HALF_FLOATS, Scratch, boxed_variant, chunks, forward_chunk, may_box,
                                         new_buffer_backward)

__all__ = ["dropout", "dropout_mask", "dropout_into", "dropout_backward_into", "check_p"]


# ---------------------------------------------------------------------------------------------------------
# Dropout masks: 31 random bits per element from a counter-based splitmix64 stream

# splitmix64 (Steele, Lea and Flood 2014): word i of a stream is a fixed mix of seed + i * golden.  Vectorised
# over int64 tensors it is ~2x faster than torch's CPU generator (serial mt19937 behind a lock) and uses every
# thread; the seed is one draw from torch's generator per call, so torch.manual_seed reproduces the masks.
_GOLDEN = 0x9E3779B97F4A7C15
_MIX = ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, None))


def _signed(v: int) -> int:
    v %= 2**64
    return v - 2**64 if v >= 2**63 else v


def check_p(p: float) -> float:
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    return p


def _seed(generator: torch.Generator | None, device: torch.device) -> int:
    """One 63-bit seed from the generator (the default one for the device when None)."""
    g_device = generator.device if generator is not None else device
    return int(torch.empty((), dtype=torch.int64, device=g_device).random_(generator=generator))


def _draw_keep(start: int, n: int, seed: int, p: float, scratch: Scratch) -> torch.Tensor:
    """int32 0/1 keep flags for elements start..start+n of the stream (start even), each kept with
    probability round((1 - p) 2^31) / 2^31: two per 64-bit word, 31 bits each."""
    w = (n + 1) // 2
    counter = scratch.counter
    if counter is None or counter.numel() < w:
        counter = torch.arange(w, dtype=torch.int64, device=scratch.device).mul_(_signed(_GOLDEN))
        scratch.counter = counter
    z = torch.add(counter[:w], _signed(seed + (start // 2) * _GOLDEN), out=scratch.get("a", w, torch.int64))
    tmp = scratch.get("b", w, torch.int64)
    for shift, mult in _MIX:
        torch.bitwise_right_shift(z, shift, out=tmp).bitwise_and_((1 << (64 - shift)) - 1)  # logical shift
        z.bitwise_xor_(tmp)
        if mult is not None:
            z.mul_(_signed(mult))  # wraps around, as unsigned arithmetic does
    r = z.view(torch.int32)[:n].bitwise_and_(0x7FFFFFFF)
    return r.sub_(round((1.0 - p) * 2**31)).bitwise_right_shift_(31).neg_()  # 1 where r < threshold


def dropout_mask(shape: torch.Size | tuple[int, ...], p: float, *, generator: torch.Generator | None = None,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """The keep mask (bool, `shape`) the functions here draw for dropout probability p, given the generator
    (default: torch's default generator) in the same state: e.g. for a reference applying the same mask."""
    p = check_p(p)
    n = math.prod(shape)
    device = torch.device(device) if device is not None else torch.device("cpu")
    scratch = Scratch(device)
    seed = _seed(generator, device)
    out = torch.empty(n, dtype=torch.bool, device=device)
    for a, b in chunks(n, forward_chunk(n)):
        out[a:b] = _draw_keep(a, b - a, seed, p, scratch)
    return out.reshape(shape)


def dropout_into(x: torch.Tensor, out: torch.Tensor, p: float, generator: torch.Generator | None,
                  scratch: Scratch) -> torch.Tensor:
    """out = x * keep / (1 - p) for contiguous x and out (out may be x); returns the packed keep bits."""
    scale = 1.0 / (1.0 - p)
    n = x.numel()
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
    seed = _seed(generator, x.device)
    xf, of = x.view(-1), out.view(-1)
    for a, b in chunks(n, forward_chunk(n)):
        keep = _draw_keep(a, b - a, seed, p, scratch)
        pack_into(scratch.get("flags", b - a, torch.uint8).copy_(keep), bits[a // 8:(b + 7) // 8], scratch)
        torch.mul(xf[a:b], keep, out=of[a:b])   # x * 0/1 (exact), then the scale, as eager rounds it
        of[a:b].mul_(scale)
    return bits


def dropout_backward_into(grad: torch.Tensor, out: torch.Tensor, bits: torch.Tensor, p: float,
                           scratch: Scratch) -> None:
    """out = grad * keep / (1 - p), chunk by chunk (out may be grad)."""
    gf, of = grad.view(-1), out.view(-1)
    for a, b in chunks(grad.numel()):
        torch.mul(gf[a:b], 1.0 / (1.0 - p), out=of[a:b]).mul_(bit_slice(bits, a, b, scratch))


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float, generator: torch.Generator | None) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        bits = dropout_into(x, out, p, generator, Scratch(x.device))
        ctx.p = p
        ctx.save_for_backward(bits)
        return out

    @staticmethod
    def _backward(ctx, grad: torch.Tensor, out: torch.Tensor):
        (bits,) = ctx.saved_tensors
        dropout_backward_into(grad, out, bits, ctx.p, Scratch(grad.device))
        return out, None, None

    backward = new_buffer_backward(_backward)


_DropoutBoxed = boxed_variant(_Dropout, _Dropout._backward)


def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, *,
            generator: torch.Generator | None = None) -> torch.Tensor:
    """F.dropout that keeps its mask as bits for backward (32x less than a float32 mask, 8x less than a byte
    mask); float32, float64, bfloat16 and float16 (torch's op at other dtypes)."""
    p = check_p(p)
    if not training or p == 0.0 or p == 1.0 or x.dtype not in FLOATS + HALF_FLOATS:
        return F.dropout(x, p, training)
    if not (torch.is_grad_enabled() and x.requires_grad):
        x = x.contiguous()
        out = torch.empty_like(x)
        dropout_into(x, out, p, generator, Scratch(x.device))
        return out
    return (_DropoutBoxed if may_box() else _Dropout).apply(x, p, generator)
