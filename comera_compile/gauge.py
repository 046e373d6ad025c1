"""Gauges of a TT layer: changes of its cores' and gates' scales, or bases, that leave the layer's function
exactly as it was.  ``balance`` puts a layer in the balanced gauge RankAdaptive's penalty is measured in;
``canonicalize`` rotates every bond to its singular basis (TT rounding).  Mathematics only: the optimizer's
moments are carried by the caller (optim_state.rescale, optim_state.restart)."""

from __future__ import annotations

import torch

from .layers import TTLayer

__all__ = ["balance", "balance_layers", "canonicalize", "canonicalize_layers", "frobenius_norm", "frobenius_norms"]

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
    excluded), from 3-way cores `flat` and gates `g` with a leading batch dimension (layers of one shape), by
    the usual transfer-matrix sweeps."""
    n = len(flat)
    left, right = [], [torch.empty(0)] * (n - 1)
    gram = None
    for k in range(n - 1):
        c = flat[k]
        rhs = c if gram is None else torch.einsum("zab,zbmk->zamk", gram * g[k - 1][:, :, None] * g[k - 1][:, None],
                                                  c)
        gram = torch.einsum("zamj,zamk->zjk", c, rhs)
        left.append(gram)
    gram = None
    for k in range(n - 2, -1, -1):
        c = flat[k + 1]
        rhs = c if gram is None else torch.einsum("zab,zkmb->zkma", gram * g[k + 1][:, :, None] * g[k + 1][:, None],
                                                  c)
        gram = torch.einsum("zjma,zkma->zjk", c, rhs)
        right[k] = gram
    return left, right


def _weight_norm(left: list[torch.Tensor], right: list[torch.Tensor], g: list[torch.Tensor]) -> torch.Tensor:
    """The Frobenius norm of each layer's weight, from the Gram matrices of its first bond and that bond's gate."""
    return torch.sqrt((left[0] * g[0][:, :, None] * g[0][:, None] * right[0]).sum((1, 2)).clamp_min(0))


def _stacked(layers: list[TTLayer]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The layers' cores (3-way) and gates in float64, stacked along a leading batch dimension."""
    cores = [torch.stack([m.cores[k].detach() for m in layers]) for k in range(len(layers[0].cores))]
    flat = [c.reshape(c.shape[0], c.shape[1], -1, c.shape[-1]).double() for c in cores]
    return flat, [torch.stack([m.gates[k].detach() for m in layers]).double() for k in range(len(layers[0].gates))]


@torch.no_grad()
def frobenius_norm(layer: TTLayer) -> float:
    """The Frobenius norm of the layer's weight (cores and gates), without forming it."""
    return float(frobenius_norms([layer])[0])


@torch.no_grad()
def frobenius_norms(layers: list[TTLayer]) -> torch.Tensor:
    """``frobenius_norm`` of every layer as one float64 vector on the CPU, layers of one shape together (one
    transfer from the device for all of them)."""
    out = torch.zeros(len(layers), dtype=torch.float64)
    groups: dict[tuple, list[int]] = {}
    for i, layer in enumerate(layers):
        if len(layer.cores) == 1:
            out[i] = layer.cores[0].detach().double().norm().cpu()
        elif len(layer.cores) > 1:
            groups.setdefault(_shape_key(layer), []).append(i)
    for members in groups.values():
        flat, g = _stacked([layers[i] for i in members])
        out[members] = _weight_norm(*_grams(flat, g), g).cpu()
    return out


@torch.no_grad()
def balance(layer: TTLayer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Put `layer` in the balanced gauge (the function is unchanged): for every bond k, the train's left half
    L_k gets unit-norm columns, its right half R_k rows of norm s_k, and gate entry j becomes
    ||L_k[:, j] g_j R_k[j, :]|| / s_k, s_k the bond's largest such norm.  Returns each bond's term norms
    relative to the layer's Frobenius norm (comparable across layers), and the factor f (float64) each gate
    was multiplied by: its optimizer moments belong in the new scale (optim_state.rescale).  A layer in 16
    bits is balanced to within _SLACK_16_BIT: a slice nearer than that keeps its entries unrounded."""
    return balance_layers([layer])[0]


def _shape_key(layer: TTLayer) -> tuple:
    return (tuple((tuple(c.shape), c.dtype, c.device) for c in layer.cores),
            tuple((tuple(g.shape), g.dtype) for g in layer.gates))


@torch.no_grad()
def balance_layers(layers: list[TTLayer]) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """``balance`` of every layer, layers of one shape computed together (a few batched operations per bond
    for all of them, not a few dozen per layer: the re-balancing runs every 10 steps, each operation a kernel
    launch on a GPU); returns each layer's (relative, factors) in order."""
    out: list = [None] * len(layers)
    groups: dict[tuple, list[int]] = {}
    for i, layer in enumerate(layers):
        if len(layer.cores) < 2:
            out[i] = ([], [])
        else:
            groups.setdefault(_shape_key(layer), []).append(i)
    for members in groups.values():
        for i, result in zip(members, _balance_group([layers[i] for i in members])):
            out[i] = result
    return out


def _balance_group(layers: list[TTLayer]) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    first = layers[0]
    n = len(first.cores)
    flat, g = _stacked(layers)
    left, right = _grams(flat, g)
    norm = _weight_norm(left, right, g)[:, None]
    tiny = torch.finfo(torch.float64).tiny
    slack = _SLACK_16_BIT if torch.finfo(first.cores[0].dtype).bits <= 16 else 0.0
    row, col = [None] * n, [None] * n   # each core's factors: rows (bond k - 1's fb), columns (bond k's fa)
    relative, factors, new_gates = [], [], []
    for k in range(n - 1):
        a = left[k].diagonal(dim1=1, dim2=2).clamp_min(0).sqrt()
        b = right[k].diagonal(dim1=1, dim2=2).clamp_min(0).sqrt()
        term = a * g[k].abs() * b
        s = term.amax(1, keepdim=True)
        # a slice with no term (a zero gate whose half of the train vanishes) keeps its scale: dividing by a
        # vanishing norm would give its cores entries of 1e30 for nothing
        ok = (a > _NEGLIGIBLE * a.amax(1, keepdim=True)) & (b > _NEGLIGIBLE * b.amax(1, keepdim=True)) & (s > 0)
        if slack:
            off = torch.stack([a, b / s, a * b / s]).log().abs().amax(0)   # each factor's distance from 1
            ok &= torch.nan_to_num(off, nan=0.0) > slack
        one = torch.ones_like(a)
        col[k] = torch.where(ok, 1 / torch.where(ok, a, one), one)
        row[k + 1] = torch.where(ok, s / torch.where(ok, b, one), one)
        fg = torch.where(ok, a * b / s.clamp_min(tiny), one)
        gate_dtype = first.gates[k].dtype
        new_gates.append(torch.stack([m.gates[k].detach() for m in layers]).mul_(fg.to(gate_dtype)))
        factors.append(fg)
        relative.append((term / norm.clamp_min(tiny)).to(gate_dtype))
    for k in range(n):   # as bond k - 1 then bond k would scale it: rows first, in the core's dtype
        cores = torch.stack([m.cores[k].detach() for m in layers])
        shape = (len(layers), -1, *([1] * (cores.dim() - 2)))
        if row[k] is not None:
            cores.mul_(row[k].to(cores.dtype).reshape(shape))
        if col[k] is not None:
            cores.mul_(col[k].to(cores.dtype).reshape(len(layers), *([1] * (cores.dim() - 2)), -1))
        torch._foreach_copy_([m.cores[k] for m in layers], list(cores.unbind(0)))
    for k, stacked in enumerate(new_gates):
        torch._foreach_copy_([m.gates[k] for m in layers], list(stacked.unbind(0)))
    return [([r[i] for r in relative], [f[i] for f in factors]) for i in range(len(layers))]


@torch.no_grad()
def canonicalize(layer: TTLayer) -> None:
    """Rotate every bond of `layer` to its singular basis (TT rounding): the gates become the singular values
    of the bond's unfolding, so a slice's gate is its true share and redundant slices get zero gates.  The
    function is unchanged but for directions below _DROPPED of their bond's largest singular value.  A QR
    sweep left to right leaves every core with orthonormal columns, then an SVD sweep right to left reads
    each bond's singular values off one small core (no Gram matrices: they square the condition number).
    Every entry is rotated: the optimizer's per-entry moments no longer fit (optim_state.restart)."""
    canonicalize_layers([layer])


@torch.no_grad()
def canonicalize_layers(layers: list[TTLayer]) -> None:
    """``canonicalize`` of every layer, layers of one shape in batched QRs and SVDs (the check rounds every
    layer at once: a few operations per bond for all of them, not a few dozen per layer)."""
    groups: dict[tuple, list[TTLayer]] = {}
    for layer in layers:
        if len(layer.cores) >= 2:
            groups.setdefault(_shape_key(layer), []).append(layer)
    for members in groups.values():
        _canonicalize_group(members)


def _canonicalize_group(layers: list[TTLayer]) -> None:
    n, z = len(layers[0].cores), len(layers)
    flat, gates = _stacked(layers)   # flat[k]: (z, r0, m, r1)
    for k in range(n - 1):  # left to right: core k -> Q (orthonormal columns), its R and gate into core k + 1
        _, r0, m, r1 = flat[k].shape
        q, rr = torch.linalg.qr((flat[k] * gates[k][:, None, None]).reshape(z, r0 * m, r1))
        if q.shape[-1] < r1:  # more slices than the bond can hold: the extra ones are zero
            q = torch.cat([q, q.new_zeros(z, q.shape[1], r1 - q.shape[-1])], -1)
            rr = torch.cat([rr, rr.new_zeros(z, r1 - rr.shape[1], r1)], 1)
        flat[k] = q.reshape(z, r0, m, r1)
        flat[k + 1] = torch.einsum("zij,zjmk->zimk", rr, flat[k + 1])
    sigma_right = flat[-1].new_ones(z, 1)
    for k in range(n - 1, 0, -1):  # right to left: the singular values of bond k - 1, from core k alone
        _, r0, m, r1 = flat[k].shape
        u, sigma, vh = torch.linalg.svd((flat[k] * sigma_right[:, None, None]).reshape(z, r0, m * r1),
                                        full_matrices=True)
        rows = vh[:, :r0]
        if rows.shape[1] < r0:
            rows = torch.cat([rows, rows.new_zeros(z, r0 - rows.shape[1], rows.shape[-1])], 1)
        sigma = torch.cat([sigma, sigma.new_zeros(z, r0 - sigma.shape[-1])], -1)
        # core k times diag(sigma_right) is now `rows` (orthonormal); a negligible direction of bond k keeps its
        # column undivided, with a zero gate
        live = sigma_right > _DROPPED * sigma_right.amax(-1, keepdim=True)
        flat[k] = rows.reshape(z, r0, m, r1) / torch.where(live, sigma_right, 1.0)[:, None, None]
        if k < n - 1:
            gates[k] = torch.where(live, sigma_right, 0.0)
        flat[k - 1] = torch.einsum("zimj,zjk->zimk", flat[k - 1], u)
        sigma_right = sigma
    live = sigma_right > _DROPPED * sigma_right.amax(-1, keepdim=True)
    gates[0] = torch.where(live, sigma_right, 0.0)
    for k in range(n):
        cores = [m.cores[k] for m in layers]
        torch._foreach_copy_(cores, list(flat[k].reshape(z, *cores[0].shape).to(cores[0].dtype).unbind(0)))
    for k in range(n - 1):
        torch._foreach_copy_([m.gates[k] for m in layers], list(gates[k].to(layers[0].gates[k].dtype).unbind(0)))
