"""Gauges of a TT layer: changes of its cores' and gates' scales, or bases, that leave the layer's function
exactly as it was.  ``balance`` puts a layer in the balanced gauge RankAdaptive's penalty is measured in;
``canonicalize`` rotates every bond to its singular basis (TT rounding), carrying the optimizer's moments
over."""

from __future__ import annotations

import torch

from .layers import TTLayer

__all__ = ["balance", "canonicalize", "frobenius_norm"]

# Optimizer state entries that are running averages of the squared gradient (they scale as its square).
_SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "acc_delta")

# Below this fraction of its bond's largest, a half's column norm (balance) is float32 noise: the slice is not
# rescaled by it.
_NEGLIGIBLE = 1e-6

# Below this fraction of its bond's largest, canonicalize gives a singular direction a zero gate (dropped).
# Not 1e-6: in the rounded form a core's slice between two bonds carries 1 / sigma of each, so a direction
# kept at 1e-6 leaves core entries up to 1e4-1e6 between two near-zero gates, where the balanced gauge
# (which normalises each half of the train as a whole) cannot see them; the next Adam steps move both gates
# by about a learning rate and the weight by (step)^2 / sigma.  On benchmarks/ra_teachers.py's six-head
# teacher (seed 2, pull_below 0.25) that blew the layer up 1e5-fold four steps after the first rounding; at
# 1e-4 none of 24 runs diverged.  A direction this weak is 1e-4 of its bond's weight: no slice being learned.
_DROPPED = 1e-4


def _grams(flat: list[torch.Tensor], g: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """For every bond k, the Gram matrices L_k^T L_k and R_k R_k^T of the train's two halves (gate k itself
    excluded), from 3-way cores `flat` and gates `g`, by the usual transfer-matrix sweeps."""
    n = len(flat)
    left, right = [], [torch.empty(0)] * (n - 1)
    gram = None
    for k in range(n - 1):
        c = flat[k]
        rhs = c if gram is None else torch.einsum("ab,bmk->amk", gram * g[k - 1][:, None] * g[k - 1], c)
        gram = torch.einsum("amj,amk->jk", c, rhs)
        left.append(gram)
    gram = None
    for k in range(n - 2, -1, -1):
        c = flat[k + 1]
        rhs = c if gram is None else torch.einsum("ab,kmb->kma", gram * g[k + 1][:, None] * g[k + 1], c)
        gram = torch.einsum("jma,kma->jk", c, rhs)
        right[k] = gram
    return left, right


def _weight_norm(left: list[torch.Tensor], right: list[torch.Tensor], g: list[torch.Tensor]) -> torch.Tensor:
    """The Frobenius norm of the layer's weight, from the Gram matrices of its first bond and that bond's gate."""
    return torch.sqrt((left[0] * g[0][:, None] * g[0] * right[0]).sum().clamp_min(0))


@torch.no_grad()
def frobenius_norm(layer: TTLayer) -> float:
    """The Frobenius norm of the layer's weight (cores and gates), without forming it."""
    flat = [c.detach().reshape(c.shape[0], -1, c.shape[-1]).double() for c in layer.cores]
    if len(flat) < 2:
        return float(flat[0].norm()) if flat else 0.0
    g = [x.detach().double() for x in layer.gates]
    return float(_weight_norm(*_grams(flat, g), g))


@torch.no_grad()
def balance(layer: TTLayer, state: dict | None = None) -> list[torch.Tensor]:
    """Put `layer` in the balanced gauge (the function is unchanged): for every bond k, the train's left half
    L_k gets unit-norm columns, its right half R_k rows of norm s_k, and gate entry j becomes
    ||L_k[:, j] g_j R_k[j, :]|| / s_k, s_k the bond's largest such norm.  Returns each bond's term norms
    relative to the layer's Frobenius norm (comparable across layers).

    With the optimizer's `state`, each gate's moments are carried into its new scale: a gate multiplied by f
    has a gradient 1/f times the old one, so first moments are divided by f and second moments by f^2.
    Left in the old scale, a gate the balance shrank a thousandfold meets gradients a thousand times larger
    against second moments from before, and Adam's next steps on it are up to a few learning rates, on a gate
    now a thousandth of its size.  Of 16 seeded runs of benchmarks/ra_teachers.py's six-head and stacked
    64-64-64 teachers, 4 diverged without this carry (and with the Gram rounding canonicalize replaced); 1
    with the carry and the Gram rounding; none with the carry and the QR rounding.  The cores' moments are left as they are: carrying them as well (single-layer discovery of a
    dense rank-5 map, 8 seeds) ended 3 of 8 runs at 2x the noise or worse, one of them
    collapsed to rank 1."""
    n = len(layer.cores)
    if n < 2:
        return []
    flat = [c.detach().reshape(c.shape[0], -1, c.shape[-1]).double() for c in layer.cores]
    g = [x.detach().double() for x in layer.gates]
    left, right = _grams(flat, g)
    norm = _weight_norm(left, right, g)
    relative = []
    for k in range(n - 1):
        a, b = left[k].diagonal().clamp_min(0).sqrt(), right[k].diagonal().clamp_min(0).sqrt()
        term = a * g[k].abs() * b
        s = term.max()
        # a slice with no term (a zero gate whose half of the train vanishes) keeps its scale: dividing by a
        # vanishing norm would give its cores entries of 1e30 for nothing
        ok = (a > _NEGLIGIBLE * a.max()) & (b > _NEGLIGIBLE * b.max()) & (s > 0)
        one = torch.ones_like(a)
        fa = torch.where(ok, 1 / torch.where(ok, a, one), one)
        fb = torch.where(ok, s / torch.where(ok, b, one), one)
        core_l, core_r, gate = layer.cores[k], layer.cores[k + 1], layer.gates[k]
        core_l.mul_(fa.to(core_l.dtype).reshape(*([1] * (core_l.dim() - 1)), -1))
        core_r.mul_(fb.to(core_r.dtype).reshape(-1, *([1] * (core_r.dim() - 1))))
        fg = torch.where(ok, a * b / s.clamp_min(torch.finfo(torch.float64).tiny), one)
        gate.mul_(fg.to(gate.dtype))
        for key, value in ((state or {}).get(gate) or {}).items():
            if isinstance(value, torch.Tensor) and value.shape == gate.shape and value.dim() > 0:
                value.copy_((value.double() / fg ** (2 if key in _SECOND_MOMENTS else 1)).to(value.dtype))
        relative.append((term / norm.clamp_min(torch.finfo(torch.float64).tiny)).to(gate.dtype))
    return relative


@torch.no_grad()
def canonicalize(layer: TTLayer, state: dict | None = None) -> None:
    """Rotate every bond of `layer` to its singular basis (TT rounding): the gates become the singular values
    of the bond's unfolding, so a slice's gate is its true share and redundant slices get zero gates.  The
    function is unchanged but for directions below 1e-4 of their bond's largest singular value (dropped: see
    _DROPPED).

    The rounding works on the cores themselves: a QR sweep left to right leaves every core with orthonormal
    columns, then an SVD sweep right to left reads each bond's singular values off one small core.  (The same
    gates can be had from the SVD of the bond's gate between the square roots of its two halves' Gram
    matrices, the first implementation; a Gram matrix squares the condition number of the half it comes
    from, and where a half's columns were nearly dependent that rounding left cores with entries up to 6e4.
    Over 8 seeds, 1,000 steps each, of benchmarks/ra_teachers.py's six-head and stacked 64-64-64 teachers,
    4 of 16 runs diverged with it and the balance as it was then, none with this rounding and the balance
    below.)

    Every core and gate is rotated, so the optimizer's per-entry moments in `state` (if given) no longer
    belong to the entries they sit on: see ``_restart_moments``."""
    n = len(layer.cores)
    if n < 2:
        return
    flat = [c.detach().reshape(c.shape[0], -1, c.shape[-1]).double() for c in layer.cores]
    gates = [x.detach().double() for x in layer.gates]
    for k in range(n - 1):  # left to right: core k -> Q (orthonormal columns), its R and gate into core k + 1
        r0, m, r1 = flat[k].shape
        q, rr = torch.linalg.qr((flat[k] * gates[k]).reshape(r0 * m, r1))
        if q.shape[1] < r1:  # more slices than the bond can hold: the extra ones are zero
            q = torch.cat([q, q.new_zeros(q.shape[0], r1 - q.shape[1])], 1)
            rr = torch.cat([rr, rr.new_zeros(r1 - rr.shape[0], r1)], 0)
        flat[k] = q.reshape(r0, m, r1)
        flat[k + 1] = torch.einsum("ij,jmk->imk", rr, flat[k + 1])
    sigma_right = torch.ones(1, dtype=torch.float64, device=flat[-1].device)
    for k in range(n - 1, 0, -1):  # right to left: the singular values of bond k - 1, from core k alone
        r0, m, r1 = flat[k].shape
        u, sigma, vh = torch.linalg.svd((flat[k] * sigma_right).reshape(r0, m * r1), full_matrices=True)
        rows = vh[:r0]
        if rows.shape[0] < r0:
            rows = torch.cat([rows, rows.new_zeros(r0 - rows.shape[0], rows.shape[1])], 0)
        sigma = torch.cat([sigma, sigma.new_zeros(r0 - sigma.numel())])
        # core k times diag(sigma_right) is now `rows` (orthonormal); a negligible direction of bond k keeps its
        # column undivided, with a zero gate
        live = sigma_right > _DROPPED * sigma_right.max()
        flat[k] = rows.reshape(r0, m, r1) / torch.where(live, sigma_right, torch.ones_like(sigma_right))
        if k < n - 1:
            gates[k] = torch.where(live, sigma_right, torch.zeros_like(sigma_right))
        flat[k - 1] = torch.einsum("imj,jk->imk", flat[k - 1], u)
        sigma_right = sigma
    live = sigma_right > _DROPPED * sigma_right.max()
    gates[0] = torch.where(live, sigma_right, torch.zeros_like(sigma_right))
    for k, core in enumerate(layer.cores):
        core.copy_(flat[k].reshape(core.shape).to(core.dtype))
    for gate, value in zip(layer.gates, gates):
        gate.copy_(value.to(gate.dtype))
    if state is not None:
        for p in (*layer.cores, *layer.gates):
            if state.get(p):
                _restart_moments(p, state[p])


def _restart_moments(p: torch.Tensor, st: dict) -> None:
    """The optimizer's state of a TT core or gate the rounding rotated.

    A core's entries belong to other rank slices after the rotation (the slices come out ordered by
    singular value), and the scale of an entry's gradient follows the gates beside it: a slice with gate g
    gets gradients g times its bond's strongest.  So a core's Adam moments restart from nothing, step count
    included: Adam's bias correction then normalises every entry by its own gradients within a few steps,
    as at the start of training.  What this replaced averaged the second moments over the rank axes, which
    gave a weak slice the strong slices' second moments, Adam steps of its gate (not its learning rate) on
    its cores, and with beta2 = 0.999 thousands of steps to lose them: a direction the task needed but had
    not yet learned stayed unlearned, and the penalty zeroed its gate.  On benchmarks/ra_teachers.py's
    four side-by-side teachers, 4 seeds each (3,000 steps at the defaults), 8 of 16 runs ended above 1.5x
    the noise (the worst at 173x) before, 3 of 16 (the worst at 3.8x) after.

    A gate's gradient has the same scale across its bond (the balanced gauge normalises both halves of the
    train), so a gate keeps its bond's average second moment and its step count, and its first moment
    restarts at zero.  Restarting the gates too made the step after each rounding a sign step of a whole
    gate learning rate on every gate (held-out MSE 9x the noise for the next step, on a run at 1.1x).

    Optimizers without Adam's bias-corrected second moment (SGD's momentum, RMSprop, Adagrad) keep what the
    rounding did before: first moments zero, second moments averaged over the rotated axes."""
    restart = p.dim() > 1 and "exp_avg_sq" in st and "step" in st
    axes = (0,) if p.dim() == 1 else (0, p.dim() - 1)
    for key, value in st.items():
        if key == "step" and restart:
            st[key] = value.zero_() if isinstance(value, torch.Tensor) else type(value)(0)
        elif isinstance(value, torch.Tensor) and value.shape == p.shape and value.dim() > 0:
            if key in _SECOND_MOMENTS and not restart:
                value.copy_(value.mean(axes, keepdim=True).expand_as(value))
            else:
                value.zero_()
