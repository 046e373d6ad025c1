"""Tempo on an nn.Module: ``tempo(model)`` traces the model and runs the graph pass, or, for a model
torch.fx cannot trace, ``tempo_modules(model)`` swaps its nn.GELU, nn.LayerNorm and nn.Dropout submodules
for the Tempo versions in place (no attention fusion: that needs the graph).  torch's own composite modules
(nn.TransformerEncoder, nn.Transformer, ...) stay leaves of the trace; ``tempo`` swaps inside its own copies of
them (parameters shared).
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import warnings

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from comera_compile.distributed.fsdp import wrapped_for_data_parallel
from comera_compile.layers import TTLayer
from comera_compile.ops.tempo_modules import (TEMPO_MODULES, TempoDropout, TempoGatedMLP, TempoGELU,
                                              TempoGELUDropout, TempoLayerNorm, TempoRMSNorm, TempoUpcastRMSNorm)
from comera_compile.passes.fx.nodes import hooked
from comera_compile.passes.fx.tempo import TempoSummary, logger, tempo_graph
from comera_compile.passes.module.trace import trace_model

__all__ = ["tempo_modules", "tempo"]

KINDS = ("gelu", "layer_norm", "dropout", "rms_norm", "swiglu")   # what the module swap can replace


# ---------------------------------------------------------------------------------------------------------
# Module swap (models torch.fx cannot trace)


@functools.lru_cache(maxsize=None)
def _is_tanh_gelu(cls: type) -> bool:
    """Whether a fresh cls() computes F.gelu(approximate="tanh") in float64 (to 1e-12 on [-10, 10]): the
    transformers activations that write the tanh GELU out in Python (GPT-2's NewGELUActivation)."""
    try:
        with torch.no_grad():
            x = torch.linspace(-10, 10, 2001, dtype=torch.float64)
            return bool((cls()(x) - F.gelu(x, approximate="tanh")).abs().max() < 1e-12)
    except Exception:   # a constructor that takes arguments, or any other failure: not recognised
        return False


def _hf_gelu_form(mod: nn.Module) -> str | None:
    """The GELU form of transformers' GELUActivation / GELUTanh modules when they call F.gelu, and of
    NewGELUActivation (the tanh form written out, checked to compute it), else None."""
    name = type(mod).__name__
    act = getattr(mod, "act", None)
    if name == "GELUActivation" and act is F.gelu:
        return "none"
    if name in ("GELUTanh", "PytorchGELUTanh") and getattr(act, "func", None) is F.gelu and \
            getattr(act, "keywords", {}) == {"approximate": "tanh"}:
        return "tanh"
    if name == "NewGELUActivation" and type(mod).__module__ == "transformers.activations" and \
            _is_tanh_gelu(type(mod)):
        return "tanh"
    return None


@functools.lru_cache(maxsize=None)
def _forward_source(cls: type) -> str | None:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None


@functools.lru_cache(maxsize=None)
def _llama_sources() -> tuple[str | None, str | None]:
    """The forward sources of transformers' LlamaRMSNorm and LlamaMLP: the forms the decoders copy."""
    try:
        llama = importlib.import_module("transformers.models.llama.modeling_llama")
    except ImportError:   # a transformers without Llama: no module is recognised as its form
        return None, None
    return _forward_source(llama.LlamaRMSNorm), _forward_source(llama.LlamaMLP)


def _hf_decoder_form(mod: nn.Module) -> str | None:
    """The form of a transformers module computed as Llama's: "rms_norm" (float32, then weight * normalised),
    "gated_mlp" (with a SiLU act_fn); else None.  Recognised by the class's forward source being Llama's own,
    as transformers copies it into Qwen2, Mistral and the others, so a family that computes anything else
    (Gemma's 1 + weight) is left alone."""
    cls = type(mod)
    if not cls.__module__.startswith("transformers.") or not cls.__name__.endswith(("RMSNorm", "MLP")):
        return None
    norm_src, mlp_src = _llama_sources()
    src = _forward_source(cls)
    weight = getattr(mod, "weight", None)
    if src == norm_src and isinstance(weight, nn.Parameter) and weight.dim() == 1 and \
            isinstance(getattr(mod, "variance_epsilon", None), float):
        return "rms_norm"
    act = getattr(mod, "act_fn", None)
    silu = (type(act) is nn.SiLU and not act.inplace) or (type(act).__name__ == "SiLUActivation" and
                                                          type(act).__module__ == "transformers.activations")
    if src == mlp_src and silu and all(isinstance(getattr(mod, n, None), nn.Module)
                                       for n in ("gate_proj", "up_proj", "down_proj")):
        return "gated_mlp"
    return None


def _swap_for(mod: nn.Module, kinds: dict[str, bool]) -> tuple[nn.Module, str] | None:
    """The Tempo module taking mod's place and what it keeps, for the kinds asked for (KINDS); None to keep it."""
    gelu, layer_norm, dropout, rms_norm, swiglu = (kinds[k] for k in KINDS)
    if isinstance(mod, TEMPO_MODULES):
        return None
    if rms_norm and type(mod) is nn.RMSNorm:
        new = TempoRMSNorm(mod.normalized_shape, mod.eps, mod.elementwise_affine, device="meta")
        new.weight = mod.weight   # the same Parameter object
        return new, "rms_norm: output and 1/rms kept"
    form = _hf_decoder_form(mod) if rms_norm or swiglu else None
    if rms_norm and form == "rms_norm":
        return TempoUpcastRMSNorm(mod.weight, mod.variance_epsilon), \
            f"rms_norm (from {type(mod).__name__}): output and 1/rms kept"
    if swiglu and form == "gated_mlp":
        return TempoGatedMLP(mod), f"swiglu (from {type(mod).__name__}): gate and up kept, not silu(gate)"
    if gelu and type(mod) is nn.GELU:
        return TempoGELU(mod.approximate), f"gelu ({mod.approximate} form): output and branch bits kept"
    if gelu and _hf_gelu_form(mod) is not None:
        form = _hf_gelu_form(mod)
        name = type(mod).__name__
        if name == "NewGELUActivation":
            name += ", now torch's op: equal to its formula within rounding"
        return TempoGELU(form), f"gelu ({form} form, from {name}): output and branch bits kept"
    if layer_norm and type(mod) is nn.LayerNorm:
        new = TempoLayerNorm(mod.normalized_shape, mod.eps, mod.elementwise_affine, bias=mod.bias is not None,
                             device="meta")
        new.weight, new.bias = mod.weight, mod.bias   # the same Parameter objects
        return new, "layer_norm: output and 1/std kept"
    if dropout and type(mod) is nn.Dropout and not mod.inplace:
        return TempoDropout(mod.p), "dropout: mask as bits"
    return None


_TORCH_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
_UNREACHABLE = "unreachable"   # the start of a kept entry's reason for a site no pass can reach


def _swap_activation(layer: nn.Module, where: str, summary: TempoSummary, dropout: bool, inside: str) -> None:
    """A torch transformer layer's GELU activation (the function F.gelu for activation="gelu", or an nn.GELU)
    becomes a TempoGELU, or with its following dropout (the layer's ``dropout``, used only after it), one
    TempoGELUDropout while ``dropout`` becomes nn.Identity: GELU alone would keep its output, which only
    the dropout reads, so only the fused op saves."""
    act = getattr(layer, "activation", None)
    form = "none" if act is F.gelu else act.approximate if type(act) is nn.GELU else None
    if form is None:
        return
    drop = getattr(layer, "dropout", None)
    if dropout and type(drop) is nn.Dropout and not drop.inplace:
        layer.activation = TempoGELUDropout(drop.p, form).train(drop.training)
        layer.dropout = nn.Identity()
        summary.replaced[where] = f"gelu+dropout ({form} form, the layer's activation and dropout, now " \
                                  f"nn.Identity): output, mask bits and branch bits kept{inside}"
    else:
        layer.activation = TempoGELU(form).train(layer.training)
        summary.replaced[where] = f"gelu ({form} form): output and branch bits kept{inside}"


def _swap_tree(root: nn.Module, prefix: str, summary: TempoSummary, swaps: dict[int, tuple[nn.Module, str]],
               kinds: dict[str, bool], attention: bool) -> None:
    """Swap the Tempo modules into root's submodules, in place, recording them under prefix.name.  torch's
    transformer layers keep activation="gelu" as the function F.gelu in an attribute: it becomes a TempoGELU
    submodule.  nn.MultiheadAttention's softmax -> dropout -> matmul runs inside torch's own function, where
    no pass reaches: listed as kept (when it has dropout and attention is asked for)."""
    inside = f" (inside {type(root).__name__} {prefix})" if prefix else ""
    if kinds["gelu"]:
        for name, mod in root.named_modules():
            if isinstance(mod, _TORCH_LAYERS):
                _swap_activation(mod, ".".join(n for n in (prefix, name, "activation") if n), summary,
                                 kinds["dropout"], inside)
    for name, mod in list(root.named_modules(remove_duplicate=False)):
        full = ".".join(n for n in (prefix, name) if n)
        if isinstance(mod, nn.MultiheadAttention) and attention and mod.dropout > 0.0:
            summary.kept[full or type(mod).__name__] = (
                f"{_UNREACHABLE}: attention inside nn.MultiheadAttention (softmax -> dropout -> matmul in torch's "
                f"own function; its dropout is a float, not a module)")
        if not name:
            continue
        if id(mod) not in swaps:
            found = _swap_for(mod, kinds)
            if found is None:
                if isinstance(mod, nn.Dropout) and type(mod) is nn.Dropout and mod.inplace:
                    summary.kept[full] = "in-place dropout (its input is overwritten; left as is)"
                continue
            if hooked(mod):
                summary.kept[full] = (f"{type(mod).__name__} with hooks or a forward of its own set on it (a swap "
                                      f"would drop them; left as is)")
                continue
            new, what = found
            new.train(mod.training)
            swaps[id(mod)] = (new, what)
        new, what = swaps[id(mod)]
        parent_name, _, attr = name.rpartition(".")
        setattr(root.get_submodule(parent_name) if parent_name else root, attr, new)
        summary.replaced[full] = what + inside


def _check_not_sharded(model: nn.Module) -> None:
    """FSDP gathers each step's parameters into the modules it wrapped, which a swap would leave behind:
    refuse before changing anything.  (A DistributedDataParallel wrapper is fine: the swaps share its
    Parameters.)"""
    wrapped = wrapped_for_data_parallel(model, ddp=False)
    if wrapped is not None:
        raise ValueError(f"tempo swaps modules, which must happen before FSDP shards the model: {wrapped}. Call "
                         f"cc.tempo(model) first, then fully_shard (the swapped modules keep every parameter "
                         f"and state_dict key)")


def _warn_unreachable(summary: TempoSummary, model: nn.Module) -> None:
    """Warn about the sites listed as unreachable in the summary (the pass saves nothing there)."""
    where = [w for w, why in summary.kept.items() if why.startswith(_UNREACHABLE)]
    if where:
        warnings.warn(f"tempo: {len(where)} site(s) of {type(model).__name__} run inside torch's own functions, "
                      f"where no Tempo op can reach (see tempo_summary.kept): {', '.join(where)}", stacklevel=3)


def tempo_modules(model: nn.Module, *, gelu: bool = True, layer_norm: bool = True, dropout: bool = True,
                  rms_norm: bool = True, swiglu: bool = True) -> nn.Module:
    """Swap the nn.GELU (and transformers' GELUActivation / GELUTanh, and the activation="gelu" of torch's
    transformer layers), nn.LayerNorm, nn.Dropout and nn.RMSNorm submodules of `model` for TempoGELU /
    TempoLayerNorm / TempoDropout / TempoRMSNorm, and the RMSNorm and SiLU-gated MLP of transformers'
    decoders (Llama, Qwen2, Mistral, ...) for TempoUpcastRMSNorm / TempoGatedMLP, in place; returns model, with
    a TempoSummary as ``model.tempo_summary``.  Parameters are shared, not copied (state_dict keys and an
    existing optimizer stay valid).  For any nn.Module; functional calls inside forward (F.gelu, softmax ->
    dropout -> matmul) need tempo_graph on a traced graph instead.  The Tempo GELU and norms keep their output
    for backward: if forward code then modifies it in place, backward raises autograd's in-place error (pass
    gelu=False / layer_norm=False / rms_norm=False for such a model)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"tempo_modules takes an nn.Module, got {type(model).__name__}")
    _check_not_sharded(model)
    summary = TempoSummary(traced=False)
    kinds = dict(gelu=gelu, layer_norm=layer_norm, dropout=dropout, rms_norm=rms_norm, swiglu=swiglu)
    _swap_tree(model, "", summary, {}, kinds, attention=False)
    model.tempo_summary = summary
    logger.info("%s", summary)
    return model


_PASS_TYPES = (nn.GELU, nn.LayerNorm, nn.Dropout, nn.RMSNorm)   # call_module leaves tempo_graph itself rewrites


def _swap_in_leaves(gm: torch.fx.GraphModule, kinds: dict[str, bool], attention: bool) -> TempoSummary:
    """The module swap inside the graph's call_module leaves (torch's own modules, such as
    nn.TransformerEncoder, whose forward the trace does not enter), each leaf first copied into the graph
    module with its parameters and buffers shared: the user's model keeps its own modules."""
    summary, swaps, seen = TempoSummary(), {}, set()
    for node in gm.graph.nodes:
        if node.op != "call_module" or node.target in seen:
            continue
        seen.add(node.target)
        mod = gm.get_submodule(node.target)
        if isinstance(mod, (TTLayer, *TEMPO_MODULES)) or type(mod) in _PASS_TYPES or not any(
                _reachable(m) for m in mod.modules()):
            continue
        own = copy.deepcopy(mod, {id(t): t for t in (*mod.parameters(), *mod.buffers())})
        parent, _, attr = node.target.rpartition(".")
        setattr(gm.get_submodule(parent) if parent else gm, attr, own)
        _swap_tree(own, node.target, summary, swaps, kinds, attention)
    return summary


def _reachable(mod: nn.Module) -> bool:
    """Whether the module swap has anything to do or report in `mod` (a torch transformer layer, a module it
    swaps, an attention it lists)."""
    return isinstance(mod, (*_TORCH_LAYERS, *_PASS_TYPES, nn.MultiheadAttention)) or \
        _hf_gelu_form(mod) is not None or _hf_decoder_form(mod) is not None


def tempo(model: nn.Module, *, gelu: bool = True, layer_norm: bool = True, attention: bool = True,
          dropout: bool = True, rms_norm: bool = True, swiglu: bool = True) -> nn.Module:
    """Tempo memory passes on any model: tempo_graph on a GraphModule (in place); otherwise trace with
    torch.fx (nn modules as leaves, the model's own modules shared) and run tempo_graph, or, when tracing
    fails, swap modules in place with tempo_modules and warn.  Inside the leaves the trace does not enter
    (torch's nn.TransformerEncoder, nn.Transformer, ...), the modules are swapped in the result's own copy
    of each leaf, its parameters and buffers shared with the model given; what no pass can reach (attention inside
    nn.MultiheadAttention) is listed in the summary's ``kept`` and warned about.  The result carries
    ``tempo_summary``."""
    kinds = dict(gelu=gelu, layer_norm=layer_norm, dropout=dropout, rms_norm=rms_norm, swiglu=swiglu)
    if isinstance(model, torch.fx.GraphModule):
        return tempo_graph(model, **kinds, attention=attention).graph_module
    if not isinstance(model, nn.Module):
        raise TypeError(f"tempo takes an nn.Module, got {type(model).__name__}")
    _check_not_sharded(model)
    try:
        gm = trace_model(model)
    except Exception as e:  # torch.fx raises many kinds of errors for untraceable code
        error = f"{type(e).__name__}: {e}".split("\n")[0]
        warnings.warn(f"tempo: torch.fx cannot trace {type(model).__name__} ({error}); swapped its GELU, "
                      f"LayerNorm, RMSNorm, gated MLP and Dropout modules in place instead (no attention fusion; "
                      f"see tempo_summary).", stacklevel=2)
        out = tempo_modules(model, **kinds)
        out.tempo_summary.trace_error = error
        if attention:   # list attention no pass reaches (nothing else is swapped with every flag off)
            _swap_tree(model, "", out.tempo_summary, {}, dict.fromkeys(KINDS, False), attention=True)
            _warn_unreachable(out.tempo_summary, model)
        return out
    inside = _swap_in_leaves(gm, kinds, attention)
    out = tempo_graph(gm, **kinds, attention=attention).graph_module
    out.tempo_summary.replaced.update(inside.replaced)
    out.tempo_summary.kept.update(inside.kept)
    _warn_unreachable(out.tempo_summary, model)
    if inside.replaced:
        logger.info("%s", out.tempo_summary)
    return out
