"""Gauges of a TT layer: changes of its cores' and gates' scales, or bases, that leave the layer's function
exactly as it was.  ``balance`` puts a layer in the balanced gauge RankAdaptive's penalty is measured in;
``canonicalize`` rotates every bond to its singular basis (TT rounding), carrying the optimizer's moments
over."""

from __future__ import annotations

import torch

from .layers import TTLayer

__all__ = ["balance", "canonicalize", "frobenius_norm"]


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
def balance(layer: TTLayer) -> list[torch.Tensor]:
    """Put `layer` in the balanced gauge (the function is unchanged): for every bond k, the train's left half
    L_k gets unit-norm columns, its right half R_k rows of norm s_k, and gate entry j becomes
    ||L_k[:, j] g_j R_k[j, :]|| / s_k, s_k the bond's largest such norm.  Returns each bond's term norms
    relative to the layer's Frobenius norm (comparable across layers)."""
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
        ok = (a > 0) & (b > 0) & (s > 0)
        one = torch.ones_like(a)
        fa = torch.where(ok, 1 / torch.where(ok, a, one), one)
        fb = torch.where(ok, s / torch.where(ok, b, one), one)
        core_l, core_r, gate = layer.cores[k], layer.cores[k + 1], layer.gates[k]
        core_l.mul_(fa.to(core_l.dtype).reshape(*([1] * (core_l.dim() - 1)), -1))
        core_r.mul_(fb.to(core_r.dtype).reshape(-1, *([1] * (core_r.dim() - 1))))
        gate.mul_(torch.where(ok, a * b / s.clamp_min(torch.finfo(torch.float64).tiny), one).to(gate.dtype))
        relative.append((term / norm.clamp_min(torch.finfo(torch.float64).tiny)).to(gate.dtype))
    return relative


def _half_inverse(gram: torch.Tensor, rtol: float = 1e-10) -> tuple[torch.Tensor, torch.Tensor]:
    """(G^{1/2}, G^{+1/2}) of a symmetric PSD matrix, directions below rtol of its largest eigenvalue dropped."""
    w, u = torch.linalg.eigh(gram)
    keep = w > rtol * w.max().clamp_min(0)
    root = torch.where(keep, w.clamp_min(0).sqrt(), torch.zeros_like(w))
    inv = torch.where(keep, 1 / torch.where(keep, root, torch.ones_like(w)), torch.zeros_like(w))
    return (u * root) @ u.T, (u * inv) @ u.T


_SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "acc_delta")


@torch.no_grad()
def canonicalize(layer: TTLayer, state: dict | None = None) -> None:
    """Rotate every bond of `layer` to its singular basis (TT rounding, left to right): the gates become the
    singular values of the bond's unfolding, so a slice's gate is its true share and redundant slices get
    zero gates.  The function is unchanged.  In the optimizer's `state` (if given) the rotated tensors'
    first moments restart at zero and their second moments are averaged over the rotated axis."""
    n = len(layer.cores)
    for k in range(n - 1):
        flat = [c.detach().reshape(c.shape[0], -1, c.shape[-1]).double() for c in layer.cores]
        g = [x.detach().double() for x in layer.gates]
        lefts, rights = _grams(flat, g)
        root_l, inv_l = _half_inverse(lefts[k])
        root_r, inv_r = _half_inverse(rights[k])
        x, sigma, yh = torch.linalg.svd(root_l @ torch.diag(g[k]) @ root_r)
        a, b = inv_l @ x, yh @ inv_r  # L_k -> L_k a (orthonormal columns), R_k -> b R_k
        core_l, core_r, gate = layer.cores[k], layer.cores[k + 1], layer.gates[k]
        core_l.copy_(torch.einsum("...i,ij->...j", flat[k], a).reshape(core_l.shape).to(core_l.dtype))
        core_r.copy_(torch.einsum("ji,i...->j...", b, flat[k + 1]).reshape(core_r.shape).to(core_r.dtype))
        gate.copy_(sigma.to(gate.dtype))
        for p, dim in ((core_l, core_l.dim() - 1), (core_r, 0), (gate, 0)):
            st = state.get(p) if state is not None else None
            for key, value in (st or {}).items():
                if isinstance(value, torch.Tensor) and value.shape == p.shape and value.dim() > 0:
                    if key in _SECOND_MOMENTS:
                        value.copy_(value.mean(dim, keepdim=True).expand_as(value))
                    else:
                        value.zero_()
