"""Tempo on an nn.Module: ``tempo(model)`` traces the model and runs the graph pass, or, for a model
torch.fx cannot trace, ``tempo_modules(model)`` swaps its nn.GELU, nn.LayerNorm and nn.Dropout submodules
for the Tempo versions in place (no attention fusion: that needs the graph).
"""

from __future__ import annotations

import warnings

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from comera_compile.ops.tempo_modules import TEMPO_MODULES, TempoDropout, TempoGELU, TempoLayerNorm
from comera_compile.passes.fx.tempo import TempoSummary, logger, tempo_graph
from comera_compile.passes.module.trace import trace_model

__all__ = ["tempo_modules", "tempo"]


# ---------------------------------------------------------------------------------------------------------
# Module swap (models torch.fx cannot trace)


def _hf_gelu_form(mod: nn.Module) -> str | None:
    """The GELU form of transformers' GELUActivation / GELUTanh modules when they call F.gelu, else None."""
    name = type(mod).__name__
    act = getattr(mod, "act", None)
    if name == "GELUActivation" and act is F.gelu:
        return "none"
    if name in ("GELUTanh", "PytorchGELUTanh") and getattr(act, "func", None) is F.gelu and \
            getattr(act, "keywords", {}) == {"approximate": "tanh"}:
        return "tanh"
    return None


def _swap_for(mod: nn.Module, gelu: bool, layer_norm: bool, dropout: bool) -> tuple[nn.Module, str] | None:
    if isinstance(mod, TEMPO_MODULES):
        return None
    if gelu and type(mod) is nn.GELU:
        return TempoGELU(mod.approximate), f"gelu ({mod.approximate} form): output and branch bits kept"
    if gelu and _hf_gelu_form(mod) is not None:
        form = _hf_gelu_form(mod)
        return TempoGELU(form), f"gelu ({form} form, from {type(mod).__name__}): output and branch bits kept"
    if layer_norm and type(mod) is nn.LayerNorm:
        new = TempoLayerNorm(mod.normalized_shape, mod.eps, mod.elementwise_affine, bias=mod.bias is not None,
                             device="meta")
        new.weight, new.bias = mod.weight, mod.bias   # the same Parameter objects
        return new, "layer_norm: output and 1/std kept"
    if dropout and type(mod) is nn.Dropout and not mod.inplace:
        return TempoDropout(mod.p), "dropout: mask as bits"
    return None


def tempo_modules(model: nn.Module, *, gelu: bool = True, layer_norm: bool = True,
                  dropout: bool = True) -> nn.Module:
    """Swap the nn.GELU (and transformers' GELUActivation / GELUTanh), nn.LayerNorm and nn.Dropout
    submodules of `model` for TempoGELU / TempoLayerNorm / TempoDropout, in place; returns model, with a
    TempoSummary as ``model.tempo_summary``.  Parameters are shared, not copied (state_dict keys and an
    existing optimizer stay valid).  For any nn.Module; functional calls inside forward (F.gelu, softmax ->
    dropout -> matmul) need tempo_graph on a traced graph instead.  TempoGELU and TempoLayerNorm keep their
    output for backward: if forward code then modifies it in place, backward raises autograd's in-place
    error (pass gelu=False / layer_norm=False for such a model)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"tempo_modules takes an nn.Module, got {type(model).__name__}")
    summary = TempoSummary(traced=False)
    swaps: dict[int, tuple[nn.Module, str]] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        if not name:
            continue
        if id(mod) not in swaps:
            found = _swap_for(mod, gelu, layer_norm, dropout)
            if found is None:
                if isinstance(mod, nn.Dropout) and type(mod) is nn.Dropout and mod.inplace:
                    summary.kept[name] = "in-place dropout (its input is overwritten; left as is)"
                continue
            new, what = found
            new.train(mod.training)
            swaps[id(mod)] = (new, what)
        new, what = swaps[id(mod)]
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
        summary.replaced[name] = what
    model.tempo_summary = summary
    logger.info("%s", summary)
    return model


def tempo(model: nn.Module, *, gelu: bool = True, layer_norm: bool = True, attention: bool = True,
          dropout: bool = True) -> nn.Module:
    """Tempo memory passes on any model: tempo_graph on a GraphModule (in place); otherwise trace with
    torch.fx (nn modules as leaves, the model's own modules shared) and run tempo_graph, or, when tracing
    fails, swap modules in place with tempo_modules and warn.  The result carries ``tempo_summary``."""
    if isinstance(model, torch.fx.GraphModule):
        return tempo_graph(model, gelu=gelu, layer_norm=layer_norm, attention=attention, dropout=dropout).graph_module
    if not isinstance(model, nn.Module):
        raise TypeError(f"tempo takes an nn.Module, got {type(model).__name__}")
    try:
        gm = trace_model(model)
    except Exception as e:  # torch.fx raises many kinds of errors for untraceable code
        error = f"{type(e).__name__}: {e}".split("\n")[0]
        warnings.warn(f"tempo: torch.fx cannot trace {type(model).__name__} ({error}); swapped its GELU, "
                      f"LayerNorm and Dropout modules in place instead (no attention fusion).", stacklevel=2)
        out = tempo_modules(model, gelu=gelu, layer_norm=layer_norm, dropout=dropout)
        out.tempo_summary.trace_error = error
        return out
    return tempo_graph(gm, gelu=gelu, layer_norm=layer_norm, attention=attention, dropout=dropout).graph_module
