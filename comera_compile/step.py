"""A whole training step compiled: ``compile_step`` (forward, loss, backward, optimizer step, zero_grad, and
optionally the RankAdaptive step after them), and ``CudaGraphCaptures``, which counts the CUDA Graph
recordings such a step makes.  The backend itself is comera_compile.backend; the repeated blocks compiled
one by one are comera_compile.regional's.  docs/method.md section 7 has the measurements behind the defaults.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from comera_compile.memory import keep_freed_memory
from comera_compile.regional import compile_blocks

if TYPE_CHECKING:
    from comera_compile.rank_adaptive import RankAdaptive

__all__ = ["compile_step", "CudaGraphCaptures"]


class CudaGraphCaptures:
    """Counts CUDA Graph recordings while active: ``with CudaGraphCaptures() as c: ...; c.count``.

    Every recording Inductor's CUDA Graph trees make (one per compiled graph and input shape; a rank
    re-allocation or a new batch size records anew) begins with ``torch.cuda.CUDAGraph.capture_begin``, which
    this wraps; a replay calls nothing of it.  ``skips`` is how many compiled graphs Inductor declined to
    record since entering (its ``cudagraph_skips`` counter: CPU tensors, mutated inputs, ...); those run
    without a graph.  Usable without a GPU (both stay 0)."""

    def __init__(self) -> None:
        from torch._dynamo.utils import counters

        self.count = 0
        self._counters = counters["inductor"]
        self._skips0 = self._counters["cudagraph_skips"]

    @property
    def skips(self) -> int:
        return self._counters["cudagraph_skips"] - self._skips0

    def __enter__(self) -> "CudaGraphCaptures":
        graph_class = torch.cuda.CUDAGraph
        self._saved = graph_class.__dict__.get("capture_begin")
        original = graph_class.capture_begin

        def capture_begin(graph: Any, *args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(graph, *args, **kwargs)

        graph_class.capture_begin = capture_begin
        self._skips0 = self._counters["cudagraph_skips"]
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._saved is None:
            del torch.cuda.CUDAGraph.capture_begin
        else:
            torch.cuda.CUDAGraph.capture_begin = self._saved


def compile_step(model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor],
                 optimizer: torch.optim.Optimizer, *, backend: str | Callable = "comera", fullgraph: bool = False,
                 options: dict[str, Any] | None = None, compile_optimizer: bool | None = None,
                 keep_memory: bool = True, regional: bool = True, mode: str | None = None,
                 autocast: torch.dtype | None = None,
                 rank_adaptive: "RankAdaptive | None" = None) -> Callable[..., torch.Tensor]:
    """A training step -- forward, loss, backward, optimizer step, zero_grad -- compiled.

    ``step(*inputs, target)`` returns the loss (detached); loss_fn(output, target) -> scalar.  The forward
    and loss compile with the backend, and AOTAutograd compiles the backward with them.

    compile_optimizer: the optimizer step compiles too when True; the default (None) compiles it on CUDA,
    where it joins the CUDA Graph replay, and not on CPU, where compiling a TT model's many small tensors
    costs long and gains nothing over the optimizer's multi-tensor kernels.  Run eagerly, param groups left
    at torch's default implementation are switched to the fused one where the optimizer has it, else to
    foreach (``optim.prefer_fast_implementation``); both compute the same update.
    keep_memory calls ``memory.keep_freed_memory()`` for models on the CPU (process-wide; False leaves
    malloc alone).

    regional (default) compiles each of the model's repeated blocks on its own (``regional.compile_blocks``)
    and runs the rest -- embeddings, head, loss -- eagerly: blocks of one class and shape share one compiled
    graph, so a deep model compiles in the time of one block and a rank re-allocation recompiles one
    block's graph; transformers' KV cache is off unless a call asks for it, so layers share a graph at any
    depth.  The blocks stay compiled when the model is called outside the step.  regional=False, or a
    model without repeated blocks, compiles forward and loss as one graph: slower to compile, slightly
    faster per step.

    mode is torch.compile's (e.g. "reduce-overhead" for backend="inductor": CUDA Graphs; backend "comera"
    records them on CUDA by default).  autocast (e.g. torch.bfloat16) runs forward and loss under
    ``torch.autocast`` on the model's device type; backward and the optimizer step run outside it.

    rank_adaptive: a RankAdaptive whose ``step(loss)`` runs after the optimizer step and zero_grad, with the
    detached loss, eagerly: outside every compiled or replayed region, since it may re-allocate the cores
    (``optimizer`` is attached to it if it has none)."""
    from comera_compile.optim import FAST_KEY, prefer_fast_implementation

    if rank_adaptive is not None and rank_adaptive.optimizer is None:
        rank_adaptive.attach(optimizer)   # its cuts must reach the optimizer this step runs
    kwargs: dict[str, Any] = {"options": options} if options else {}
    if mode is not None:
        kwargs["mode"] = mode
    if keep_memory and not any(p.is_cuda for p in model.parameters()):
        keep_freed_memory()
    device_type = next((p.device.type for p in model.parameters()), "cpu")

    def forward_loss(*args: Any) -> torch.Tensor:
        *inputs, target = args
        if autocast is None:
            return loss_fn(model(*inputs), target)
        with torch.autocast(device_type, dtype=autocast):
            return loss_fn(model(*inputs), target)

    blocks = compile_blocks(model, backend=backend, fullgraph=fullgraph, **kwargs) if regional else []
    if blocks:
        fwd = forward_loss
    else:
        fwd = torch.compile(forward_loss, backend=backend, fullgraph=fullgraph, **kwargs)
    state: dict[str, Any] = {}

    def opt_step() -> None:
        if "fn" not in state:
            on_cuda = any(p.is_cuda for g in optimizer.param_groups for p in g["params"])
            use = on_cuda if compile_optimizer is None else compile_optimizer
            if use:   # torch's own kernels, compiled: the groups' marks asking for fused ones go
                for group in optimizer.param_groups:
                    group.pop(FAST_KEY, None)
                state["fn"] = torch.compile(optimizer.step, backend=backend, **kwargs)
            else:
                prefer_fast_implementation(optimizer)
                state["fn"] = optimizer.step
        state["fn"]()

    def step(*args: Any) -> torch.Tensor:
        loss = fwd(*args)
        loss.backward()
        opt_step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach()
        if rank_adaptive is not None:   # eager, after every compiled part of the step has run
            rank_adaptive.step(loss)
        return loss

    return step
