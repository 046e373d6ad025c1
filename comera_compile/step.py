"""A whole training step compiled: ``compile_step`` (forward, loss, backward, optimizer step, zero_grad, and
optionally the RankAdaptive step after them), and ``CudaGraphCaptures``, which counts the CUDA Graph
recordings such a step makes.  The backend itself is comera_compile.backend; the repeated blocks compiled
one by one are comera_compile.regional's.  docs/method.md section 7 has the measurements behind the defaults.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch

from comera_compile import compiled_region
from comera_compile.graphs import HostReadError
from comera_compile.memory import keep_freed_memory
from comera_compile.micro_batches import (accumulate, averaging_processes, check_row_weights, own_gradients, pack,
                                          resolve_weights, unpack)
from comera_compile.regional import compile_blocks
from comera_compile.step_modes import (choose_cuda_graphs, compile_kwargs, compiled_optimizer_step,
                                       without_cuda_graphs)

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


CUDA_GRAPHS = (None, "auto", "compiled", "step", "off")


def compile_step(model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor] | None,
                 optimizer: torch.optim.Optimizer, *, backend: str | Callable = "comera", fullgraph: bool = False,
                 options: dict[str, Any] | None = None, compile_optimizer: bool | None = None,
                 keep_memory: bool = True, regional: bool = True, mode: str | None = None,
                 autocast: torch.dtype | None = None, cuda_graphs: str | None = None, warmup: int = 2,
                 rank_adaptive: "RankAdaptive | None" = None, micro_batches: int = 1,
                 micro_batch_weights: str | None = None,
                 scaler: "torch.amp.GradScaler | None" = None) -> Callable[..., torch.Tensor]:
    """A training step -- forward, loss, backward, optimizer step, zero_grad -- compiled.

    ``step(*inputs, target, **kwargs)`` returns the loss (detached) of ``loss_fn(model(*inputs, **kwargs),
    target)``, a scalar.  loss_fn None: the model computes its loss, as transformers' models do when given
    ``labels``; ``step(*inputs, **kwargs)`` (e.g. ``step(**batch)``) returns ``model(...).loss`` (or the
    output itself where it is a 0-dim tensor).  The forward and loss compile with the backend, and
    AOTAutograd compiles the backward with them.

    compile_optimizer: True compiles the optimizer step too (with the backend, its CUDA Graphs off); the
    default (None) runs it eagerly: param groups left at torch's default implementation are switched to the
    fused one where the optimizer has it, else to foreach (``optim.prefer_fast_implementation``); both
    compute the same update, in a few multi-tensor kernels.  On the CPU compiling a TT model's many small
    tensors costs long and gains nothing over those kernels.
    keep_memory calls ``memory.keep_freed_memory()`` for models on the CPU (process-wide; False leaves
    malloc alone).

    regional (default) compiles each of the model's repeated blocks on its own (``regional.compile_blocks``)
    and runs the rest -- embeddings, head, loss -- eagerly: blocks of one class and shape share one compiled
    graph, so a deep model compiles in the time of one block and a rank re-allocation recompiles one
    block's graph; transformers' KV cache is off in training calls unless one asks for it, so layers share
    a graph at any depth (cc.compile_blocks).  The blocks stay compiled when the model is called outside the
    step.  regional=False, or a model without repeated blocks, compiles forward and loss as one graph:
    slower to compile, slightly faster per step.

    cuda_graphs, for a model on CUDA: "compiled" (the default) replays each compiled graph with Inductor's
    CUDA Graph trees (backend "comera", or mode "reduce-overhead"), the eager parts and the optimizer between
    them launched kernel by kernel; "step" captures the whole step -- forward, loss, backward, optimizer step,
    zero_grad -- as one CUDA graph (``graphs.StepGraph``: static input buffers, a capturable optimizer,
    ``warmup`` calls per input shape before the capture, a new capture after a rank re-allocation, a new
    input shape or a changed optimizer setting) and replays it, one launch per step; "auto" is "step" where
    the step can be captured and "compiled" otherwise, with a warning that says why: an optimizer without
    ``capturable``, DDP or FSDP2, a host read the last warm-up call found, or a setting changed at every
    call (the last two: the blocks recompile once with their own graphs); mode "reduce-overhead" or the
    backend options ``cudagraphs`` or ``profile`` choose "compiled" without one.  "off" launches every
    kernel.  On the CPU every mode but "step" (an error there) runs the same code.  ``step.cuda_graphs`` is
    the mode in effect (None on the CPU) and ``step.graph`` the StepGraph (its captures, replays and
    warm-ups) while that mode is "step".  ``step.last_call_compiled`` says whether the last call compiled
    (a graph dynamo compiled, or a whole-step warm-up, probe or capture) rather than ran steady: what a loop
    that times its steps leaves out of a steady-state median.

    mode is torch.compile's (e.g. "reduce-overhead" for backend="inductor": CUDA Graphs; backend "comera"
    records them on CUDA by default).  autocast (e.g. torch.bfloat16) runs forward and loss under
    ``torch.autocast`` on the model's device type; backward and the optimizer step run outside it.
    scaler: a ``torch.amp.GradScaler`` scaling the loss before backward and stepping the optimizer through it
    (a step whose gradients overflowed is skipped: parameters, optimizer state and rank_adaptive unchanged,
    the scale halved; ``step.skipped`` says so for the last call).  autocast=torch.float16 makes one by
    default, as float16 gradients underflow to zero without it (pass ``GradScaler(enabled=False)`` to go
    without); an optimizer accelerate prepared for fp16 brings its own.  ``step.scaler`` is it, to checkpoint
    its ``state_dict()``.  The scale is read on the host after each step, so the step is not one CUDA graph.

    rank_adaptive: a RankAdaptive whose ``step(loss)`` runs after the optimizer step and zero_grad, with the
    detached loss, eagerly: outside every compiled or replayed region, since it may re-allocate the cores
    (``optimizer`` is attached to it if it has none).  A step built on a DistributedDataParallel wrapper is
    built again after a re-allocation (``ra.on_reallocate``): its next call is an error that says so.

    micro_batches (gradient accumulation): each call's batch is split along its first dimension into this
    many micro-batches, run forward and backward one after another with their gradients added, then one
    optimizer step: the whole batch's update at the activation memory of one micro-batch.  Every tensor
    argument, and every tensor inside a list, tuple or dict argument, must have the batch as its first
    dimension (other arguments go to each micro-batch whole).
    Each micro-batch's loss counts so that the call returns the whole batch's loss and leaves its gradient
    (``micro_batch_weights``): "rows", by its share of the rows, for a loss_fn averaging over rows (or over
    equally many elements per row); "tokens", by its share of the target's entries other than -100 (the
    ignore index), for a token mean such as a masked LM's or a padded batch's; "sum", added as it is, for a
    loss summing over the batch.  None (the default) chooses from loss_fn: "tokens" for nn.CrossEntropyLoss
    or nn.NLLLoss taking the mean (their own ignore_index), "sum" for a torch loss with reduction "sum",
    "rows" for any other function (its first call warns where the target holds -100).  A transformers model
    given ``labels`` (loss_fn None) averages over the label tokens that are not -100, so there each
    micro-batch counts by its share of those (after the causal shift): padded batches too get the whole
    batch's token mean.
    Under DistributedDataParallel or FSDP2 the gradients are reduced once, in the last micro-batch's
    backward; with cuda_graphs="step" all micro-batches are in the one captured graph.  There such a token
    mean counts every process's tokens, as the transformers Trainer does (``average_tokens_across_devices``):
    the gradient of the global batch's token mean, one all-reduce of the counts per call (for a loss_fn's
    "tokens" too); each process's call returns its own batch's token mean."""
    from comera_compile.optim import (FAST_KEY, check_holds, fused_takes_the_scale, loss_scaler,
                                      prefer_fast_implementation, scaled_step)

    if cuda_graphs not in CUDA_GRAPHS:
        raise ValueError(f"cuda_graphs={cuda_graphs!r}: choose one of {CUDA_GRAPHS}")
    if autocast is not None and not (isinstance(autocast, torch.dtype) and autocast.is_floating_point):
        raise ValueError(f"autocast={autocast!r}: give the dtype forward and loss run in, torch.bfloat16 or "
                         f"torch.float16 (None, the default, runs them in the parameters' dtype)")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches!r}: give a whole number >= 1 (1, the default, runs each "
                         f"call's batch at once)")
    weights = resolve_weights(loss_fn, micro_batch_weights)
    check_holds(optimizer, model)
    if rank_adaptive is not None and rank_adaptive.optimizer is None:
        rank_adaptive.attach(optimizer)   # its cuts must reach the optimizer this step runs
    kwargs = compile_kwargs(backend, mode, options)
    on_cuda = _on_cuda(model)
    if keep_memory and not on_cuda:
        keep_freed_memory()
    device_type = next((p.device.type for p in model.parameters()), "cpu")
    scaler = loss_scaler(scaler, autocast, device_type, cuda_graphs, compile_optimizer, optimizer)
    scaling = scaler is not None and scaler.is_enabled()
    chosen = choose_cuda_graphs(cuda_graphs, on_cuda, optimizer, model, backend, kwargs, scaling)
    auto = cuda_graphs == "auto" and chosen == "step"   # may still fall back to "compiled" (fall_back)
    whole = chosen == "step"
    compiled_kwargs = kwargs
    if whole or (chosen == "off" and on_cuda):
        kwargs = without_cuda_graphs(kwargs, backend, chosen)
    if whole:   # refused before anything is compiled or changed
        from comera_compile import graphs as _graphs

        _graphs.check_capturable(optimizer, model)
        capture = _graphs.CudaGraphs(next((p.device for g in optimizer.param_groups for p in g["params"]), None))

    def model_loss(*args: Any, **kw: Any) -> torch.Tensor:
        if loss_fn is None:
            return _loss_of(model(*args, **kw))
        *inputs, target = args
        return loss_fn(model(*inputs, **kw), target)

    def precision() -> contextlib.AbstractContextManager:
        """The forward's autocast region; a captured step casts afresh in every replay: autocast's cache
        would hold the capture's casts."""
        if autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=autocast, cache_enabled=not whole)

    def forward_loss(*flat: Any) -> torch.Tensor:
        args, kw = unpack(flat)
        with precision():
            return model_loss(*args, **kw)

    def forward_outputs(*flat: Any) -> Any:
        """The model's output without the loss (accumulate's micro-batches that hold no token)."""
        args, kw = unpack(flat)
        with precision():
            return model(*(args if loss_fn is None else args[:-1]), **kw)

    def compile_forward(compile_kwargs: dict[str, Any]) -> Callable[..., torch.Tensor]:
        if regional and compile_blocks(model, backend=backend, fullgraph=fullgraph, **compile_kwargs):
            return forward_loss
        owner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        owner.__dict__.setdefault("_comera_compiled_codes", set()).add(forward_loss.__code__)   # drop_stale_graphs
        compiled = torch.compile(forward_loss, backend=backend, fullgraph=fullgraph, **compile_kwargs)
        return compiled_region.watched(compiled, forward_loss, "compile_step's compiled forward and loss", owner)

    fwd = compile_forward(kwargs)
    if compile_optimizer:   # torch's own kernels, compiled: the groups' marks asking for fused ones go
        for group in optimizer.param_groups:
            group.pop(FAST_KEY, None)
        owner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        opt_step = compiled_optimizer_step(optimizer, owner, backend, without_cuda_graphs(kwargs, backend,
                                                                                           "optimizer"))
    else:
        prefer_fast_implementation(optimizer, model)
        opt_step = optimizer.step
        if scaling:
            fused_takes_the_scale(optimizer)

    # processes whose gradients DDP or FSDP2 averages: a token-mean loss counts every process's tokens
    processes = averaging_processes(model) if weights in ("tokens", "labels") else 1

    def forward_backward(*args: Any) -> torch.Tensor:
        """The call's loss, its gradients added to .grad: the whole batch at once, or micro-batch by
        micro-batch; where the model's loss is a token mean, each part weighed by its share of the tokens
        of the batch (of every process's batches, under DDP or FSDP2)."""
        if micro_batches == 1 and processes == 1:
            loss = fwd(*args)
            (scaler.scale(loss) if scaling else loss).backward()
            return loss
        # a graph tree's next replay reuses the memory a backward wrote .grad into: keep a copy between parts
        keep = (lambda: own_gradients(model, owned)) if on_cuda and not whole and chosen != "off" else None
        return accumulate(fwd, args, model, loss_fn, micro_batches, weights, processes,
                          asked=micro_batch_weights is not None, between=keep,
                          scale=scaler.scale if scaling else None, outputs=forward_outputs)

    owned: dict[int, torch.Tensor] = {}   # the .grad copies own_gradients made in this call, by id

    def run(*args: Any) -> torch.Tensor:
        # read before any kernel of this step is queued (a read after backward would hold the optimizer's back)
        before = scaler.get_scale() if scaling else 0.0
        loss = forward_backward(*args)
        owned.clear()
        if scaling:
            step.skipped = scaled_step(scaler, optimizer, before)
        else:
            opt_step()
        optimizer.zero_grad(set_to_none=True)
        # a compiled graph's output lives in CUDA Graph memory that the next step's replay overwrites
        return loss.detach().clone() if on_cuda and not whole else loss.detach()

    inner: Callable[..., torch.Tensor] = run
    graph = None
    never_captured: list[str] = []   # auto: why no call could be captured (a change at every call)
    if whole:
        from comera_compile.graphs import StepGraph
        from comera_compile.rank_adaptive import host_state, rank_adaptive_of

        ra = rank_adaptive if rank_adaptive is not None else rank_adaptive_of(model)
        graph = StepGraph(run, model, optimizer, warmup=warmup, graphs=capture,
                          extra=(lambda: host_state(ra)) if ra is not None else None,
                          never_captured=never_captured.append if auto else None)
        inner = graph

    def fall_back(why: str, fix: str) -> None:
        """cuda_graphs="auto" where the whole step cannot be one graph: say so, and go on as "compiled"."""
        nonlocal whole, fwd, inner
        warnings.warn(f"compile_step(cuda_graphs='auto'): {why}, so it runs with cuda_graphs='compiled' from now "
                      f"on (each compiled graph replayed on its own; the blocks compile once more).  For the "
                      f"faster whole-step graph, {fix}; pass cuda_graphs='compiled' to choose this and silence "
                      f"this warning", stacklevel=3)
        whole, inner = False, run
        fwd = compile_forward(compiled_kwargs)
        step.graph, step.cuda_graphs = None, "compiled"

    from torch._dynamo.utils import counters

    # rows chosen by default for a function of the user's: its first call says so if the target looks padded
    unchecked = loss_fn is not None and micro_batches > 1 and micro_batch_weights is None and weights == "rows"

    def step(*args: Any, **kw: Any) -> torch.Tensor:
        nonlocal unchecked
        if step.stale:
            raise RuntimeError(
                "compile_step: RankAdaptive re-allocated the TT cores (new Parameters), and the "
                "DistributedDataParallel wrapper this step was built on still holds the old ones: build the step "
                "again on a new wrapper after each re-allocation, e.g. in ra.on_reallocate(lambda ra: ...): "
                "step = cc.compile_step(DistributedDataParallel(model), ...)")
        if loss_fn is not None and not args:
            raise TypeError("step(*inputs, target, **kwargs): the last positional argument is loss_fn's target, and "
                            "this call has none; pass it, or build the step with loss_fn=None where the model "
                            "computes its own loss (transformers' models given labels)")
        if unchecked:
            unchecked = False
            check_row_weights(args[-1], micro_batches)
        before = _compile_marks(step.graph, counters)
        try:
            loss = inner(*pack(args, kw))
        except HostReadError as e:
            if not (auto and whole):
                raise
            fall_back(f"the step reads device values on the host ({len(e.reads)} read(s), the first at "
                      f"{e.reads[0]}), which one CUDA graph cannot capture", "move that read out of the step")
            loss = e.loss   # the probing call ran, uncaptured: its step is done
        if never_captured and whole:
            fall_back(f"no call could be captured: {never_captured[0]}",
                      "make a setting changed every step a tensor the graph reads (learning rates: capturable, "
                      "or SGD with fused=True), or change it less often")
        step.last_call_compiled = _compile_marks(step.graph, counters) != before
        if rank_adaptive is not None and not step.skipped:   # eager, after every compiled part of the step
            rank_adaptive.step(loss)
        return loss

    step.graph = graph   # the StepGraph (its captures, replays and warm-ups) while the mode is "step"
    step.cuda_graphs = chosen if on_cuda or whole else None
    step.last_call_compiled = False
    step.scaler, step.skipped, step.stale = scaler, False, False
    if rank_adaptive is not None and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        _stale_after_reallocations(step, rank_adaptive)
    return step


def _stale_after_reallocations(step: Any, ra: Any) -> None:
    """Mark `step` stale at every re-allocation of `ra`'s, from its own steps or from anywhere else
    (load_checkpoint's cut, an explicit ra.cut()): its DDP wrapper holds the old cores from then on."""
    ref = weakref.ref(step)
    handle = ra.on_reallocate(lambda _: setattr(ref(), "stale", True) if ref() is not None else None)
    weakref.finalize(step, handle.remove)


def _compile_marks(graph: Any, counters: dict[str, Any]) -> tuple[int, ...]:
    """What a call that compiles changes: dynamo's count of the graphs it compiled in this process (from its
    `counters`, read afresh: tests clear them), and a whole-step graph's warm-ups and captures."""
    compiled = counters["stats"]["unique_graphs"]
    return (compiled,) if graph is None else (compiled, graph.warmups, graph.captures)


def _on_cuda(model: torch.nn.Module) -> bool:
    return any(p.is_cuda for p in model.parameters())


def _loss_of(output: Any) -> torch.Tensor:
    """The loss a model computed: a 0-dim tensor itself, else the output's ``loss`` (transformers' outputs)."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if loss is None:
        raise ValueError(f"compile_step(model, None, ...): the model returned {type(output).__name__} with no loss; "
                         f"give the call what makes the model compute one (transformers' models: labels=...), or "
                         f"build the step with a loss_fn(output, target) and pass the target last")
    return loss
