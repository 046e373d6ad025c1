"""TT layers that a compiled region runs eagerly, said aloud.

Dynamo runs a part of a compiled function it cannot trace eagerly, without a word: a call to a
``torch.compiler.disable``-d function, or an activation checkpoint whose body has a side effect dynamo will not
replay.  A TT layer run there loses what the compile was for (its contraction in Inductor's kernels, the CUDA
Graph replays).  A compiled region (a block ``regional`` compiled, compile_step's forward and loss) runs its
compiled call under ``enter``; a TT layer whose forward runs eagerly meanwhile calls ``ran_eagerly``, which
warns once per region (a block class, or one step), naming dynamo's recompile limit where compile_step's
forward and loss hold as many graphs.  Code between two graphs of a region, where dynamo breaks
the graph but goes on tracing after it, is compiled, and says nothing.

A TT layer traced by torch.compile calls ``allow_segment_graphs``: the graphs its contraction orders
make by design do not use up dynamo's recompile limit of a model compiled whole.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import warnings
from typing import Any, Callable

import torch
from torch import nn

from .tt import constant_under_compile

__all__ = ["RanEagerlyWarning", "enter", "leave", "watched", "ran_eagerly", "dynamo_runs",
           "allow_segment_graphs"]

log = logging.getLogger(__name__)


class RanEagerlyWarning(UserWarning):
    """A compiled region ran one of its TT layers eagerly (a category of its own, for warnings filters)."""


# (key, what the region is, the module it runs, whether it raises dynamo's recompile limit for its TT layers'
# plan segments itself) of the compiled call running now; None outside one, or in a call meant to run eagerly
_REGION: contextvars.ContextVar[tuple[object, str, nn.Module | None, bool] | None] = contextvars.ContextVar(
    "comera_compiled_region", default=None)
_WARNED: set[object] = set()


def enter(key: object | None, region: str = "", module: nn.Module | None = None, *, own_limit: bool = False
          ) -> contextvars.Token:
    """Mark the compiled call about to run: key is what a warning is said once for (None: a call meant to run
    eagerly, whose TT layers say nothing), region what it is, module the module it runs (a warning names the
    layer within it), own_limit whether the call raises dynamo's recompile limit for its TT layers' plan
    segments itself (``allow_segment_graphs`` then leaves it).  Returns the token ``leave`` takes."""
    return _REGION.set(None if key is None else (key, region, module, own_limit))


def leave(token: contextvars.Token) -> None:
    _REGION.reset(token)


def dynamo_runs() -> bool:
    """False where the user turned dynamo off (``torch._dynamo.config.disable``, ``torch.compiler.set_stance``
    to an eager stance): compiled calls then run eagerly as asked."""
    if torch._dynamo.config.disable:
        return False
    stance = getattr(getattr(torch._dynamo.eval_frame, "_stance", None), "stance", "default")
    return stance not in ("force_eager", "eager_on_recompile")


def ran_eagerly(layer: nn.Module) -> None:
    """Called by a TT layer's forward outside dynamo's tracing: warn, once per region, where a compiled
    region's call is running."""
    region = _REGION.get()
    if region is None or region[0] in _WARNED:
        return
    _WARNED.add(region[0])
    key, where, module, _ = region
    names = {m: n for n, m in module.named_modules()} if module is not None else {}
    name = names.get(layer) or getattr(layer, "comera_name", None) or type(layer).__name__
    said = (f"comera_compile: a TT layer ran eagerly in a compiled region: {where} ran its TT layer {name} "
            f"outside its graph")
    limit = _limit_reached(key)
    if limit is not None:
        warnings.warn(f"{said}: dynamo's recompile limit ({limit}) was reached for it, so a call whose inputs "
                      f"match none of its graphs runs eagerly from now on, its contractions op by op, without the "
                      f"compiled kernels and CUDA Graphs.  To fix it, see which guard failed with "
                      f"TORCH_LOGS=recompiles and keep that input the same from call to call (a batch of another "
                      f"size, a flag), or raise torch._dynamo.config.recompile_limit.", RanEagerlyWarning,
                      stacklevel=4)
        return
    warnings.warn(f"{said}, as dynamo runs code it cannot trace (a torch.compiler.disable-d "
                  f"call, a side effect inside an activation checkpoint), so its contraction runs op by op, "
                  f"without the compiled kernels and CUDA Graphs; so may the other TT layers there.  To fix it, "
                  f"find the cause with TORCH_LOGS=graph_breaks and remove it, or compile with fullgraph=True to "
                  f"make it an error.", RanEagerlyWarning, stacklevel=4)


def _limit_reached(key: object) -> int | None:
    """dynamo's recompile limit where the region's function (the key of compile_step's forward and loss) holds
    that many graphs: then it is why the region ran eagerly; None otherwise."""
    code = getattr(key, "__code__", None)
    if code is None:
        return None
    limit = torch._dynamo.config.recompile_limit
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    try:
        held = len(_debug_get_cache_entry_list(code))
    except Exception:   # a torch that keeps them otherwise: the general cause is said
        return None
    return limit if held >= limit else None


def watched(compiled: Callable[..., Any], key: object, region: str, module: nn.Module | None = None
            ) -> Callable[..., Any]:
    """``compiled`` (a torch.compile-d function) run as a compiled region: a TT layer it runs eagerly warns."""
    @functools.wraps(compiled)
    def run(*args: Any, **kwargs: Any) -> Any:
        token = enter(key if dynamo_runs() else None, region, module)
        try:
            return compiled(*args, **kwargs)
        finally:
            leave(token)

    return run


# (grad mode, input needs grad, threshold) of the plan segments traced in graphs of dynamic shapes, and the
# recompile limit allow_segment_graphs last set for them
_SEGMENTS: set[tuple[bool, bool, int]] = set()
_LIMIT_SET: list[int] = []


@constant_under_compile
def allow_segment_graphs(training: bool, input_grad: bool, thresholds: tuple[int, ...]) -> None:
    """Called at trace time by a TT layer under torch.compile: in a graph of dynamic shapes, dynamo compiles a
    graph for each segment between the thresholds where the layer's best contraction order changes that the
    row count reaches, by design.  ``torch._dynamo.config.recompile_limit`` is raised, for the process, by
    the number of (mode, threshold) pairs traced so far, so that these graphs leave a model compiled whole
    the headroom the limit is for (at 8, a 12-layer Llama's padded batches then its evaluation sent the whole
    model to eager for the rest of the run); a limit set since is raised again on top of the new value.  Said
    at INFO (``TORCH_LOGS=comera_compile``).  A compiled block raises its own limit, around its call, instead."""
    region = _REGION.get()
    if (region is not None and region[3]) or not _dynamic_trace():
        return
    config = torch._dynamo.config
    new = {(training, input_grad, t) for t in thresholds} - _SEGMENTS
    _SEGMENTS.update(new)
    current = config.recompile_limit
    ours = _LIMIT_SET == [current]
    if ours and not new:
        return
    config.recompile_limit = target = current + (len(new) if ours else len(_SEGMENTS))
    _LIMIT_SET[:] = [target]
    log.info("comera: torch._dynamo.config.recompile_limit raised from %d to %d: a changing row count compiles a "
             "graph per contraction order of the TT layers it reaches (%d plan thresholds traced)", current, target,
             len(_SEGMENTS))


def _dynamic_trace() -> bool:
    """Whether the graph dynamo is tracing has symbolic sizes (a static one serves one row count only)."""
    from torch._guards import TracingContext

    env = getattr(getattr(TracingContext.try_get(), "fake_mode", None), "shape_env", None)
    return env is None or bool(env.backed_var_to_val)
