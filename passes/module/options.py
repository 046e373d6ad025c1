"""tensorize's arguments: the presets, the explicit shapes a user may give, and check_options, which turns
the arguments into ``Options`` or raises TensorizeError before anything is read from the layers' weights.

Kept apart from the layer choice (select.py): these checks need only the model's module names and the kinds
of layer tensorize rewrites (``layer_kind``).
"""

from __future__ import annotations

import fnmatch
import operator
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from comera_compile.distributed.fsdp import wrapped_for_data_parallel
from comera_compile.layers import TTLayer

__all__ = ["TensorizeError", "LayerShape", "PRESETS", "Options", "as_shape", "check_options", "is_conv1d",
           "layer_kind", "matches"]


class TensorizeError(ValueError):
    """A tensorize request that cannot be carried out; the model was left untouched."""


@dataclass(frozen=True)
class LayerShape:
    """Explicit TT shape for a layer: input (or row) modes, output (or column) modes, and optionally its
    own rank (an int, or one rank per internal bond)."""

    in_modes: tuple[int, ...] | None = None
    out_modes: tuple[int, ...] | None = None
    rank: int | tuple[int, ...] | None = None


def layer_d(shape: LayerShape | None, d: int | None) -> int | None:
    """tensorize's d for one layer: the modes per side of a layer whose shape is chosen automatically; a
    shape that gives modes sets its layer's count (its other side takes as many)."""
    return d if shape is None or (shape.in_modes is None and shape.out_modes is None) else None


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
    asked_shapes: tuple = ()   # the keys of the user's own shapes (not a preset's): each must find a layer


def is_conv1d(mod: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2): a linear map with weight (in, out), y = x @ W + b."""
    return (type(mod).__name__ == "Conv1D" and hasattr(mod, "nf") and isinstance(getattr(mod, "weight", None),
            torch.Tensor) and mod.weight.dim() == 2)


def layer_kind(mod: nn.Module) -> str | None:
    """The kind of dense layer tensorize rewrites `mod` as ("linear", "conv1d", "embedding",
    "embedding_bag"), or None."""
    if isinstance(mod, TTLayer):
        return None
    if isinstance(mod, nn.Linear):
        return "linear"
    if isinstance(mod, nn.Embedding):
        return "embedding"
    if isinstance(mod, nn.EmbeddingBag):
        return "embedding_bag"
    if is_conv1d(mod):
        return "conv1d"
    return None


def as_shape(value: Any, where: str) -> LayerShape:
    """A value of tensorize's shapes (a LayerShape, a dict of its fields, or (in_modes, out_modes))."""
    try:
        if isinstance(value, LayerShape):
            return value
        if isinstance(value, Mapping):
            return LayerShape(**value)
        if isinstance(value, Sequence) and len(value) == 2:
            return LayerShape(tuple(value[0]), tuple(value[1]))
    except TypeError:
        pass
    raise TensorizeError(f"shapes[{where!r}] must be a LayerShape, a dict of its fields, or a pair "
                         f"(in_modes, out_modes); got {value!r}")


def matches(name: str, patterns: Sequence[str]) -> bool:
    """Whether a qualified module name matches any of the fnmatch patterns."""
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
    if isinstance(model, torch.jit.ScriptModule):
        raise TensorizeError(f"tensorize takes an eager nn.Module; {type(model).__name__} is TorchScript "
                             f"(torch.jit.script / torch.jit.trace), whose layers cannot be replaced. Call "
                             f"tensorize on the model before scripting it")
    wrapped = wrapped_for_data_parallel(model)
    if wrapped is not None:
        raise TensorizeError(f"tensorize takes the model before it is wrapped for data parallelism: {wrapped}. The "
                             f"wrapper holds the dense layers' parameters, so TT layers swapped in would train "
                             f"without being averaged or sharded across the processes. Call cc.tensorize (and "
                             f"cc.tempo) on the bare model, then wrap the result (DistributedDataParallel, "
                             f"fully_shard), then build the optimizer and RankAdaptive")
    asked = dict(shapes or {})
    shaped_only = False
    rank_chosen = rank is not None
    if preset is not None:
        if preset not in PRESETS:
            raise TensorizeError(f"unknown preset {preset!r}; available: {sorted(PRESETS)}")
        p = PRESETS[preset]
        rank = p["rank"] if rank is None else rank
        shapes = {**p["shapes"], **asked}
        shaped_only = p.get("shaped_only", False)
    rank = 30 if rank is None else rank
    if not isinstance(rank, (bool, str, bytes, Sequence)) and hasattr(rank, "__index__"):
        rank = operator.index(rank)   # a NumPy or 0-d tensor integer
    if isinstance(rank, (bool, str, bytes)) or not isinstance(rank, (int, Sequence)):
        raise TensorizeError(f"rank must be a positive int or a list of ints, got {rank!r}")
    if isinstance(rank, int) and rank <= 0:
        raise TensorizeError(f"rank must be a positive integer, got {rank}")
    if isinstance(min_features, bool) or not isinstance(min_features, int) or min_features < 0:
        raise TensorizeError(f"min_features must be an integer of at least 0, got {min_features!r}")
    if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
        raise TensorizeError(f"d (the number of cores per layer) must be an integer of at least 1, got {d!r}")
    for key, value in asked.items():
        as_shape(value, key)
    if init not in ("random", "svd"):
        raise TensorizeError(f"init must be 'random' or 'svd', got {init!r}")
    if tied not in ("keep", "untie"):
        raise TensorizeError(f"tied must be 'keep' or 'untie', got {tied!r}")
    include_p = _as_patterns(include, "include")
    exclude_p = _as_patterns(exclude, "exclude") or []

    all_names = [n for n, _ in model.named_modules(remove_duplicate=False) if n]   # a module's every name
    modules = dict(model.named_modules(remove_duplicate=False))
    for pats, label in ((include_p or [], "include"), (exclude_p, "exclude")):
        for p in pats:
            hits = [n for n in all_names if fnmatch.fnmatchcase(n, p)]
            if not hits:
                sample = ", ".join(all_names[:8]) + (", ..." if len(all_names) > 8 else "")
                raise TensorizeError(f"{label} pattern {p!r} matches no module of {type(model).__name__}; "
                                     f"module names look like: {sample}")
            if label == "include" and p in modules and layer_kind(modules[p]) is None:
                m = modules[p]
                what = "already a TT layer" if isinstance(m, TTLayer) else "not a layer tensorize can rewrite"
                raise TensorizeError(f"include names {p!r}, a {type(m).__name__}: {what}; tensorize rewrites "
                                     f"nn.Linear, nn.Embedding, nn.EmbeddingBag and transformers' Conv1D")
    return Options(rank=rank, rank_chosen=rank_chosen, shapes=dict(shapes or {}), include=include_p,
                   exclude=exclude_p, min_features=min_features, init=init, d=d, shaped_only=shaped_only,
                   tied=tied, asked_shapes=tuple(asked))
