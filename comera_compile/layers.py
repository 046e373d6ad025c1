"""TT layers: plain nn.Modules holding TT cores and rank gates.

TTLinear stands in for nn.Linear (and look-alikes such as transformers' Conv1D), TTEmbedding for
nn.Embedding and TTEmbeddingBag for nn.EmbeddingBag.  Both keep the dense layer's interface (shapes, dtype, bias, padding_idx) and are ordinary
modules: state_dict, .to(), deepcopy and pickling work as for any nn.Module.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import networks
from .tt import TTSpec, cores_to_dense, gemm_core_padding, gemm_spec, make_spec, random_cores, svd_cores

__all__ = ["TTLinear", "TTEmbedding", "TTEmbeddingBag", "TTLayer", "DEFAULT_TAU"]

# A gate entry below this (in absolute value) counts as switched off.  RankAdaptive's proximal step drives
# unneeded gates to exactly zero, while a needed direction that is still being learned can sit far below 1%
# of its bond's strongest: only (numerical) zeros are off.
DEFAULT_TAU = 1e-6

_INITS = ("random", "svd")

# The row count whose plan serves row counts unknown at trace time (exported programs, symbolic batches).
EXPORT_ROWS = 4096


def _check_init(init: str) -> None:
    if init not in _INITS:
        raise ValueError(f"init must be one of {_INITS}, got {init!r}")


def _checked_dtype(init: str, dtype: torch.dtype | None) -> torch.dtype:
    """Check a TT layer's init and dtype arguments; the dtype to use (default: torch's default)."""
    _check_init(init)
    if dtype is not None and not dtype.is_floating_point:
        raise TypeError(f"TT layers hold floating-point parameters; got dtype {dtype}. "
                        f"Use a float dtype such as torch.float32")
    return dtype or torch.get_default_dtype()


def _has_data(t: torch.Tensor) -> bool:
    """True for a real tensor in eager mode: not while compiling, not a fake or meta tensor."""
    if torch.compiler.is_compiling() or t.is_meta:
        return False
    from torch._subclasses.fake_tensor import is_fake

    return not is_fake(t)


class _PairRows(torch.autograd.Function):
    """Products of two cores' slices per row, out[j] = a[ia[j]] @ b[ib[j]], run over chunks of rows: forward
    and backward never hold the gathered slices of more than one chunk, and the backward adds each chunk's
    gradient into the slices of the cores it came from (index_add), nothing else."""

    CHUNK_ELEMENTS = 1 << 20  # gathered elements per chunk (4 MB in float32)

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, ia: torch.Tensor, ib: torch.Tensor) -> torch.Tensor:
        n = ia.shape[0]
        chunk = max(1, _PairRows.CHUNK_ELEMENTS // max(a[0].numel(), b[0].numel(), 1))
        out = a.new_empty(n, a.shape[1], b.shape[2])
        for start in range(0, n, chunk):
            sl = slice(start, start + chunk)
            torch.bmm(a.index_select(0, ia[sl]), b.index_select(0, ib[sl]), out=out[sl])
        ctx.save_for_backward(a, b, ia, ib)
        ctx.chunk = chunk
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        a, b, ia, ib = ctx.saved_tensors
        ga = torch.zeros_like(a) if ctx.needs_input_grad[0] else None
        gb = torch.zeros_like(b) if ctx.needs_input_grad[1] else None
        for start in range(0, ia.shape[0], ctx.chunk):
            sl = slice(start, start + ctx.chunk)
            g = grad[sl]
            if ga is not None:
                ga.index_add_(0, ia[sl], torch.bmm(g, b.index_select(0, ib[sl]).transpose(1, 2)))
            if gb is not None:
                gb.index_add_(0, ib[sl], torch.bmm(a.index_select(0, ia[sl]).transpose(1, 2), g))
        return ga, gb, None, None


class TTLayer(nn.Module):
    """Common part of the TT layers: the spec, the cores and the gates."""

    spec: TTSpec

    def _init_params(self, spec: TTSpec, cores: Sequence[torch.Tensor], dtype, device) -> None:
        self.spec = spec
        self.cores = nn.ParameterList(
            [nn.Parameter(c.to(device=device, dtype=dtype).contiguous()) for c in cores])
        self.gates = nn.ParameterList(
            [nn.Parameter(torch.ones(r, device=device, dtype=dtype)) for r in spec.gate_sizes])

    @property
    def ranks(self) -> tuple[int, ...]:
        """Allocated ranks, boundary 1s included."""
        return self.spec.ranks

    def active_ranks(self, tau: float = DEFAULT_TAU) -> tuple[int, ...]:
        """Ranks counting only gate entries with |g| >= tau, boundary 1s included."""
        return (1, *(int((g.detach().abs() >= tau).sum()) for g in self.gates), 1)

    def gated_cores(self) -> list[torch.Tensor]:
        """The cores with each bond's gate folded into the core on its left (diag(g) between cores)."""
        out = []
        for k, core in enumerate(self.cores):
            out.append(core * self.gates[k] if k < len(self.gates) else core)
        return out

    def tt_params(self) -> int:
        """Parameters of the factorization: cores and gates."""
        return self.spec.num_params()

    @torch.no_grad()
    def prune_ranks(self, keep: Sequence[torch.Tensor | None]
                    ) -> list[tuple[nn.Parameter, nn.Parameter, int, torch.Tensor]]:
        """Cut rank slices out of the cores for real: keep[k] lists the slices of bond k to keep (None keeps
        all).  The cut cores and gates are new, smaller Parameters (a Parameter cannot change shape while
        an old autograd graph still refers to it).  Returns (old, new, dim, index) for every replaced
        parameter, so callers can point an optimizer at the new ones and cut its state the same way."""
        if len(keep) != len(self.gates):
            raise ValueError(f"prune_ranks needs one entry per bond ({len(self.gates)}), got {len(keep)}")
        cuts: dict[tuple[str, int], list] = {}
        ranks = list(self.spec.ranks)
        for k, idx in enumerate(keep):
            if idx is None or len(idx) == ranks[k + 1]:
                continue
            idx = torch.as_tensor(idx, dtype=torch.long, device=self.gates[k].device)
            if idx.numel() == 0:
                raise ValueError(f"bond {k} would keep no rank slice; keep at least one (a zero gate "
                                 f"switches the layer off without removing its last slice)")
            for plist, j, dim in ((self.cores, k, self.cores[k].dim() - 1), (self.cores, k + 1, 0),
                                  (self.gates, k, 0)):
                key = ("cores" if plist is self.cores else "gates", j)
                old = plist[j]
                new = nn.Parameter(old.data.index_select(dim, idx).contiguous(), requires_grad=old.requires_grad)
                plist[j] = new
                if key in cuts:  # a core cut on both of its bonds: compose the two cuts
                    cuts[key][1] = new
                    cuts[key][2].append((dim, idx))
                else:
                    cuts[key] = [old, new, [(dim, idx)]]
            ranks[k + 1] = idx.numel()
        self.spec = self.spec.with_ranks(ranks)
        return [(old, new, dim, idx) for old, new, steps in cuts.values() for dim, idx in steps]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # A checkpoint of a layer whose ranks were cut: take its ranks, then load as usual.
        ranks = list(self.spec.ranks)
        for k, core in enumerate(self.cores):
            saved = state_dict.get(f"{prefix}cores.{k}")
            if saved is not None and saved.shape != core.shape and saved.dim() == core.dim():
                core.data = core.data.new_empty(saved.shape)
                ranks[k], ranks[k + 1] = saved.shape[0], saved.shape[-1]
        for k, gate in enumerate(self.gates):
            saved = state_dict.get(f"{prefix}gates.{k}")
            if saved is not None and saved.shape != gate.shape:
                gate.data = gate.data.new_empty(saved.shape)
        if tuple(ranks) != self.spec.ranks:
            self.spec = self.spec.with_ranks(ranks)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def dense_params(self) -> int:
        return self.spec.dense_params()

    @torch.no_grad()
    def _reset_cores(self, target_std: float) -> None:
        """Fresh random cores (their product's entries of standard deviation target_std) and unit gates, in
        place, at the current ranks, dtype and device."""
        for core, fresh in zip(self.cores, random_cores(self.spec, target_std, dtype=torch.float64)):
            core.copy_(fresh)
        for gate in self.gates:
            gate.fill_(1.0)


class TTLinear(TTLayer):
    """y = x W^T + b with W held as a TT (tensor-train) factorization.

    Inputs of any leading shape (..., in_features).  The contraction order is chosen per row count from
    the planner's cache, so nothing is searched twice."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 rank: int | Sequence[int] = 30, in_modes: Sequence[int] | None = None,
                 out_modes: Sequence[int] | None = None, d: int | None = None, init: str = "random",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 spec: TTSpec | None = None, _cores: Sequence[torch.Tensor] | None = None) -> None:
        super().__init__()
        dtype = _checked_dtype(init, dtype)
        if spec is None:
            spec = make_spec("tt", in_features, out_features, rank, in_modes, out_modes, d, where="TTLinear")
        self.in_features, self.out_features = spec.in_features, spec.out_features
        if _cores is None:
            if init == "svd":
                raise ValueError("init='svd' needs a dense weight: use TTLinear.from_dense(linear, ...)")
            # nn.Linear's default init: U(-1/sqrt(in), 1/sqrt(in)), i.e. std 1/sqrt(3 in)
            _cores = random_cores(spec, 1.0 / math.sqrt(3 * in_features), dtype=torch.float64)
        self._init_params(spec, _cores, dtype, device)
        if bias:
            bound = 1.0 / math.sqrt(in_features)
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype).uniform_(-bound, bound))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_dense(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   rank: int | Sequence[int] = 30, in_modes: Sequence[int] | None = None,
                   out_modes: Sequence[int] | None = None, d: int | None = None, init: str = "svd",
                   transposed: bool = False) -> "TTLinear":
        """A TTLinear for a dense weight of nn.Linear's layout (out, in), or (in, out) with transposed=True
        (transformers' Conv1D).  init="svd" factorizes the weight by TT-SVD (exact at full ranks);
        init="random" keeps only the shape and the bias."""
        _check_init(init)
        w_t = weight.detach() if transposed else weight.detach().t()
        in_f, out_f = w_t.shape
        spec = make_spec("tt", in_f, out_f, rank, in_modes, out_modes, d, where="TTLinear")
        cores = svd_cores(w_t, spec) if init == "svd" else None
        layer = cls(in_f, out_f, bias is not None, spec=spec, _cores=cores, init="random",
                    device=weight.device, dtype=weight.dtype)
        if bias is not None:
            with torch.no_grad():
                layer.bias.copy_(bias.detach())
        return layer

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-initialise as nn.Linear does (weight entries of its variance, bias U(-1/sqrt(in), 1/sqrt(in))):
        what ``model.to_empty(device=...)`` followed by each module's reset_parameters() relies on, e.g. for
        a model built on the meta device, which never holds a dense weight."""
        self._reset_cores(1.0 / math.sqrt(3 * self.in_features))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features)
            self.bias.uniform_(-bound, bound)

    @property
    def gemm_spec(self) -> TTSpec:
        """The spec the contractions run at: ranks padded by tt.gemm_ranks (zero slices), so the GEMMs'
        narrow side suits the BLAS kernels.  Equal to spec when no rank needs padding."""
        return gemm_spec(self.spec)

    def plan(self, rows: int, training: bool = True, input_requires_grad: bool = True) -> networks.Plan:
        """The contraction plan for an input with this many rows (at gemm_spec's ranks): least forward +
        backward cost when training, least forward cost for inference (searched once per shape, then
        cached)."""
        return networks.plan_tt_linear(self.gemm_spec, rows, training, input_requires_grad)

    def flops(self, rows: int) -> int:
        """Forward FLOPs of the TT product (bias excluded) for this many rows."""
        return self.plan(rows, training=False).flops

    def _operands(self) -> list[torch.Tensor]:
        """The gated cores as the contraction takes them: zero-padded to gemm_spec's ranks, boundary
        ranks dropped."""
        cores = self.gated_cores()
        for k, pad in enumerate(gemm_core_padding(self.spec.key())):
            if pad is not None:
                cores[k] = F.pad(cores[k], pad)
        cores[0] = cores[0].reshape(cores[0].shape[1], cores[0].shape[2])
        cores[-1] = cores[-1].reshape(cores[-1].shape[0], cores[-1].shape[1])
        return cores

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"TTLinear expects inputs of shape (..., {self.in_features}), got {tuple(x.shape)}")
        spec = self.spec
        lead = x.shape[:-1]
        rows = 1
        for n in lead:  # not math.prod: the sizes may be symbolic under torch.compile
            rows = rows * n
        x2 = x.reshape(rows, self.in_features)
        if spec.in_padded != self.in_features:
            x2 = F.pad(x2, (0, spec.in_padded - self.in_features))
        x2 = x2.reshape(rows, *spec.in_modes)
        training = torch.is_grad_enabled() and (x.requires_grad or self.cores[0].requires_grad)
        if torch.compiler.is_exporting():
            # An exported program serves every row count: one plan (any plan computes the same product), no
            # guard on the row count.
            program = networks.tt_linear_program(spec, EXPORT_ROWS, training, x.requires_grad)
        elif torch.compiler.is_compiling():
            # The plans of all row counts are one constant; comparing the (maybe symbolic) row count with
            # their thresholds picks one, so dynamic batch sizes need no recompile per size.
            thresholds, programs = networks.tt_linear_segments(spec.key(), training, x.requires_grad)
            segment = 0
            for t in thresholds:
                if rows >= t:
                    segment += 1
            program = programs[segment]
        else:
            program = networks.tt_linear_program(spec, rows, training, x.requires_grad)
        fused = self.bias is not None and networks.fuses_bias(program[-1].recipe, self.out_features)
        y = networks.run_program(program, [x2, *self._operands()], rows, self.bias if fused else None)
        y = y.reshape(rows, spec.out_padded)
        if spec.out_padded != self.out_features:
            y = y[:, : self.out_features]
        if self.bias is not None and not fused:
            y = y + self.bias.to(y.dtype)  # under autocast y is in the autocast dtype, as nn.Linear's output
        return y.reshape(*lead, self.out_features)

    def to_dense(self) -> torch.Tensor:
        """The dense weight in nn.Linear's layout (out_features, in_features)."""
        return cores_to_dense(list(self.cores), list(self.gates), self.spec).t()

    @property
    def weight(self) -> torch.Tensor:
        """nn.Linear's weight, for code that reads it (``layer.weight.dtype`` in transformers' T5): the dense
        matrix the cores represent, built on each access (differentiable; under torch.compile an access that
        only asks for dtype, device or shape costs nothing)."""
        return self.to_dense()

    def extra_repr(self) -> str:
        s = self.spec
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, modes={s.in_modes}->{s.out_modes}, ranks={s.ranks}")


class TTEmbedding(TTLayer):
    """An embedding table V x D held as a TTM factorization; lookups never build the table.

    Row i is found from its mixed-radix digits (i_1..i_d) over the row modes: the product of the cores'
    slices G_k[:, i_k, :, :].  padding_idx behaves as in nn.Embedding: that row reads as zeros and gets
    no gradient."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *,
                 rank: int | Sequence[int] = 30, row_modes: Sequence[int] | None = None,
                 col_modes: Sequence[int] | None = None, d: int | None = None, init: str = "random",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 spec: TTSpec | None = None, _cores: Sequence[torch.Tensor] | None = None) -> None:
        super().__init__()
        dtype = _checked_dtype(init, dtype)
        if spec is None:
            spec = make_spec("ttm", num_embeddings, embedding_dim, rank, row_modes, col_modes, d,
                             where="TTEmbedding")
        self.num_embeddings, self.embedding_dim = spec.in_features, spec.out_features
        if padding_idx is not None:
            if not -self.num_embeddings <= padding_idx < self.num_embeddings:
                raise ValueError(f"padding_idx must be within the {self.num_embeddings} rows, got {padding_idx}")
            padding_idx %= self.num_embeddings
        self.padding_idx = padding_idx
        if _cores is None:
            if init == "svd":
                raise ValueError("init='svd' needs a dense table: use TTEmbedding.from_dense(embedding, ...)")
            _cores = random_cores(spec, 1.0, dtype=torch.float64)  # nn.Embedding's default: N(0, 1)
        self._init_params(spec, _cores, dtype, device)
        strides, acc = [], 1
        for v in reversed(spec.in_modes):
            strides.append(acc)
            acc *= v
        self._strides = tuple(reversed(strides))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-initialise as nn.Embedding does (rows N(0, 1); the padding row reads as zeros whatever the
        cores hold): for ``model.to_empty(device=...)`` followed by each module's reset_parameters()."""
        self._reset_cores(1.0)

    @classmethod
    def from_dense(cls, weight: torch.Tensor, padding_idx: int | None = None, *,
                   rank: int | Sequence[int] = 30, row_modes: Sequence[int] | None = None,
                   col_modes: Sequence[int] | None = None, d: int | None = None,
                   init: str = "svd") -> "TTEmbedding":
        """A TTEmbedding for a dense (V, D) table; init="svd" factorizes it (exact at full ranks)."""
        _check_init(init)
        v, e = weight.shape
        spec = make_spec("ttm", v, e, rank, row_modes, col_modes, d, where="TTEmbedding")
        cores = svd_cores(weight.detach(), spec) if init == "svd" else None
        return cls(v, e, padding_idx, spec=spec, _cores=cores, device=weight.device, dtype=weight.dtype)

    def plan(self, rows: int, training: bool = True, dedupe: bool = True) -> networks.LookupPlan:
        """How `rows` distinct rows are looked up: the core pairs merged (into tables, or only for the
        batch's digit pairs) and the contraction order, chosen by the planner's cost model and cached."""
        return networks.plan_ttm_lookup(self.spec, networks.lookup_bucket(rows), training, dedupe)

    def flops(self, rows: int) -> int:
        """Forward FLOPs of looking up `rows` distinct rows with the planned merging and order."""
        return self.plan(rows, training=False).flops

    def _check_indices(self, indices: torch.Tensor, where: str) -> torch.Tensor:
        """The indices as a flat int64 tensor, after nn.Embedding's checks (type, range) where data exists."""
        if indices.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{where} expects integer indices (torch.long or torch.int), got {indices.dtype}")
        flat = indices.reshape(-1).long()
        if not _has_data(flat):  # compiled or exported: a runtime assert, as a compiled nn.Embedding has
            torch._assert_async(((flat >= 0) & (flat < self.num_embeddings)).all(), "index out of range in self")
        elif flat.numel() > 0:
            lo, hi = torch.aminmax(flat)
            if int(lo) < 0 or int(hi) >= self.num_embeddings:
                self._out_of_range(flat)
        return flat

    def _out_of_range(self, flat: torch.Tensor) -> None:
        raise IndexError("index out of range in self")  # nn.Embedding's words

    def _rows(self, idx: torch.Tensor, groups: tuple, program: tuple) -> torch.Tensor:
        """Rows (n, out_padded) of a 1-D index tensor, following a lookup plan's groups and program."""
        s = self.spec
        eager = _has_data(idx)
        n = idx.shape[0]
        cores = self.gated_cores()
        by_row: dict[int, torch.Tensor] = {}

        def row_major(k: int) -> torch.Tensor:  # core k as (v_k, r, e_k, r'): a row gather is one memcpy
            if k not in by_row:
                by_row[k] = cores[k].permute(1, 0, 2, 3).contiguous()
            return by_row[k]

        def digits(first: int, last: int, values: torch.Tensor) -> torch.Tensor:
            modes = math.prod(s.in_modes[first:last])
            return torch.div(values, self._strides[last - 1], rounding_mode="floor") % modes

        def pair_rows(a: int, d: torch.Tensor) -> torch.Tensor:  # cores a, a+1 multiplied per digit pair
            vb, r = s.in_modes[a + 1], s.ranks[a + 1]
            left = row_major(a).reshape(s.in_modes[a], s.ranks[a] * s.out_modes[a], r)
            right = row_major(a + 1).reshape(vb, r, s.out_modes[a + 1] * s.ranks[a + 2])
            ia, ib = torch.div(d, vb, rounding_mode="floor"), d % vb
            if eager:
                return _PairRows.apply(left, right, ia, ib)
            return torch.bmm(left.index_select(0, ia), right.index_select(0, ib))

        ops = []
        for a, b, how in groups:
            d = digits(a, b, idx)
            if b - a == 1:
                t = row_major(a).index_select(0, d)
            elif how == "table":
                va, vb = s.in_modes[a], s.in_modes[a + 1]
                left = row_major(a).reshape(-1, s.ranks[a + 1])
                right = cores[a + 1].reshape(s.ranks[a + 1], -1)
                shape = (va, s.ranks[a], s.out_modes[a], vb, s.out_modes[a + 1], s.ranks[b])
                table = (left @ right).reshape(shape).permute(0, 3, 1, 2, 4, 5).reshape(va * vb, -1)
                t = table.index_select(0, d)
            elif how == "dedupe":
                pairs, inverse = torch.unique(d, return_inverse=True)
                t = pair_rows(a, pairs).flatten(1).index_select(0, inverse)
            else:
                t = pair_rows(a, d)
            e = math.prod(s.out_modes[a:b])
            shape = (n, e, s.ranks[b]) if a == 0 else (n, s.ranks[a], e) if b == len(s.in_modes) else (
                n, s.ranks[a], e, s.ranks[b])
            ops.append(t.reshape(shape))
        out = ops[0] if not program else networks.run_program(program, ops, n)
        out = out.reshape(n, s.out_padded)
        if s.out_padded != self.embedding_dim:
            out = out[:, : self.embedding_dim]
        return out

    def _lookup(self, flat: torch.Tensor, dedupe: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rows, inverse): in eager mode the distinct rows of `flat` and where each entry of it sits among
        them; while compiling (no data-dependent shapes) one row per entry and inverse None.  The padding
        row reads as zeros, so it gets no gradient."""
        with torch.autocast(flat.device.type, enabled=False):  # nn.Embedding ignores autocast: so do we
            return self._lookup_rows(flat, dedupe)

    def _lookup_rows(self, flat: torch.Tensor, dedupe: bool | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        training = torch.is_grad_enabled() and self.cores[0].requires_grad
        concrete = flat.numel() > 0 and _has_data(flat) if dedupe is None else dedupe
        if concrete:
            keys, inverse = torch.unique(flat, return_inverse=True)
            groups, program = networks.ttm_lookup_program(self.spec.key(), keys.shape[0], training, True)
        else:
            keys, inverse = flat, None
            # Compiling (the row count may be symbolic, and a plan per count would recompile per batch size):
            # the plan of a typical batch, which computes the same rows as any other.
            groups, program = networks.ttm_lookup_program(self.spec.key(), EXPORT_ROWS, training, False)
        out = self._rows(keys, groups, program)
        if self.padding_idx is not None:
            out = out * (keys != self.padding_idx).unsqueeze(1).to(out.dtype)
        return out, inverse

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        flat = self._check_indices(indices, type(self).__name__)
        rows, inverse = self._lookup(flat)
        out = rows if inverse is None else rows.index_select(0, inverse)
        return out.reshape(*indices.shape, self.embedding_dim)

    def to_dense(self) -> torch.Tensor:
        """The dense table (num_embeddings, embedding_dim), padding row zeroed as the lookup reads it."""
        w = cores_to_dense(list(self.cores), list(self.gates), self.spec)
        if self.padding_idx is not None:
            w = w.clone()
            w[self.padding_idx] = 0
        return w

    def extra_repr(self) -> str:
        s = self.spec
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return (f"{self.num_embeddings}, {self.embedding_dim}{pad}, row_modes={s.in_modes}, "
                f"col_modes={s.out_modes}, ranks={s.ranks}")


_BAG_MODES = ("sum", "mean", "max")


class _BagIndexError(IndexError, RuntimeError):
    """An out-of-range index of a bag: nn.EmbeddingBag's message and its RuntimeError, and an IndexError as
    TTEmbedding raises, so either except clause catches it."""


class TTEmbeddingBag(TTEmbedding):
    """nn.EmbeddingBag with the table held as a TTM factorization: sums, means or maxima of bags of rows,
    bags given as nn.EmbeddingBag takes them (a 2-D input of fixed-size bags, or a 1-D input with offsets,
    include_last_offset, per_sample_weights in "sum" mode).  Each distinct row of a batch is looked up once;
    entries equal to padding_idx are left out of their bag (and of a mean's count)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, mode: str = "mean", *,
                 padding_idx: int | None = None, include_last_offset: bool = False,
                 rank: int | Sequence[int] = 30, row_modes: Sequence[int] | None = None,
                 col_modes: Sequence[int] | None = None, d: int | None = None, init: str = "random",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 spec: TTSpec | None = None, _cores: Sequence[torch.Tensor] | None = None) -> None:
        if mode not in _BAG_MODES:
            raise ValueError(f"mode must be one of {_BAG_MODES} (as in nn.EmbeddingBag), got {mode!r}")
        super().__init__(num_embeddings, embedding_dim, padding_idx, rank=rank, row_modes=row_modes,
                         col_modes=col_modes, d=d, init=init, device=device, dtype=dtype, spec=spec,
                         _cores=_cores)
        self.mode = mode
        self.include_last_offset = include_last_offset

    @classmethod
    def from_dense(cls, weight: torch.Tensor, padding_idx: int | None = None, *, mode: str = "mean",
                   include_last_offset: bool = False, rank: int | Sequence[int] = 30,
                   row_modes: Sequence[int] | None = None, col_modes: Sequence[int] | None = None,
                   d: int | None = None, init: str = "svd") -> "TTEmbeddingBag":
        """A TTEmbeddingBag for a dense (V, D) table; init="svd" factorizes it (exact at full ranks)."""
        _check_init(init)
        v, e = weight.shape
        spec = make_spec("ttm", v, e, rank, row_modes, col_modes, d, where="TTEmbeddingBag")
        cores = svd_cores(weight.detach(), spec) if init == "svd" else None
        return cls(v, e, mode, padding_idx=padding_idx, include_last_offset=include_last_offset, spec=spec,
                   _cores=cores, device=weight.device, dtype=weight.dtype)

    def _out_of_range(self, flat: torch.Tensor) -> None:
        bad = int(((flat < 0) | (flat >= self.num_embeddings)).nonzero()[0, 0])
        raise _BagIndexError(f"Index {bad} of input takes value {int(flat[bad])} which is not in the valid "
                             f"range [0, {self.num_embeddings})")

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        flat = self._check_indices(input, "TTEmbeddingBag")
        rows, inverse = self._lookup(flat)
        position = torch.arange(flat.shape[0], device=flat.device) if inverse is None else inverse
        pad = None
        if self.padding_idx is not None:
            # Padding entries point at one extra row that F.embedding_bag leaves out of every bag.
            pad = rows.shape[0]
            rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
            position = torch.where(flat == self.padding_idx, pad, position)
        return F.embedding_bag(position.reshape(input.shape), rows, offsets, mode=self.mode,
                               per_sample_weights=per_sample_weights,
                               include_last_offset=self.include_last_offset, padding_idx=pad)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}" + (
            ", include_last_offset=True" if self.include_last_offset else "")
