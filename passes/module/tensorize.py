"""Rewrite a model's dense layers (nn.Linear, nn.Embedding, nn.EmbeddingBag, transformers' Conv1D) into TT
layers.  Takes an nn.Module.

By default the layers are swapped module by module: the result is the user's own model (its class,
methods, containers and train/eval behaviour) with TT layers inside; the graph the compiler rewrites is
dynamo's, under torch.compile.  ``trace=True`` asks for a torch.fx GraphModule instead, whose TT layers are
``tt_<name>`` call_module nodes (``print(gm.code)`` shows them); where torch.fx cannot trace the model, or
its graph differs between train and eval mode (code reading ``self.training``, which a trace would freeze),
the layers are swapped module by module, with a warning.  Everything that can fail is checked before
anything is swapped, so an error leaves the user's model exactly as it was.

tensorize runs in stages, each a function with plain data between them: check_options (-> Options) and
select_layers (-> Selection: the rewrites, the layers kept dense and why, the warnings) in
passes/module/select.py; build_layers (-> (dense module, TT layer) pairs); swap_in (the copy or the model
itself, the TT layers in place); trace_stage (trace=True); comera_compile.huggingface.attach (a
transformers model's save_pretrained, resize_token_embeddings, tie_weights).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from comera_compile import huggingface
from comera_compile.embedding import TTEmbedding, TTEmbeddingBag
from comera_compile.huggingface import resize_token_embeddings  # noqa: F401  (its old home)
from comera_compile.layers import TTLayer, TTLinear
from comera_compile.passes.module.options import layer_d
from comera_compile.passes.module.select import (PRESETS, LayerShape, Options, Rewrite, Selection,
                                                 TensorizeError, TensorizeSummary, check_options, select_layers)
from comera_compile.passes.module.trace import trace_model

__all__ = ["tensorize", "densify", "LayerShape", "TensorizeSummary", "PRESETS", "TensorizeError"]


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
    include / exclude: fnmatch patterns on qualified module names (a layer registered under two names
        matches by either); excluded layers stay dense.
    min_features: layers whose smaller dimension is below this stay dense (unless given a shape).
    init: "random" (trains from scratch, variance of the dense default init) or "svd" (TT-SVD of the
        existing weights: exact at full ranks).
    d: modes per side of the layers whose shapes are chosen automatically (default 3 for linears, 4 for
        embedding tables); a `shapes` entry's own modes set its layer's.
    preset: a name from PRESETS, e.g. "comera-six-encoder" (CoMERA's shapes and ranks; only the layers
        it lists are rewritten).
    tied: what to do with layers sharing a weight with another module: "keep" leaves them dense (and
        tied), "untie" tensorizes each separately.  Either way a warning says which.
    inplace: swap the layers inside `model` itself instead of a copy.
    trace: False (default) swaps the layers inside the model, which keeps its class and methods; True returns
        a torch.fx GraphModule where the model can be traced and its graph does not depend on train/eval.

    The returned model carries a TensorizeSummary as ``comera_summary``.
    """
    options = check_options(model, rank, shapes, include, exclude, min_features, init, d, preset, tied)
    selection = select_layers(model, options)
    built = build_layers(selection, options, share_hooks=inplace)
    for message in selection.warnings:
        warnings.warn(message, stacklevel=2)
    # Nothing below can fail on bad input: all replacements are built.
    summary = _merged(getattr(model, "comera_summary", None), selection.summary)
    whole = next((new for old, new in built if old is model), None)
    if whole is not None:  # the model is itself a dense layer: the TT layer is the result
        whole.comera_summary = summary
        return whole
    try:
        clear = huggingface.untie_plan(model, selection.summary)
    except Exception as e:   # transformers' tie map of a model it cannot expand
        raise TensorizeError(f"tied='untie': cannot read which weights {type(model).__name__} ties "
                             f"({type(e).__name__}: {e}); pass tied='keep'") from e
    result = swap_in(model, built, selection.names_of, inplace)
    if trace:
        result = trace_stage(result, summary)
    huggingface.attach(result, summary, clear)
    result.comera_summary = summary
    return result


def _build(rewrite: Rewrite, init: str, d: int | None) -> TTLayer:
    """The TT layer for one rewrite, from the dense module's weights (init="svd") or its shape alone."""
    mod, kind, r, shape = rewrite.module, rewrite.kind, rewrite.rank, rewrite.shape
    d = layer_d(shape, d)
    in_modes = shape.in_modes if shape else None
    out_modes = shape.out_modes if shape else None
    if init == "svd" and mod.weight.is_meta:
        raise TensorizeError(f"cannot tensorize {rewrite.name!r} ({type(mod).__name__}) with init='svd': its weight "
                             f"is on the meta device (no values to factor); load the weights first, or pass "
                             f"init='random'")
    if init == "svd" and not torch.isfinite(mod.weight).all():
        raise TensorizeError(f"cannot tensorize {rewrite.name!r} ({type(mod).__name__}) with init='svd': its weight "
                             f"holds NaN or inf, which a TT-SVD cannot factor; exclude it, or pass init='random'")
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
        raise TensorizeError(f"cannot tensorize {rewrite.name!r} ({type(mod).__name__}): {e}") from e


def build_layers(selection: Selection, options: Options, share_hooks: bool = False) -> list[tuple[nn.Module, TTLayer]]:
    """The TT layer of every rewrite, paired with the dense module it replaces; the model is not touched.
    Each TT layer's parameters require grad as the dense ones do (a frozen layer stays frozen), and it runs
    the dense module's forward and backward hooks: their own dicts (share_hooks, for inplace: the user's
    handles still remove them) or copies (a copy of the model, as deepcopy gives the other modules)."""
    built = []
    biases: dict[int, nn.Parameter] = {}
    for rewrite in selection.rewrites:
        new = _build(rewrite, options.init, options.d)
        new.comera_name = rewrite.name   # its profiler ranges' name
        new.comera_origin = type(rewrite.module).__name__   # densify's dense class (Conv1D or not)
        old = rewrite.module
        for p in (*new.cores, *new.gates):
            p.requires_grad_(old.weight.requires_grad)
        if getattr(new, "bias", None) is not None:
            new.bias.requires_grad_(old.bias.requires_grad)
            _share_bias(old, new, biases, share_hooks)
        carry_hooks(old, new, share_hooks)
        new.train(old.training)
        built.append((old, new))
    return built


def _share_bias(old: nn.Module, new: TTLayer, biases: dict[int, nn.Parameter], inplace: bool) -> None:
    """A bias stays the one Parameter it was wherever the model shares it (BERT's decoder.bias is
    predictions.bias): in place, the TT layer takes the old Parameter itself; in a copy, every TT layer of one
    old bias takes one new Parameter, and swap_in's copy maps the old one to it."""
    if not _same_bias(old, new):
        return
    new.bias = old.bias if inplace else biases.setdefault(id(old.bias), new.bias)


def _same_bias(old: nn.Module, new: nn.Module) -> bool:
    """Both layers have a bias Parameter of one dtype and shape (one can stand for the other)."""
    a, b = getattr(old, "bias", None), getattr(new, "bias", None)
    return isinstance(a, nn.Parameter) and isinstance(b, nn.Parameter) and a.dtype == b.dtype and a.shape == b.shape


def carry_hooks(old: nn.Module, new: nn.Module, share: bool) -> None:
    """Give `new` the forward and backward hooks of the module it replaces: their own dicts (share, in place:
    the user's handles still remove them) or copies (in a copy of the model)."""
    for attr in _HOOKS:
        hooks = getattr(old, attr, None)
        if hooks:
            setattr(new, attr, hooks if share else copy.copy(hooks))


# nn.Module's dicts of forward and backward hooks (and the flags they are registered with)
_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
          "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_is_full_backward_hook")


def _merged(before: TensorizeSummary | None, now: TensorizeSummary) -> TensorizeSummary:
    """The summary of a tensorize call over a model tensorized before: the earlier rewrites kept (densify
    reads them: which layers were Conv1D), the untied groups of both."""
    if before is None:
        return now
    now.rewritten = {**before.rewritten, **now.rewritten}
    now.kept_dense = {n: r for n, r in now.kept_dense.items() if n not in now.rewritten}
    now.untied = sorted({*before.untied, *now.untied})
    return now


def swap_in(model: nn.Module, built: list[tuple[nn.Module, TTLayer]], names_of: dict[int, list[str]],
            inplace: bool) -> nn.Module:
    """The model (inplace) or a copy of it with every built TT layer under each name of the module it
    replaces."""
    if inplace:
        work = model
    else:
        # Share (don't copy) the layers about to be replaced: the copy drops them anyway.
        memo: dict[int, Any] = {id(old): old for old, _ in built}
        # a bias another module shares: its copies there are the TT layer's (_share_bias)
        memo.update((id(old.bias), new.bias) for old, new in built if _same_bias(old, new))
        try:
            work = copy.deepcopy(model, memo)
        except Exception as e:   # an attribute deepcopy cannot copy (a lock, a file, an open connection)
            raise TensorizeError(f"cannot copy the model to rewrite the copy ({type(e).__name__}: {e}); pass "
                                 f"inplace=True to rewrite the model itself") from e
    for old, new in built:
        for n in names_of[id(old)]:
            _set_submodule(work, n, new)
    return work


def trace_stage(model: nn.Module, summary: TensorizeSummary) -> nn.Module:
    """The rewritten model as a torch.fx GraphModule (summary.traced), or, where it cannot be traced, the
    model itself with a warning (summary.trace_error says why)."""
    try:
        result = trace_model(model)
        summary.traced = True
        return result
    except Exception as e:  # torch.fx raises many kinds of errors for untraceable code
        summary.trace_error = f"{type(e).__name__}: {e}".split("\n")[0]
        warnings.warn(f"tensorize: no torch.fx graph for {type(model).__name__} ({summary.trace_error}); "
                      f"rewrote its layers module by module instead, so the result keeps its class and "
                      f"is not a GraphModule.", stacklevel=3)
        return model


def _set_submodule(root: nn.Module, qualname: str, new: nn.Module) -> None:
    parent_name, _, attr = qualname.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, attr, new)


def densify(model: nn.Module, *, inplace: bool = False) -> nn.Module:
    """Every TT layer of `model` back to a plain dense layer -- TTLinear to nn.Linear (or to transformers'
    Conv1D where it replaced one, as in GPT-2: ``comera_summary`` says which), TTEmbedding to nn.Embedding,
    TTEmbeddingBag to nn.EmbeddingBag -- holding the weight its cores and gates represent
    (``TTLayer.to_dense_module``): for export or serving, or for a plain model after compressed training.
    With no TT layer left, a transformers model is a plain one again (huggingface.detach): transformers'
    save_pretrained writes a checkpoint its from_pretrained loads, and layers tied='untie' gave their own stay
    apart.  Returns a copy unless inplace; a model that is itself a TT layer comes back as the dense layer."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"densify takes an nn.Module, got {type(model).__name__}")
    if isinstance(model, TTLayer):
        return _dense_layer(model, getattr(model, "comera_summary", None), "")
    layers = [(name, m) for name, m in model.named_modules(remove_duplicate=False) if isinstance(m, TTLayer)]
    _check_reads_no_cores(model, {name for name, _ in layers})
    summary = getattr(model, "comera_summary", None)
    built: dict[int, nn.Module] = {}
    biases: dict[int, nn.Parameter] = {}
    for name, layer in layers:
        if id(layer) not in built:  # a layer registered under two names stays one layer
            built[id(layer)] = _dense_layer(layer, summary, name)
            carry_hooks(layer, built[id(layer)], share=inplace)
            if getattr(layer, "bias", None) is not None:
                _share_bias(layer, built[id(layer)], biases, inplace)
    memo: dict[int, Any] = {id(m): m for _, m in layers}
    memo.update((id(m.bias), built[id(m)].bias) for _, m in layers if _same_bias(m, built[id(m)]))
    work = model if inplace else copy.deepcopy(model, memo)
    summary = getattr(work, "comera_summary", None)
    for name, layer in layers:
        _set_submodule(work, name, built[id(layer)])
    if summary is not None:
        for name, _ in layers:
            summary.rewritten.pop(name, None)
            summary.kept_dense[name] = "made dense by densify"
    if not any(isinstance(m, TTLayer) for m in work.modules()):
        huggingface.detach(work)
    return work


def _check_reads_no_cores(model: nn.Module, names: set[str]) -> None:
    """Raise where a GraphModule's graph reads a TT layer's cores or gates itself (expand_contractions wrote
    its products into the graph): swapping in a dense layer would leave those reads without their tensors."""
    if not isinstance(model, torch.fx.GraphModule):
        return
    reads = sorted({n.target.rsplit(".", 2)[0] for n in model.graph.nodes if n.op == "get_attr"
                    and n.target.count(".") >= 2 and n.target.rsplit(".", 2)[0] in names})
    if reads:
        raise ValueError(f"densify: the graph of {type(model).__name__} reads the cores of {len(reads)} TT layer(s) "
                         f"itself ({', '.join(reads[:4])}{', ...' if len(reads) > 4 else ''}): "
                         f"expand_contractions wrote their products into it.  Densify the model before "
                         f"expanding its contractions.")


def _dense_layer(layer: TTLayer, summary: TensorizeSummary | None, name: str) -> nn.Module:
    """The dense layer for `layer`: transformers' Conv1D (weight (in, out)) where the summary says it
    replaced one, so that the model's own checkpoints fit it; else ``layer.to_dense_module()``."""
    dense = layer.to_dense_module()
    origin = getattr(layer, "comera_origin", None)   # set by tensorize; a summary may sit on an outer model
    if origin != "Conv1D" and (summary is None or not summary.rewritten.get(name, "").endswith("(from Conv1D)")):
        return dense
    from transformers.pytorch_utils import Conv1D

    with torch.device("meta"):   # its own initial weight, about to be replaced, is never allocated
        conv = Conv1D(dense.out_features, dense.in_features)
    conv.weight = nn.Parameter(dense.weight.detach().t().contiguous())
    conv.bias = dense.bias
    return conv
