"""compile_step's torch.compile arguments and CUDA Graph mode: the mode and options as torch.compile takes
them (backend "comera" takes a mode's Inductor settings as options, where torch.compile refuses both), which
``cuda_graphs`` mode a step runs in, and the arguments with each compiled graph's own CUDA Graphs off where
the whole step is captured as one (or for the optimizer step), and the optimizer step compiled
(compile_optimizer=True) so that re-allocations do not use up dynamo's recompile limit.  Apart from step.py,
which builds the step."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

__all__ = ["compile_kwargs", "choose_cuda_graphs", "without_cuda_graphs", "compiled_optimizer_step"]


def compile_kwargs(backend: str | Callable, mode: str | None, options: dict[str, Any] | None) -> dict[str, Any]:
    """torch.compile's mode and options for compile_step's arguments: both given to backend "comera" (which
    torch.compile refuses), the mode's settings folded into the options."""
    kwargs: dict[str, Any] = {"options": options} if options else {}
    if mode is not None and options and backend == "comera":
        kwargs["options"] = _mode_as_options(mode, options)
    elif mode is not None:
        kwargs["mode"] = mode
    return kwargs


def choose_cuda_graphs(cuda_graphs: str | None, on_cuda: bool, optimizer: torch.optim.Optimizer,
                        model: torch.nn.Module, backend: str | Callable, kwargs: dict[str, Any],
                        scaling: bool = False) -> str | None:
    """The cuda_graphs mode a step runs in: the one asked for, "compiled" for the default, and for "auto"
    "step" where nothing known refuses the capture (else "compiled", with a warning where the caller did not
    ask for per-graph replays or profiling)."""
    if cuda_graphs is None:
        return "compiled"
    if cuda_graphs != "auto":
        return cuda_graphs
    options = kwargs.get("options") or {}
    if (not on_cuda or kwargs.get("mode") == "reduce-overhead" or options.get("cudagraphs")
            or options.get("profile") or backend == "cudagraphs"):
        return "compiled"   # the CPU, or graphs (or per-layer profiling) of each compiled piece asked for
    from comera_compile.graphs import check_capturable

    try:
        if scaling:
            raise ValueError("a loss scaler (float16 autocast) reads its overflow check on the host at every "
                             "step; autocast=torch.bfloat16 needs none")
        check_capturable(optimizer, model)
    except ValueError as e:
        warnings.warn(f"compile_step(cuda_graphs='auto'): the step runs with cuda_graphs='compiled' (each "
                      f"compiled graph replayed on its own), not as one CUDA graph: {e}", stacklevel=3)
        return "compiled"
    return "step"


def _mode_as_options(mode: str, options: dict[str, Any]) -> dict[str, Any]:
    """Backend "comera"'s options with a torch.compile mode's Inductor settings folded in, below the options'
    own (as the backend ranks a mode it is handed); "reduce-overhead" is its option cudagraphs, a
    "-no-cudagraphs" mode cudagraphs=False."""
    from torch._inductor import list_mode_options

    settings = {k: v for k, v in list_mode_options(mode).items() if k != "triton.cudagraphs" and k not in options}
    given = dict(options.get("inductor") or {})
    out = {**options, "inductor": {**settings, **given}} if settings else dict(options)
    if mode == "reduce-overhead":
        out.setdefault("cudagraphs", True)
    elif mode.endswith("no-cudagraphs"):
        out.setdefault("cudagraphs", False)
    return out


def without_cuda_graphs(kwargs: dict[str, Any], backend: str | Callable, why: str) -> dict[str, Any]:
    """torch.compile's arguments with the compiled graphs' own CUDA Graphs off: backend "comera"'s option
    ``cudagraphs`` False; mode "reduce-overhead" is an error where the whole step is one graph (a graph
    cannot be captured inside another) and dropped for the optimizer step."""
    kwargs = dict(kwargs)
    if kwargs.get("mode") == "reduce-overhead":
        if why != "optimizer":
            raise ValueError(f"cuda_graphs={why!r} with mode='reduce-overhead', which replays each compiled graph "
                             f"as a CUDA graph of its own: leave mode unset (or cuda_graphs at its default)")
        kwargs.pop("mode")
    if backend == "comera":
        options = dict(kwargs.get("options") or {})
        if kwargs.get("mode") is not None:   # torch.compile takes one of the two
            options = _mode_as_options(kwargs.pop("mode"), options)
        if options.get("cudagraphs") and why != "optimizer":
            raise ValueError(f"cuda_graphs={why!r} with options={{'cudagraphs': True}}: the two disagree; drop "
                             f"the option")
        options["cudagraphs"] = False
        kwargs["options"] = options
    return kwargs


def compiled_optimizer_step(optimizer: torch.optim.Optimizer, owner: torch.nn.Module, backend: str | Callable,
                             kwargs: dict[str, Any]) -> Callable[[], Any]:
    """The optimizer step compiled, its graphs (and those of torch's step wrapper, which dynamo compiles as a
    frame of its own) dropped by drop_stale_graphs at each re-allocation: each re-allocation's graph counted
    toward dynamo's recompile limit, and after about eight the step ran eagerly, unsaid.  A limit reached all
    the same runs the step eagerly from then on, with a warning."""
    def optimizer_step() -> Any:
        return optimizer.step()

    owner.__dict__.setdefault("_comera_compiled_codes", set()).update(_step_codes(optimizer, optimizer_step))
    compiled = torch.compile(optimizer_step, backend=backend, **kwargs)
    config = torch._dynamo.config
    if not hasattr(config, "fail_on_recompile_limit_hit"):   # a torch without it: dynamo's own fallback
        return compiled
    from torch._dynamo.exc import FailOnRecompileLimitHit

    eager: list[bool] = []

    def run() -> Any:
        if eager:
            return optimizer.step()
        before, config.fail_on_recompile_limit_hit = config.fail_on_recompile_limit_hit, True
        try:
            return compiled()
        except FailOnRecompileLimitHit:
            eager.append(True)
            warnings.warn("compile_step(compile_optimizer=True): dynamo's recompile limit was reached for the "
                          "optimizer step, which runs eagerly from now on (same results, slower); see which guard "
                          "failed with TORCH_LOGS=recompiles, or raise torch._dynamo.config.recompile_limit",
                          stacklevel=3)
            return optimizer.step()
        finally:
            config.fail_on_recompile_limit_hit = before

    return run


def _step_codes(optimizer: torch.optim.Optimizer, entry: Callable[..., Any]) -> set[Any]:
    """The code objects a compiled optimizer step leaves graphs on: dynamo resumes after graph breaks in
    frames of torch's step wrapper, the optimizer's methods and its module's functions (torch.optim.sgd's
    ``sgd``, ``_multi_tensor_sgd``), each counting recompiles of its own."""
    import inspect
    import sys

    funcs = [entry, getattr(optimizer.step, "__func__", None)]
    for cls in type(optimizer).__mro__[:-1]:
        funcs += [inspect.unwrap(f) for f in vars(cls).values() if inspect.isfunction(f)]
        funcs += [f for f in vars(sys.modules.get(cls.__module__, inspect)).values()
                  if inspect.isfunction(f) and f.__module__ == cls.__module__]
    funcs += [getattr(f, "__wrapped__", None) for f in funcs]
    return {f.__code__ for f in funcs if inspect.isfunction(f)}
