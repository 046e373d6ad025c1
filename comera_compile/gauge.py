"""Gauges of a TT layer: changes of its cores' and gates' scales, or bases, that leave the layer's function
exactly as it was.  ``balance`` puts a layer in the balanced gauge RankAdaptive's penalty is measured in;
``canonicalize`` rotates every bond to its singular basis (TT rounding).  Mathematics only: the optimizer's
moments are carried by the caller (optim_state.rescale, optim_state.restart)."""

from __future__ import annotations

import torch

from .layers import TTLayer

__all__ = ["balance", "canonicalize", "frobenius_norm"]

# Below this fraction of its bond's largest, a half's column norm (balance) is float32 noise: the slice is not
# rescaled by it.
_NEGLIGIBLE = 1e-6

# In a layer held in 16 bits, a slice is rescaled only where one of its factors is off 1 by more than this: each
# rescale rounds its entries again (bfloat16: 0.4%), and balancing every 10 steps, those roundings added up.
_SLACK_16_BIT = 0.05

# Below this fraction of its bond's largest, canonicalize gives a singular direction a zero gate (dropped).
# A direction kept far below this leaves its core slices at 1/sigma between two near-zero gates, out of the
# balanced gauge's sight, and the next optimizer steps can blow the layer up (docs/method.md section 4).
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
def balance(layer: TTLayer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Put `layer` in the balanced gauge (the function is unchanged): for every bond k, the train's left half
    L_k gets unit-norm columns, its right half R_k rows of norm s_k, and gate entry j becomes
    ||L_k[:, j] g_j R_k[j, :]|| / s_k, s_k the bond's largest such norm.  Returns each bond's term norms
    relative to the layer's Frobenius norm (comparable across layers), and the factor f (float64) each gate
    was multiplied by: its optimizer moments belong in the new scale (optim_state.rescale).  A layer in 16
    bits is balanced to within _SLACK_16_BIT: a slice nearer than that keeps its entries unrounded."""
    n = len(layer.cores)
    if n < 2:
        return [], []
    flat = [c.detach().reshape(c.shape[0], -1, c.shape[-1]).double() for c in layer.cores]
    g = [x.detach().double() for x in layer.gates]
    left, right = _grams(flat, g)
    norm = _weight_norm(left, right, g)
    slack = _SLACK_16_BIT if torch.finfo(layer.cores[0].dtype).bits <= 16 else 0.0
    relative, factors = [], []
    for k in range(n - 1):
        a, b = left[k].diagonal().clamp_min(0).sqrt(), right[k].diagonal().clamp_min(0).sqrt()
        term = a * g[k].abs() * b
        s = term.max()
        # a slice with no term (a zero gate whose half of the train vanishes) keeps its scale: dividing by a
        # vanishing norm would give its cores entries of 1e30 for nothing
        ok = (a > _NEGLIGIBLE * a.max()) & (b > _NEGLIGIBLE * b.max()) & (s > 0)
        if slack:
            off = torch.stack([a, b / s, a * b / s]).log().abs().amax(0)   # each factor's distance from 1
            ok &= torch.nan_to_num(off, nan=0.0) > slack
        one = torch.ones_like(a)
        fa = torch.where(ok, 1 / torch.where(ok, a, one), one)
        fb = torch.where(ok, s / torch.where(ok, b, one), one)
        core_l, core_r, gate = layer.cores[k], layer.cores[k + 1], layer.gates[k]
        core_l.mul_(fa.to(core_l.dtype).reshape(*([1] * (core_l.dim() - 1)), -1))
        core_r.mul_(fb.to(core_r.dtype).reshape(-1, *([1] * (core_r.dim() - 1))))
        fg = torch.where(ok, a * b / s.clamp_min(torch.finfo(torch.float64).tiny), one)
        gate.mul_(fg.to(gate.dtype))
        factors.append(fg)
        relative.append((term / norm.clamp_min(torch.finfo(torch.float64).tiny)).to(gate.dtype))
    return relative, factors


@torch.no_grad()
def canonicalize(layer: TTLayer) -> None:
    """Rotate every bond of `layer` to its singular basis (TT rounding): the gates become the singular values
    of the bond's unfolding, so a slice's gate is its true share and redundant slices get zero gates.  The
    function is unchanged but for directions below _DROPPED of their bond's largest singular value.  A QR
    sweep left to right leaves every core with orthonormal columns, then an SVD sweep right to left reads
    each bond's singular values off one small core (no Gram matrices: they square the condition number).
    Every entry is rotated: the optimizer's per-entry moments no longer fit (optim_state.restart)."""
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
