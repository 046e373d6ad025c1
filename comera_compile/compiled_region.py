"""TT layers that a compiled region runs eagerly, said aloud.

Dynamo runs a part of a compiled function it cannot trace eagerly, without a word: a call to a
``torch.compiler.disable``-d function, or an activation checkpoint whose body has a side effect dynamo will not
replay.  A TT layer run there loses what the compile was for (its contraction in Inductor's kernels, the CUDA
Graph replays).  A compiled region (a block ``regional`` compiled, compile_step's forward and loss) runs its
compiled call under ``enter``; a TT layer whose forward runs eagerly meanwhile calls ``ran_eagerly``, which
warns once per region (a block class, or one step).  Code between two graphs of a region, where dynamo breaks
the graph but goes on tracing after it, is compiled, and says nothing.
"""

from __future__ import annotations

import contextvars
import functools
import warnings
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["RanEagerlyWarning", "enter", "leave", "watched", "ran_eagerly", "dynamo_runs"]


class RanEagerlyWarning(UserWarning):
    """A compiled region ran one of its TT layers eagerly (a category of its own, for warnings filters)."""


# (key, what the region is, the module it runs) of the compiled call running now; None outside one, or in a
# call meant to run eagerly
_REGION: contextvars.ContextVar[tuple[object, str, nn.Module] | None] = contextvars.ContextVar(
    "comera_compiled_region", default=None)
_WARNED: set[object] = set()


def enter(key: object | None, region: str = "", module: nn.Module | None = None) -> contextvars.Token:
    """Mark the compiled call about to run: key is what a warning is said once for (None: a call meant to run
    eagerly, whose TT layers say nothing), region what it is, module the module it runs (a warning names the
    layer within it).  Returns the token ``leave`` takes."""
    return _REGION.set(None if key is None else (key, region, module))


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
    _, where, module = region
    names = {m: n for n, m in module.named_modules()} if module is not None else {}
    name = names.get(layer) or getattr(layer, "comera_name", None) or type(layer).__name__
    warnings.warn(f"comera_compile: a TT layer ran eagerly in a compiled region: {where} ran its TT layer "
                  f"{name} outside its graph, as dynamo runs code it cannot trace (a torch.compiler.disable-d "
                  f"call, a side effect inside an activation checkpoint), so its contraction runs op by op, "
                  f"without the compiled kernels and CUDA Graphs; so may the other TT layers there.  To fix it, "
                  f"find the cause with TORCH_LOGS=graph_breaks and remove it, or compile with fullgraph=True to "
                  f"make it an error.", RanEagerlyWarning, stacklevel=4)


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
