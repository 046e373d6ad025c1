"""Tempo memory passes: GELU, LayerNorm, dropout and attention that keep less for the backward pass.

Tempo (Andoorveedu et al., NeurIPS 2022, arXiv 2210.10246) rewrites a transformer's GELU, LayerNorm and
attention so that autograd keeps fewer and smaller tensors, with the same gradients.  Here each rewrite is
an autograd Function:

- GELU keeps its *output* (which the next layer keeps anyway) plus one bit per element: the branch, since
  GELU is not one-to-one below its minimum x0 = -0.7518 (tanh form: -0.7522).  Backward gets the derivative
  from the output and the branch: in s = sqrt(y - y_min) both branches are smooth, and GELU' is tabulated
  against s (float32: quadratic interpolation, within 1.5e-7, float32 rounding level) or the input is
  recovered by a table guess and three Newton steps (float64: machine precision).  Where that is
  ill-conditioned -- within 0.1 (float64: 0.02) of x0, and below -3 where GELU flattens out -- the input
  itself is kept for those few elements (about 6% of N(0, 1) inputs; index and value).
- GELU followed by dropout is fused: it keeps the dropout output (again what the next layer keeps), the
  dropout mask as bits and the branch bits, instead of the GELU input, a float mask and the dropout output.
- LayerNorm keeps its output and the per-row 1/std; backward rebuilds the normalised input from the output,
  (y - bias) / weight.  Features whose weight is 0 or small next to the bias (|bias| > 8 |weight|, where that
  division would lose digits) keep their normalised input column instead.
- Dropout keeps its mask as bits (eager CPU PyTorch keeps a float mask).
- softmax -> dropout -> matmul (attention) keeps the softmax output once (not a dropped-out copy as well),
  the mask as bits, and computes the softmax backward from its output.

float32 and float64 take these paths; other dtypes, no-grad and eval mode run the original ops.  Dropout
masks come from a counter-based splitmix64 stream, 31 bits per element, seeded by one draw from the default
generator (or the one given): reproducible under torch.manual_seed, and 3-5x cheaper on CPU than torch's
Bernoulli sampling, but not the masks torch would draw for the same seed.  The keep probability is the same
up to 2^-31 and the scaling the same 1 / (1 - p).  ``dropout_mask`` redraws a mask, e.g. to check results
against a reference that applies the same mask.

Elementwise work runs in slices of 2^17 (forward: 2^19) elements with reused scratch buffers (fresh memory costs a page
fault per 4 KiB on first touch, as much as the arithmetic), and a backward writes its result into the
incoming gradient's buffer when nothing else can see that buffer.

Three entry points: ``tempo_graph(gm)`` rewrites a torch.fx GraphModule in place (e.g. the result of
comera_compile.tensorize), ``tempo_modules(model)`` swaps nn.GELU, nn.LayerNorm and nn.Dropout submodules of
any model for their Tempo versions (for models torch.fx cannot trace; the attention pattern needs the
graph), and ``tempo(model)`` tries the first and falls back to the second.  Each records what it replaced
in a ``TempoSummary`` (``.tempo_summary`` on the result, and logged by the "comera_compile.memory" logger).
"""

from __future__ import annotations

import logging
import math
import operator
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

__all__ = [
    "gelu", "gelu_dropout", "layer_norm", "dropout", "softmax_dropout_matmul", "dropout_mask",
    "pack_bits", "unpack_bits", "TempoGELU", "TempoLayerNorm", "TempoDropout", "TempoSummary",
    "tempo_graph", "tempo_modules", "tempo",
]

logger = logging.getLogger("comera_compile.memory")

_FLOATS = (torch.float32, torch.float64)
# Elements per slice of the elementwise loops (multiples of 8: whole bytes of bits).  Backward passes, which
# run at the step's memory peak, take smaller slices (less scratch); forward passes larger (fewer ops).
_CHUNK = 1 << 17
_CHUNK_FORWARD = 1 << 19


def _chunks(n: int, size: int = _CHUNK) -> Iterator[tuple[int, int]]:
    """(start, stop) slices of range(n)."""
    for start in range(0, n, size):
        yield start, min(start + size, n)


def _forward_chunk(n: int) -> int:
    """Slice length for a forward loop over n elements: large, but at most a quarter of the tensor (scratch
    buffers a few times the slice would otherwise outweigh what the pass saves on mid-sized tensors)."""
    return max(_CHUNK, min(_CHUNK_FORWARD, (n // 4 + 7) // 8 * 8))


class _Scratch:
    """Slice-sized buffers reused across the slices of one call: raw bytes per name, viewed as any dtype,
    so loops run one after another share them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}
        self.counter: torch.Tensor | None = None   # the random stream's word counters (times the constant)

    def get(self, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = n * dtype.itemsize
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1 << 14), dtype=torch.uint8, device=self.device)
            self.buffers[name] = buf
        return buf[:nbytes].view(dtype)


# ---------------------------------------------------------------------------------------------------------
# Gradient buffers: a backward may write its result into the incoming gradient when nothing else can see it


def _ref_counts(t: torch.Tensor) -> tuple[int, ...]:
    """Python and C++ reference counts of t, of its storage and of its base (if t is a view)."""
    base = t._base
    counts = (sys.getrefcount(t), t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata))
    if base is not None:
        counts += (sys.getrefcount(base), base._use_count())
    return counts


def _sole_owner_counts(make: Callable[[], torch.Tensor]) -> tuple[int, ...]:
    """_ref_counts of a tensor referenced by nothing but a local variable, reached as in _take_grad."""
    grads = [make()]
    grad = grads.pop()
    return _ref_counts(grad)


def _sole_counts(view: bool) -> tuple[int, ...] | None:
    """The counts of a sole-owned tensor (a view when `view`), measured now: the interpreter's own
    references to a frame's locals can change during a run (after a failed torch.compile, for one), so
    a baseline taken once at import would stop matching.  None without the private APIs."""
    try:
        return _sole_owner_counts((lambda: torch.empty(8).view(2, 4)) if view else (lambda: torch.empty(8)))
    except (AttributeError, RuntimeError, TypeError):
        return None


_REFCOUNTS = _sole_counts(False) is not None   # without them, gradients are never reused (always new)


def _take_grad(grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(gradient, buffer for the input gradient) from a boxed backward's gradient list (emptied).

    The buffer is the gradient itself when no one else holds it, its storage or its base (no hook kept
    it, it is not expanded, not shared with another consumer): as autograd's AccumulateGrad steals a
    gradient it owns, this saves a full-size allocation at the backward pass's peak.  Otherwise a new one."""
    grad = grads.pop()
    grads.clear()
    if _REFCOUNTS and grad.is_contiguous() and not grad.requires_grad and \
            _ref_counts(grad) == _sole_counts(grad._base is not None):
        return grad, grad
    grad = grad.contiguous()
    return grad, torch.empty_like(grad)


def _boxed() -> bool:
    """Whether the Functions may take their gradients boxed (not under torch.compile or compiled autograd,
    which do not support it)."""
    if torch.compiler.is_compiling():
        return False
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return not (ca is not None and getattr(ca, "compiled_autograd_enabled", False))


# ---------------------------------------------------------------------------------------------------------
# Bit packing: uint8 0/1 flags <-> 8 per byte, with int64 arithmetic on 8 bytes at a time (little endian)

_PACK = 0x0102040810204080            # gathers bit 0 of each byte of a word into the top byte
_SPREAD = 0x0101010101010101          # copies a byte into all eight
_SELECT = 0x8040201008040201 - 2**64  # byte k keeps bit k (constants above 2**63 written as signed int64)
_ROUND = 0x7F7F7F7F7F7F7F7F           # sets a byte's top bit when the byte is non-zero
_ONES = 0x0101010101010101
_LITTLE = sys.byteorder == "little"


def _pack_into(flags: torch.Tensor, out: torch.Tensor, scratch: _Scratch | None = None) -> None:
    """Pack uint8 0/1 flags into `out` (uint8, ceil(len / 8)); flags is padded with zeros as needed."""
    n = flags.numel()
    if n % 8 or not _LITTLE:
        padded = flags.new_zeros(8 * out.numel())
        padded[:n] = flags
        flags = padded
    if not _LITTLE:
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=flags.device)
        out.copy_((flags.view(-1, 8) * weights).sum(-1, dtype=torch.uint8))
        return
    words = flags.view(torch.int64)
    tmp = scratch.get("pack", words.numel(), torch.int64) if scratch is not None else torch.empty_like(words)
    torch.mul(words, _PACK, out=tmp)  # wraps around: only the top byte is wanted
    out.copy_(tmp.bitwise_right_shift_(56))  # int64 -> uint8 keeps the low byte


def _unpack(packed: torch.Tensor, n: int, scratch: _Scratch | None = None) -> torch.Tensor:
    """The first n uint8 0/1 flags packed in `packed` (bit k of byte j is flag 8j + k)."""
    if not _LITTLE:
        shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
        return ((packed.unsqueeze(-1) >> shifts) & 1).view(-1)[:n]
    words = scratch.get("unpack", packed.numel(), torch.int64) if scratch is not None else \
        torch.empty(packed.numel(), dtype=torch.int64, device=packed.device)
    words.copy_(packed).mul_(_SPREAD).bitwise_and_(_SELECT).add_(_ROUND)
    return words.bitwise_right_shift_(7).bitwise_and_(_ONES).view(torch.uint8)[:n]


def _bits(packed: torch.Tensor, a: int, b: int, scratch: _Scratch | None = None) -> torch.Tensor:
    """uint8 0/1 flags a..b (a a multiple of 8) of a packed tensor."""
    return _unpack(packed[a // 8:(b + 7) // 8], b - a, scratch)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool (or 0/1) tensor as bits, 8 per byte, in row-major order: uint8 of length ceil(numel / 8)."""
    flags = mask.reshape(-1).to(torch.uint8)
    out = torch.empty((flags.numel() + 7) // 8, dtype=torch.uint8, device=mask.device)
    _pack_into(flags, out)
    return out


def unpack_bits(packed: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """The bool tensor of `shape` that pack_bits packed."""
    n = math.prod(shape)
    if packed.dtype != torch.uint8 or packed.numel() != (n + 7) // 8:
        raise ValueError(f"unpack_bits needs the uint8 tensor pack_bits made from {n} elements "
                         f"({(n + 7) // 8} bytes); got {packed.numel()} elements of {packed.dtype}")
    return _unpack(packed, n).view(torch.bool).reshape(shape)


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


def _check_p(p: float) -> float:
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    return p


def _seed(generator: torch.Generator | None, device: torch.device) -> int:
    """One 63-bit seed from the generator (the default one for the device when None)."""
    g_device = generator.device if generator is not None else device
    return int(torch.empty((), dtype=torch.int64, device=g_device).random_(generator=generator))


def _draw_keep(start: int, n: int, seed: int, p: float, scratch: _Scratch) -> torch.Tensor:
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
    p = _check_p(p)
    n = math.prod(shape)
    device = torch.device(device) if device is not None else torch.device("cpu")
    scratch = _Scratch(device)
    seed = _seed(generator, device)
    out = torch.empty(n, dtype=torch.bool, device=device)
    for a, b in _chunks(n, _forward_chunk(n)):
        out[a:b] = _draw_keep(a, b - a, seed, p, scratch)
    return out.reshape(shape)


def _dropout_into(x: torch.Tensor, out: torch.Tensor, p: float, generator: torch.Generator | None,
                  scratch: _Scratch) -> torch.Tensor:
    """out = x * keep / (1 - p) for contiguous x and out (out may be x); returns the packed keep bits."""
    scale = 1.0 / (1.0 - p)
    n = x.numel()
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
    seed = _seed(generator, x.device)
    xf, of = x.view(-1), out.view(-1)
    for a, b in _chunks(n, _forward_chunk(n)):
        keep = _draw_keep(a, b - a, seed, p, scratch)
        _pack_into(scratch.get("flags", b - a, torch.uint8).copy_(keep), bits[a // 8:(b + 7) // 8], scratch)
        torch.mul(xf[a:b], keep, out=of[a:b])   # x * 0/1 (exact), then the scale, as eager rounds it
        of[a:b].mul_(scale)
    return bits


def _dropout_backward_into(grad: torch.Tensor, out: torch.Tensor, bits: torch.Tensor, p: float,
                           scratch: _Scratch) -> None:
    """out = grad * keep / (1 - p), chunk by chunk (out may be grad)."""
    gf, of = grad.view(-1), out.view(-1)
    for a, b in _chunks(grad.numel()):
        torch.mul(gf[a:b], 1.0 / (1.0 - p), out=of[a:b]).mul_(_bits(bits, a, b, scratch))


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float, generator: torch.Generator | None) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        bits = _dropout_into(x, out, p, generator, _Scratch(x.device))
        ctx.p = p
        ctx.save_for_backward(bits)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        return _Dropout._backward(ctx, grad, torch.empty_like(grad))

    @staticmethod
    def _backward(ctx, grad: torch.Tensor, out: torch.Tensor):
        (bits,) = ctx.saved_tensors
        _dropout_backward_into(grad, out, bits, ctx.p, _Scratch(grad.device))
        return out, None, None


class _DropoutBoxed(_Dropout):
    boxed_grads_call = True

    @staticmethod
    @once_differentiable
    def backward(ctx, grads: list[torch.Tensor]):
        return _Dropout._backward(ctx, *_take_grad(grads))


def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, *,
            generator: torch.Generator | None = None) -> torch.Tensor:
    """F.dropout that keeps its mask as bits for backward (32x less than a float32 mask)."""
    p = _check_p(p)
    if not training or p == 0.0 or p == 1.0 or x.dtype not in _FLOATS:
        return F.dropout(x, p, training)
    if not (torch.is_grad_enabled() and x.requires_grad):
        x = x.contiguous()
        out = torch.empty_like(x)
        _dropout_into(x, out, p, generator, _Scratch(x.device))
        return out
    return (_DropoutBoxed if _boxed() else _Dropout).apply(x, p, generator)


# ---------------------------------------------------------------------------------------------------------
# GELU from its output


_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TANH_K = math.sqrt(2.0 / math.pi)
_TANH_A = 0.044715
_TABLE_STEP = 5e-4   # table spacing in s = sqrt(y - y_min)
_TAIL = -3.0         # inputs below this are kept exactly: GELU is too flat there to invert accurately
_TABLE_TOP = 8.0     # right branch tabulated up to here; above, GELU(x) = x and GELU'(x) = 1 to 4e-14
_WINDOW = {torch.float32: 0.1, torch.float64: 0.02}   # half-width around the minimum kept exactly
_NEWTON_STEPS = 3    # float64: Newton steps from the table's guess (1e-4 -> 1e-7 -> 1e-13 -> rounding)


def _gelu_terms64(x: torch.Tensor, approximate: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GELU, its derivative and its second derivative at x (float64; for building the tables)."""
    if approximate == "none":
        cdf = 0.5 * torch.erfc(-x * _SQRT_HALF)
        pdf = _INV_SQRT_2PI * torch.exp(-0.5 * x * x)
        return x * cdf, cdf + x * pdf, pdf * (2.0 - x * x)
    t = torch.tanh(_TANH_K * (x + _TANH_A * x**3))
    du = _TANH_K * (1.0 + 3.0 * _TANH_A * x * x)
    om = 1.0 - t * t
    d1 = 0.5 * (1.0 + t) + 0.5 * x * om * du
    d2 = om * (du + 3.0 * _TANH_A * _TANH_K * x * x - x * t * du * du)
    return 0.5 * x * (1.0 + t), d1, d2


class _GeluInverse:
    """Tables for GELU's derivative given y = GELU(x) and the branch (x >= x0 or not).

    In s = sqrt(y - y_min) both the inverse x(s) and the derivative GELU'(x(s)) are smooth on each branch
    (the square root takes away the fold at the minimum).  Tables at uniform steps of s -- left-branch cells
    first (s = 0 at x0, growing towards the tail), then right-branch cells -- give
    - float32: GELU' directly, by quadratic interpolation within a cell (through its ends and middle): within
      1.5e-7 of GELU' outside the kept window and tail, i.e. float32 rounding level;
    - float64: x, by linear interpolation (within 1e-4), then Newton steps to machine precision."""

    def __init__(self, approximate: str) -> None:
        self.approximate = approximate
        x0 = torch.tensor(-0.75, dtype=torch.float64)
        for _ in range(60):
            _, d1, d2 = _gelu_terms64(x0, approximate)
            x0 = x0 - d1 / d2
        self.x0 = float(x0)
        self.y_min = float(_gelu_terms64(x0, approximate)[0])
        tail_y = float(_gelu_terms64(torch.tensor(_TAIL - 0.1, dtype=torch.float64), approximate)[0])
        self.n_left = math.ceil(math.sqrt(tail_y - self.y_min) / _TABLE_STEP) + 2
        self.n_right = math.ceil(math.sqrt(_TABLE_TOP - self.y_min) / _TABLE_STEP) + 1
        half_steps = [0.5 * _TABLE_STEP * torch.arange(2 * n - 1, dtype=torch.float64)
                      for n in (self.n_left, self.n_right)]
        left, right = self._solve(half_steps[0], right=False), self._solve(half_steps[1], right=True)
        xs = torch.cat([left[::2], right[::2]])
        slope = torch.zeros_like(xs)
        slope[:-1] = xs[1:] - xs[:-1]
        slope[self.n_left - 1] = 0.0  # the last left entry does not run on into the right branch
        self.x_table64 = torch.stack([xs, slope], dim=1)
        # Per cell [s_i, s_i + step): GELU' = a + f (b + f c), f the fraction of the step, through the cell's
        # ends and middle.  The last cell of each branch is constant (it has no neighbour on its branch).
        cells = []
        for xb in (left, right):
            d = _gelu_terms64(xb, approximate)[1]
            d0, dm, d1 = d[0:-1:2], d[1::2], d[2::2]
            abc = torch.stack([d0, 4 * dm - 3 * d0 - d1, 2 * d0 - 4 * dm + 2 * d1, torch.zeros_like(d0)], 1)
            cells += [abc, torch.tensor([[float(d[-1]), 0.0, 0.0, 0.0]], dtype=torch.float64)]
        self.d_table64 = torch.cat(cells)
        self.last = float(xs.numel() - 1)
        self._cache: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def _solve(self, s: torch.Tensor, right: bool) -> torch.Tensor:
        """x on the given branch with GELU(x) = y_min + s^2, by bisection (float64)."""
        target = self.y_min + s * s
        lo = torch.full_like(s, self.x0 if right else -60.0)
        hi = torch.full_like(s, _TABLE_TOP + 10.0 if right else self.x0)
        for _ in range(120):
            mid = 0.5 * (lo + hi)
            above = _gelu_terms64(mid, self.approximate)[0] > target
            go_left = above if right else ~above
            hi = torch.where(go_left, mid, hi)
            lo = torch.where(go_left, lo, mid)
        return 0.5 * (lo + hi)

    def _cached(self, kind: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The float32 derivative table ("d": rows a, b, c, 0) or the float64 x table ("x": rows x, slope),
        each row viewed as one complex128 element so that one gather fetches it; or the constant
        -y_min / step^2 ("c")."""
        key = (kind, dtype, device)
        if key not in self._cache:
            if kind == "c":
                value = torch.tensor(-self.y_min / _TABLE_STEP**2, dtype=dtype, device=device)
            else:
                rows = (self.d_table64 if kind == "d" else self.x_table64).to(device=device, dtype=dtype)
                value = rows.contiguous().view(torch.complex128).view(-1)
            self._cache[key] = value
        return self._cache[key]

    def bounds(self, dtype: torch.dtype) -> tuple[float, float]:
        """(centre, half-width) of the window around the minimum whose inputs are kept exactly."""
        return self.x0, _WINDOW[dtype]

    def derivative(self, z: torch.Tensor, right: torch.Tensor, scale: float, scratch: _Scratch,
                   out: torch.Tensor) -> torch.Tensor:
        """GELU'(x) into `out` for the x on branch `right` (uint8 0/1) with GELU(x) = z / scale."""
        n, dtype = z.numel(), z.dtype
        # f = s / step = sqrt((z / scale - y_min) / step^2): the table position; whole part = cell
        f = torch.add(self._cached("c", dtype, z.device), z, alpha=1.0 / (scale * _TABLE_STEP**2),
                      out=scratch.get("f", n, dtype)).clamp_(min=0.0).sqrt_()
        f.add_(right, alpha=self.n_left)
        torch.nan_to_num_(f.clamp_(max=self.last), nan=0.0)   # x = NaN is kept exactly; this is a guard
        i = scratch.get("i", n, torch.int32).copy_(f)
        f.frac_()
        if dtype == torch.float32:
            rows = torch.index_select(self._cached("d", dtype, z.device), 0, i,
                                      out=scratch.get("rows", n, torch.complex128)).view(dtype).view(-1, 4)
            torch.addcmul(rows[:, 1], f, rows[:, 2], out=out)
            return torch.addcmul(rows[:, 0], f, out, out=out)
        xs = torch.index_select(self._cached("x", dtype, z.device), 0, i).view(dtype).view(-1, 2)
        x = torch.addcmul(xs[:, 0], f, xs[:, 1])
        y = z if scale == 1.0 else torch.div(z, scale)
        newton = self._newton_exact if self.approximate == "none" else self._newton_tanh
        for k in range(_NEWTON_STEPS):
            deriv = newton(x, y, last=k == _NEWTON_STEPS - 1)
        return out.copy_(deriv)

    @staticmethod
    def _newton_exact(x: torch.Tensor, y: torch.Tensor, last: bool) -> torch.Tensor:
        """One Newton step for x Phi(x) = y, in place on x; on the last step returns GELU' at the updated x
        (by a first-order Taylor step of GELU' from the old x, exact to the square of the step)."""
        sq = x * x
        e = sq.mul(-0.5).exp_()
        cdf = torch.mul(x, _SQRT_HALF).erf_().mul_(0.5).add_(0.5)
        step = torch.addcmul(y, x, cdf, value=-1.0)
        d1 = cdf.addcmul_(x, e, value=_INV_SQRT_2PI)
        step.div_(d1)
        if not last:
            x.add_(step)
            return d1
        d2 = sq.neg_().add_(2.0).mul_(e)
        return d1.addcmul_(d2, step, value=_INV_SQRT_2PI)

    @staticmethod
    def _newton_tanh(x: torch.Tensor, y: torch.Tensor, last: bool) -> torch.Tensor:
        """As _newton_exact, for GELU's tanh form 0.5 x (1 + tanh(k (x + a x^3)))."""
        sq = x * x
        du = sq.mul(3.0 * _TANH_A * _TANH_K).add_(_TANH_K)           # d/dx of the tanh argument
        t = sq.mul(_TANH_A * _TANH_K).add_(_TANH_K).mul_(x).tanh_()
        half = t.mul(0.5).add_(0.5)                                   # 0.5 (1 + t)
        step = torch.addcmul(y, x, half, value=-1.0)
        om = torch.mul(t, t).neg_().add_(1.0)                         # 1 - t^2
        b = torch.mul(om, du).mul_(0.5)
        d1 = half.addcmul_(x, b)
        step.div_(d1)
        if not last:
            x.add_(step)
            return d1
        # d2 = (1 - t^2) (du + 3 a k x^2 - x t du^2)
        inner = torch.mul(du, du).mul_(t).mul_(x).neg_().add_(du).add_(sq.mul_(3.0 * _TANH_A * _TANH_K))
        return d1.addcmul_(inner.mul_(om), step)


_INVERSES: dict[str, _GeluInverse] = {}


def _inverse(approximate: str) -> _GeluInverse:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    if approximate not in _INVERSES:
        _INVERSES[approximate] = _GeluInverse(approximate)
    return _INVERSES[approximate]


def _gelu_side_info(x: torch.Tensor, inv: _GeluInverse, keep_bits: torch.Tensor | None,
                    scratch: _Scratch) -> tuple[torch.Tensor, torch.Tensor]:
    """Branch bits (1 = right of the minimum) and the flat indices of inputs to keep exactly: those in the
    window around the minimum, below the tail, or not finite (with dropout: only kept elements)."""
    n, dtype = x.numel(), x.dtype
    centre, half = inv.bounds(dtype)
    ints, sign = (torch.int32, 31) if dtype == torch.float32 else (torch.int64, 63)
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
    found = []
    xf = x.view(-1)
    for a, b in _chunks(n, _forward_chunk(n)):
        m = b - a
        # Sign bits do the comparisons: integer ops on the float's bits are cheaper than bool-valued ones.
        t = torch.sub(xf[a:b], centre, out=scratch.get("a", m, dtype))
        right = torch.bitwise_right_shift(t.view(ints), sign, out=scratch.get("b", m, ints)).add_(1)
        dist = torch.abs(t, out=scratch.get("c", m, dtype)).sub_(half)
        torch.nan_to_num_(dist, nan=-1.0, posinf=-1.0)
        torch.minimum(dist, t.sub_(_TAIL - centre), out=dist)   # < 0: in the window or below the tail
        odd = dist.view(ints).bitwise_right_shift_(sign).neg_()
        flags = scratch.get("flags", m, torch.uint8).copy_(right)
        if keep_bits is not None:
            keep = _bits(keep_bits, a, b, scratch)
            flags.bitwise_or_(keep.bitwise_xor(1))   # dropped elements count as right: their (unused) x is 0
            odd = scratch.get("odd", m, torch.uint8).copy_(odd).bitwise_and_(keep)
        _pack_into(flags, bits[a // 8:(b + 7) // 8], scratch)
        idx = odd.nonzero().view(-1)
        if idx.numel():
            found.append(idx.add_(a))
    idx = torch.cat(found) if found else torch.zeros(0, dtype=torch.int64, device=x.device)
    return bits, idx.to(torch.int32) if n < 2**31 else idx


class _Gelu(torch.autograd.Function):
    """GELU, or GELU then dropout (p > 0), keeping the output, the branch bits and a few exact inputs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, approximate: str, p: float, generator: torch.Generator | None):
        inv = _inverse(approximate)
        x = x.contiguous()
        scratch = _Scratch(x.device)
        y = F.gelu(x, approximate=approximate)
        keep_bits = _dropout_into(y, y, p, generator, scratch) if p > 0.0 else None
        branch, idx = _gelu_side_info(x, inv, keep_bits, scratch)
        ctx.approximate, ctx.p = approximate, p
        # Few exceptions (the usual case): keep their index and value.  Many: keep x itself, as GELU does.
        ctx.dense = idx.numel() * (idx.element_size() + x.element_size()) >= x.numel() * x.element_size()
        if ctx.dense:
            kept, idx = x, idx.new_zeros(0)
        else:
            kept = x.view(-1)[idx]
        if keep_bits is None:
            keep_bits = x.new_zeros(0, dtype=torch.uint8)
        ctx.save_for_backward(y, branch, idx, kept, keep_bits)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        return _Gelu._backward(ctx, grad, torch.empty_like(grad))

    @staticmethod
    def _backward(ctx, grad: torch.Tensor, out: torch.Tensor):
        """The input gradient, written into `out` (which may be grad itself)."""
        y, branch, idx, kept, keep_bits = ctx.saved_tensors
        p, approximate = ctx.p, ctx.approximate
        scale = 1.0 / (1.0 - p)
        scratch = _Scratch(grad.device)
        gf, of = grad.view(-1), out.view(-1)
        if ctx.dense:
            if p > 0.0:
                _dropout_backward_into(grad, out, keep_bits, p, scratch)
                gf = of
            torch.ops.aten.gelu_backward.grad_input(gf, kept.view(-1), approximate=approximate, grad_input=of)
            return out, None, None, None
        inv = _inverse(approximate)
        yf = y.view(-1)
        g_kept = gf[idx] * scale if p > 0.0 else gf[idx]   # before the loop: out may be grad itself
        for a, b in _chunks(yf.numel()):
            m = b - a
            right = _bits(branch, a, b, scratch)
            deriv = inv.derivative(yf[a:b], right, scale, scratch, scratch.get("deriv", m, grad.dtype))
            if p > 0.0:   # dropout's backward, then GELU's, in eager's order
                torch.mul(gf[a:b], scale, out=of[a:b]).mul_(_bits(keep_bits, a, b, scratch)).mul_(deriv)
            else:
                torch.mul(gf[a:b], deriv, out=of[a:b])
        if idx.numel():
            of[idx] = torch.ops.aten.gelu_backward(g_kept, kept, approximate=approximate)
        return out, None, None, None


class _GeluBoxed(_Gelu):
    boxed_grads_call = True

    @staticmethod
    @once_differentiable
    def backward(ctx, grads: list[torch.Tensor]):
        return _Gelu._backward(ctx, *_take_grad(grads))


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """F.gelu that keeps its output (plus a bit per element) for backward instead of its input."""
    _inverse(approximate)
    if x.dtype not in _FLOATS or not (torch.is_grad_enabled() and x.requires_grad):
        return F.gelu(x, approximate=approximate)
    return (_GeluBoxed if _boxed() else _Gelu).apply(x, approximate, 0.0, None)


def gelu_dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, approximate: str = "none", *,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """dropout(gelu(x)): keeps the output, the mask as bits and the GELU branch bits for backward."""
    p = _check_p(p)
    _inverse(approximate)
    if not training or p == 0.0:
        return gelu(x, approximate)
    if p == 1.0 or x.dtype not in _FLOATS:
        return F.dropout(F.gelu(x, approximate=approximate), p, training)
    if not (torch.is_grad_enabled() and x.requires_grad):
        y = F.gelu(x.contiguous(), approximate=approximate)
        _dropout_into(y, y, p, generator, _Scratch(y.device))
        return y
    return (_GeluBoxed if _boxed() else _Gelu).apply(x, approximate, p, generator)


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
    @once_differentiable
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
    """F.layer_norm that keeps its output and per-row 1/std for backward instead of its input."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    tensors = [t for t in (x, weight, bias) if t is not None]
    if x.dtype not in _FLOATS or not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors) \
            or any(t.dtype != x.dtype for t in tensors):
        return F.layer_norm(x, shape, weight, bias, eps)
    return _LayerNorm.apply(x, shape, weight, bias, eps)


# ---------------------------------------------------------------------------------------------------------
# Attention: softmax -> dropout -> matmul


class _SoftmaxDropoutMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: torch.Tensor, v: torch.Tensor, p: float,
                generator: torch.Generator | None) -> torch.Tensor:
        probs = torch.softmax(scores, dim=-1)
        dropped = torch.empty_like(probs)
        bits = _dropout_into(probs, dropped, p, generator, _Scratch(probs.device))
        out = torch.matmul(dropped, v)
        ctx.p = p
        ctx.save_for_backward(probs, bits, v)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        probs, bits, v = ctx.saved_tensors
        scale = 1.0 / (1.0 - ctx.p)
        keep = _unpack(bits, probs.numel()).view(probs.shape)   # 0/1 bytes
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
            d_scores = torch._softmax_backward_data(d_dropped, probs, -1, probs.dtype)
        return d_scores, d_v, None, None


def softmax_dropout_matmul(scores: torch.Tensor, v: torch.Tensor, p: float = 0.1, training: bool = True,
                           dim: int = -1, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """dropout(softmax(scores, dim), p) @ v, keeping the softmax output once and the mask as bits."""
    p = _check_p(p)
    last = dim in (-1, scores.dim() - 1)
    fusable = (training and 0.0 < p < 1.0 and last and scores.dtype in _FLOATS and v.dtype == scores.dtype
               and v.dim() >= 2 and scores.dim() >= 2)
    if not fusable or not (torch.is_grad_enabled() and (scores.requires_grad or v.requires_grad)):
        return torch.matmul(dropout(torch.softmax(scores, dim=dim), p, training, generator=generator), v)
    return _SoftmaxDropoutMatmul.apply(scores, v, p, generator)


# ---------------------------------------------------------------------------------------------------------
# Modules


class TempoGELU(nn.GELU):
    """nn.GELU keeping its output (and a bit per element) for backward instead of its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu(x, self.approximate)


class TempoLayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose backward works from its output and per-row statistics."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class TempoDropout(nn.Dropout):
    """nn.Dropout keeping its mask as bits for backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inplace:
            return F.dropout(x, self.p, self.training, inplace=True)
        return dropout(x, self.p, self.training)


# ---------------------------------------------------------------------------------------------------------
# Graph adapters: nodes replacing call_module nodes read p and training from the module at run time


def _module_dropout(x: torch.Tensor, module: nn.Dropout) -> torch.Tensor:
    """dropout with the p and training flag of an nn.Dropout (graph target for call_module dropouts)."""
    return dropout(x, module.p, module.training)


def _module_gelu_dropout(x: torch.Tensor, approximate: str, module: nn.Dropout) -> torch.Tensor:
    """gelu_dropout with the p and training flag of an nn.Dropout."""
    return gelu_dropout(x, module.p, module.training, approximate)


def _module_attention(scores: torch.Tensor, v: torch.Tensor, dim: int, module: nn.Dropout) -> torch.Tensor:
    """softmax_dropout_matmul with the p and training flag of an nn.Dropout."""
    return softmax_dropout_matmul(scores, v, module.p, module.training, dim)


# ---------------------------------------------------------------------------------------------------------
# Summary


@dataclass
class TempoSummary:
    """What a Tempo pass did: what it replaced (where -> by what), and what it recognised but left alone
    (where -> why).  Keys are graph node names (FX pass) or module names (module swap)."""

    replaced: dict[str, str] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)
    traced: bool = True
    trace_error: str | None = None

    def counts(self) -> dict[str, int]:
        """Number of replacements of each kind."""
        out: dict[str, int] = {}
        for what in self.replaced.values():
            kind = what.split(" ", 1)[0].rstrip(":")
            out[kind] = out.get(kind, 0) + 1
        return out

    def __str__(self) -> str:
        how = "FX graph" if self.traced else "module swap"
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.counts().items())) or "nothing"
        lines = [f"tempo ({how}): replaced {kinds}; {len(self.kept)} left as they were"]
        lines += [f"  replaced  {where}: {what}" for where, what in self.replaced.items()]
        lines += [f"  kept      {where}: {why}" for where, why in self.kept.items()]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# FX pass

_GELU_FNS = {F.gelu}
_LAYER_NORM_FNS = {F.layer_norm, torch.layer_norm}
_DROPOUT_FNS = {F.dropout, torch.dropout}
_SOFTMAX_FNS = {torch.softmax, F.softmax}
_MATMUL_FNS = {operator.matmul, torch.matmul}
_TEMPO_MODULES = (TempoGELU, TempoLayerNorm, TempoDropout)
# The functional versions under other names: tempo_graph's keyword flags reuse the public names.
_gelu_fn, _layer_norm_fn, _dropout_fn = gelu, layer_norm, dropout


def _arg(node: torch.fx.Node, i: int, name: str, default: Any) -> Any:
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _input(node: torch.fx.Node) -> Any:
    """The first argument of a call, given by position or as `input`."""
    return _arg(node, 0, "input", None)


def _module(gm: torch.fx.GraphModule, node: torch.fx.Node) -> nn.Module | None:
    if node.op != "call_module":
        return None
    mod = gm.get_submodule(node.target)
    return None if isinstance(mod, _TEMPO_MODULES) else mod


def _where(node: torch.fx.Node) -> str:
    return f"{node.name} ({node.target})" if node.op == "call_module" else node.name


@dataclass
class _DropoutSite:
    """A recognised dropout node: its input, and how to get p and training in the new graph."""

    node: torch.fx.Node
    module: str | None   # call_module target, or None for F.dropout with constant p / training
    p: float | None
    training: bool | None


def _as_dropout(gm: torch.fx.GraphModule, node: torch.fx.Node, summary: TempoSummary) -> _DropoutSite | None:
    mod = _module(gm, node)
    if mod is not None:
        if type(mod) is not nn.Dropout:
            return None
        if mod.inplace:
            summary.kept[_where(node)] = "in-place dropout (its input is overwritten; left as is)"
            return None
        return _DropoutSite(node, node.target, None, None)
    if node.op == "call_function" and node.target in _DROPOUT_FNS:
        p = _arg(node, 1, "p", 0.5)
        training = _arg(node, 2, "training" if node.target is F.dropout else "train", True)
        inplace = _arg(node, 3, "inplace", False) if node.target is F.dropout else False
        if not isinstance(p, (int, float)) or not isinstance(training, bool):
            summary.kept[_where(node)] = "dropout whose p or training flag is computed in the graph"
            return None
        if inplace:
            summary.kept[_where(node)] = "in-place dropout (its input is overwritten; left as is)"
            return None
        return _DropoutSite(node, None, float(p), training)
    return None


def _gelu_form(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str | None:
    mod = _module(gm, node)
    if mod is not None:
        return mod.approximate if type(mod) is nn.GELU else None
    if node.op == "call_function" and node.target in _GELU_FNS:
        form = _arg(node, 1, "approximate", "none")
        return form if form in ("none", "tanh") else None
    return None


_INPLACE_FNS = {operator.iadd, operator.isub, operator.imul, operator.itruediv}


def _written_in_place(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Whether some user of node's output overwrites it (x.add_(..), x += .., an inplace=True module or
    function): the Tempo GELU and LayerNorm keep their output, so they must not replace such a node."""
    for user in node.users:
        if _input(user) is not node:
            continue
        if user.op == "call_method" and isinstance(user.target, str) and user.target.endswith("_") \
                and not user.target.endswith("__"):
            return True
        if user.op == "call_function" and (user.target in _INPLACE_FNS or user.kwargs.get("inplace") is True):
            return True
        if user.op == "call_module" and getattr(gm.get_submodule(user.target), "inplace", False) is True:
            return True
        if user.op == "call_function" and user.target is F.dropout and _arg(user, 3, "inplace", False) is True:
            return True
    return False


def _single_user(node: torch.fx.Node) -> torch.fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _softmax_dim(node: torch.fx.Node) -> Any:
    if node.op == "call_method" and node.target == "softmax":
        return _arg(node, 1, "dim", None)
    if node.op == "call_function" and node.target in _SOFTMAX_FNS:
        return _arg(node, 1, "dim", None)
    return False  # not a softmax


def _ndim(node: torch.fx.Node) -> int | None:
    val = node.meta.get("val", node.meta.get("example_value"))
    if isinstance(val, torch.Tensor):
        return val.dim()
    tm = node.meta.get("tensor_meta")
    return len(tm.shape) if tm is not None and hasattr(tm, "shape") else None


def _is_matmul(node: torch.fx.Node) -> bool:
    return ((node.op == "call_function" and node.target in _MATMUL_FNS)
            or (node.op == "call_method" and node.target == "matmul"))


def tempo_graph(gm: torch.fx.GraphModule, *, gelu: bool = True, layer_norm: bool = True,
                attention: bool = True, dropout: bool = True) -> torch.fx.GraphModule:
    """Replace GELU, LayerNorm, dropout and softmax -> dropout -> matmul in `gm` by their Tempo versions,
    in place; returns gm, with a TempoSummary as ``gm.tempo_summary`` (also logged).

    Recognised: nn.GELU / F.gelu (both forms), nn.LayerNorm / F.layer_norm (any affine setting), nn.Dropout
    / F.dropout, torch.softmax / F.softmax / .softmax over the last dim feeding a dropout feeding the left
    side of a matmul (@, torch.matmul, .matmul), and GELU feeding a dropout (fused).  Modules keep their
    parameters and their train/eval switch: the new nodes read them from the module at run time, and the
    model's own modules are not changed.  Nodes it does not recognise are left exactly as they were."""
    if not isinstance(gm, torch.fx.GraphModule):
        raise TypeError(f"tempo_graph takes a torch.fx.GraphModule, got {type(gm).__name__}; get one from "
                        f"comera_compile.tensorize(model) or torch.fx.symbolic_trace(model), or use "
                        f"tempo_modules(model) for a model torch.fx cannot trace")
    graph = gm.graph
    summary = TempoSummary()
    done: set[torch.fx.Node] = set()

    def replace(old: torch.fx.Node, target: Callable, args: tuple, what: str, where: str,
                erase: tuple[torch.fx.Node, ...] = ()) -> None:
        with graph.inserting_before(old):
            new = graph.call_function(target, args)
        new.meta.update(old.meta)
        old.replace_all_uses_with(new)
        for n in (old, *erase):
            graph.erase_node(n)
        done.add(new)
        summary.replaced[where] = what

    if attention:
        for node in list(graph.nodes):
            dim = _softmax_dim(node)
            if dim is False or node not in graph.nodes:
                continue
            scores = _input(node)
            if not isinstance(scores, torch.fx.Node):
                continue
            if "dtype" in node.kwargs and node.kwargs["dtype"] is not None:
                summary.kept[_where(node)] = "softmax with a dtype argument"
                continue
            nd = _ndim(scores)
            if not isinstance(dim, int) or not (dim == -1 or (nd is not None and dim == nd - 1)):
                summary.kept[_where(node)] = f"softmax over dim {dim!r}, not known to be the last"
                continue
            drop_node = _single_user(node)
            if drop_node is None:
                continue  # softmax output used elsewhere too (e.g. returned): nothing to save
            d = _as_dropout(gm, drop_node, summary)
            mm = _single_user(drop_node) if d is not None else None
            if d is None or mm is None or not _is_matmul(mm) or _input(drop_node) is not node:
                continue
            v = _arg(mm, 1, "other", None)
            if _input(mm) is not drop_node or not isinstance(v, torch.fx.Node):
                continue
            with graph.inserting_before(mm):
                if d.module is not None:
                    target, args = _module_attention, (scores, v, dim, graph.get_attr(d.module))
                else:
                    target, args = softmax_dropout_matmul, (scores, v, d.p, d.training, dim)
            where = f"{node.name} -> {_where(drop_node)} -> {mm.name}"
            replace(mm, target, args, "attention softmax -> dropout -> matmul (softmax output kept once, "
                    "mask as bits)", where, erase=(drop_node, node))

    for node in list(graph.nodes):
        if node not in graph.nodes or node in done:
            continue
        form = _gelu_form(gm, node) if gelu else None
        if form is not None and _written_in_place(gm, node):
            summary.kept[_where(node)] = "gelu whose output is then modified in place (Tempo keeps the output)"
            continue
        if form is not None and _input(node) is not None:
            x = _input(node)
            user = _single_user(node)
            d = _as_dropout(gm, user, summary) if (dropout and user is not None) else None
            if d is not None and _input(user) is node and not _written_in_place(gm, user):
                with graph.inserting_before(user):
                    if d.module is not None:
                        target, args = _module_gelu_dropout, (x, form, graph.get_attr(d.module))
                    else:
                        target, args = gelu_dropout, (x, d.p, d.training, form)
                replace(user, target, args, f"gelu+dropout ({form} form): output, mask bits and branch bits "
                        f"kept", f"{_where(node)} -> {_where(user)}", erase=(node,))
            else:
                replace(node, _gelu_fn, (x, form), f"gelu ({form} form): output and branch bits kept",
                        _where(node))
            continue
        if layer_norm and _written_in_place(gm, node) and (
                (node.op == "call_module" and type(_module(gm, node)) is nn.LayerNorm)
                or (node.op == "call_function" and node.target in _LAYER_NORM_FNS)):
            summary.kept[_where(node)] = "layer_norm whose output is then modified in place (Tempo keeps the output)"
            continue
        if layer_norm:
            mod = _module(gm, node)
            if mod is not None and type(mod) is nn.LayerNorm and _input(node) is not None:
                with graph.inserting_before(node):
                    w = graph.get_attr(f"{node.target}.weight") if mod.weight is not None else None
                    b = graph.get_attr(f"{node.target}.bias") if mod.bias is not None else None
                replace(node, _layer_norm_fn, (_input(node), tuple(mod.normalized_shape), w, b, mod.eps),
                        "layer_norm: output and 1/std kept", _where(node))
                continue
            if node.op == "call_function" and node.target in _LAYER_NORM_FNS:
                args = [_arg(node, i, k, dflt) for i, (k, dflt) in enumerate(
                    [("input", None), ("normalized_shape", None), ("weight", None), ("bias", None),
                     ("eps", 1e-5)])]
                if isinstance(args[1], (int, tuple, list, torch.Size)) and not isinstance(args[4], torch.fx.Node):
                    shape = (args[1],) if isinstance(args[1], int) else tuple(args[1])
                    replace(node, _layer_norm_fn, (args[0], shape, args[2], args[3], args[4]),
                            "layer_norm: output and 1/std kept", _where(node))
                else:
                    summary.kept[_where(node)] = "layer_norm whose shape or eps is computed in the graph"
                continue
        if dropout:
            d = _as_dropout(gm, node, summary)
            if d is not None and _input(node) is not None:
                if d.module is not None:
                    with graph.inserting_before(node):
                        args = (_input(node), graph.get_attr(d.module))
                    replace(node, _module_dropout, args, "dropout: mask as bits", _where(node))
                else:
                    replace(node, _dropout_fn, (_input(node), d.p, d.training), "dropout: mask as bits",
                            _where(node))
    graph.lint()
    gm.recompile()
    gm.tempo_summary = summary
    logger.info("%s", summary)
    return gm


# ---------------------------------------------------------------------------------------------------------
# Module swap (models torch.fx cannot trace)


def _hf_gelu_form(mod: nn.Module) -> str | None:
    """The GELU form of transformers' GELUActivation / GELUTanh modules when they call F.gelu, else None."""
    name = type(mod).__name__
    act = getattr(mod, "act", None)
    if name == "GELUActivation" and act is F.gelu:
        return "none"
    if name in ("GELUTanh", "PytorchGELUTanh") and getattr(act, "func", None) is F.gelu and \
            getattr(act, "keywords", {}) == {"approximate": "tanh"}:
        return "tanh"
    return None


def _swap_for(mod: nn.Module, gelu: bool, layer_norm: bool, dropout: bool) -> tuple[nn.Module, str] | None:
    if isinstance(mod, _TEMPO_MODULES):
        return None
    if gelu and type(mod) is nn.GELU:
        return TempoGELU(mod.approximate), f"gelu ({mod.approximate} form): output and branch bits kept"
    if gelu and _hf_gelu_form(mod) is not None:
        form = _hf_gelu_form(mod)
        return TempoGELU(form), f"gelu ({form} form, from {type(mod).__name__}): output and branch bits kept"
    if layer_norm and type(mod) is nn.LayerNorm:
        new = TempoLayerNorm(mod.normalized_shape, mod.eps, mod.elementwise_affine, bias=mod.bias is not None,
                             device="meta")
        new.weight, new.bias = mod.weight, mod.bias   # the same Parameter objects
        return new, "layer_norm: output and 1/std kept"
    if dropout and type(mod) is nn.Dropout and not mod.inplace:
        return TempoDropout(mod.p), "dropout: mask as bits"
    return None


def tempo_modules(model: nn.Module, *, gelu: bool = True, layer_norm: bool = True,
                  dropout: bool = True) -> nn.Module:
    """Swap the nn.GELU (and transformers' GELUActivation / GELUTanh), nn.LayerNorm and nn.Dropout
    submodules of `model` for TempoGELU / TempoLayerNorm / TempoDropout, in place; returns model, with a
    TempoSummary as ``model.tempo_summary``.  Parameters are shared, not copied (state_dict keys and an
    existing optimizer stay valid).  For any nn.Module; functional calls inside forward (F.gelu, softmax ->
    dropout -> matmul) need tempo_graph on a traced graph instead.  TempoGELU and TempoLayerNorm keep their
    output for backward: if forward code then modifies it in place, backward raises autograd's in-place
    error (pass gelu=False / layer_norm=False for such a model)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"tempo_modules takes an nn.Module, got {type(model).__name__}")
    summary = TempoSummary(traced=False)
    swaps: dict[int, tuple[nn.Module, str]] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        if not name:
            continue
        if id(mod) not in swaps:
            found = _swap_for(mod, gelu, layer_norm, dropout)
            if found is None:
                if isinstance(mod, nn.Dropout) and type(mod) is nn.Dropout and mod.inplace:
                    summary.kept[name] = "in-place dropout (its input is overwritten; left as is)"
                continue
            new, what = found
            new.train(mod.training)
            swaps[id(mod)] = (new, what)
        new, what = swaps[id(mod)]
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
        summary.replaced[name] = what
    model.tempo_summary = summary
    logger.info("%s", summary)
    return model


def tempo(model: nn.Module, *, gelu: bool = True, layer_norm: bool = True, attention: bool = True,
          dropout: bool = True) -> nn.Module:
    """Tempo memory passes on any model: tempo_graph on a GraphModule (in place); otherwise trace with
    torch.fx (nn modules as leaves, the model's own modules shared) and run tempo_graph, or, when tracing
    fails, swap modules in place with tempo_modules and warn.  The result carries ``tempo_summary``."""
    if isinstance(model, torch.fx.GraphModule):
        return tempo_graph(model, gelu=gelu, layer_norm=layer_norm, attention=attention, dropout=dropout)
    if not isinstance(model, nn.Module):
        raise TypeError(f"tempo takes an nn.Module, got {type(model).__name__}")
    from comera_compile.passes.tensorize import _trace

    try:
        gm = _trace(model)
    except Exception as e:  # torch.fx raises many kinds of errors for untraceable code
        error = f"{type(e).__name__}: {e}".split("\n")[0]
        warnings.warn(f"tempo: torch.fx cannot trace {type(model).__name__} ({error}); swapped its GELU, "
                      f"LayerNorm and Dropout modules in place instead (no attention fusion).", stacklevel=2)
        out = tempo_modules(model, gelu=gelu, layer_norm=layer_norm, dropout=dropout)
        out.tempo_summary.trace_error = error
        return out
    return tempo_graph(gm, gelu=gelu, layer_norm=layer_norm, attention=attention, dropout=dropout)
