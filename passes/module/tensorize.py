"""Rewrite a model's dense layers (nn.Linear, nn.Embedding, nn.EmbeddingBag, transformers' Conv1D) into TT
layers.  Takes an nn.Module.

By default the layers are swapped module by module: the result is the user's own model (its class,
methods, containers and train/eval behaviour) with TT layers inside; the graph the compiler rewrites is
dynamo's, under torch.compile.  ``trace=True`` asks for a torch.fx GraphModule instead, whose TT layers are
``tt_<name>`` call_module nodes (``print(gm.code)`` shows them); where torch.fx cannot trace the model, or
its graph differs between train and eval mode (code reading ``self.training``, which a trace would freeze),
the layers are swapped module by module, with a warning.  Everything that can fail is checked before
anything is swapped, so an error leaves the user's model exactly as it was.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.fx
from torch import nn

from comera_compile.checkpoint import save_pretrained
from comera_compile.embedding import TTEmbedding, TTEmbeddingBag
from comera_compile.layers import TTLayer, TTLinear
from comera_compile.passes.module.trace import trace_model

__all__ = ["tensorize", "densify", "LayerShape", "TensorizeSummary", "PRESETS", "TensorizeError"]


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


def _build(mod: nn.Module, kind: str, rank, shape: LayerShape | None, init: str, d: int | None,
           where: str) -> TTLayer:
    in_modes = shape.in_modes if shape else None
    out_modes = shape.out_modes if shape else None
    r = shape.rank if shape is not None and shape.rank is not None else rank
    try:
        if kind == "embedding":
            return TTEmbedding.from_dense(mod.weight, mod.padding_idx, rank=r, row_modes=in_modes,
                                          col_modes=out_modes, d=d, init=init)
        if kind == "embedding_bag":
            return TTEmbeddingBag.from_dense(mod.weight, mod.padding_idx, mode=mod.mode,
                                             include_last_offset=mod.include_last_offset, rank=r,
                                             row_modes=in_modes, col_modes=out_modes, d=d, init=init)
        return TTLinear.from_dense(mod.weight, mod.bias, rank=r, in_modes=in_modes, out_modes=out_modes,
                                   d=d, init=init, transposed=kind == "conv1d")
    except (ValueError, TypeError) as e:
        raise TensorizeError(f"cannot tensorize {where!r} ({type(mod).__name__}): {e}") from e


def _set_submodule(root: nn.Module, qualname: str, new: nn.Module) -> None:
    parent_name, _, attr = qualname.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, attr, new)


def tensorize(model: nn.Module, rank: int | Sequence[int] | None = None, *,
              shapes: Mapping[Any, Any] | None = None, include: str | Iterable[str] | None = None,
              exclude: str | Iterable[str] | None = None, min_features: int = 64, init: str = "random",
              d: int | None = None, preset: str | None = None, tied: str = "keep",
              inplace: bool = False, trace: bool = False) -> nn.Module:
    """Rewrite the model's dense layers into TT layers and return the rewritten model.

    rank: one int (capped per bond at its largest meaningful value) or a list of internal ranks;
        default 30, or the preset's.
    shapes: explicit shapes, keyed by module-name pattern or by (in, out) / (rows, dim); values are
        LayerShape, a dict of its fields, or (in_modes, out_modes).  Others are chosen automatically.
    include / exclude: fnmatch patterns on qualified module names; excluded layers stay dense.
    min_features: layers whose smaller dimension is below this stay dense (unless given a shape).
    init: "random" (trains from scratch, variance of the dense default init) or "svd" (TT-SVD of the
        existing weights: exact at full ranks).
    preset: a name from PRESETS, e.g. "comera-six-encoder" (CoMERA's shapes and ranks; only the layers
        it lists are rewritten).
    tied: what to do with layers sharing a weight with another module: "keep" leaves them dense (and
        tied), "untie" tensorizes each separately.  Either way a warning says which.
    inplace: swap the layers inside `model` itself instead of a copy.
    trace: False (default) swaps the layers inside the model, which keeps its class and methods; True returns
        a torch.fx GraphModule where the model can be traced and its graph does not depend on train/eval.

    The returned model carries a TensorizeSummary as ``comera_summary``.
    """
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
    shapes = dict(shapes or {})
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

    # Every name under which each module object is registered (a module reused twice is replaced twice).
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
    plan: list[tuple[nn.Module, TTLayer]] = []
    tied_groups: list[str] = []
    grown: list[str] = []  # kept dense: the default rank would have made them bigger
    bigger: list[str] = []  # rewritten at the rank or shape asked for, though bigger than dense
    for name, mod in model.named_modules():
        kind = _kind(mod)
        if kind is None:
            continue
        dims = _dims(mod, kind)
        shape = _find_shape(shapes, name, dims)
        explicit = include_p is not None and name in include_p
        reason = None
        if id(mod) in inside_mha:
            reason = "out_proj of nn.MultiheadAttention, which reads its weight directly"
        elif _matches(name, exclude_p):
            reason = "excluded"
        elif include_p is not None and not _matches(name, include_p):
            reason = "not included"
        elif shaped_only and shape is None:
            reason = f"no shape for {dims} in the preset"
        elif shape is None and min(dims) < min_features:
            reason = f"smaller than min_features={min_features}"
        elif kind in ("embedding", "embedding_bag") and _unsupported_embedding_options(mod):
            opts = _unsupported_embedding_options(mod)
            cls, tt_cls = type(mod).__name__, "TTEmbedding" if kind == "embedding" else "TTEmbeddingBag"
            if explicit:
                raise TensorizeError(f"cannot tensorize {name!r}: nn.{cls} options {opts} are not "
                                     f"supported by {tt_cls}; exclude it or drop those options")
            reason = f"uses {', '.join(opts)}, which {tt_cls} does not support"
        elif len(owners.get(id(mod.weight), ())) > 1:
            sharers = sorted(n for n2, m2 in model.named_modules() if id(m2) in owners[id(mod.weight)]
                             for n in [n2] if n)
            if tied == "keep":
                reason = f"weight tied with {', '.join(s for s in sharers if s != name)}"
                tied_groups.append(" and ".join(sharers))
            else:
                tied_groups.append(" and ".join(sharers))
        if reason is not None:
            summary.kept_dense[name] = reason
            continue
        new = _build(mod, kind, rank, shape, init, d, name)
        new.comera_name = name   # its profiler ranges' name
        if new.tt_params() >= dims[0] * dims[1]:
            what = (f"{name} ({dims[0]}x{dims[1]}): {new.tt_params():,} TT parameters at ranks {new.ranks}, "
                    f"dense {dims[0] * dims[1]:,}")
            if not (rank_chosen or shape is not None or explicit):  # the default rank: keep it dense
                summary.kept_dense[name] = f"no smaller as TT at the default rank ({what.split(': ', 1)[1]})"
                grown.append(what)
                continue
            bigger.append(what)
        plan.append((mod, new))
        for n in names_of[id(mod)]:
            summary.rewritten[n] = f"{type(plan[-1][1]).__name__} (from {type(mod).__name__})"

    if include_p is not None and not plan:
        raise TensorizeError(f"include {include_p} selects no layer that can be tensorized "
                             f"({len(summary.kept_dense)} candidates kept dense: {summary.kept_dense})")
    if tied_groups:
        groups = "; ".join(sorted(set(tied_groups)))
        if tied == "untie":
            summary.untied = sorted(set(tied_groups))
        if tied == "keep":
            warnings.warn(f"tensorize: {groups} share one weight; left dense so they stay tied. Pass "
                          f"tied='untie' to tensorize them separately (they then train independently).",
                          stacklevel=2)
        else:
            warnings.warn(f"tensorize: {groups} shared one weight and are now UNTIED: each tensorizable one "
                          f"got its own TT factorization (tied='untie').", stacklevel=2)

    if grown:
        warnings.warn(f"tensorize: kept {len(grown)} layer(s) dense: at the default rank their TT form would "
                      f"have no fewer parameters ({'; '.join(grown[:4])}{'; ...' if len(grown) > 4 else ''}). "
                      f"Pass a smaller rank to tensorize them.", stacklevel=2)
    if bigger:
        warnings.warn(f"tensorize: {len(bigger)} layer(s) are no smaller as TT at the rank or shape asked for "
                      f"({'; '.join(bigger[:4])}{'; ...' if len(bigger) > 4 else ''}).", stacklevel=2)

    # Nothing below can fail on bad input: all replacements are built.
    if inplace:
        work = model
    else:
        # Share (don't copy) the layers about to be replaced: the copy drops them anyway.
        memo = {id(old): old for old, _ in plan}
        work = copy.deepcopy(model, memo)
    for old, new in plan:
        if old is model:  # the model is itself a dense layer: the TT layer is the result
            new.comera_summary = summary
            return new
        for n in names_of[id(old)]:
            _set_submodule(work, n, new)

    result: nn.Module = work
    if trace:
        try:
            result = trace_model(work)
            summary.traced = True
        except Exception as e:  # torch.fx raises many kinds of errors for untraceable code
            summary.trace_error = f"{type(e).__name__}: {e}".split("\n")[0]
            warnings.warn(f"tensorize: no torch.fx graph for {type(model).__name__} ({summary.trace_error}); "
                          f"rewrote its layers module by module instead, so the result keeps its class and "
                          f"is not a GraphModule.", stacklevel=2)
    if not summary.traced and hasattr(result, "config") and callable(getattr(result, "save_pretrained", None)):
        # A transformers model: its own save_pretrained would write TT weights that the dense class then
        # "loads" with fresh layers; this one records the layout for cc.from_pretrained instead.
        result.save_pretrained = functools.partial(save_pretrained, result)
    if not summary.traced and callable(getattr(result, "resize_token_embeddings", None)) and callable(
            getattr(result, "get_input_embeddings", None)):
        result.resize_token_embeddings = functools.partial(resize_token_embeddings, result)
    if not summary.traced and summary.untied and callable(getattr(result, "tie_weights", None)):
        result.tie_weights = functools.partial(_tie_weights, result)
    result.comera_summary = summary
    return result


def _tie_weights(model: nn.Module, *args: Any, **kwargs: Any) -> None:
    """transformers' ``tie_weights`` on a model tensorize untied (tied='untie'): its config still names the
    pairs to tie, but each member is now its own layer, and a TT layer has no ``weight`` to share; tying would
    fail, or, once a resize has made them dense again, quietly replace one trained layer by the other.  The
    model stays untied, as the user asked; with no TT layer left, transformers' own tying runs."""
    if any(isinstance(m, TTLayer) for m in model.modules()) or getattr(model, "_comera_resized", False):
        return None
    return type(model).tie_weights(model, *args, **kwargs)


def resize_token_embeddings(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    """transformers' ``model.resize_token_embeddings(...)`` on a tensorized model (tensorize puts this in its
    place): a TT input embedding or output head is first made the dense layer it represents (exactly, its
    gates folded in), so transformers resizes it as usual -- old rows unchanged, new rows initialised as
    transformers does -- and it stays dense afterwards, with the reason in ``comera_summary`` and a warning.
    A TT factorization of the resized table would change the old rows at any rank below full; call
    ``cc.tensorize(model)`` again to compress the new table.  Returns what transformers returns."""
    names = {id(m): n for n, m in model.named_modules()}
    summary = getattr(model, "comera_summary", None)
    ends = {names.get(id(getattr(model, get)())) for get in ("get_input_embeddings", "get_output_embeddings")
            if callable(getattr(model, get, None))}
    for group in (summary.untied if summary is not None else []):
        members = group.split(" and ")
        others = [m for m in members if m not in ends]
        if others and len(others) < len(members):
            # e.g. T5: set_input_embeddings puts the one resized table in encoder and decoder as well
            raise TensorizeError(f"resize_token_embeddings would make {group} one layer again (transformers "
                                 f"resizes the input embedding and shares it), replacing {', '.join(others)}, "
                                 f"which tensorize(tied='untie') gave layers of their own. Resize the dense model "
                                 f"before tensorize, or tensorize with tied='keep'")
    made_dense = []
    for get, put in (("get_input_embeddings", "set_input_embeddings"),
                     ("get_output_embeddings", "set_output_embeddings")):
        layer = getattr(model, get)() if callable(getattr(model, get, None)) else None
        if isinstance(layer, TTLayer) and callable(getattr(model, put, None)):
            name = names.get(id(layer), get[4:])
            getattr(model, put)(_dense_layer(layer))
            made_dense.append(name)
            if summary is not None:
                summary.rewritten.pop(name, None)
                summary.kept_dense[name] = ("made dense by resize_token_embeddings (a TT form of the resized "
                                            "table would change its old rows); cc.tensorize(model) compresses it again")
    if made_dense:
        model._comera_resized = True   # no re-tying of what tensorize untied (_tie_weights)
        warnings.warn(f"resize_token_embeddings: {', '.join(made_dense)} made dense to be resized (old rows exact); "
                      f"call cc.tensorize(model) to compress again", stacklevel=2)
    return type(model).resize_token_embeddings(model, *args, **kwargs)


@torch.no_grad()
def _dense_layer(layer: TTLayer) -> nn.Module:
    """The plain dense layer computing what `layer` computes (its gates folded into the weight)."""
    ref = layer.cores[0]
    kwargs = {"device": ref.device, "dtype": ref.dtype}
    if isinstance(layer, TTLinear):
        dense: nn.Module = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, **kwargs)
        if layer.bias is not None:
            dense.bias.copy_(layer.bias)
    elif isinstance(layer, TTEmbeddingBag):
        dense = nn.EmbeddingBag(layer.num_embeddings, layer.embedding_dim, mode=layer.mode,
                                include_last_offset=layer.include_last_offset, padding_idx=layer.padding_idx,
                                **kwargs)
    elif isinstance(layer, TTEmbedding):
        dense = nn.Embedding(layer.num_embeddings, layer.embedding_dim, padding_idx=layer.padding_idx, **kwargs)
    else:
        raise TypeError(f"densify does not know the dense form of {type(layer).__name__}")
    dense.weight.copy_(layer.to_dense())
    for p in dense.parameters():
        p.requires_grad_(ref.requires_grad)
    dense.train(layer.training)
    return dense


def densify(model: nn.Module, *, inplace: bool = False) -> nn.Module:
    """Every TT layer of `model` back to a plain dense layer -- TTLinear to nn.Linear, TTEmbedding to
    nn.Embedding, TTEmbeddingBag to nn.EmbeddingBag -- holding the weight its cores and gates represent:
    for export or serving, or for a plain model after compressed training.  Returns a copy unless
    inplace; a model that is itself a TT layer comes back as the dense layer."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"densify takes an nn.Module, got {type(model).__name__}")
    if isinstance(model, TTLayer):
        return _dense_layer(model)
    layers = [(name, m) for name, m in model.named_modules(remove_duplicate=False) if isinstance(m, TTLayer)]
    work = model if inplace else copy.deepcopy(model, {id(m): m for _, m in layers})
    built: dict[int, nn.Module] = {}
    for name, layer in layers:
        if id(layer) not in built:  # a layer registered under two names stays one layer
            built[id(layer)] = _dense_layer(layer)
        _set_submodule(work, name, built[id(layer)])
    return work
