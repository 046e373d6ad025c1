"""tensorize's second stage: choose the layers.

After ``check_options`` (options.py) has turned tensorize's arguments into ``Options``, ``select_layers``
walks the model and returns a ``Selection``: for every dense-looking layer, either a ``Rewrite`` (the TT
layer's kind, shape and ranks as a TTSpec) or a reason to keep it dense, the groups sharing a weight, and the
warnings to give.  Both only read the model; nothing is built or swapped here, and every bad request is
found here, so an error leaves the model untouched.
"""

from __future__ import annotations

import copy
import fnmatch
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from comera_compile.passes.module.options import (PRESETS, LayerShape, Options, TensorizeError, as_shape,
                                                  check_options, layer_d, layer_kind, matches)
from comera_compile.passes.module.notices import (FROZEN, frozen_warning, kept_dense_warnings, nothing_rewritten,
                                                  plain_weights, plain_weights_warning)
from comera_compile.passes.module.outside import held_outside, tied_outside
from comera_compile.tt import TTSpec, make_spec

__all__ = ["TensorizeError", "LayerShape", "PRESETS", "TensorizeSummary", "Options", "Rewrite", "Selection",
           "check_options", "select_layers"]


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


_BASE = {"linear": nn.Linear, "embedding": nn.Embedding, "embedding_bag": nn.EmbeddingBag}


def _own_forward(mod: nn.Module, kind: str) -> str | None:
    """The base class whose forward `mod`'s class replaces with one computing something else
    (transformers' scaled word embeddings and learned position embeddings, MoE routers, LoRA adapters), or
    None.  A TT layer computes only the base class's forward from the weight and bias, so a class that
    replaces the forward and holds state of its own (parameters, buffers or submodules besides weight and
    bias) is not the base; one that holds nothing more is run on a small probe (no hooks, no grad; in train
    and in eval mode, since a forward may read ``self.training``; a weight on the meta device stands in as a
    random one on the CPU) and counts as the base's only where it computes the plain linear map or lookup
    (Falcon's ``input @ weight.T + bias``) in both; a bag's does not."""
    base = _BASE.get(kind)
    if base is None or type(mod).forward is base.forward:
        return None
    if kind == "embedding_bag" or _own_state(mod):
        return f"nn.{base.__name__}"
    probe = copy.copy(mod)   # attributes the forward sets land on the probe, not on the user's module
    gen = torch.Generator().manual_seed(0)
    if mod.weight.is_meta:   # its own parameters dict: the user's module keeps its meta tensors
        probe._parameters = {n: None if t is None else nn.Parameter(
            torch.randn(t.shape, generator=gen).to(t.dtype), t.requires_grad) for n, t in mod._parameters.items()}
    w, bias = probe.weight, getattr(probe, "bias", None)
    try:   # a different map, output or signature raises: not the base class's forward
        for training in (True, False):
            probe.training = training
            with torch.no_grad():
                if kind == "linear":
                    x = torch.randn(2, mod.in_features, generator=gen).to(w.device, w.dtype)
                    got, want = type(mod).forward(probe, x), nn.functional.linear(x, w, bias)
                else:
                    x = torch.randint(0, mod.num_embeddings, (2, 4), generator=gen).to(w.device)
                    got, want = type(mod).forward(probe, x), nn.functional.embedding(x, w, mod.padding_idx)
            torch.testing.assert_close(got, want)
        return None
    except Exception:
        return f"nn.{base.__name__}"


def _own_state(mod: nn.Module) -> list[str]:
    """What `mod` holds besides a dense layer's weight and bias: its other parameters, buffers, submodules."""
    return [n for n in (*mod._parameters, *mod._buffers, *mod._modules) if n not in ("weight", "bias")]


def _custom_reason(mod: nn.Module, kind: str) -> str:
    extra = f" and holds {', '.join(_own_state(mod))}" if _own_state(mod) else ""
    return f"{type(mod).__name__} has its own forward{extra}, which a {_TT_CLASS[kind]} would not compute"


def _weight_reason(mod: nn.Module) -> str | None:
    """Why the layer's weight cannot be factorized as it stands: computed from other tensors (a
    parametrization, or the hooks of torch.nn.utils.weight_norm / spectral_norm), or not yet created."""
    if "weight" not in mod._parameters:
        how = "parametrized (torch.nn.utils.parametrize)" if hasattr(mod, "parametrizations") else (
            "computed by a hook (torch.nn.utils.weight_norm or spectral_norm)")
        return f"its weight is {how}, which a TT layer would drop"
    if nn.parameter.is_lazy(mod._parameters["weight"]):
        return "a lazy module whose weight is not created yet (run one forward first)"
    return None


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


def _find_shape(shapes: Mapping, names: Sequence[str], dims: tuple[int, int]) -> tuple[Any, LayerShape | None]:
    """The key of `shapes` that gives this layer its shape (its dims, else the first name pattern one of
    its names matches), and the shape; (None, None) where none does."""
    if dims in shapes:
        return dims, as_shape(shapes[dims], str(dims))
    for key, value in shapes.items():
        if isinstance(key, str) and any(fnmatch.fnmatchcase(n, key) for n in names):
            return key, as_shape(value, key)
    return None, None


def _unused_shapes(asked: Sequence[Any], used: set, seen: dict[str, tuple[int, int]]) -> None:
    """Raise where a key of the user's shapes found no layer (a typo, or (out, in) for (in, out)), as an
    include pattern that matches nothing is an error."""
    unused = [key for key in asked if key not in used]
    if unused:
        layers = "; ".join(f"{n} {d}" for n, d in list(seen.items())[:8]) + ("; ..." if len(seen) > 8 else "")
        raise TensorizeError(f"shapes key(s) {unused} match no layer tensorize rewrites: a key is a module-name "
                             f"pattern or (in_features, out_features) ((num_embeddings, embedding_dim) for an "
                             f"embedding). The layers are: {layers}")


def _spec(mod: nn.Module, kind: str, rank: int | Sequence[int], shape: LayerShape | None, d: int | None,
          where: str) -> TTSpec:
    """The spec the TT layer's from_dense will make for `mod` (the same call, so the same spec and errors)."""
    dims = _dims(mod, kind)
    try:
        return make_spec("tt" if _TT_CLASS[kind] == "TTLinear" else "ttm", dims[0], dims[1], rank,
                         shape.in_modes if shape else None, shape.out_modes if shape else None, layer_d(shape, d),
                         where=_TT_CLASS[kind])
    except (ValueError, TypeError) as e:
        raise TensorizeError(f"cannot tensorize {where!r} ({type(mod).__name__}): {e}") from e


def _named(opts: Options, names: Sequence[str]) -> bool:
    """Whether the user's include names this layer outright, under any of the names it is registered by."""
    return opts.include is not None and any(n in opts.include for n in names)


def _keep_dense_reason(model: nn.Module, names: Sequence[str], mod: nn.Module, kind: str,
                       shape: LayerShape | None, opts: Options, inside_mha: set[int], owners: dict[int, set[int]],
                       tied_groups: list[str]) -> str | None:
    """Why `mod` stays dense, or None to rewrite it; a weight shared with others adds its group to
    tied_groups.  Raises where the user named a layer that cannot be rewritten.  `names` are every name
    the module is registered by (the first is named_modules'); include / exclude match any of them."""
    dims, name = _dims(mod, kind), names[0]
    explicit = _named(opts, names)
    if id(mod) in inside_mha:
        return "out_proj of nn.MultiheadAttention, which reads its weight directly"
    if any(matches(n, opts.exclude) for n in names):
        return "excluded"
    if opts.include is not None and not any(matches(n, opts.include) for n in names):
        return "not included"
    weight_reason = _weight_reason(mod)
    if weight_reason is not None and explicit:
        raise TensorizeError(f"cannot tensorize {name!r}: {weight_reason}; exclude it")
    if weight_reason is None and opts.init == "random" and not mod.weight.requires_grad:
        if explicit:
            raise TensorizeError(f"cannot tensorize {name!r} with init='random': its weight is frozen "
                                 f"(requires_grad=False), and random TT cores would replace the values it holds "
                                 f"for good; pass init='svd' to factor them, or exclude it")
        return FROZEN
    lazy = nn.parameter.is_lazy(mod._parameters.get("weight"))
    if opts.shaped_only and shape is None:
        return f"no shape for {dims} in the preset"
    if shape is None and min(dims) < opts.min_features and not lazy:
        return f"smaller than min_features={opts.min_features}"
    if weight_reason is not None:
        return weight_reason
    if kind in ("embedding", "embedding_bag") and _unsupported_embedding_options(mod):   # before the probe:
        unsupported = _unsupported_embedding_options(mod)                                 # max_norm writes rows
        cls, tt_cls = type(mod).__name__, _TT_CLASS[kind]
        if explicit:
            raise TensorizeError(f"cannot tensorize {name!r}: nn.{cls} options {unsupported} are not "
                                 f"supported by {tt_cls}; exclude it or drop those options")
        return f"uses {', '.join(unsupported)}, which {tt_cls} does not support"
    base = _own_forward(mod, kind)
    if base is not None:
        if explicit:
            raise TensorizeError(f"cannot tensorize {name!r}: its class {type(mod).__name__} replaces {base}."
                                 f"forward, and a {_TT_CLASS[kind]} computes only {base}'s; exclude it")
        return _custom_reason(mod, kind)
    if len(owners.get(id(mod.weight), ())) > 1:
        sharers = sorted(n for n2, m2 in model.named_modules() if id(m2) in owners[id(mod.weight)]
                         for n in [n2 or "the model itself"])
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
    held = held_outside(model)
    foreign = tied_outside(model)
    outside: list[str] = []   # kept dense: held in a plain container too, which the forward may call
    tied_away: list[str] = []   # sharing a weight or bias with a module outside the model

    summary = TensorizeSummary()
    rewrites: list[Rewrite] = []
    tied_groups: list[str] = []
    grown: list[str] = []  # kept dense: the default rank would have made them bigger
    bigger: list[str] = []  # rewritten at the rank or shape asked for, though bigger than dense
    custom: list[str] = []  # kept dense: a subclass with its own forward, or a weight computed by hooks
    options: list[str] = []  # kept dense: embeddings with options the TT embeddings lack
    scripted: list[str] = []  # kept dense: layers inside a torch.jit.script / trace submodule
    frozen: list[str] = []  # kept dense: frozen layers whose values init="random" would replace
    used_shapes: set = set()
    seen: dict[str, tuple[int, int]] = {}
    for name, mod in model.named_modules():
        kind = layer_kind(mod)
        if kind is None:
            if getattr(mod, "original_name", None) in _SCRIPTED_KINDS and isinstance(mod, torch.jit.ScriptModule):
                summary.kept_dense[name] = "TorchScript (torch.jit.script / trace), which tensorize cannot replace"
                scripted.append(name)
            continue
        dims = seen[name] = _dims(mod, kind)
        key, shape = _find_shape(opts.shapes, names_of[id(mod)], dims)
        used_shapes.add(key)
        reason = _keep_dense_reason(model, names_of[id(mod)], mod, kind, shape, opts, inside_mha, owners,
                                    tied_groups)
        if reason is None and id(mod) in foreign:
            tied_away.append(name)
            if opts.tied == "keep":
                reason = "weight or bias tied with a module outside the model given"
        if reason is None and id(mod) in held:
            if _named(opts, names_of[id(mod)]):
                raise TensorizeError(f"cannot tensorize {name!r}: the model also holds it at {held[id(mod)]}, "
                                     f"outside its submodules, where a TT layer cannot replace it; register "
                                     f"that container as nn.ModuleDict or nn.ModuleList, or exclude it")
            reason = f"also held at {held[id(mod)]}, outside the submodules, where a TT layer cannot replace it"
            outside.append(f"{name} (at {held[id(mod)]})")
        if reason is not None:
            summary.kept_dense[name] = reason
            if reason == _custom_reason(mod, kind):
                custom.append(f"{name} ({type(mod).__name__})")
            elif reason == _weight_reason(mod):
                custom.append(f"{name} ({type(mod).__name__}: {reason.split(', which')[0]})")
            elif reason.startswith("uses "):
                options.append(f"{name} ({reason.split(', which')[0][5:]})")
            elif reason == FROZEN:
                frozen.append(name)
            continue
        rank = shape.rank if shape is not None and shape.rank is not None else opts.rank
        spec = _spec(mod, kind, rank, shape, opts.d, name)
        if spec.num_params() >= dims[0] * dims[1]:
            what = (f"{name} ({dims[0]}x{dims[1]}): {spec.num_params():,} TT parameters at ranks {spec.ranks}, "
                    f"dense {dims[0] * dims[1]:,}")
            explicit = _named(opts, names_of[id(mod)])
            if not (opts.rank_chosen or shape is not None or explicit):  # the default rank: keep it dense
                summary.kept_dense[name] = f"no smaller as TT at the default rank ({what.split(': ', 1)[1]})"
                grown.append(what)
                continue
            bigger.append(what)
        rewrites.append(Rewrite(name, mod, kind, rank, shape, spec))
        for n in names_of[id(mod)]:
            summary.rewritten[n] = f"{_TT_CLASS[kind]} (from {type(mod).__name__})"

    _unused_shapes(opts.asked_shapes, used_shapes, seen)
    plain = plain_weights(model, opts.min_features)
    summary.kept_dense.update(plain)
    if opts.include is not None and not rewrites:
        raise TensorizeError(f"include {opts.include} selects no layer that can be tensorized "
                             f"({len(summary.kept_dense)} candidates kept dense: {summary.kept_dense})")
    warned = kept_dense_warnings(summary, opts.tied, tied_groups, grown, bigger, custom)
    warned += [w for w in (frozen_warning(frozen) if frozen else None, plain_weights_warning(model, plain)) if w]
    if options:
        warned.append(f"tensorize: kept {len(options)} embedding(s) dense whose nn.Embedding options the TT "
                      f"embeddings do not support ({'; '.join(options[:4])}{'; ...' if len(options) > 4 else ''}).")
    if outside:
        warned.append(f"tensorize: kept {len(outside)} layer(s) dense that the model also holds outside its "
                      f"submodules ({'; '.join(outside[:4])}{'; ...' if len(outside) > 4 else ''}): a forward "
                      f"calling them from there would run the dense layer, not the TT one.  Register the "
                      f"container as nn.ModuleDict or nn.ModuleList to tensorize them.")
    if tied_away:
        what = ("left dense so they stay tied" if opts.tied == "keep" else
                "now UNTIED from it (tied='untie'): that module goes on with the dense tensor alone")
        warned.append(f"tensorize: {len(tied_away)} layer(s) share a weight or bias with a module outside "
                      f"{type(model).__name__} ({'; '.join(tied_away[:4])}{'; ...' if len(tied_away) > 4 else ''}"
                      f"), as a language model's head shares the embedding of the body passed alone; {what}.  "
                      f"Tensorize the whole model to keep them tied as TT layers.")
    if scripted:
        warned.append(f"tensorize: kept {len(scripted)} layer(s) dense inside TorchScript submodules "
                      f"({'; '.join(scripted[:4])}{'; ...' if len(scripted) > 4 else ''}), whose layers cannot "
                      f"be replaced: tensorize the eager modules before torch.jit.script / trace.")
    if not rewrites:
        warned.append(nothing_rewritten(model, summary))
    return Selection(rewrites, names_of, summary, warned)


# The classes whose TorchScript copies (``original_name``) would have been rewritten as eager modules.
_SCRIPTED_KINDS = frozenset({"Linear", "Embedding", "EmbeddingBag", "Conv1D"})
