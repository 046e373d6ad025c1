"""TTEmbedding and TTEmbeddingBag: nn.Embedding / nn.EmbeddingBag stand-ins whose table is a TTM.

A lookup gathers each row's core slices and contracts them, in the grouping and order the lookup planner
(comera_compile.networks) chose for the batch's distinct rows.  padding_idx and the bag modes behave as in
torch's modules.
"""

from __future__ import annotations

import contextlib

import math
import warnings
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import networks
from .graphs import capturing
from .layers import EXPORT_ROWS, TTLayer, check_init, profiled
from .tt import TTSpec, cores_to_dense, make_spec, svd_cores

__all__ = ["TTEmbedding", "TTEmbeddingBag"]


def _has_data(t: torch.Tensor) -> bool:
    """True for a real tensor in eager mode whose values the host may read: not while compiling, not a fake or
    meta tensor, and not while a CUDA graph is captured or StepGraph probes a step for host reads (a capture
    forbids reading device values and a replay would not repeat it: the lookup takes the static path a
    compiled graph takes)."""
    if torch.compiler.is_compiling() or t.is_meta:
        return False
    if capturing() or (t.is_cuda and torch.cuda.is_current_stream_capturing()):
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
    def backward(ctx, grad: torch.Tensor):   # differentiable ops (out-of-place adds): create_graph works
        a, b, ia, ib = ctx.saved_tensors
        ga = torch.zeros_like(a) if ctx.needs_input_grad[0] else None
        gb = torch.zeros_like(b) if ctx.needs_input_grad[1] else None
        # In the cores' dtype, as the forward's bmm(out=...) ran: a backward called inside an autocast
        # region would otherwise get lower-precision products that index_add_ refuses to add.
        kind = grad.device.type
        with torch.autocast(kind, enabled=False) if torch.is_autocast_enabled(kind) else contextlib.nullcontext():
            for start in range(0, ia.shape[0], ctx.chunk):
                sl = slice(start, start + ctx.chunk)
                g = grad[sl].to(a.dtype)
                if ga is not None:
                    ga = ga.index_add(0, ia[sl], torch.bmm(g, b.index_select(0, ib[sl]).transpose(1, 2)))
                if gb is not None:
                    gb = gb.index_add(0, ib[sl], torch.bmm(a.index_select(0, ia[sl]).transpose(1, 2), g))
        return ga, gb, None, None


def _fill_padding_row(layer: nn.Module, incompatible: object) -> None:
    """Load post-hook of TTEmbedding: the padding row a state_dict lacked, from the cores just loaded."""
    fill = layer.__dict__.pop("_row_to_fill", None)
    if fill is None:
        return
    prefix, unversioned = fill
    with torch.no_grad():
        keys = torch.tensor([layer.padding_idx], device=layer.cores[0].device)
        program = networks.ttm_lookup_program(layer.spec.token, 1, False, True)
        layer.padding_row.copy_(layer._rows(keys, *program)[0])
    if unversioned:
        warnings.warn(f"{prefix.rstrip('.') or 'TTEmbedding'}: the state_dict has no padding_row, so row "
                      f"{layer.padding_idx} reads what the loaded cores give, as a layer saved without padding_idx "
                      f"did; if it comes from a padding layer saved before padding_row existed, that row read "
                      f"zeros: call padding_row.zero_() on the layer", stacklevel=4)


class TTEmbedding(TTLayer):
    """An embedding table V x D held as a TTM factorization; lookups never build the table.

    Row i is found from its mixed-radix digits (i_1..i_d) over the row modes: the product of the cores'
    slices G_k[:, i_k, :, :].  padding_idx behaves as in nn.Embedding: that row is stored apart (the buffer
    ``padding_row``: zeros, or the dense table's row from_dense was given) and gets no gradient."""

    _keeps_padding_row = True   # a bag leaves padding entries out, so it never reads the row
    # 2: a state_dict saved without padding_row comes from a layer without padding_idx (see _load_from_state_dict)
    _version = 2

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *,
                 rank: int | Sequence[int] = 30, row_modes: Sequence[int] | None = None,
                 col_modes: Sequence[int] | None = None, d: int | None = None, init: str = "random",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 spec: TTSpec | None = None, _cores: Sequence[torch.Tensor] | None = None) -> None:
        super().__init__()
        # nn.Embedding's default init: N(0, 1)
        self._build("ttm", num_embeddings, embedding_dim, rank, row_modes, col_modes, d, init, device, dtype, spec,
                    _cores, std=1.0)
        spec = self.spec
        self.num_embeddings, self.embedding_dim = spec.in_features, spec.out_features
        if padding_idx is not None:
            if not -self.num_embeddings <= padding_idx < self.num_embeddings:
                raise ValueError(f"padding_idx must be within the {self.num_embeddings} rows, got {padding_idx}")
            padding_idx %= self.num_embeddings
            if self._keeps_padding_row:
                self.register_buffer("padding_row", torch.zeros(self.embedding_dim, device=device,
                                                                dtype=self.cores[0].dtype))
        self.padding_idx = padding_idx
        if padding_idx is not None and self._keeps_padding_row:
            self.register_load_state_dict_post_hook(_fill_padding_row)
        strides, acc = [], 1
        for v in reversed(spec.in_modes):
            strides.append(acc)
            acc *= v
        self._strides = tuple(reversed(strides))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-initialise as nn.Embedding does (rows N(0, 1), the padding row zeros): for
        ``model.to_empty(device=...)`` followed by each module's reset_parameters()."""
        self._reset_cores(1.0)
        if getattr(self, "padding_row", None) is not None:
            self.padding_row.zero_()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if f"{prefix}padding_row" in missing_keys:
            # Saved by a layer without padding_idx, which read that row from its cores: keep it, as nn.Embedding
            # keeps a loaded table's padding row (filled in by _fill_padding_row, once the cores are loaded).
            # Without the version (a checkpoint from before it, or a format that drops torch's metadata) it may
            # also be a padding layer's from before the row was kept, which read zeros: that is said.
            missing_keys.remove(f"{prefix}padding_row")
            self._row_to_fill = (prefix, (local_metadata or {}).get("version", 1) < 2)


    @classmethod
    def from_dense(cls, weight: torch.Tensor, padding_idx: int | None = None, *,
                   rank: int | Sequence[int] = 30, row_modes: Sequence[int] | None = None,
                   col_modes: Sequence[int] | None = None, d: int | None = None,
                   init: str = "svd") -> "TTEmbedding":
        """A TTEmbedding for a dense (V, D) table; init="svd" factorizes it (exact at full ranks, the padding
        row included: it is kept as it is)."""
        check_init(init)
        v, e = weight.shape
        spec = make_spec("ttm", v, e, rank, row_modes, col_modes, d, where="TTEmbedding")
        cores = svd_cores(weight.detach(), spec) if init == "svd" else None
        layer = cls(v, e, padding_idx, spec=spec, _cores=cores, device=weight.device, dtype=weight.dtype)
        if init == "svd" and padding_idx is not None:
            with torch.no_grad():
                layer.padding_row.copy_(weight[layer.padding_idx])
        return layer

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
            if k not in by_row:   # r = 1 (the first core): a view, so its gradient has the core's own strides
                c = cores[k]      # (permute's gives the size-1 dim another stride, which DDP warns of and copies)
                by_row[k] = c.reshape(c.shape[1], 1, *c.shape[2:]) if c.shape[0] == 1 else \
                    c.permute(1, 0, 2, 3).contiguous()
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
        for group in groups:   # fields by name: dynamo of torch 2.11/2.12 cannot unpack a constant NamedTuple
            a, b, how = group.first, group.stop, group.how
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
        row reads as padding_row (zeros in a bag), so the cores get no gradient from it."""
        # nn.Embedding ignores autocast: so do we (the meta device has no autocast to turn off)
        with contextlib.nullcontext() if flat.is_meta else torch.autocast(flat.device.type, enabled=False):
            return self._lookup_rows(flat, dedupe)

    def _lookup_rows(self, flat: torch.Tensor, dedupe: bool | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        training = torch.is_grad_enabled() and self.cores[0].requires_grad
        concrete = flat.numel() > 0 and _has_data(flat) if dedupe is None else dedupe
        if concrete:
            keys, inverse = torch.unique(flat, return_inverse=True)
            groups, program = networks.ttm_lookup_program(self.spec.token, keys.shape[0], training, True)
        else:
            keys, inverse = flat, None
            # Compiling (the row count may be symbolic, and a plan per count would recompile per batch size):
            # the plan of a typical batch, which computes the same rows as any other.
            groups, program = networks.ttm_lookup_program(self.spec.token, EXPORT_ROWS, training, False)
        out = self._rows(keys, groups, program)
        if self.padding_idx is not None:
            row = self.padding_row.to(out.dtype) if self._keeps_padding_row else out.new_zeros(())
            out = torch.where((keys == self.padding_idx).unsqueeze(1), row, out)
        return out, inverse

    @profiled("tt_embedding")
    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        flat = self._check_indices(indices, type(self).__name__)
        rows, inverse = self._lookup(flat)
        if inverse is None:
            return rows.reshape(*indices.shape, self.embedding_dim)
        # gathered straight into the output's shape: a tensor of its own as nn.Embedding's, not a view, whose
        # base a compiled block taking it would guard on (a second graph for the block it feeds)
        return F.embedding(inverse.reshape(indices.shape), rows)

    def to_dense(self) -> torch.Tensor:
        """The dense table (num_embeddings, embedding_dim), the padding row as the lookup reads it."""
        w = cores_to_dense(list(self.cores), list(self.gates), self.spec)
        if self.padding_idx is not None:
            w = w.clone()
            w[self.padding_idx] = self.padding_row if self._keeps_padding_row else 0
        return w

    @property
    def weight(self) -> torch.Tensor:
        """nn.Embedding's weight, for code that reads it (``emb.weight.device``, a head written as
        ``h @ emb.weight.t()``): the dense table the cores represent, built on each access (differentiable)."""
        return self.to_dense()

    @torch.no_grad()
    def to_dense_module(self) -> nn.Embedding:
        """The nn.Embedding computing what this layer computes (gates folded into the table)."""
        return self._fill_dense(nn.Embedding(self.num_embeddings, self.embedding_dim, padding_idx=self.padding_idx,
                                             **self._dense_kwargs()))

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

    _keeps_padding_row = False

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
        check_init(init)
        v, e = weight.shape
        spec = make_spec("ttm", v, e, rank, row_modes, col_modes, d, where="TTEmbeddingBag")
        cores = svd_cores(weight.detach(), spec) if init == "svd" else None
        return cls(v, e, mode, padding_idx=padding_idx, include_last_offset=include_last_offset, spec=spec,
                   _cores=cores, device=weight.device, dtype=weight.dtype)

    def _out_of_range(self, flat: torch.Tensor) -> None:
        bad = int(((flat < 0) | (flat >= self.num_embeddings)).nonzero()[0, 0])
        raise _BagIndexError(f"Index {bad} of input takes value {int(flat[bad])} which is not in the valid "
                             f"range [0, {self.num_embeddings})")

    @profiled("tt_embedding_bag")
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

    @torch.no_grad()
    def to_dense_module(self) -> nn.EmbeddingBag:
        """The nn.EmbeddingBag computing what this layer computes (gates folded into the table)."""
        return self._fill_dense(nn.EmbeddingBag(self.num_embeddings, self.embedding_dim, mode=self.mode,
                                                include_last_offset=self.include_last_offset,
                                                padding_idx=self.padding_idx, **self._dense_kwargs()))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}" + (
            ", include_last_offset=True" if self.include_last_offset else "")
