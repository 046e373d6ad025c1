"""GELU that keeps its output and one branch bit per element for the backward, not its input.

GELU is not one-to-one below its minimum x0 = -0.7518 (tanh form: -0.7522), so the branch is kept as a
bit.  Backward gets the derivative from the output and the branch: in s = sqrt(y - y_min) both branches are
smooth, and GELU' is tabulated against s (float32: quadratic interpolation, within 1.5e-7 at the exact
output; torch's float32 output itself is up to 1e-6 off on [-3, -2], where 1 + erf cancels, which puts
the derivative read from it up to 2.6e-6 off there: docs/method.md) or the input is recovered by a table
guess and three Newton steps (float64: machine precision).
Where that is ill-conditioned -- within 0.1 (float64: 0.02) of x0, and below -3 where GELU flattens out --
the input itself is kept for those few elements (about 6% of N(0, 1) inputs; index and value).  GELU
followed by dropout is fused: it keeps the dropout output (what the next layer keeps anyway), the dropout
mask as bits and the branch bits.  float32 and float64 take these paths; bfloat16 and float16 GELU then
dropout keeps the input, as GELU does, and the mask as bits (inverting GELU from a 16-bit output would not
give torch's gradient to 16-bit precision); GELU alone at other dtypes runs torch's op (with a warning,
once).  No-grad, eval (training=False, or a module in eval), torch.export and torch.compile run the original
ops.  A form's tables are built once, eagerly, when a Tempo pass swaps a GELU in (prepare_tables), else on
first use; never inside a torch.compile trace.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from comera_compile.ops.bit_dropout import check_p, dropout_backward_into, dropout_into
from comera_compile.ops.bits import bit_slice, pack_into
from comera_compile.ops.buffers import (FLOATS, HALF_FLOATS, Scratch, boxed_variant, chunks, dtype_fallback,
                                         forward_chunk, may_box, new_buffer_backward, plain_ops, traced)

__all__ = ["gelu", "gelu_dropout", "prepare_tables"]


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
      1.5e-7 of GELU' at the exact output, outside the kept window and tail;
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

    def derivative(self, z: torch.Tensor, right: torch.Tensor, scale: float, scratch: Scratch,
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


def _check_form(approximate: str) -> None:
    """Raise unless approximate is one of GELU's forms (without building any table: this runs under tracing)."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")


def _inverse(approximate: str) -> _GeluInverse:
    """The tables for a GELU form, built on first use (float64 work: only inside a Tempo forward)."""
    _check_form(approximate)
    if approximate not in _INVERSES:
        _INVERSES[approximate] = _build_tables(approximate)
    return _INVERSES[approximate]


@torch.compiler.disable
def _build_tables(approximate: str) -> _GeluInverse:
    """Tables built eagerly, never traced: dynamo would unroll their 180 loop steps into graphs that take
    Inductor many minutes (the passes build them beforehand, prepare_tables, so a trace finds them built)."""
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        return _GeluInverse(approximate)


def prepare_tables(approximate: str) -> None:
    """Build a GELU form's tables now, outside any trace: the Tempo passes call it as they swap a GELU in, so
    that torch.compile of the result never meets the build."""
    _inverse(approximate)


def _gelu_side_info(x: torch.Tensor, inv: _GeluInverse, keep_bits: torch.Tensor | None,
                    scratch: Scratch) -> tuple[torch.Tensor, torch.Tensor]:
    """Branch bits (1 = right of the minimum) and the flat indices of inputs to keep exactly: those in the
    window around the minimum, below the tail, or not finite (with dropout: only kept elements)."""
    n, dtype = x.numel(), x.dtype
    centre, half = inv.bounds(dtype)
    ints, sign = (torch.int32, 31) if dtype == torch.float32 else (torch.int64, 63)
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
    found = []
    xf = x.view(-1)
    for a, b in chunks(n, forward_chunk(n)):
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
            keep = bit_slice(keep_bits, a, b, scratch)
            flags.bitwise_or_(keep.bitwise_xor(1))   # dropped elements count as right: their (unused) x is 0
            odd = scratch.get("odd", m, torch.uint8).copy_(odd).bitwise_and_(keep)
        pack_into(flags, bits[a // 8:(b + 7) // 8], scratch)
        idx = odd.nonzero().view(-1)
        if idx.numel():
            found.append(idx.add_(a))
    idx = torch.cat(found) if found else torch.zeros(0, dtype=torch.int64, device=x.device)
    return bits, idx.to(torch.int32) if n < 2**31 else idx


class _Gelu(torch.autograd.Function):
    """GELU, or GELU then dropout (p > 0), keeping the output, the branch bits and a few exact inputs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, approximate: str, p: float, generator: torch.Generator | None):
        x = x.contiguous()
        scratch = Scratch(x.device)
        y = F.gelu(x, approximate=approximate)
        keep_bits = dropout_into(y, y, p, generator, scratch) if p > 0.0 else None
        ctx.approximate, ctx.p = approximate, p
        if x.dtype in FLOATS:
            branch, idx = _gelu_side_info(x, _inverse(approximate), keep_bits, scratch)
            # Few exceptions (the usual case): keep their index and value.  Many: keep x itself, as GELU does.
            ctx.dense = idx.numel() * (idx.element_size() + x.element_size()) >= x.numel() * x.element_size()
        else:   # 16-bit floats: keep x (GELU then dropout: the mask is what is saved)
            branch, idx, ctx.dense = x.new_zeros(0, dtype=torch.uint8), x.new_zeros(0, dtype=torch.int32), True
        if ctx.dense:   # the output is not needed: backward works from x
            kept, idx, branch, y_kept = x, idx.new_zeros(0), branch.new_zeros(0), y.new_zeros(0)
        else:
            kept, y_kept = x.view(-1)[idx], y
        if keep_bits is None:
            keep_bits = x.new_zeros(0, dtype=torch.uint8)
        ctx.save_for_backward(y_kept, branch, idx, kept, keep_bits)
        return y

    @staticmethod
    def _backward(ctx, grad: torch.Tensor, out: torch.Tensor):
        """The input gradient, written into `out` (which may be grad itself)."""
        y, branch, idx, kept, keep_bits = ctx.saved_tensors
        p, approximate = ctx.p, ctx.approximate
        scale = 1.0 / (1.0 - p)
        scratch = Scratch(grad.device)
        gf, of = grad.view(-1), out.view(-1)
        if ctx.dense:
            if p > 0.0:
                dropout_backward_into(grad, out, keep_bits, p, scratch)
                gf = of
            torch.ops.aten.gelu_backward.grad_input(gf, kept.view(-1), approximate=approximate, grad_input=of)
            return out, None, None, None
        inv = _inverse(approximate)
        yf = y.view(-1)
        g_kept = gf[idx] * scale if p > 0.0 else gf[idx]   # before the loop: out may be grad itself
        for a, b in chunks(yf.numel()):
            m = b - a
            right = bit_slice(branch, a, b, scratch)
            deriv = inv.derivative(yf[a:b], right, scale, scratch, scratch.get("deriv", m, grad.dtype))
            if p > 0.0:   # dropout's backward, then GELU's, in eager's order
                torch.mul(gf[a:b], scale, out=of[a:b]).mul_(bit_slice(keep_bits, a, b, scratch)).mul_(deriv)
            else:
                torch.mul(gf[a:b], deriv, out=of[a:b])
        if idx.numel():
            of[idx] = torch.ops.aten.gelu_backward(g_kept, kept, approximate=approximate)
        return out, None, None, None

    backward = new_buffer_backward(_backward)


_GeluBoxed = boxed_variant(_Gelu, _Gelu._backward)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """F.gelu that keeps its output (plus a bit per element) for backward instead of its input; torch's op
    where no gradient is needed, under torch.export and torch.compile, and for dtypes other than float32 /
    float64 (warned)."""
    _check_form(approximate)
    if plain_ops(x):
        return F.gelu(x, approximate=approximate)
    if x.dtype not in FLOATS:
        if x.is_floating_point():
            dtype_fallback("gelu", x.dtype, "it takes float32 and float64; at 16 bits only GELU followed by "
                           "dropout saves, its mask")
        return F.gelu(x, approximate=approximate)
    return (_GeluBoxed if may_box() else _Gelu).apply(x, approximate, 0.0, None)


def gelu_dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, approximate: str = "none", *,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """dropout(gelu(x)): keeps the output, the mask as bits and the GELU branch bits for backward (16-bit
    floats: the input and the mask as bits).  training=False runs torch's GELU, as eval mode does."""
    p = check_p(p)
    _check_form(approximate)
    if not training:
        return F.gelu(x, approximate=approximate)
    if p == 0.0:
        return gelu(x, approximate)
    if p == 1.0 or traced() or x.dtype not in FLOATS + HALF_FLOATS:
        if x.is_floating_point() and x.dtype not in FLOATS + HALF_FLOATS and not plain_ops(x):
            dtype_fallback("gelu+dropout", x.dtype, "it takes float32, float64, bfloat16 and float16")
        return F.dropout(F.gelu(x, approximate=approximate), p, training)
    if not (torch.is_grad_enabled() and x.requires_grad):
        y = F.gelu(x.contiguous(), approximate=approximate)
        dropout_into(y, y, p, generator, Scratch(y.device))
        return y
    return (_GeluBoxed if may_box() else _Gelu).apply(x, approximate, p, generator)
