"""Saving and loading tensorized transformers models: the TT layout travels with the checkpoint.

``save_pretrained`` (installed on the model by ``tensorize``, or called as ``cc.save_pretrained``; it lives in
comera_compile.huggingface with what else tensorize puts on a model) writes the config with the TT layout of
every layer and the weights to WEIGHTS_NAME, with an index (INDEX_NAME) the Trainer resumes from but a plain
``from_pretrained`` stops at.  ``cc.from_pretrained(ModelClass, folder)`` rebuilds the model at the recorded
shapes and ranks, loads it, and sets it up as tensorize sets up a model (``huggingface.attach``), so it saves,
resizes and ties as the model that was saved.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from .embedding import TTEmbedding, TTEmbeddingBag
from .huggingface import INDEX_NAME, WEIGHTS_NAME, attach, save_pretrained, tt_layout
from .layers import TTLayer, TTLinear

__all__ = ["WEIGHTS_NAME", "INDEX_NAME", "tt_layout", "apply_layout", "save_pretrained", "from_pretrained"]


def _layer(entry: dict[str, Any], like: torch.Tensor | None) -> TTLayer:
    kw: dict[str, Any] = {"rank": tuple(entry["ranks"])}
    if like is not None:
        kw.update(device=like.device, dtype=like.dtype if like.is_floating_point() else None)
    kind = entry["kind"]
    if kind == "TTLinear":
        return TTLinear(entry["in_features"], entry["out_features"], entry["bias"], in_modes=entry["in_modes"],
                        out_modes=entry["out_modes"], **kw)
    if kind == "TTEmbedding":
        return TTEmbedding(entry["in_features"], entry["out_features"], entry["padding_idx"],
                           row_modes=entry["in_modes"], col_modes=entry["out_modes"], **kw)
    if kind == "TTEmbeddingBag":
        return TTEmbeddingBag(entry["in_features"], entry["out_features"], entry["mode"],
                              padding_idx=entry["padding_idx"], include_last_offset=entry["include_last_offset"],
                              row_modes=entry["in_modes"], col_modes=entry["out_modes"], **kw)
    raise ValueError(f"unknown TT layer kind {kind!r} in the layout")


def _module(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError as e:
        raise ValueError(f"the TT layout names {name!r}, which {type(model).__name__} does not have: load the "
                         f"checkpoint into the model class it was saved from") from e


def apply_layout(model: nn.Module, layout: dict[str, dict[str, Any]]) -> nn.Module:
    """Swap the layers named in `layout` for TT layers of the recorded shapes and ranks (fresh values),
    in place, each under every name its dense layer has (one layer applied in two places stays one);
    returns the model."""
    names_of: dict[int, list[str]] = {}
    for n, m in model.named_modules(remove_duplicate=False):
        names_of.setdefault(id(m), []).append(n)
    olds = {id(m): (m, entry) for m, entry in [(_module(model, n), e) for n, e in layout.items()]}
    for old, entry in olds.values():   # every layer found before any is swapped
        new = _layer(entry, next(old.parameters(), None))
        for n in names_of[id(old)]:
            parent, _, attr = n.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, new)
    return model


def _dtype(asked: torch.dtype | str | None, state: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype to build in: the one asked for (a floating torch.dtype or its name), else ("auto" or None)
    that of most of the saved floating-point values, as transformers' from_pretrained takes it."""
    if asked is None or asked == "auto":
        sizes: dict[torch.dtype, int] = {}
        for v in state.values():
            if v.is_floating_point():
                sizes[v.dtype] = sizes.get(v.dtype, 0) + v.numel()
        return max(sizes, key=sizes.__getitem__) if sizes else torch.get_default_dtype()
    dtype = getattr(torch, asked, None) if isinstance(asked, str) else asked
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, its name or 'auto', got {asked!r}")
    return dtype


def _shared_groups(model: nn.Module, layout: dict[str, dict[str, Any]]) -> set[str]:
    """The layers that share one weight in the freshly built model (transformers tied them, as the config
    says) and of which the saved model has a TT layer: they were apart when saved, so they stay apart.
    Named as tensorize names an untied group."""
    owners: dict[int, list[str]] = {}
    for name, m in model.named_modules():
        for p in m.parameters(recurse=False):
            if name:
                owners.setdefault(id(p), []).append(name)
    return {" and ".join(sorted(names)) for names in owners.values()
            if len(names) > 1 and any(n in layout for n in names)}


def from_pretrained(model_class: Any, directory: str | os.PathLike, *, dtype: torch.dtype | str | None = None,
                    **config_kwargs: Any) -> nn.Module:
    """Load a folder written by save_pretrained into `model_class` (a transformers model class), as
    transformers' from_pretrained loads a dense one: built from the config in `dtype` (default: the saved
    weights'; ``torch_dtype=`` is taken too), its layers swapped for TT layers at the recorded shapes and
    ranks, every weight loaded (strictly: a missing or unexpected key is an error), returned in eval mode.
    Other keywords set the config's fields; one that is not a field is a TypeError, as in transformers.
    The model gets what tensorize gives one (comera's save_pretrained, resize_token_embeddings and, where
    layers were untied, tie_weights; ``comera_summary``), so it saves, resizes and ties as the saved one."""
    from comera_compile.passes.module.select import TensorizeSummary

    legacy = config_kwargs.pop("torch_dtype", None)
    config, unused = model_class.config_class.from_pretrained(directory, return_unused_kwargs=True, **config_kwargs)
    if unused:   # transformers' loader raises on a keyword it does not take; the config's drops it silently
        raise TypeError(f"from_pretrained got keyword argument(s) {sorted(unused)} that are neither dtype= nor "
                        f"fields of {type(config).__name__}; transformers' loading options (device_map, "
                        f"low_cpu_mem_usage, ...) are not supported: load, then move the model")
    layout = getattr(config, "comera_layout", None)
    path = os.path.join(directory, WEIGHTS_NAME)
    if layout is None or not os.path.exists(path):
        raise ValueError(f"{directory} is not a tensorized checkpoint (no comera_layout in its config or no "
                         f"{WEIGHTS_NAME}); load it with {getattr(model_class, '__name__', model_class)}"
                         f".from_pretrained")
    state = torch.load(path, map_location="cpu", weights_only=True)
    dtype = _dtype(dtype if dtype is not None else legacy, state)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)   # as transformers builds a model in the dtype it loads
    try:
        model = model_class(config)
    finally:
        torch.set_default_dtype(previous)
    summary = TensorizeSummary(
        rewritten={n: f"{e['kind']} (from {type(_module(model, n)).__name__})" for n, e in layout.items()},
        untied=sorted(set(getattr(config, "comera_untied", None) or ()) | _shared_groups(model, layout)))
    apply_layout(model, layout)
    model.load_state_dict(state, strict=True)
    model.config.dtype = dtype
    attach(model, summary)
    model.comera_summary = summary
    if callable(getattr(model, "tie_weights", None)):
        model.tie_weights()   # comera's where layers were untied: those stay apart
    return model.eval()
