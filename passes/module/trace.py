"""Tracing a model with torch.fx for the module passes (tensorize(trace=True), tempo, the inspect command):
TT layers stay call_module leaves, and a model whose graph depends on train/eval mode is refused rather than
frozen in one mode."""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from comera_compile.layers import TTLayer

__all__ = ["trace_model"]


class _Tracer(torch.fx.Tracer):
    """Keeps TT layers (and torch.nn's own modules) as call_module leaves."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, TTLayer) or super().is_leaf_module(m, qualname)

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        # Name TT-layer calls tt_<path> so print(gm.code) shows which layers were rewritten.
        if kind == "call_module" and name is None and isinstance(self.root.get_submodule(target), TTLayer):
            name = "tt_" + target.replace(".", "_")
        return super().create_node(kind, target, args, kwargs, name, type_expr)


def _trace_both_modes(model: nn.Module) -> torch.fx.Graph:
    """The model's graph in its modules' current modes, after checking that a trace with every module's mode
    flipped gives the same code: a GraphModule freezes the modes it was traced in (dropout after eval(), or
    none after train()).  Each module keeps its own mode (a frozen part in eval inside a model in train)."""
    modes = {m: m.training for m in model.modules()}
    graphs = []
    try:
        for flipped in (False, True):
            for m, training in modes.items():   # the flag alone: train() would set every submodule alike
                m.training = training != flipped
            graphs.append(_Tracer().trace(model))
    finally:
        for m, training in modes.items():
            m.training = training
    if torch.fx.GraphModule(model, graphs[0]).code != torch.fx.GraphModule(model, graphs[1]).code:
        raise TypeError("its graph depends on train/eval mode (it reads self.training), which a trace freezes")
    return graphs[0]


def trace_model(model: nn.Module) -> torch.fx.GraphModule:
    """A torch.fx GraphModule of the model that stays the model's own: TT layers as call_module leaves
    named tt_<path>, the model's children, parameters, buffers and public attributes kept under their names.
    Raises TypeError when the graph would depend on train/eval mode."""
    graph = _trace_both_modes(model)
    name = type(model).__name__
    gm = torch.fx.GraphModule(model, graph, name)
    # GraphModule copies only what the graph uses, under plain containers.  Put the model's own children,
    # parameters and buffers back, so gm.layers[0] works and state_dict keys match the original model.
    for child_name, child in model._modules.items():  # not named_children(): keep aliases of one module
        setattr(gm, child_name, child)
    for pname, param in model._parameters.items():
        if pname not in gm._parameters:
            gm.register_parameter(pname, param)
    for bname, buf in model._buffers.items():
        if bname not in gm._buffers:
            gm.register_buffer(bname, buf, persistent=bname not in model._non_persistent_buffers_set)
    gm.training = model.training   # its children are the model's, in their own modes
    # Keep plain attributes user code reads (e.g. model.config) available on the GraphModule.
    for key, value in vars(model).items():
        if not key.startswith("_") and key != "training" and not hasattr(gm, key):
            setattr(gm, key, value)
    return gm
