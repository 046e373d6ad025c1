"""What tensorize puts on a transformers model in place of its own methods, so that they keep working on
TT layers: ``save_pretrained`` (the TT layout travels with the checkpoint; ``cc.from_pretrained``,
comera_compile.checkpoint, rebuilds it), ``resize_token_embeddings`` (a TT table is made dense to be resized)
and, after tied='untie', ``tie_weights`` (the untied layers stay apart).  ``attach`` is tensorize's last
stage and cc.from_pretrained's; ``detach`` is densify's, once no TT layer is left (RankAdaptive's
``TrainerCallback`` is rank_adaptive/trainer.py's).  transformers itself is imported only where a function
needs it.

The checkpoint: a TT layer's weights are cores, which a dense model of the same class cannot hold.  So
save_pretrained writes the config with the TT layout of every layer (``comera_layout``: kind, modes, ranks
as allocated now; ``comera_untied``: the groups tied='untie' gave layers of their own) and the weights to
WEIGHTS_NAME, not to the file name transformers loads.  An index (INDEX_NAME, transformers' name for a
sharded checkpoint's) maps every weight to that file: the Trainer's ``resume_from_checkpoint`` reads it and
loads the weights into the model, whose TT layers take the saved ranks.  It carries no ``metadata`` entry,
which a plain ``from_pretrained`` reads first, so that one stops (at a KeyError) instead of returning dense
layers with fresh weights.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from comera_compile.embedding import TTEmbeddingBag
from comera_compile.layers import TTLayer, TTLinear

if TYPE_CHECKING:
    from comera_compile.passes.module.select import TensorizeSummary

__all__ = ["WEIGHTS_NAME", "INDEX_NAME", "tt_layout", "save_pretrained", "attach", "detach",
           "resize_token_embeddings"]

WEIGHTS_NAME = "comera_model.pt"
INDEX_NAME = "pytorch_model.bin.index.json"
# transformers' own weight files (whole or sharded, and their indexes): an earlier dense save's, left in the
# folder, would be what a plain from_pretrained loads in place of the TT checkpoint
_TRANSFORMERS_WEIGHTS = re.compile(r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?")


def tt_layout(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Every TT layer of `model` by qualified name (each name of a layer registered under several): its kind
    and what rebuilds it at its current shape."""
    layout: dict[str, dict[str, Any]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
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


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, is_main_process: bool = True,
                    state_dict: Mapping[str, torch.Tensor] | None = None, **kwargs: Any) -> None:
    """Save a tensorized transformers model: config (with ``comera_layout`` and ``comera_untied``), weights in
    WEIGHTS_NAME and the index the Trainer resumes from (INDEX_NAME).  Takes transformers' arguments, so the
    Trainer can call it: ``state_dict=`` is saved instead of the model's, a process with
    ``is_main_process=False`` writes nothing (the main one writes the folder), the serialization options are
    ignored.  transformers' own weight files already in the folder are removed, as its save_pretrained
    removes the shards it does not write again."""
    if not hasattr(model, "config") or not hasattr(model.config, "save_pretrained"):
        raise TypeError(f"save_pretrained needs a transformers model (with .config); for {type(model).__name__} "
                        f"save model.state_dict(): a freshly tensorized model loads it, ranks included")
    if not is_main_process:
        return
    os.makedirs(save_directory, exist_ok=True)
    for name in os.listdir(save_directory):
        if _TRANSFORMERS_WEIGHTS.fullmatch(name) and os.path.isfile(os.path.join(save_directory, name)):
            os.remove(os.path.join(save_directory, name))
    model.config.comera_layout = tt_layout(model)
    untied = getattr(getattr(model, "comera_summary", None), "untied", None)
    if untied:
        model.config.comera_untied = list(untied)
    model.config.save_pretrained(save_directory)
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(save_directory)
    state = state_dict if state_dict is not None else model.state_dict()
    torch.save({k: v.detach().contiguous() for k, v in state.items()}, os.path.join(save_directory, WEIGHTS_NAME))
    index = {"comera_compile": f"TT weights, in {WEIGHTS_NAME}: load them with comera_compile.from_pretrained("
                               f"ModelClass, folder), or resume with the Trainer",
             "weight_map": {k: WEIGHTS_NAME for k in state}}
    with open(os.path.join(save_directory, INDEX_NAME), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=1)


def attach(model: nn.Module, summary: "TensorizeSummary", clear: Iterable[str] = ()) -> None:
    """Put comera's save_pretrained, resize_token_embeddings and (after tied='untie') tie_weights on a
    tensorized transformers model (one with a config and these methods), and mark the untied layers untied in
    its config where that can say so (_untie_config; `clear`: ``untie_plan`` of the dense model); nothing on
    a GraphModule (summary.traced) or another model."""
    if summary.traced:
        return
    if hasattr(model, "config") and callable(getattr(model, "save_pretrained", None)):
        # Its own save_pretrained would write TT weights that the dense class then "loads" with fresh layers;
        # this one records the layout for cc.from_pretrained instead.
        model.save_pretrained = functools.partial(save_pretrained, model)
    if callable(getattr(model, "resize_token_embeddings", None)) and callable(
            getattr(model, "get_input_embeddings", None)):
        model.resize_token_embeddings = functools.partial(resize_token_embeddings, model)
    if summary.untied and callable(getattr(model, "tie_weights", None)):
        model.tie_weights = functools.partial(_tie_weights, model)
        _untie_config(model, _untied_names(summary), clear)


def detach(model: nn.Module) -> None:
    """densify's last stage, once no TT layer is left: the model is a plain transformers model again, so its
    own save_pretrained comes back (comera's would write a checkpoint only cc.from_pretrained reads) and its
    config loses the TT layout.  comera's tie_weights and resize_token_embeddings stay where tensorize untied
    layers: transformers would tie them again wherever config.tie_word_embeddings could not say otherwise
    (_untie_config), and its resize would share T5's one resized table again; elsewhere transformers' own
    resize_token_embeddings comes back too."""
    gone = {"save_pretrained": save_pretrained}
    if not _untied_names(getattr(model, "comera_summary", None)):
        gone["resize_token_embeddings"] = resize_token_embeddings
    for name, func in gone.items():
        method = model.__dict__.get(name)
        if isinstance(method, functools.partial) and method.func is func:
            del model.__dict__[name]
    config = getattr(model, "config", None)
    for key in ("comera_layout", "comera_untied"):
        if key in getattr(config, "__dict__", {}):
            delattr(config, key)


def _untied_names(summary: "TensorizeSummary | None") -> set[str]:
    return {n for group in (summary.untied if summary is not None else []) for n in group.split(" and ")}


def _ties_any(pairs: Mapping[str, str], names: set[str], prefix: str = "") -> bool:
    """Whether a transformers tied-weights mapping ({target param: source param}) joins a layer in `names`."""
    at = f"{prefix}." if prefix else ""
    return any(f"{at}{p}".rpartition(".")[0] in names for pair in pairs.items() for p in pair)


def untie_plan(model: nn.Module, summary: "TensorizeSummary") -> set[str]:
    """The (sub)models, by qualified name, whose ``config.tie_word_embeddings`` tied='untie' clears: those whose
    tying would join an untied layer, unless a forward reads the flag (T5-style output scaling: clearing it
    would change the logits).  Read off the dense model, before any swap: transformers expands some tie maps
    (BERT's, which ties a bias too) by looking the tied parameters up, and a TT layer has no ``weight``."""
    names, clear = _untied_names(summary), set()
    for prefix, sub in model.named_modules() if names else ():
        expand, config = getattr(sub, "get_expanded_tied_weights_keys", None), getattr(sub, "config", None)
        if not callable(expand) or getattr(config, "tie_word_embeddings", None) is not True:
            continue
        if not _ties_any(expand(all_submodels=False), names, prefix):
            continue
        readers = {type(m) for m in model.modules() if getattr(m, "config", None) is config}
        if not any(_reads_tie_flag(cls) for cls in readers):
            clear.add(prefix)
    return clear


def _untie_config(model: nn.Module, names: set[str], clear: Iterable[str]) -> None:
    """Stop transformers tying the untied layers `names` again: drop them from each (sub)model's record of
    its tied weights (``all_tied_weights_keys``, which ``tie_weights(recompute_mapping=False)`` reads), and
    set ``tie_word_embeddings=False`` in the config of each (sub)model in `clear` (``untie_plan``): the flag a
    plain transformers model -- this one densified, saved and loaded -- keeps them apart by.  Before
    transformers 5 (no tied-weights mapping) _tie_weights keeps the layers apart on this model alone."""
    for prefix, sub in model.named_modules():
        record = getattr(sub, "all_tied_weights_keys", None)
        if isinstance(record, dict):
            sub.all_tied_weights_keys = {k: v for k, v in record.items() if not _ties_any({k: v}, names, prefix)}
    for prefix in clear:
        model.get_submodule(prefix).config.tie_word_embeddings = False


def _reads_tie_flag(cls: type) -> bool:
    """Whether `cls.forward` reads ``tie_word_embeddings`` (or its source cannot be read: assume it does)."""
    try:
        return "tie_word_embeddings" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return True


def _tie_weights(model: nn.Module, *args: Any, **kwargs: Any) -> None:
    """transformers' ``tie_weights`` on a model tensorize untied (tied='untie'), with TT layers or after they
    were made dense (resize_token_embeddings, densify): where its tying would join an untied layer -- failing
    on a TT layer, which has no ``weight`` to share, or quietly replacing one trained dense layer by the
    other -- nothing is tied; otherwise transformers' own tying runs."""
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    if not callable(expand):
        return None
    try:
        pairs = {**expand(all_submodels=True), **getattr(model, "all_tied_weights_keys", {})}
    except (ValueError, KeyError, AttributeError):   # its tie map names a parameter a TT layer no longer has
        return None
    if _ties_any(pairs, _untied_names(getattr(model, "comera_summary", None))):
        return None
    return type(model).tie_weights(model, *args, **kwargs)


def resize_token_embeddings(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    """transformers' ``model.resize_token_embeddings(...)`` on a tensorized model (tensorize puts this in its
    place): a TT input embedding or output head is first made the dense layer it represents (exactly, its
    gates folded in), so transformers resizes it as usual -- old rows unchanged, new rows initialised as
    transformers does -- and it stays dense afterwards, with the reason in ``comera_summary`` and a warning.
    A TT factorization of the resized table would change the old rows at any rank below full; call
    ``cc.tensorize(model)`` again to compress the new table.  Returns what transformers returns."""
    from comera_compile.passes.module.select import TensorizeError

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
            getattr(model, put)(layer.to_dense_module())
            made_dense.append(name)
            if summary is not None:
                summary.rewritten.pop(name, None)
                summary.kept_dense[name] = ("made dense by resize_token_embeddings (a TT form of the resized "
                                            "table would change its old rows); cc.tensorize(model) compresses it again")
    if made_dense:
        warnings.warn(f"resize_token_embeddings: {', '.join(made_dense)} made dense to be resized (old rows exact); "
                      f"call cc.tensorize(model) to compress again", stacklevel=2)
    return type(model).resize_token_embeddings(model, *args, **kwargs)
