"""Saving and loading tensorized transformers models: the TT layout travels with the checkpoint.

A tensorized model's weights are TT cores, which a dense model of the same class cannot hold.  So
``save_pretrained`` (installed on the model by ``tensorize``, or called as ``cc.save_pretrained``) writes the
config with the TT layout of every layer (kind, modes, ranks as allocated now) and the weights to
``comera_model.pt``, not to the file name transformers loads.  A plain ``from_pretrained`` of such a folder
therefore fails instead of returning a dense model with freshly initialised layers;
``cc.from_pretrained(ModelClass, folder)`` rebuilds the model at the recorded shapes and ranks and loads it.
An index (INDEX_NAME, transformers' name for a sharded checkpoint's) maps every weight to that file: the
Trainer's ``resume_from_checkpoint`` reads it and loads the weights into the model, whose TT layers take the
saved ranks.  It carries no ``metadata`` entry, which a plain ``from_pretrained`` reads first, so that one
still stops (at a KeyError) before loading anything.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from .embedding import TTEmbedding, TTEmbeddingBag
from .layers import TTLayer, TTLinear

__all__ = ["WEIGHTS_NAME", "INDEX_NAME", "tt_layout", "apply_layout", "save_pretrained", "from_pretrained"]

WEIGHTS_NAME = "comera_model.pt"
INDEX_NAME = "pytorch_model.bin.index.json"


def tt_layout(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Every TT layer of `model` by qualified name: its kind and what rebuilds it at its current shape."""
    layout: dict[str, dict[str, Any]] = {}
    for name, m in model.named_modules():
        if not isinstance(m, TTLayer):
            continue
        s = m.spec
        entry: dict[str, Any] = {"kind": type(m).__name__, "in_features": s.in_features,
                                 "out_features": s.out_features, "in_modes": list(s.in_modes),
                                 "out_modes": list(s.out_modes), "ranks": list(s.ranks)}
        if isinstance(m, TTLinear):
            entry["bias"] = m.bias is not None
        else:
            entry["padding_idx"] = m.padding_idx
        if isinstance(m, TTEmbeddingBag):
            entry["mode"], entry["include_last_offset"] = m.mode, m.include_last_offset
        layout[name] = entry
    return layout


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


def apply_layout(model: nn.Module, layout: dict[str, dict[str, Any]]) -> nn.Module:
    """Swap the layers named in `layout` for TT layers of the recorded shapes and ranks (fresh values),
    in place; returns the model."""
    for name, entry in layout.items():
        old = model.get_submodule(name)
        like = next(old.parameters(), None)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, _layer(entry, like))
    return model


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, **kwargs: Any) -> None:
    """Save a tensorized transformers model: config (with the TT layout as ``comera_layout``), weights in
    WEIGHTS_NAME and the index the Trainer resumes from (INDEX_NAME).  Accepts (and ignores the serialization
    options of) transformers' keyword arguments, so the Trainer can call it; ``state_dict=`` is honoured."""
    if not hasattr(model, "config") or not hasattr(model.config, "save_pretrained"):
        raise TypeError(f"save_pretrained needs a transformers model (with .config); for {type(model).__name__} "
                        f"save model.state_dict(): a freshly tensorized model loads it, ranks included")
    os.makedirs(save_directory, exist_ok=True)
    model.config.comera_layout = tt_layout(model)
    model.config.save_pretrained(save_directory)
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(save_directory)
    state = kwargs.get("state_dict") or model.state_dict()
    torch.save({k: v.detach().contiguous() for k, v in state.items()}, os.path.join(save_directory, WEIGHTS_NAME))
    index = {"comera_compile": f"TT weights, in {WEIGHTS_NAME}: load them with comera_compile.from_pretrained("
                               f"ModelClass, folder), or resume with the Trainer",
             "weight_map": {k: WEIGHTS_NAME for k in state}}
    with open(os.path.join(save_directory, INDEX_NAME), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=1)


def from_pretrained(model_class: Any, directory: str | os.PathLike, **config_kwargs: Any) -> nn.Module:
    """Load a folder written by save_pretrained into `model_class` (a transformers model class): built from
    the config, its layers swapped for TT layers at the recorded shapes and ranks, then every weight loaded
    (strictly: a missing or unexpected key is an error)."""
    config = model_class.config_class.from_pretrained(directory, **config_kwargs)
    layout = getattr(config, "comera_layout", None)
    path = os.path.join(directory, WEIGHTS_NAME)
    if layout is None or not os.path.exists(path):
        raise ValueError(f"{directory} is not a tensorized checkpoint (no comera_layout in its config or no "
                         f"{WEIGHTS_NAME}); load it with {getattr(model_class, '__name__', model_class)}"
                         f".from_pretrained")
    model = apply_layout(model_class(config), layout)
    model.load_state_dict(torch.load(path, map_location="cpu"), strict=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model
