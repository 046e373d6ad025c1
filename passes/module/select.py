"""tensorize's first two stages: check the options (presets resolved), then choose the layers.

``check_options`` turns tensorize's arguments into ``Options`` (or raises TensorizeError); ``select_layers``
walks the model and returns a ``Selection``: for every dense-looking layer, either a ``Rewrite`` (the TT
layer's kind, shape and ranks as a TTSpec) or a reason to keep it dense, the groups sharing a weight, and the
warnings to give.  Both only read the model; nothing is built or swapped here, and every bad request is
found here, so an error leaves the model untouched.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from comera_compile.layers import TTLayer
from comera_compile.tt import TTSpec, make_spec

__all__ = ["TensorizeError", "LayerShape", "PRESETS", "TensorizeSummary", "Options", "Rewrite", "Selection",
           "check_options", "select_layers"]


class TensorizeError(ValueError):
    """A tensorize request that cannot be carried out; the model was left untouched."""


@dataclass(frozen=True)
class LayerShape:
    """Explicit TT shape for a layer: input (or row) modes, output (or column) modes, and optionally its
    own rank (an int, or one rank per internal bond)."""

    in_modes: tuple[int, ...] | None = None
    out_modes: tuple[int, ...] | None = None
    rank: int | tuple[int, ...] | None = None


# CoMERA's shapes for the six-encoder (BERT-base sized) model, keyed by (in, out) / (rows, dim).  Only the
# layers listed are rewritten: position and segment embeddings and the 768 -> 3 classifier stay dense.
PRESETS: dict[str, dict[str, Any]] = {
    "comera-six-encoder": {
        "rank": 30,
        "shapes": {
            (768, 768): LayerShape((12, 8, 8), (8, 8, 12)),
            (768, 3072): LayerShape((12, 8, 8), (12, 16, 16)),
            (3072, 768): LayerShape((16, 16, 12), (8, 8, 12)),
            (30522, 768): LayerShape((16, 20, 10, 10), (4, 4, 8, 6), rank=32),
        },
        "shaped_only": True,
    },
}


@dataclass
class TensorizeSummary:
    """What tensorize did: the layers rewritten (name -> TT layer kind), the dense-looking layers kept
    dense (name -> reason), and whether the result is an FX GraphModule."""

    rewritten: dict[str, str] = field(default_factory=dict)
    kept_dense: dict[str, str] = field(default_factory=dict)
    untied: list[str] = field(default_factory=list)   # groups that shared a weight, tensorized apart
    traced: bool = False
    trace_error: str | None = None

    def __str__(self) -> str:
        how = "FX GraphModule" if self.traced else "module-by-module rewrite"
        lines = [f"tensorize: {len(self.rewritten)} layers rewritten ({how}), {len(self.kept_dense)} kept dense"]
        lines += [f"  TT     {n} ({k})" for n, k in self.rewritten.items()]
        lines += [f"  dense  {n}: {r}" for n, r in self.kept_dense.items()]
        return "\n".join(lines)


@dataclass(frozen=True)
class Options:
    """tensorize's arguments, checked, with the preset's rank and shapes folded in."""

    rank: int | Sequence[int]
    rank_chosen: bool          # the user gave a rank (else the default or the preset's)
    shapes: dict[Any, Any]
    include: list[str] | None
    exclude: list[str]
    min_features: int
    init: str
    d: int | None
    shaped_only: bool          # only layers with a shape are rewritten (a preset's way)
    tied: str


@dataclass
class Rewrite:
    """One layer to rewrite: the module, its kind ("linear", "conv1d", "embedding", "embedding_bag"), the
    rank and shape asked for, and the TT layer's spec they give."""

    name: str
    module: nn.Module
    kind: str
    rank: int | Sequence[int]
    shape: LayerShape | None
    spec: TTSpec


@dataclass
class Selection:
    """What select_layers chose: the rewrites in module order, every name each module is registered under
    (a module reused twice is replaced twice), the summary so far and the warnings to give."""

    rewrites: list[Rewrite]
    names_of: dict[int, list[str]]
    summary: TensorizeSummary
    warnings: list[str]


# The TT layer class each kind becomes, and the format of its spec.
_TT_CLASS = {"linear": "TTLinear", "conv1d": "TTLinear", "embedding": "TTEmbedding",
             "embedding_bag": "TTEmbeddingBag"}


def _is_conv1d(mod: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2): a linear map with weight (in, out), y = x @ W + b."""
    return (type(mod).__name__ == "Conv1D" and hasattr(mod, "nf") and isinstance(getattr(mod, "weight", None),
            torch.Tensor) and mod.weight.dim() == 2)


def _kind(mod: nn.Module) -> str | None:
    if isinstance(mod, TTLayer):
        return None
    if isinstance(mod, nn.Linear):
        return "linear"
    if isinstance(mod, nn.Embedding):
        return "embedding"
    if isinstance(mod, nn.EmbeddingBag):
        return "embedding_bag"
    if _is_conv1d(mod):
        return "conv1d"
    return None


_BASE = {"linear": nn.Linear, "embedding": nn.Embedding, "embedding_bag": nn.EmbeddingBag}


def _own_forward(mod: nn.Module, kind: str) -> str | None:
    """The base class whose forward `mod`'s class replaces with one computing something else
    (transformers' scaled word embeddings and learned position embeddings, MoE routers), or None.
    A TT layer computes only the base class's forward, so a replaced forward is run once on a small probe
    (no hooks, no grad) and counts as the base's only where it computes the plain linear map or lookup
    (Falcon's ``input @ weight.T + bias``); a bag's, or one whose weight is on the meta device, does not."""
    base = _BASE.get(kind)
    if base is None or type(mod).forward is base.forward:
        return None
    w, gen = mod.weight, torch.Generator().manual_seed(0)
    if kind == "embedding_bag" or w.is_meta:
        return f"nn.{base.__name__}"
    try:   # a different map, output or signature raises: not the base class's forward
        with torch.no_grad():
            if kind == "linear":
                x = torch.randn(2, mod.in_features, generator=gen).to(w.device, w.dtype)
                got, want = type(mod).forward(mod, x), nn.functional.linear(x, w, mod.bias)
            else:
                x = torch.randint(0, mod.num_embeddings, (2, 4), generator=gen).to(w.device)
                got, want = type(mod).forward(mod, x), nn.functional.embedding(x, w, mod.padding_idx)
        torch.testing.assert_close(got, want)
        return None
    except Exception:
        return f"nn.{base.__name__}"


def _custom_reason(mod: nn.Module, kind: str) -> str:
    return f"{type(mod).__name__} has its own forward, which a {_TT_CLASS[kind]} would not compute"


def _dims(mod: nn.Module, kind: str) -> tuple[int, int]:
    if kind == "linear":
        return mod.in_features, mod.out_features
    if kind == "conv1d":
        return tuple(mod.weight.shape)
    return mod.num_embeddings, mod.embedding_dim


def _unsupported_embedding_options(mod: nn.Embedding | nn.EmbeddingBag) -> list[str]:
    opts = []
    if mod.max_norm is not None:
        opts.append("max_norm")
    if mod.scale_grad_by_freq:
        opts.append("scale_grad_by_freq")
    if mod.sparse:
        opts.append("sparse")
    return opts


def _as_shape(value: Any, where: str) -> LayerShape:
    if isinstance(value, LayerShape):
        return value
    if isinstance(value, Mapping):
        return LayerShape(**value)
    if isinstance(value, Sequence) and len(value) == 2:
        return LayerShape(tuple(value[0]), tuple(value[1]))
    raise TensorizeError(f"shapes[{where!r}] must be a LayerShape, a dict of its fields, or a pair "
                         f"(in_modes, out_modes); got {value!r}")


def _find_shape(shapes: Mapping, name: str, dims: tuple[int, int]) -> LayerShape | None:
    if dims in shapes:
        return _as_shape(shapes[dims], str(dims))
    for key, value in shapes.items():
        if isinstance(key, str) and fnmatch.fnmatchcase(name, key):
            return _as_shape(value, key)
    return None


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _as_patterns(value: str | Iterable[str] | None, label: str) -> list[str] | None:
    if value is None:
        return None
    pats = [value] if isinstance(value, str) else list(value)
    if not all(isinstance(p, str) for p in pats):
        raise TensorizeError(f"{label} takes module-name patterns (strings, fnmatch style such as "
                             f"'layers.*.ffn_up'); got {value!r}")
    return pats


def check_options(model: nn.Module, rank: int | Sequence[int] | None, shapes: Mapping[Any, Any] | None,
                  include: str | Iterable[str] | None, exclude: str | Iterable[str] | None, min_features: int,
                  init: str, d: int | None, preset: str | None, tied: str) -> Options:
    """tensorize's arguments checked against each other and the model (every include / exclude pattern
    must name a module), the preset's rank and shapes folded in."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"tensorize takes an nn.Module, got {type(model).__name__}")
    shaped_only = False
    rank_chosen = rank is not None
    if preset is not None:
        if preset not in PRESETS:
            raise TensorizeError(f"unknown preset {preset!r}; available: {sorted(PRESETS)}")
        p = PRESETS[preset]
        rank = p["rank"] if rank is None else rank
        shapes = {**p["shapes"], **(shapes or {})}
        shaped_only = p.get("shaped_only", False)
    rank = 30 if rank is None else rank
    if isinstance(rank, bool) or not isinstance(rank, (int, Sequence)):
        raise TensorizeError(f"rank must be a positive int or a list of ints, got {rank!r}")
    if isinstance(rank, int) and rank <= 0:
        raise TensorizeError(f"rank must be a positive integer, got {rank}")
    if init not in ("random", "svd"):
        raise TensorizeError(f"init must be 'random' or 'svd', got {init!r}")
    if tied not in ("keep", "untie"):
        raise TensorizeError(f"tied must be 'keep' or 'untie', got {tied!r}")
    include_p = _as_patterns(include, "include")
    exclude_p = _as_patterns(exclude, "exclude") or []

    all_names = [n for n, _ in model.named_modules() if n]
    modules = dict(model.named_modules())
    for pats, label in ((include_p or [], "include"), (exclude_p, "exclude")):
        for p in pats:
            hits = [n for n in all_names if fnmatch.fnmatchcase(n, p)]
            if not hits:
                sample = ", ".join(all_names[:8]) + (", ..." if len(all_names) > 8 else "")
                raise TensorizeError(f"{label} pattern {p!r} matches no module of {type(model).__name__}; "
                                     f"module names look like: {sample}")
            if label == "include" and p in modules and _kind(modules[p]) is None:
                m = modules[p]
                what = "already a TT layer" if isinstance(m, TTLayer) else "not a layer tensorize can rewrite"
                raise TensorizeError(f"include names {p!r}, a {type(m).__name__}: {what}; tensorize rewrites "
                                     f"nn.Linear, nn.Embedding, nn.EmbeddingBag and transformers' Conv1D")
    return Options(rank=rank, rank_chosen=rank_chosen, shapes=dict(shapes or {}), include=include_p,
                   exclude=exclude_p, min_features=min_features, init=init, d=d, shaped_only=shaped_only,
                   tied=tied)


def _spec(mod: nn.Module, kind: str, rank: int | Sequence[int], shape: LayerShape | None, d: int | None,
          where: str) -> TTSpec:
    """The spec the TT layer's from_dense will make for `mod` (the same call, so the same spec and errors)."""
    dims = _dims(mod, kind)
    try:
        return make_spec("tt" if _TT_CLASS[kind] == "TTLinear" else "ttm", dims[0], dims[1], rank,
                         shape.in_modes if shape else None, shape.out_modes if shape else None, d,
                         where=_TT_CLASS[kind])
    except (ValueError, TypeError) as e:
        raise TensorizeError(f"cannot tensorize {where!r} ({type(mod).__name__}): {e}") from e


def _keep_dense_reason(model: nn.Module, name: str, mod: nn.Module, kind: str, shape: LayerShape | None,
                       opts: Options, inside_mha: set[int], owners: dict[int, set[int]],
                       tied_groups: list[str]) -> str | None:
    """Why `mod` stays dense, or None to rewrite it; a weight shared with others adds its group to
    tied_groups.  Raises where the user named a layer that cannot be rewritten."""
    dims = _dims(mod, kind)
    explicit = opts.include is not None and name in opts.include
    if id(mod) in inside_mha:
        return "out_proj of nn.MultiheadAttention, which reads its weight directly"
    if _matches(name, opts.exclude):
        return "excluded"
    if opts.include is not None and not _matches(name, opts.include):
        return "not included"
    if opts.shaped_only and shape is None:
        return f"no shape for {dims} in the preset"
    if shape is None and min(dims) < opts.min_features:
        return f"smaller than min_features={opts.min_features}"
    base = _own_forward(mod, kind)
    if base is not None:
        if explicit:
            raise TensorizeError(f"cannot tensorize {name!r}: its class {type(mod).__name__} replaces {base}."
                                 f"forward, and a {_TT_CLASS[kind]} computes only {base}'s; exclude it")
        return _custom_reason(mod, kind)
    if kind in ("embedding", "embedding_bag") and _unsupported_embedding_options(mod):
        unsupported = _unsupported_embedding_options(mod)
        cls, tt_cls = type(mod).__name__, _TT_CLASS[kind]
        if explicit:
            raise TensorizeError(f"cannot tensorize {name!r}: nn.{cls} options {unsupported} are not "
                                 f"supported by {tt_cls}; exclude it or drop those options")
        return f"uses {', '.join(unsupported)}, which {tt_cls} does not support"
    if len(owners.get(id(mod.weight), ())) > 1:
        sharers = sorted(n for n2, m2 in model.named_modules() if id(m2) in owners[id(mod.weight)]
                         for n in [n2] if n)
        tied_groups.append(" and ".join(sharers))
        if opts.tied == "keep":
            return f"weight tied with {', '.join(s for s in sharers if s != name)}"
    return None


def select_layers(model: nn.Module, opts: Options) -> Selection:
    """Choose, for every layer tensorize can rewrite, its TT shape and ranks or the reason it stays dense."""
    names_of: dict[int, list[str]] = {}
    for n, m in model.named_modules(remove_duplicate=False):
        names_of.setdefault(id(m), []).append(n)  # "" is the model itself, when it is a layer
    owners: dict[int, set[int]] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(id(m))
    # nn.MultiheadAttention computes with its out_proj's weight directly, never calling the module.
    inside_mha = {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}

    summary = TensorizeSummary()
    rewrites: list[Rewrite] = []
    tied_groups: list[str] = []
    grown: list[str] = []  # kept dense: the default rank would have made them bigger
    bigger: list[str] = []  # rewritten at the rank or shape asked for, though bigger than dense
    custom: list[str] = []  # kept dense: a subclass with its own forward
    for name, mod in model.named_modules():
        kind = _kind(mod)
        if kind is None:
            continue
        dims = _dims(mod, kind)
        shape = _find_shape(opts.shapes, name, dims)
        reason = _keep_dense_reason(model, name, mod, kind, shape, opts, inside_mha, owners, tied_groups)
        if reason is not None:
            summary.kept_dense[name] = reason
            if reason == _custom_reason(mod, kind):
                custom.append(f"{name} ({type(mod).__name__})")
            continue
        rank = shape.rank if shape is not None and shape.rank is not None else opts.rank
        spec = _spec(mod, kind, rank, shape, opts.d, name)
        if spec.num_params() >= dims[0] * dims[1]:
            what = (f"{name} ({dims[0]}x{dims[1]}): {spec.num_params():,} TT parameters at ranks {spec.ranks}, "
                    f"dense {dims[0] * dims[1]:,}")
            explicit = opts.include is not None and name in opts.include
            if not (opts.rank_chosen or shape is not None or explicit):  # the default rank: keep it dense
                summary.kept_dense[name] = f"no smaller as TT at the default rank ({what.split(': ', 1)[1]})"
                grown.append(what)
                continue
            bigger.append(what)
        rewrites.append(Rewrite(name, mod, kind, rank, shape, spec))
        for n in names_of[id(mod)]:
            summary.rewritten[n] = f"{_TT_CLASS[kind]} (from {type(mod).__name__})"

    if opts.include is not None and not rewrites:
        raise TensorizeError(f"include {opts.include} selects no layer that can be tensorized "
                             f"({len(summary.kept_dense)} candidates kept dense: {summary.kept_dense})")
    return Selection(rewrites, names_of, summary, _warnings(summary, opts.tied, tied_groups, grown, bigger,
                                                                  custom))


def _warnings(summary: TensorizeSummary, tied: str, tied_groups: list[str], grown: list[str],
              bigger: list[str], custom: list[str]) -> list[str]:
    """The warnings a selection gives (tied groups, layers kept dense or grown by their TT form); records
    the untied groups in the summary."""
    out = []
    if tied_groups:
        groups = "; ".join(sorted(set(tied_groups)))
        if tied == "untie":
            summary.untied = sorted(set(tied_groups))
            out.append(f"tensorize: {groups} shared one weight and are now UNTIED: each tensorizable one "
                       f"got its own TT factorization (tied='untie').")
        else:
            out.append(f"tensorize: {groups} share one weight; left dense so they stay tied. Pass "
                       f"tied='untie' to tensorize them separately (they then train independently).")
    if grown:
        out.append(f"tensorize: kept {len(grown)} layer(s) dense: at the default rank their TT form would "
                   f"have no fewer parameters ({'; '.join(grown[:4])}{'; ...' if len(grown) > 4 else ''}). "
                   f"Pass a smaller rank to tensorize them.")
    if custom:
        out.append(f"tensorize: kept {len(custom)} layer(s) dense whose class has its own forward, which a TT "
                   f"layer would not compute ({'; '.join(custom[:4])}{'; ...' if len(custom) > 4 else ''}).")
    if bigger:
        out.append(f"tensorize: {len(bigger)} layer(s) are no smaller as TT at the rank or shape asked for "
                   f"({'; '.join(bigger[:4])}{'; ...' if len(bigger) > 4 else ''}).")
    return out
