"""The decoder-LM sites of the Tempo graph pass: RMSNorm (nn.RMSNorm, F.rms_norm, and the float32 form
transformers' Llama, Qwen2 and Mistral write out, as dynamo's graph holds it, or Meta's Llama code with
``x.float()`` and ``.type_as(x)``) and SwiGLU's ``silu(gate) * up``.

decoder_site(gm, node) reads one node and returns what tempo_graph should put in its place, or why it
leaves it; the graph is not changed here.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from comera_compile.ops.rms_norm import cast_rms_norm, rms_norm, scaled_rms_norm, silu_mul
from comera_compile.ops.tempo_modules import module_rms_norm
from comera_compile.passes.fx.nodes import arg, called_module, first_input, single_user

__all__ = ["DecoderSite", "decoder_site"]

_RMS_NORM_FNS = {F.rms_norm, torch.rms_norm}
_MUL_FNS = {operator.mul, torch.mul}
_ADD_FNS = {operator.add, torch.add}
_RMS_KEPT = "rms_norm: output and 1/rms kept"


@dataclass
class DecoderSite:
    """What replaces `node`: target(*args) (the args at positions `attrs` name submodules, read with get_attr),
    the nodes erased with it, what it keeps; or, with target None, why the node is left (kept)."""

    node: torch.fx.Node
    target: Callable | None
    args: tuple = ()
    erase: tuple[torch.fx.Node, ...] = ()
    what: str = ""
    where: str = ""
    keeps_output: bool = False   # the Tempo op keeps its output: an in-place write to it must keep the node
    kept: str | None = None
    attrs: tuple[int, ...] = ()


def _rms_norm_fn(x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None,
                 eps: float | None) -> torch.Tensor:
    """F.rms_norm's arguments for the Tempo rms_norm (eps None: the input dtype's machine epsilon, as torch)."""
    return rms_norm(x, len(shape), weight, torch.finfo(x.dtype).eps if eps is None else eps)


def _is_call(node: Any, fns: set, method: str) -> bool:
    return isinstance(node, torch.fx.Node) and (
        (node.op == "call_function" and node.target in fns) or (node.op == "call_method" and node.target == method))


def _operands(node: torch.fx.Node) -> tuple[Any, Any] | None:
    """The two operands of a binary call given positionally (no keywords, such as add's alpha)."""
    return tuple(node.args) if len(node.args) == 2 and not node.kwargs else None


def _other(node: torch.fx.Node, one: Any) -> Any:
    """The operand of binary `node` that is not `one` (None when neither or both are)."""
    ops = _operands(node)
    if ops is None or (ops[0] is one) == (ops[1] is one):
        return None
    return ops[1] if ops[0] is one else ops[0]


def _squared(node: Any) -> torch.fx.Node | None:
    """h for h.pow(2), torch.pow(h, 2), h ** 2 or h * h."""
    if _is_call(node, {torch.pow, operator.pow}, "pow") and _operands(node) and node.args[1] == 2:
        return node.args[0]
    if _is_call(node, _MUL_FNS, "mul") and _operands(node) and node.args[0] is node.args[1]:
        return node.args[0]
    return None


def _upcast_chain(node: torch.fx.Node) -> DecoderSite | None:
    """rsqrt(mean(h^2, -1, keepdim=True) + eps) at `node`, then h * it, optionally .to(dtype), optionally times
    a weight: the RMSNorm transformers' decoders write (and much user code), replaced at its last node."""
    if not _is_call(node, {torch.rsqrt}, "rsqrt") or len(node.args) != 1:
        return None
    add = node.args[0]
    if not _is_call(add, _ADD_FNS, "add") or _operands(add) is None:
        return None
    mean = next((a for a in add.args if isinstance(a, torch.fx.Node)), None)
    eps = _other(add, mean)
    if not _is_call(mean, {torch.mean}, "mean") or not isinstance(eps, float):
        return None
    if arg(mean, 1, "dim", None) not in (-1, [-1], (-1,)) or arg(mean, 2, "keepdim", False) is not True:
        return None
    h = _squared(first_input(mean))
    scaled = single_user(node)
    if h is None or scaled is None or not _is_call(scaled, _MUL_FNS, "mul") or _other(scaled, node) is not h:
        return None
    chain = [first_input(mean), mean, add, node]
    if any(single_user(n) is None for n in chain):
        return None
    source = _float32_copy(h) if set(h.users) == {first_input(mean), scaled} else None
    last, dtype, cast_back, read = scaled, None, False, []
    cast = single_user(scaled)
    if cast is not None and cast.op == "call_method" and not cast.kwargs and len(cast.args) == 2:
        to = cast.args[1]
        if cast.target == "to" and isinstance(to, torch.dtype):
            cast_back, dtype = True, to
        elif source is not None and ((cast.target == "type_as" and to is source) or (
                cast.target == "to" and _dtype_of(to) is source)):   # x's dtype, however the code reads it
            cast_back, read = True, [to] if cast.target == "to" and set(to.users) == {cast} else []
        if cast_back:
            chain.append(scaled)
            last = cast
    weight = None
    times = single_user(last)
    if times is not None and _is_call(times, _MUL_FNS, "mul") and isinstance(_other(times, last), torch.fx.Node):
        chain.append(last)
        weight, last = _other(times, last), times
    where = f"{node.name} -> {last.name}"
    if source is None:
        return DecoderSite(last, scaled_rms_norm, (h, weight, eps, dtype), tuple(reversed(chain)),
                           _RMS_KEPT + " (written out)", where, keeps_output=True)
    # from a float32 copy of an input, which only the norm reads: recomputed from that input in the backward
    # where the cast goes back to its dtype (cast_rms_norm); with no cast back the output stays float32
    return DecoderSite(last, cast_rms_norm, (source, weight, eps, dtype if cast_back else torch.float32),
                       tuple(reversed([*read, h, *chain])), _RMS_KEPT + " (written out from a float32 copy)", where,
                       keeps_output=True)


def _dtype_of(node: Any) -> Any:
    """x for a node reading x.dtype (as torch.fx traces it; dynamo's graphs hold the dtype itself)."""
    if isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is getattr and \
            len(node.args) == 2 and node.args[1] == "dtype":
        return node.args[0]
    return None


def _float32_copy(h: torch.fx.Node) -> torch.fx.Node | None:
    """x for h = x.float() or x.to(torch.float32) (None otherwise)."""
    if h.op != "call_method" or h.kwargs or not h.args or not isinstance(h.args[0], torch.fx.Node):
        return None
    if (h.target == "float" and len(h.args) == 1) or (h.target == "to" and h.args[1:] == (torch.float32,)):
        return h.args[0]
    return None


def _gated(gm: torch.fx.GraphModule, node: torch.fx.Node) -> DecoderSite | None:
    """silu(gate) * up or up * silu(gate), the SiLU (F.silu, nn.SiLU, not in place) read by the product alone."""
    if not _is_call(node, _MUL_FNS, "mul") or _operands(node) is None:
        return None
    for act, up in (node.args, reversed(node.args)):
        if not (isinstance(act, torch.fx.Node) and isinstance(up, torch.fx.Node) and single_user(act) is node):
            continue
        mod = called_module(gm, act)
        if mod is not None:
            silu = type(mod) is nn.SiLU and not mod.inplace
        else:
            silu = act.op == "call_function" and act.target is F.silu and not arg(act, 1, "inplace", False)
        if silu and isinstance(first_input(act), torch.fx.Node):
            return DecoderSite(node, silu_mul, (first_input(act), up), (act,),
                               "swiglu: gate and up kept, not silu(gate)", f"{act.name} -> {node.name}")
    return None


def decoder_site(gm: torch.fx.GraphModule, node: torch.fx.Node, rms_norm: bool = True,
                 swiglu: bool = True) -> DecoderSite | None:
    """The replacement tempo_graph makes for a decoder-LM site at `node` (None: not one)."""
    if rms_norm:
        mod = called_module(gm, node)
        if type(mod) is nn.RMSNorm and first_input(node) is not None:
            return DecoderSite(node, module_rms_norm, (first_input(node), node.target), what=_RMS_KEPT,
                               where=f"{node.name} ({node.target})", keeps_output=True, attrs=(1,))
        if node.op == "call_function" and node.target in _RMS_NORM_FNS and first_input(node) is not None:
            args = [arg(node, i, k, None) for i, k in enumerate(("input", "normalized_shape", "weight", "eps"))]
            if isinstance(args[1], (int, tuple, list, torch.Size)) and not isinstance(args[3], torch.fx.Node):
                shape = (args[1],) if isinstance(args[1], int) else tuple(args[1])
                return DecoderSite(node, _rms_norm_fn, (args[0], shape, args[2], args[3]), what=_RMS_KEPT,
                                   where=node.name, keeps_output=True)
            return DecoderSite(node, None, where=node.name, kept="rms_norm whose shape or eps is computed in the graph")
        site = _upcast_chain(node)
        if site is not None:
            return site
    return _gated(gm, node) if swiglu else None
