"""Tensor-train formats: TT for linear maps, TTM for embedding tables.

A TT linear map W: N -> M has 2d cores G_k of shape (r_{k-1}, size_k, r_k): the first d carry the input
modes n_1..n_d, the last d the output modes m_1..m_d (r_0 = r_2d = 1).  A TTM embedding table V x D has d
cores of shape (r_{k-1}, v_k, e_k, r_k).  Between consecutive cores sits diag(g_k), the rank gates.
Dimensions that do not factor well are padded up to one that does (modes.py); the padding stays internal.
"""

from __future__ import annotations

import contextlib
import math
import operator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Sequence

import torch

from .modes import balanced_factors, choose_modes

__all__ = ["TTSpec", "constant_under_compile", "balanced_factors", "choose_modes", "make_spec", "tt_svd", "full_tensor",
           "random_cores", "gemm_ranks", "rank_padding", "gemm_spec", "gemm_core_padding"]

# Contractions run each TT bond at a multiple of this size when that costs few zero slices (gemm_ranks): BLAS
# GEMMs are much faster when their narrow side is a multiple of 16 (docs/method.md).  1 turns padding off.
GEMM_RANK_MULTIPLE = 16


@dataclass(frozen=True)
class TTSpec:
    """Shape of one TT (linear) or TTM (embedding) factorization.

    For kind "tt": in_features -> out_features, cores over in_modes then out_modes.
    For kind "ttm": in_features rows (vocabulary) by out_features columns; core k carries
    (in_modes[k], out_modes[k]).  ranks has r_0 = 1 and r_last = 1 included."""

    kind: str
    in_features: int
    out_features: int
    in_modes: tuple[int, ...]
    out_modes: tuple[int, ...]
    ranks: tuple[int, ...]
    max_ranks: tuple[int, ...] = field(compare=False)
    # key() as text, made once: what the layers hand the planner's constant functions under torch.compile.
    token: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "token", repr(self.key()))

    @property
    def in_padded(self) -> int:
        return math.prod(self.in_modes)

    @property
    def out_padded(self) -> int:
        return math.prod(self.out_modes)

    @property
    def num_cores(self) -> int:
        return len(self.ranks) - 1

    @property
    def core_shapes(self) -> list[tuple[int, ...]]:
        r = self.ranks
        if self.kind == "tt":
            sizes = self.in_modes + self.out_modes
            return [(r[k], sizes[k], r[k + 1]) for k in range(len(sizes))]
        return [(r[k], self.in_modes[k], self.out_modes[k], r[k + 1]) for k in range(len(self.in_modes))]

    @property
    def gate_sizes(self) -> list[int]:
        return list(self.ranks[1:-1])

    def core_params(self) -> int:
        """Parameters in the cores: sum_k r_{k-1} * size_k * r_k."""
        return sum(math.prod(s) for s in self.core_shapes)

    def num_params(self) -> int:
        """Cores plus rank gates."""
        return self.core_params() + sum(self.gate_sizes)

    def dense_params(self) -> int:
        return self.in_features * self.out_features

    def key(self) -> tuple:
        """The spec as a tuple of plain values (``token`` is its text)."""
        return (self.kind, self.in_features, self.out_features, self.in_modes, self.out_modes, self.ranks,
                self.max_ranks)

    @staticmethod
    def of(spec: "TTSpec | tuple | str") -> "TTSpec":
        """A spec, or the spec of a key() or of a token.

        The layers pass ``spec.token``, not the spec, to the planner's constant functions under
        torch.compile: dynamo guards a string by value (a spec object by identity), so layers of equal
        shapes share one compiled graph and a rank cut to equal ranks reuses it.  A string, unlike a tuple
        of ints, is never made symbolic: dynamo turns an int that changed between compiles into a SymInt
        when it is read from a module that FSDP2 manages (its ints are not specialized as other modules'
        are), and a cut changes the ranks."""
        if isinstance(spec, TTSpec):
            return spec
        return _spec_of_token(spec) if isinstance(spec, str) else TTSpec(*spec)

    def with_ranks(self, ranks: Sequence[int]) -> "TTSpec":
        return TTSpec(self.kind, self.in_features, self.out_features, self.in_modes, self.out_modes,
                      tuple(int(r) for r in ranks), self.max_ranks)


@lru_cache(maxsize=4096)
def _spec_of_token(token: str) -> TTSpec:
    import ast

    return TTSpec(*ast.literal_eval(token))


def gemm_ranks(ranks: Sequence[int], multiple: int | None = None) -> tuple[int, ...]:
    """The bond ranks a TT product is contracted at: each inner rank r rounded up to a multiple of
    `multiple` (default GEMM_RANK_MULTIPLE) when that adds at most max(4, r // 8) slices, which are zero
    in the cores so the product is unchanged.  A few percent more FLOPs buys GEMMs whose narrow side
    suits the BLAS kernels (r = 30 runs as 32; 20 or 24 stay, padding them to 32 costs more than it
    saves)."""
    m = GEMM_RANK_MULTIPLE if multiple is None else multiple
    out = [int(ranks[0])]
    for r in ranks[1:-1]:
        up = -(-r // m) * m
        out.append(up if up - r <= max(4, r // 8) else r)
    return (*out, int(ranks[-1]))


def constant_under_compile(fn: Callable) -> Callable:
    """Mark fn as ``torch.compiler.assume_constant_result`` does (torch.compile calls it once at trace time
    and records its result as a constant), without that decorator's import of dynamo: the formats and
    layers should import with torch alone.  tests/test_package.py checks the mark is the one torch sets."""
    fn._dynamo_marked_constant = True
    return fn


@lru_cache(maxsize=4096)
def gemm_spec(spec: TTSpec) -> TTSpec:
    """spec at gemm_ranks' ranks: the shapes the contraction programs run at."""
    ranks = gemm_ranks(spec.ranks)
    return spec if ranks == spec.ranks else spec.with_ranks(ranks)


@constant_under_compile
def gemm_core_padding(spec: TTSpec | tuple | str) -> tuple[tuple[int, ...] | None, ...]:
    """rank_padding of every core of spec (or its key() or token) to gemm_spec(spec)'s ranks (a constant under
    torch.compile)."""
    spec = TTSpec.of(spec)
    target = gemm_spec(spec)
    return tuple(rank_padding(a, b) for a, b in zip(spec.core_shapes, target.core_shapes))


def rank_padding(shape: Sequence[int], target: Sequence[int]) -> tuple[int, ...] | None:
    """F.pad's argument taking a core of this shape (r_left, ..., r_right) to target's ranks with zero
    slices, or None when the ranks already match."""
    left, right = target[0] - shape[0], target[-1] - shape[-1]
    if left == 0 and right == 0:
        return None
    return (0, right) + (0, 0) * (len(shape) - 2) + (0, left)


def _max_ranks(sizes: Sequence[int]) -> tuple[int, ...]:
    """Largest meaningful rank of every bond: min of the products of the sizes on either side."""
    total = math.prod(sizes)
    out, left = [1], 1
    for s in sizes[:-1]:
        left *= s
        out.append(min(left, total // left))
    out.append(1)
    return tuple(out)


def _integer(value: Any, what: str) -> int:
    """`value` as an int, where it is one (a Python or NumPy integer, not a bool, float or string)."""
    try:
        if not isinstance(value, bool):
            return operator.index(value)
    except TypeError:
        pass
    raise TypeError(f"{what} must be an integer, got {value!r}")


def _resolve_ranks(rank: int | Sequence[int], max_ranks: tuple[int, ...], where: str) -> tuple[int, ...]:
    n_bonds = len(max_ranks) - 2
    if not isinstance(rank, (bool, str, bytes, Sequence)) and hasattr(rank, "__index__"):
        rank = _integer(rank, f"{where}: rank")   # a NumPy or 0-d tensor integer
    if isinstance(rank, (bool, str, bytes)) or not isinstance(rank, (int, Sequence)):
        raise TypeError(f"{where}: rank must be an int or a list of ints, got {rank!r}")
    if isinstance(rank, int):
        if rank <= 0:
            raise ValueError(f"{where}: rank must be a positive integer, got {rank}")
        return (1, *(min(rank, m) for m in max_ranks[1:-1]), 1)
    ranks = [_integer(r, f"{where}: rank list entry") for r in rank]
    if len(ranks) == n_bonds + 2:
        if ranks[0] != 1 or ranks[-1] != 1:
            raise ValueError(f"{where}: a full rank list must start and end with 1, got {ranks}")
        ranks = ranks[1:-1]
    if len(ranks) != n_bonds:
        raise ValueError(
            f"{where}: expected {n_bonds} internal ranks (one per bond between {n_bonds + 1} cores), "
            f"or {n_bonds + 2} with the boundary 1s, got {len(ranks)}: {list(rank)}")
    for k, (r, m) in enumerate(zip(ranks, max_ranks[1:-1]), start=1):
        if r <= 0:
            raise ValueError(f"{where}: rank of bond {k} must be positive, got {r}")
        if r > m:
            raise ValueError(
                f"{where}: rank {r} of bond {k} is above its largest meaningful value {m} "
                f"(the smaller of the mode products on either side); use at most {m}, or pass an int rank, "
                f"which is capped automatically")
    return (1, *ranks, 1)


def make_spec(kind: str, in_features: int, out_features: int, rank: int | Sequence[int],
              in_modes: Sequence[int] | None = None, out_modes: Sequence[int] | None = None,
              d: int | None = None, where: str = "layer") -> TTSpec:
    """Build a TTSpec, choosing modes automatically where not given and checking everything.

    kind "tt": in_modes default to a balanced split in non-increasing order, out_modes in non-decreasing
    order (the layout of the CoMERA paper's shapes); kind "ttm" (embeddings): both non-increasing."""
    if kind not in ("tt", "ttm"):
        raise ValueError(f"kind must be 'tt' or 'ttm', got {kind!r}")
    for name, v in (("in_features", in_features), ("out_features", out_features)):   # NumPy, 0-d tensors too
        if isinstance(v, bool) or not hasattr(v, "__index__") or _integer(v, f"{where}: {name}") < 1:
            raise ValueError(f"{where}: {name} must be a positive integer, got {v!r}")
    in_features, out_features = operator.index(in_features), operator.index(out_features)
    if d is None:
        d = len(in_modes) if in_modes is not None else len(out_modes) if out_modes is not None else (
            3 if kind == "tt" else 4)
    elif _integer(d, f"{where}: d (the number of cores)") < 1:
        raise ValueError(f"{where}: d (the number of cores) must be at least 1, got {d}")
    else:   # a d given beside modes must agree with them
        for label, modes in zip(("in_modes", "out_modes") if kind == "tt" else ("row_modes", "col_modes"),
                                (in_modes, out_modes)):
            if modes is not None and d != len(modes):
                raise ValueError(f"{where}: d={d} modes a side, but {label} {tuple(modes)} has {len(modes)}; leave d "
                                 f"out (the given modes set it) or give modes of that length")
    if in_modes is None:
        in_modes = choose_modes(in_features, d)
    if out_modes is None:
        out_modes = choose_modes(out_features, d)
        if kind == "tt":
            out_modes = tuple(sorted(out_modes))
    in_modes, out_modes = (tuple(_integer(m, f"{where}: a mode") for m in ms) for ms in (in_modes, out_modes))
    for label, modes, n in (("in_modes", in_modes, in_features), ("out_modes", out_modes, out_features)):
        if not modes or any(m < 1 for m in modes):
            raise ValueError(f"{where}: {label} must be positive integers, got {modes}")
        if math.prod(modes) < n:
            what = "rows" if (kind == "ttm" and label == "in_modes") else "features"
            raise ValueError(
                f"{where}: {label} {modes} multiply to {math.prod(modes)}, fewer than the layer's {n} {what}; "
                f"give modes whose product is at least {n} (a larger product pads), or leave them out to "
                f"have them chosen")
    if kind == "ttm" and len(in_modes) != len(out_modes):
        raise ValueError(f"{where}: a TTM embedding needs as many row modes as column modes, "
                         f"got {in_modes} and {out_modes}")
    sizes = in_modes + out_modes if kind == "tt" else tuple(v * e for v, e in zip(in_modes, out_modes))
    max_ranks = _max_ranks(sizes)
    ranks = _resolve_ranks(rank, max_ranks, where)
    return TTSpec(kind, in_features, out_features, in_modes, out_modes, ranks, max_ranks)


# ---------------------------------------------------------------------------------------------------------
# Building cores


def _core_sizes(spec: TTSpec) -> list[int]:
    """The flattened physical size of each core (product of its non-rank axes)."""
    return [math.prod(s[1:-1]) for s in spec.core_shapes]


def random_cores(spec: TTSpec, target_std: float, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None,
                 generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Gaussian cores whose full tensor has entries of standard deviation target_std (gates = 1).

    An entry of the full tensor is a sum over prod(internal ranks) paths of products of one entry per core,
    so its variance is prod_k sigma_k^2 * prod_bonds r; every core gets the same sigma."""
    n = spec.num_cores
    log_var = 2 * math.log(target_std) - sum(math.log(r) for r in spec.ranks[1:-1])
    sigma = math.exp(log_var / (2 * n))
    return [torch.randn(s, dtype=dtype, device=device, generator=generator) * sigma for s in spec.core_shapes]


def tt_svd(tensor: torch.Tensor, ranks: Sequence[int]) -> list[torch.Tensor]:
    """TT-SVD: split a d-way tensor into cores (r_{k-1}, n_k, r_k) by sequential truncated SVDs.

    Exact when every rank is at least the bond's largest meaningful rank; otherwise the standard
    quasi-optimal truncation (error at most sqrt(d-1) times the best TT approximation's)."""
    sizes = list(tensor.shape)
    if len(ranks) != len(sizes) + 1:
        raise ValueError(f"tt_svd: need {len(sizes) + 1} ranks for a {len(sizes)}-way tensor, got {len(ranks)}")
    cores = []
    rest = tensor.reshape(1, -1)
    r_prev = 1
    for k, n in enumerate(sizes[:-1]):
        mat = rest.reshape(r_prev * n, -1)
        u, s, vh = torch.linalg.svd(mat, full_matrices=False)
        r = min(ranks[k + 1], s.numel())
        u, s, vh = u[:, :r], s[:r], vh[:r]
        if r < ranks[k + 1]:  # requested rank beyond the matrix rank: pad with zeros (still exact)
            pad = ranks[k + 1] - r
            u = torch.cat([u, u.new_zeros(u.shape[0], pad)], dim=1)
            s = torch.cat([s, s.new_zeros(pad)])
            vh = torch.cat([vh, vh.new_zeros(pad, vh.shape[1])], dim=0)
            r = ranks[k + 1]
        cores.append(u.reshape(r_prev, n, r))
        rest = s[:, None] * vh
        r_prev = r
    cores.append(rest.reshape(r_prev, sizes[-1], 1))
    return cores


def full_tensor(cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """Contract TT cores (r, n_k, r') into the full tensor of shape (n_1, ..., n_d), gates applied between
    cores.  Meant for checks and small layers: it materializes everything."""
    out = cores[0]
    if out.dim() != 3:
        raise ValueError("full_tensor takes 3-way cores; reshape TTM cores to (r, v*e, r') first")
    out = out.reshape(-1, out.shape[-1])
    sizes = [cores[0].shape[1]]
    for k, core in enumerate(cores[1:]):
        if k < len(gates):
            out = out * gates[k]
        out = (out @ core.reshape(core.shape[0], -1)).reshape(-1, core.shape[-1])
        sizes.append(core.shape[1])
    return out.reshape(sizes)


def dense_to_tt_tensor(weight_t: torch.Tensor, spec: TTSpec) -> torch.Tensor:
    """Pad a (in_features, out_features) matrix to the spec's padded sizes and fold it into the
    tensor the cores factorize: (n_1..n_d, m_1..m_d) for TT, (v_1*e_1, ..., v_d*e_d) for TTM."""
    padded = weight_t.new_zeros(spec.in_padded, spec.out_padded)
    padded[: spec.in_features, : spec.out_features] = weight_t
    if spec.kind == "tt":
        return padded.reshape(*spec.in_modes, *spec.out_modes)
    d = len(spec.in_modes)
    t = padded.reshape(*spec.in_modes, *spec.out_modes)
    perm = [p for k in range(d) for p in (k, d + k)]
    return t.permute(perm).reshape([v * e for v, e in zip(spec.in_modes, spec.out_modes)])


def svd_cores(weight_t: torch.Tensor, spec: TTSpec) -> list[torch.Tensor]:
    """Cores of the spec's shapes from a dense (in_features, out_features) matrix by TT-SVD (in float64)."""
    tensor = dense_to_tt_tensor(weight_t.detach().to(torch.float64), spec)
    cores = tt_svd(tensor, spec.ranks)
    return [c.reshape(shape) for c, shape in zip(cores, spec.core_shapes)]


def cores_to_dense(cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor], spec: TTSpec) -> torch.Tensor:
    """The (in_features, out_features) matrix the cores represent (padding cut off), in the cores' dtype under
    autocast too, as a dense layer's parameter reads."""
    flat = [c.reshape(c.shape[0], -1, c.shape[-1]) for c in cores]
    with contextlib.nullcontext() if flat[0].is_meta else torch.autocast(flat[0].device.type, enabled=False):
        t = full_tensor(flat, gates)
    if spec.kind == "ttm":
        d = len(spec.in_modes)
        t = t.reshape([m for v, e in zip(spec.in_modes, spec.out_modes) for m in (v, e)])
        t = t.permute(list(range(0, 2 * d, 2)) + list(range(1, 2 * d, 2)))
    return t.reshape(spec.in_padded, spec.out_padded)[: spec.in_features, : spec.out_features]
