"""Regional compilation: a model's repeated blocks compiled one by one, sharing one graph per block class.

``repeated_blocks`` finds a model's stack of layers, ``compile_block`` compiles one block so that blocks of a
class share dynamo's cache, and ``compile_blocks`` does both for a whole model and keeps the blocks' inputs
equal across layers: transformers' key/value cache, whose per-layer state dynamo guards layer by layer, is
off unless a call asks for it.  A block that dynamo would stop compiling (its recompile limit) is never run
eagerly in silence: a warning names it, the guard's likely cause and the fix.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
import warnings
from typing import Any, Callable

import torch
from torch import nn

from comera_compile import compiled_region, networks
from comera_compile.layers import TTLayer, TTLinear

__all__ = ["repeated_blocks", "compile_block", "compile_blocks", "is_compiled_block", "cache_off_by_default",
           "eager_blocks", "drop_stale_graphs"]

def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the members of each outermost ModuleList or Sequential whose members
    are two or more composite modules (with submodules and parameters) of one class: a transformer's stack
    of layers, not a Sequential of plain Linears.  Compiled one by one, blocks of equal code and shapes
    share one compiled graph: the compile cost of one block, not of all."""
    containers = (nn.ModuleList, nn.Sequential)
    holders = (nn.ParameterList, nn.ParameterDict)

    def composite(m: nn.Module) -> bool:
        return any(not isinstance(c, holders) for c in m.children()) and next(m.parameters(), None) is not None

    def visit(module: nn.Module) -> list[nn.Module]:
        members = list(module.children())
        if (isinstance(module, containers) and len(members) > 1 and len({type(m) for m in members}) == 1
                and all(composite(m) for m in members)):
            return members
        return [block for child in members for block in visit(child)]

    return visit(model)


def compile_block(block: nn.Module, *, name: str | None = None, **compile_kwargs: Any) -> None:
    """``block.compile(**compile_kwargs)`` for any block, torch.nn's own classes included.

    ``Module.compile`` compiles the block's ``_call_impl``, a frame in torch.nn that dynamo does not trace:
    for one of torch.nn's classes (``nn.TransformerEncoderLayer``) only the calls that leave torch (a TT
    layer's forward) would be captured, each as a graph of its own.  Here the compiled frame is a function of
    this package that calls the block, which dynamo inlines the block into, without wrapping the block in
    another module (its name and state_dict keys stay the user's).  The function has one code object per
    block class: dynamo keys its cache and recompile limit on the code object, so blocks of one class share
    one compiled graph and other classes do not count against it.  The block runs under that limit raised by
    the graphs its TT layers' row-count plans may add (a graph per contraction order a changing batch
    reaches), so padded batches of changing length keep it compiled.

    Where dynamo would run the block eagerly from its recompile limit on, it runs eagerly with a warning that
    names the block (``name``, else its class) and the fix, once per block class and cause among the blocks
    of one ``compile_blocks`` call; with ``fullgraph=True`` that is an error.  A call
    that hands the block a transformers KV cache runs eagerly with a warning (each layer's cache state is
    guarded per layer, so every layer would compile a graph of its own): ``compile_blocks`` turns the cache
    off by default."""
    _compile_block(block, name, set(), compile_kwargs)


def _compile_block(block: nn.Module, name: str | None, warned: set[tuple[type, str]],
                   compile_kwargs: dict[str, Any]) -> None:
    """compile_block; `warned` holds the (block class, cause) pairs already said, shared by the blocks of one
    compile_blocks call so that a cause is said once per class, not once per layer."""
    call = _block_call(type(block))
    compiled = torch.compile(types.FunctionType(call.__code__, call.__globals__, call.__name__, None,
                                                (types.CellType(block._call_impl),)), **compile_kwargs)
    block._compiled_call_impl = _dispatch(block, compiled, name or type(block).__name__,
                                          bool(compile_kwargs.get("fullgraph", False)), warned)
    block.__dict__["_comera_compiled_block"] = True   # (a plain attribute: not in state_dict or repr)


def is_compiled_block(module: nn.Module) -> bool:
    """Whether compile_block (or compile_blocks) compiled `module` (a copy, deep or pickled, is not compiled:
    nn.Module leaves its compiled call out)."""
    return bool(module.__dict__.get("_comera_compiled_block")) and module._compiled_call_impl is not None


@functools.cache
def _block_call(block_class: type) -> Callable[..., Any]:
    """A function calling a block, with a code object of its own for block_class (see compile_block)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return call_impl(*args, **kwargs)

    call_impl = None   # the cell; compile_block gives each block's function its own
    name = f"compiled_{block_class.__name__}"
    call.__code__ = call.__code__.replace(co_name=name)
    call.__name__ = name
    return call


def _is_kv_cache(value: Any) -> bool:
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers.")
               for c in type(value).__mro__)


def _dispatch(block: nn.Module, compiled: Callable[..., Any], name: str, fullgraph: bool,
              warned: set[tuple[type, str]]) -> Callable[..., Any]:
    """The block's call: the compiled function, or the block's own call where compiling cannot serve."""
    config = torch._dynamo.config
    try:
        from torch._dynamo.exc import FailOnRecompileLimitHit
    except ImportError:   # a torch without it: dynamo's own fallback (and its own warning)
        FailOnRecompileLimitHit = type("FailOnRecompileLimitHit", (Exception,), {})
    flag = "fail_on_recompile_limit_hit" if hasattr(config, "fail_on_recompile_limit_hit") else None
    limit_name = next((n for n in ("recompile_limit", "cache_size_limit") if hasattr(config, n)), None)
    block.__dict__["_comera_planned"] = _plan_graphs(block)   # drop_stale_graphs counts again after a cut
    call_impl = block._call_impl

    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():   # in another compile: traced into it
            return call_impl(*args, **kwargs)
        if block.__dict__.get("_comera_eager") or not compiled_region.dynamo_runs():
            return _run_eagerly(call_impl, args, kwargs)
        if any(_is_kv_cache(v) for v in (*args, *kwargs.values())):
            why = ("it was handed a transformers KV cache, whose state dynamo guards layer by layer (every layer "
                   "would compile a graph of its own)")
            if block.__dict__.get("_comera_cache_off"):   # compile_blocks': the call asked for the cache
                fix = ("pass use_cache=False where a call needs no cache (an eval-mode call without labels "
                       "follows the config, which a decoding loop relies on); generate() needs it, and runs the "
                       "blocks eagerly")
            else:
                fix = ("pass use_cache=False to the model's forward, or compile with cc.compile_blocks(model), "
                       "which turns the cache off unless a call asks for it")
            _eager(block, name, warned, why, fix, remember=False)
            return _run_eagerly(call_impl, args, kwargs)
        # Blocks of one class share graphs: their graphs guard on the hooks of the modules inside (dynamo skips
        # those guards by default), so a hook on one layer is neither lost nor run on the others.  A block
        # checkpointed by transformers (gradient_checkpointing_enable) runs its forward in checkpoint's
        # higher-order op, where dynamo breaks the graph at any side effect, and the block ran eagerly: since
        # transformers 5.25 every Llama attention sets a context variable (the kernels hub's).  Side effects
        # there run once, in the forward, not again in the backward's recompute.
        settings = dict(_SETTINGS)
        if limit_name is not None:   # the graphs the TT layers' plans make by design do not count against it
            settings[limit_name] = getattr(config, limit_name) + block.__dict__.get("_comera_planned", 0)
        saved = {setting: getattr(config, setting) for setting in settings}
        for setting, value in settings.items():
            setattr(config, setting, value)
        region = compiled_region.enter(type(block), f"compiled block {name} ({type(block).__name__})", block,
                                       own_limit=limit_name is not None)
        if flag is None or config.suppress_errors:   # no way to hear of the limit: dynamo's own fallback
            try:
                return compiled(*args, **kwargs)
            finally:
                compiled_region.leave(region)
                for setting, value in saved.items():
                    setattr(config, setting, value)
        before = getattr(config, flag)
        setattr(config, flag, True)
        try:
            return compiled(*args, **kwargs)
        except FailOnRecompileLimitHit as e:
            setattr(config, flag, before)
            limit = getattr(config, limit_name) if limit_name else "?"
            why = (f"dynamo's recompile limit ({limit} graphs per block class) was reached: its inputs or "
                   f"attributes match none of the graphs compiled for {type(block).__name__} so far")
            fix = ("see which guard failed with TORCH_LOGS=recompiles; make the blocks' inputs and attributes "
                   "equal across layers (a per-layer int or flag read in forward), or raise "
                   "torch._dynamo.config.recompile_limit")
            if _holds_tt_layers(block):   # ranks cut per layer are the usual cause here
                fix = ("cut ranks that blocks of one shape share (ra.cut(), not ra.cut(share=False): TT layers of "
                       "ranks of their own make one graph per block), or raise torch._dynamo.config."
                       f"recompile_limit to the number of blocks; else {fix}")
            if fullgraph:
                raise RuntimeError(f"compiled block {name} cannot be compiled: {why}. To fix it, {fix}") from e
            _eager(block, name, warned, why, fix)
            return _run_eagerly(call_impl, args, kwargs)
        finally:
            compiled_region.leave(region)
            setattr(config, flag, before)
            for setting, value in saved.items():
                setattr(config, setting, value)

    return run


def _holds_tt_layers(block: nn.Module) -> bool:
    return any(isinstance(m, TTLayer) for m in block.modules())


def _plan_graphs(block: nn.Module) -> int:
    """How many graphs the block's TT layers may add by design: a TT layer picks its contraction order by
    comparing the row count with its plans' thresholds (networks.tt_linear_segments), and dynamo compiles a
    graph per segment a dynamic row count reaches, in training and in evaluation.  Without these in the
    recompile limit, padded batches of changing length plus evaluation reached dynamo's 8 on a 12-layer Llama
    and every block ran eagerly from then on."""
    thresholds = set()
    for module in block.modules():
        if isinstance(module, TTLinear):
            for mode in ((True, True), (True, False), (False, True), (False, False)):
                thresholds.update((mode, t) for t in networks.tt_linear_segments(module.spec.token, *mode)[0])
    return len(thresholds)


def _run_eagerly(call_impl: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """A compiled block's call run eagerly on purpose (said already, or asked for): its TT layers say nothing."""
    token = compiled_region.enter(None)
    try:
        return call_impl(*args, **kwargs)
    finally:
        compiled_region.leave(token)


# dynamo's settings while a compiled block runs (_dispatch says why); those this torch has
_SETTINGS = {name: value for name, value in {"skip_nnmodule_hook_guards": False,
                                             "skip_fwd_side_effects_in_bwd_under_checkpoint": True}.items()
             if hasattr(torch._dynamo.config, name)}


def _eager(block: nn.Module, name: str, warned: set[tuple[type, str]], why: str, fix: str,
           remember: bool = True) -> None:
    """Warn, once per block class and cause, that the block runs eagerly; remember=True keeps it eager.

    Layers of one class meet the same cause one after another (a 32-layer ``generate()`` hands each its
    cache), so the first names itself and stands for the rest; ``eager_blocks`` lists every one kept eager."""
    key = (type(block), why)
    if key not in warned:
        warned.add(key)
        others = f"; so will every other {type(block).__name__} block it happens to"
        if remember:
            others += " (cc.regional.eager_blocks(model) lists them)"
        warnings.warn(f"comera_compile: block {name} runs eagerly{' from now on' if remember else ''}: {why}"
                      f"{others}. To fix it, {fix}.", UserWarning, stacklevel=4)
    if remember:
        block._comera_eager = why


def drop_stale_graphs(model: nn.Module) -> int:
    """Drop the graphs dynamo holds for the parts of the model that hold a TT layer: its compiled blocks'
    classes, the forward of each module class (``torch.compile(model)`` keeps its graphs on the model's
    forward), and the forward and loss that cc.compile_step compiled as one graph (regional=False).

    A rank re-allocation replaces TT layers' Parameters with smaller ones, so no graph compiled before it
    runs again; yet each still counts toward dynamo's recompile limit (8 per code object), which a few
    re-allocations with an evaluation graph each would reach, sending the model to eager for the rest of
    the run.  The graphs a compiled block's TT layers add by design are counted again at the new ranks.
    RankAdaptive calls this after each cut.  Other models sharing these code objects (their
    classes, another compiled step) compile again on their next call.  Returns the number of code objects
    reset."""
    codes: set[types.CodeType] = set()
    for m in model.modules():
        if not any(isinstance(layer, TTLayer) for layer in m.modules()):
            continue
        forward = getattr(type(m).forward, "__code__", None)
        if forward is not None:
            codes.add(forward)
        if is_compiled_block(m):
            codes.add(_block_call(type(m)).__code__)
            m.__dict__["_comera_planned"] = _plan_graphs(m)   # the new ranks' plans may have more segments
        codes |= m.__dict__.get("_comera_compiled_codes", set())
    if codes:
        import torch._dynamo

        lock = getattr(getattr(torch._dynamo, "convert_frame", None), "compile_lock", None)
        with lock if lock is not None else contextlib.nullcontext():
            for code in codes:
                torch._dynamo.reset_code(code)
    return len(codes)


def eager_blocks(model: nn.Module) -> dict[str, str]:
    """The model's compiled blocks that run eagerly from now on, by qualified name, with the reason."""
    return {n: m._comera_eager for n, m in model.named_modules() if m.__dict__.get("_comera_eager")}


def _use_cache_position(module: nn.Module) -> int | None:
    """Where ``use_cache`` sits among the module's forward arguments, if its config has the flag too."""
    if not hasattr(getattr(module, "config", None), "use_cache"):
        return None
    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("use_cache") if "use_cache" in params else None


def _no_cache_unless_asked(module: nn.Module, args: tuple, kwargs: dict[str, Any], *,
                           position: int) -> tuple[tuple, dict]:
    """The forward pre-hook: use_cache (argument `position`, or the keyword) False where the call leaves it
    None and computes a loss (training mode, or labels given); an evaluation call without labels follows the
    config, as a decoding loop that reads ``past_key_values`` needs.  A module-level function under
    functools.partial, so a hooked model pickles (torch.save(model))."""
    if not module.training and kwargs.get("labels") is None:
        return args, kwargs
    if len(args) > position:
        if args[position] is None:
            args = (*args[:position], False, *args[position + 1:])
    elif kwargs.get("use_cache") is None:
        kwargs["use_cache"] = False
    return args, kwargs


def cache_off_by_default(model: nn.Module) -> int:
    """Make transformers' key/value cache off in calls that compute a loss (training mode, or labels given)
    unless they pass ``use_cache=True``.

    A forward pass that computes a loss never reads the cache, and its per-layer state (which layers were
    filled) is guarded by dynamo layer by layer, so with the cache on every layer compiles a graph of its
    own.  An evaluation call without labels follows the config: a hand-written decoding loop reads the
    ``past_key_values`` it returns (such calls run the compiled blocks eagerly, said once; pass
    ``use_cache=False`` where none is needed).  ``generate()`` passes ``use_cache`` explicitly and keeps its
    cache.  A forward pre-hook on every module whose config has ``use_cache`` and whose forward takes it; the
    config is left as it is.  Returns the number of modules hooked (0 for a model that is not a transformers
    one); calling it again hooks nothing twice."""
    hooked = 0
    for module in model.modules():
        position = _use_cache_position(module)
        if position is not None and module.__dict__.get("_comera_cache_hook") is None:
            module._comera_cache_hook = module.register_forward_pre_hook(
                functools.partial(_no_cache_unless_asked, position=position), with_kwargs=True)
            hooked += 1
    return hooked


def compile_blocks(model: nn.Module, **compile_kwargs: Any) -> list[nn.Module]:
    """Compile the model's repeated blocks one by one (``compile_block``), in place, and turn transformers'
    KV cache off unless a call asks for it (``cache_off_by_default``), so that every layer of a block class
    shares one graph whatever the depth.  ``compile_kwargs`` are torch.compile's (``backend="comera"``
    by default).  Returns the blocks compiled: none for a model without repeated blocks (compile it whole).
    Use it before handing the model to a training loop or transformers' Trainer."""
    compile_kwargs.setdefault("backend", "comera")
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        inner = model.module
    else:
        inner = model
    cache_off_by_default(inner)
    names = {m: n for n, m in inner.named_modules()}
    blocks = repeated_blocks(inner)
    warned: set[tuple[type, str]] = set()
    for block in blocks:
        _compile_block(block, names.get(block), warned, compile_kwargs)
        block.__dict__["_comera_cache_off"] = True   # a cache reaching it was asked for (its warning says so)
    return blocks
