"""Tempo on a torch.fx GraphModule: GELU, LayerNorm, dropout and softmax -> dropout -> matmul replaced by
the memory-saving ops of comera_compile.ops, which keep less for the backward with the same gradients.

Takes a GraphModule (a torch.fx trace, e.g. from comera_compile.tensorize(trace=True), or dynamo's graph);
records what it replaced in a ``TempoSummary`` (also logged by the "comera_compile.tempo" logger).
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from comera_compile.ops.attention import softmax_dropout_matmul
from comera_compile.ops.gelu import gelu, gelu_dropout, prepare_tables
from comera_compile.ops.hash_dropout import HashDropout, hash_dropout
from comera_compile.ops.layer_norm import layer_norm
from comera_compile.ops.tempo_modules import (module_attention, module_dropout, module_gelu,
                                              module_gelu_dropout, module_layer_norm, tempo_dropout)
from comera_compile.passes import GraphPassResult, calls_in_place, node_shape
from comera_compile.passes.fx.nodes import arg, called_module, first_input, hooked, single_user
from comera_compile.passes.fx.tempo_decoder import decoder_site

__all__ = ["TempoSummary", "tempo_graph"]

logger = logging.getLogger("comera_compile.tempo")


# ---------------------------------------------------------------------------------------------------------
# Summary


@dataclass
class TempoSummary:
    """What a Tempo pass did: what it replaced (where -> by what), and what it recognised but left alone
    (where -> why).  Keys are graph node names (FX pass) or module names (module swap)."""

    replaced: dict[str, str] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)
    traced: bool = True
    trace_error: str | None = None

    def counts(self) -> dict[str, int]:
        """Number of replacements of each kind."""
        out: dict[str, int] = {}
        for what in self.replaced.values():
            kind = what.split(" ", 1)[0].rstrip(":")
            out[kind] = out.get(kind, 0) + 1
        return out

    def __str__(self) -> str:
        how = "FX graph" if self.traced else "module swap"
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.counts().items())) or "nothing"
        lines = [f"tempo ({how}): replaced {kinds}; {len(self.kept)} left as they were"]
        lines += [f"  replaced  {where}: {what}" for where, what in self.replaced.items()]
        lines += [f"  kept      {where}: {why}" for where, why in self.kept.items()]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# FX pass

_GELU_FNS = {F.gelu}
_LAYER_NORM_FNS = {F.layer_norm, torch.layer_norm}
_DROPOUT_FNS = {F.dropout, torch.dropout}
_SOFTMAX_FNS = {torch.softmax, F.softmax}
_MATMUL_FNS = {operator.matmul, torch.matmul}
_PASS_MODULES = (nn.GELU, nn.LayerNorm, nn.Dropout, nn.RMSNorm, nn.SiLU)   # call_module sites the pass replaces
# The functional versions under other names: tempo_graph's keyword flags reuse the public names.
_gelu_fn, _layer_norm_fn, _dropout_fn = gelu, layer_norm, tempo_dropout


def _where(node: torch.fx.Node) -> str:
    return f"{node.name} ({node.target})" if node.op == "call_module" else node.name


@dataclass
class _DropoutSite:
    """A recognised dropout node: its input, and how to get p and training in the new graph."""

    node: torch.fx.Node
    module: str | None   # call_module target, or None for F.dropout with constant p / training
    p: float | None
    training: bool | None


def _as_dropout(gm: torch.fx.GraphModule, node: torch.fx.Node, summary: TempoSummary) -> _DropoutSite | None:
    mod = called_module(gm, node)
    if isinstance(mod, HashDropout) or node.op == "call_function" and node.target is hash_dropout:
        summary.kept[_where(node)] = "hash dropout (fast_dropout ran first; Tempo fuses torch's dropouts)"
        return None
    if mod is not None:
        if type(mod) is not nn.Dropout:
            return None
        if mod.inplace:
            summary.kept[_where(node)] = "in-place dropout (its input is overwritten; left as is)"
            return None
        return _DropoutSite(node, node.target, None, None)
    if node.op == "call_function" and node.target in _DROPOUT_FNS:
        p = arg(node, 1, "p", 0.5)
        training = arg(node, 2, "training" if node.target is F.dropout else "train", True)
        inplace = arg(node, 3, "inplace", False) if node.target is F.dropout else False
        if not isinstance(p, (int, float)) or not isinstance(training, bool):
            summary.kept[_where(node)] = "dropout whose p or training flag is computed in the graph"
            return None
        if inplace:
            summary.kept[_where(node)] = "in-place dropout (its input is overwritten; left as is)"
            return None
        return _DropoutSite(node, None, float(p), training)
    return None


def _gelu_form(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str | None:
    mod = called_module(gm, node)
    if mod is not None:
        return mod.approximate if type(mod) is nn.GELU else None
    if node.op == "call_function" and node.target in _GELU_FNS:
        form = arg(node, 1, "approximate", "none")
        return form if form in ("none", "tanh") else None
    return None


# Functions and methods whose result may be a view of their first argument: writing into it writes the input.
_VIEW_FNS = {operator.getitem, torch.narrow, torch.select, torch.transpose, torch.permute, torch.reshape,
             torch.flatten, torch.unflatten, torch.squeeze, torch.unsqueeze, torch.chunk, torch.split, torch.unbind,
             torch.t, torch.movedim, torch.swapaxes, torch.diagonal}
_VIEW_METHODS = {"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "narrow", "select", "flatten",
                 "unflatten", "squeeze", "unsqueeze", "expand", "expand_as", "t", "contiguous", "chunk", "split",
                 "unbind", "movedim", "swapaxes", "diagonal", "as_strided", "__getitem__", "unfold", "T", "mT"}


def _written_in_place(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Whether some user of node's output overwrites it (x.add_(..), x += .., x[i] = .., an inplace=True module
    or function), directly or through a view of it (x[:, 0].mul_(..)): the Tempo GELU and LayerNorm keep their
    output, so they must not replace such a node."""
    for user in node.users:
        if user.op == "call_function" and user.target is operator.setitem and user.args[0] is node:
            return True
        if first_input(user) is not node:
            continue
        if (user.op == "call_function" and user.target in _VIEW_FNS) or (
                user.op == "call_method" and user.target in _VIEW_METHODS):
            if _written_in_place(gm, user):
                return True
            continue
        if user.op == "call_method" and isinstance(user.target, str) and user.target.endswith("_") \
                and not user.target.endswith("__"):
            return True
        if user.op == "call_function" and calls_in_place(user):
            return True
        if user.op == "call_module" and getattr(gm.get_submodule(user.target), "inplace", False) is True:
            return True
    return False


def _softmax_dim(node: torch.fx.Node) -> Any:
    if node.op == "call_method" and node.target == "softmax":
        return arg(node, 1, "dim", None)
    if node.op == "call_function" and node.target in _SOFTMAX_FNS:
        return arg(node, 1, "dim", None)
    return False  # not a softmax


def _ndim(node: torch.fx.Node) -> int | None:
    shape = node_shape(node)
    return None if shape is None else len(shape)


def _is_matmul(node: torch.fx.Node) -> bool:
    return ((node.op == "call_function" and node.target in _MATMUL_FNS)
            or (node.op == "call_method" and node.target == "matmul"))


def tempo_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[object] | None = None, *, gelu: bool = True,
                layer_norm: bool = True, attention: bool = True, dropout: bool = True, rms_norm: bool = True,
                swiglu: bool = True) -> GraphPassResult:
    """Replace GELU, LayerNorm, RMSNorm, silu(gate) * up, dropout and softmax -> dropout -> matmul in `gm` by
    their Tempo versions, in place; the result's summary (also ``gm.tempo_summary``, and logged) is a
    TempoSummary.  example_inputs is accepted, as by every fx pass, and not needed.

    Recognised: nn.GELU / F.gelu (both forms), nn.LayerNorm / F.layer_norm (any affine setting), nn.RMSNorm /
    F.rms_norm / the float32 RMSNorm transformers' decoders write out (passes.fx.tempo_decoder), F.silu /
    nn.SiLU multiplied by another tensor (SwiGLU's gating), nn.Dropout / F.dropout, torch.softmax / F.softmax /
    .softmax over the last dim feeding a dropout feeding the left side of a matmul (@, torch.matmul, .matmul),
    and GELU feeding a dropout (fused).  Modules keep their parameters and their train/eval switch: the new
    nodes read them from the module at run time (in eval, torch's ops run), and the model's own modules are not
    changed.  Functional calls have no mode: they run the Tempo op whenever a gradient is needed.  Nodes it
    does not recognise are left exactly as they were."""
    if not isinstance(gm, torch.fx.GraphModule):
        raise TypeError(f"tempo_graph takes a torch.fx.GraphModule, got {type(gm).__name__}; get one from "
                        f"comera_compile.tensorize(model) or torch.fx.symbolic_trace(model), or use "
                        f"tempo_modules(model) for a model torch.fx cannot trace")
    graph = gm.graph
    summary = TempoSummary()
    done: set[torch.fx.Node] = set()

    def replace(old: torch.fx.Node, target: Callable, args: tuple, what: str, where: str,
                erase: tuple[torch.fx.Node, ...] = ()) -> None:
        with graph.inserting_before(old):
            new = graph.call_function(target, args)
        new.meta.update(old.meta)
        old.replace_all_uses_with(new)
        for n in (old, *erase):
            graph.erase_node(n)
        done.add(new)
        summary.replaced[where] = what

    if attention:
        for node in list(graph.nodes):
            dim = _softmax_dim(node)
            if dim is False or node not in graph.nodes:
                continue
            scores = first_input(node)
            if not isinstance(scores, torch.fx.Node):
                continue
            # torch.softmax(x, dim, dtype) and x.softmax(dim, dtype) take it third; F.softmax fourth
            if arg(node, 3 if node.target is F.softmax else 2, "dtype", None) is not None:
                summary.kept[_where(node)] = "softmax with a dtype argument"
                continue
            nd = _ndim(scores)
            if not isinstance(dim, int) or not (dim == -1 or (nd is not None and dim == nd - 1)):
                summary.kept[_where(node)] = f"softmax over dim {dim!r}, not known to be the last"
                continue
            drop_node = single_user(node)
            if drop_node is None:
                continue  # softmax output used elsewhere too (e.g. returned): nothing to save
            d = _as_dropout(gm, drop_node, summary)
            mm = single_user(drop_node) if d is not None else None
            if d is None or mm is None or not _is_matmul(mm) or first_input(drop_node) is not node:
                continue
            v = arg(mm, 1, "other", None)
            if first_input(mm) is not drop_node or not isinstance(v, torch.fx.Node):
                continue
            with graph.inserting_before(mm):
                if d.module is not None:
                    target, args = module_attention, (scores, v, dim, graph.get_attr(d.module))
                else:
                    target, args = softmax_dropout_matmul, (scores, v, d.p, d.training, dim)
            where = f"{node.name} -> {_where(drop_node)} -> {mm.name}"
            replace(mm, target, args, "attention softmax -> dropout -> matmul (softmax output kept once, "
                    "mask as bits)", where, erase=(drop_node, node))

    for node in list(graph.nodes):
        if node not in graph.nodes or node in done:
            continue
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), _PASS_MODULES) and \
                hooked(gm.get_submodule(node.target)):
            summary.kept[_where(node)] = "module with hooks or a forward set on it (its call stays, to run them)"
            continue
        form = _gelu_form(gm, node) if gelu else None
        if form is not None and _written_in_place(gm, node):
            summary.kept[_where(node)] = "gelu whose output is then modified in place (Tempo keeps the output)"
            continue
        if form is not None and first_input(node) is not None:
            prepare_tables(form)   # now, not inside a forward torch.compile would trace
            x = first_input(node)
            user = single_user(node)
            d = _as_dropout(gm, user, summary) if (dropout and user is not None) else None
            if d is not None and first_input(user) is node and not _written_in_place(gm, user):
                with graph.inserting_before(user):
                    if d.module is not None:
                        target, args = module_gelu_dropout, (x, form, graph.get_attr(d.module))
                    else:
                        target, args = gelu_dropout, (x, d.p, d.training, form)
                replace(user, target, args, f"gelu+dropout ({form} form): output, mask bits and branch bits "
                        f"kept", f"{_where(node)} -> {_where(user)}", erase=(node,))
            else:
                if node.op == "call_module":   # eval mode runs torch's GELU: read the module's flag at run time
                    with graph.inserting_before(node):
                        target, args = module_gelu, (x, form, graph.get_attr(node.target))
                else:
                    target, args = _gelu_fn, (x, form)
                replace(node, target, args, f"gelu ({form} form): output and branch bits kept", _where(node))
            continue
        if layer_norm and _written_in_place(gm, node) and (
                (node.op == "call_module" and type(called_module(gm, node)) is nn.LayerNorm)
                or (node.op == "call_function" and node.target in _LAYER_NORM_FNS)):
            summary.kept[_where(node)] = "layer_norm whose output is then modified in place (Tempo keeps the output)"
            continue
        if layer_norm:
            mod = called_module(gm, node)
            if mod is not None and type(mod) is nn.LayerNorm and first_input(node) is not None:
                with graph.inserting_before(node):   # shape, eps, parameters and mode read at run time
                    args = (first_input(node), graph.get_attr(node.target))
                replace(node, module_layer_norm, args, "layer_norm: output and 1/std kept", _where(node))
                continue
            if node.op == "call_function" and node.target in _LAYER_NORM_FNS:
                args = [arg(node, i, k, dflt) for i, (k, dflt) in enumerate(
                    [("input", None), ("normalized_shape", None), ("weight", None), ("bias", None),
                     ("eps", 1e-5)])]
                if isinstance(args[1], (int, tuple, list, torch.Size)) and not isinstance(args[4], torch.fx.Node):
                    shape = (args[1],) if isinstance(args[1], int) else tuple(args[1])
                    replace(node, _layer_norm_fn, (args[0], shape, args[2], args[3], args[4]),
                            "layer_norm: output and 1/std kept", _where(node))
                else:
                    summary.kept[_where(node)] = "layer_norm whose shape or eps is computed in the graph"
                continue
        site = decoder_site(gm, node, rms_norm, swiglu)
        if site is not None:
            if site.keeps_output and site.target is not None and _written_in_place(gm, site.node):
                site.kept = f"{site.what.split(':')[0]} whose output is then modified in place (Tempo keeps the output)"
            if site.kept is not None:
                summary.kept[site.where] = site.kept
            else:
                with graph.inserting_before(site.node):
                    args = tuple(graph.get_attr(a) if i in site.attrs else a for i, a in enumerate(site.args))
                replace(site.node, site.target, args, site.what, site.where, erase=site.erase)
            continue
        if dropout:
            d = _as_dropout(gm, node, summary)
            if d is not None and first_input(node) is not None:
                if d.module is not None:
                    with graph.inserting_before(node):
                        args = (first_input(node), graph.get_attr(d.module))
                    replace(node, module_dropout, args, "dropout: mask as bits", _where(node))
                else:
                    replace(node, _dropout_fn, (first_input(node), d.p, d.training), "dropout: mask as bits",
                            _where(node))
    graph.lint()
    gm.recompile()
    gm.tempo_summary = summary
    logger.info("%s", summary)
    return GraphPassResult(gm, len(summary.replaced), summary)
