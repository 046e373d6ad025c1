"""TT layers: plain nn.Modules holding TT cores and rank gates; TTLayer (what every TT layer shares) and
TTLinear, which stands in for nn.Linear (and look-alikes such as transformers' Conv1D).

TT layers keep the dense layer's interface (shapes, dtype, bias) and are ordinary modules: state_dict,
.to(), deepcopy and pickling work as for any nn.Module.  The embeddings are in comera_compile.embedding.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from . import compiled_region, networks, optim_state
from .networks import codegen
from .ops.buffers import exporting
from .tt import TTSpec, cores_to_dense, gemm_core_padding, gemm_spec, make_spec, random_cores, svd_cores

__all__ = ["TTLayer", "TTLinear", "DEFAULT_TAU", "EXPORT_ROWS", "check_init", "checked_dtype", "exporting",
           "profiled"]

# A gate entry below this (in absolute value) counts as switched off.  RankAdaptive's proximal step drives
# unneeded gates to exactly zero, while a needed direction that is still being learned can sit far below 1%
# of its bond's strongest: only (numerical) zeros are off.
DEFAULT_TAU = 1e-6

_INITS = ("random", "svd")

# Each TT layer's parameters -> the layer (weakly, both ways): a compiled graph that several blocks share
# names, at run time, the layer whose parameters it was handed (comera_compile.profiling, compiled profiles).
_OWNERS: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def layer_of(tensor: torch.Tensor) -> "TTLayer | None":
    """The TT layer holding `tensor` as a parameter, if it is one (layers built, cut or named in this process)."""
    ref = _OWNERS.get(tensor)
    return None if ref is None else ref()


# The row count whose plan serves row counts unknown at trace time (exported programs, symbolic batches).
EXPORT_ROWS = 4096


def profiled(kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for a TT layer's forward: while torch's profiler records, and outside torch.compile, the
    call runs inside ``record_function("comera.<kind>[<layer name>]")``, so profiler tables and traces name
    each layer's contractions (their backward ops carry the forward ops' sequence numbers, see
    comera_compile.profiling), and a compiled region that runs the layer eagerly warns (compiled_region).  Under
    torch.compile the branch folds away (``is_compiling()`` is a constant to dynamo): the graph is the same."""

    def wrap(forward: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(forward)
        def call(self: "TTLayer", *args: Any, **kwargs: Any) -> Any:
            if not torch.compiler.is_compiling():
                compiled_region.ran_eagerly(self)   # a word where a compiled region runs this layer eagerly
                if torch.autograd.profiler._is_profiler_enabled:
                    with torch.profiler.record_function(f"comera.{kind}[{self.comera_name or type(self).__name__}]"):
                        return forward(self, *args, **kwargs)
            return forward(self, *args, **kwargs)

        call.comera_kind = kind   # the range's kind, for compiled profiles (comera_compile.profiling)
        return call

    return wrap


def check_init(init: str) -> None:
    if init not in _INITS:
        raise ValueError(f"init must be one of {_INITS}, got {init!r}")


def checked_dtype(init: str, dtype: torch.dtype | None) -> torch.dtype:
    """Check a TT layer's init and dtype arguments; the dtype to use (default: torch's default)."""
    check_init(init)
    if dtype is not None and not dtype.is_floating_point:
        raise TypeError(f"TT layers hold floating-point parameters; got dtype {dtype}. "
                        f"Use a float dtype such as torch.float32")
    return dtype or torch.get_default_dtype()



class TTLayer(nn.Module):
    """Common part of the TT layers: the spec, the cores and the gates."""

    spec: TTSpec
    # The layer's qualified name in its model, for profiler ranges: set by tensorize and comera_compile.profiling.
    comera_name: str | None = None

    def _build(self, kind: str, in_features: int, out_features: int, rank: int | Sequence[int],
               in_modes: Sequence[int] | None, out_modes: Sequence[int] | None, d: int | None, init: str,
               device: torch.device | str | None, dtype: torch.dtype | None, spec: TTSpec | None,
               cores: Sequence[torch.Tensor] | None, std: float) -> torch.dtype:
        """The spec (made from the shape arguments unless given), then the cores (given, or random with
        entries of this std: the dense layer's own init scale) and gates as parameters; returns the dtype."""
        dtype = checked_dtype(init, dtype)
        if spec is None:
            spec = make_spec(kind, in_features, out_features, rank, in_modes, out_modes, d, where=type(self).__name__)
        if cores is None:
            if init == "svd":
                raise ValueError(f"init='svd' needs the dense {'weight' if kind == 'tt' else 'table'}: use "
                                 f"{type(self).__name__}.from_dense(...)")
            cores = random_cores(spec, std, dtype=torch.float64)
        self._init_params(spec, cores, dtype, device)
        return dtype

    def _init_params(self, spec: TTSpec, cores: Sequence[torch.Tensor], dtype, device) -> None:
        self.spec = spec
        self.cores = nn.ParameterList(
            [nn.Parameter(c.to(device=device, dtype=dtype).contiguous()) for c in cores])
        self.gates = nn.ParameterList(
            [nn.Parameter(torch.ones(r, device=device, dtype=dtype)) for r in spec.gate_sizes])
        self.claim_parameters()

    def claim_parameters(self) -> None:
        """Record this layer as the owner of its parameters (layer_of); done when they are made or cut."""
        ref = weakref.ref(self)
        for p in self.parameters():
            _OWNERS[p] = ref

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
        self.claim_parameters()
        return [(old, new, dim, idx) for old, new, steps in cuts.values() for dim, idx in steps]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # A checkpoint of a layer whose ranks were cut: take its ranks, then load as usual.
        cores = [state_dict.get(f"{prefix}cores.{k}") for k in range(len(self.cores))]
        gates = [state_dict.get(f"{prefix}gates.{k}") for k in range(len(self.gates))]
        if any(t is not None and t.shape != p.shape for t, p in zip(cores + gates, [*self.cores, *self.gates])):
            ranks = self._saved_ranks(cores, gates)
            if ranks is None:   # torch's size-mismatch errors follow, from super()
                error_msgs.append(
                    f"TT layer {prefix[:-1] or '(the model)'}: the checkpoint's cores "
                    f"{[tuple(t.shape) if t is not None else None for t in cores]} are not this layer's modes "
                    f"{[tuple(c.shape[1:-1]) for c in self.cores]} at other ranks, or some cores or gates are "
                    f"missing: tensorize the model with the shapes it was saved with, and load every core and gate")
            else:
                changed = []
                for plist, saved in ((self.cores, cores), (self.gates, gates)):
                    for p, t in zip(plist, saved):
                        if t.shape != p.shape:
                            changed.append((p, tuple(p.shape)))
                            p.data, p.grad = p.data.new_empty(t.shape), None   # a gradient of the old shape
                optim_state.reshaped(changed)   # an optimizer's state of the old shapes: an error at its step
                self.spec = self.spec.with_ranks(ranks)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def _saved_ranks(self, cores: list[Any], gates: list[Any]) -> list[int] | None:
        """The ranks of a checkpoint's cores and gates where they are this layer's modes at other ranks (every
        core and gate present, the bonds chained, the end ranks kept), else None."""
        if any(t is None for t in cores + gates):
            return None
        ranks = [t.shape[0] for t in cores] + [cores[-1].shape[-1]]
        fits = all(t.dim() == c.dim() and t.shape[1:-1] == c.shape[1:-1] for t, c in zip(cores, self.cores))
        fits = fits and ranks[0] == self.spec.ranks[0] and ranks[-1] == self.spec.ranks[-1]
        fits = fits and all(a.shape[-1] == b.shape[0] for a, b in zip(cores, cores[1:]))
        fits = fits and all(g.dim() == 1 and g.numel() == ranks[k + 1] for k, g in enumerate(gates))
        return ranks if fits else None

    def dense_params(self) -> int:
        return self.spec.dense_params()

    def to_dense_module(self) -> nn.Module:
        """The plain dense layer computing what this layer computes, its gates folded into the weight (for
        densify and resize_token_embeddings); each TT layer class gives its own."""
        raise TypeError(f"densify does not know the dense form of {type(self).__name__}")

    def _dense_kwargs(self) -> dict[str, Any]:
        """device and dtype for the dense module: the cores'."""
        return {"device": self.cores[0].device, "dtype": self.cores[0].dtype}

    @torch.no_grad()
    def _fill_dense(self, dense: nn.Module) -> nn.Module:
        """`dense` (a freshly built dense layer of this layer's shape) given this layer's weight, its
        parameters' requires_grad (the weight's: the cores'; the bias keeps its own) and its train/eval mode."""
        dense.weight.copy_(self.to_dense())
        trains = any(core.requires_grad for core in self.cores)
        for name, p in dense.named_parameters():
            own = getattr(self, name, None) if name != "weight" else None
            p.requires_grad_(own.requires_grad if isinstance(own, torch.Tensor) else trains)
        dense.train(self.training)
        return dense

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
        # nn.Linear's default init: U(-1/sqrt(in), 1/sqrt(in)), i.e. std 1/sqrt(3 in)
        dtype = self._build("tt", in_features, out_features, rank, in_modes, out_modes, d, init, device, dtype, spec,
                            _cores, std=1.0 / math.sqrt(3 * in_features))
        self.in_features, self.out_features = self.spec.in_features, self.spec.out_features
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
        check_init(init)
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
        for k, pad in enumerate(gemm_core_padding(self.spec.token)):
            if pad is not None:
                cores[k] = F.pad(cores[k], pad)
        cores[0] = cores[0].reshape(cores[0].shape[1], cores[0].shape[2])
        cores[-1] = cores[-1].reshape(cores[-1].shape[0], cores[-1].shape[1])
        return cores

    @profiled("tt_linear")
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
        # read from the lists' own dicts: dynamo traces that in a few steps, ParameterList's indexing in dozens
        params = (*self.cores._parameters.values(), *self.gates._parameters.values())
        if len(params) != 2 * spec.num_cores - 1:
            raise RuntimeError(f"{type(self).__name__} {self.comera_name or ''}: its cores and gates must be the "
                               f"Parameters of its ParameterLists ({len(params)} found, {2 * spec.num_cores - 1} "
                               f"expected); a parametrization of a core (torch.nn.utils.parametrize) is not "
                               f"supported: parametrize the TT layer's input or output instead")
        training = torch.is_grad_enabled() and (x.requires_grad or params[0].requires_grad)
        has_bias, export = self.bias is not None, exporting()
        if export or torch.compiler.is_compiling():
            # The plans of all row counts are one constant (their runners' names): comparing the (maybe
            # symbolic) row count with their thresholds picks one, so dynamic batch sizes need no recompile per
            # size.  An exported program serves every row count: one plan (any plan computes the same
            # product), no guard on the row count (strict export traces with dynamo, which cannot enter the
            # planner's caches).
            thresholds, names = codegen.tt_linear_runner_names(spec.token, training, x.requires_grad, has_bias)
            if export:
                segment = sum(EXPORT_ROWS >= t for t in thresholds)
            else:
                # (the graphs of the segments a changing row count reaches: not counted against dynamo's limit)
                compiled_region.allow_segment_graphs(training, x.requires_grad, thresholds)
                segment = 0
                for t in thresholds:
                    if rows >= t:
                        segment += 1
            run = getattr(codegen.RUNNERS, names[segment])
        else:
            run = codegen.eager_tt_linear_runner(spec, rows, training, x.requires_grad, has_bias)
        y = run(x2, *params, self.bias, rows)
        return y.reshape(*lead, self.out_features)

    def to_dense(self) -> torch.Tensor:
        """The dense weight in nn.Linear's layout (out_features, in_features)."""
        return cores_to_dense(list(self.cores), list(self.gates), self.spec).t()

    @torch.no_grad()
    def to_dense_module(self) -> nn.Linear:
        """The nn.Linear computing what this layer computes (gates folded into the weight, bias copied)."""
        dense = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, **self._dense_kwargs())
        if self.bias is not None:
            dense.bias.copy_(self.bias)
        return self._fill_dense(dense)

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


def tt_layers(model: nn.Module) -> dict[str, TTLayer]:
    """Every TT layer of `model` (TTLinear, the TT embeddings), by qualified name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, TTLayer)}
