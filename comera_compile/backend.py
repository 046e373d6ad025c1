"""The "comera" torch.compile backend: comera's graph passes, then AOTAutograd + Inductor.

``torch.compile(model, backend="comera")`` works on any model, tensorized or not.  Dynamo inlines the TT
layers' forward, whose contraction order was planned for the traced shapes (a constant at trace time), so
the graph Inductor sees already holds the planned matmuls; TT-layer nodes left as call_module (graphs built
by hand or by torch.fx) are expanded by passes.fx.contraction first.  On CUDA inputs Inductor's CUDA Graph
trees replay the compiled forward and backward with no per-kernel launch cost.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.fx

from comera_compile.regional import compile_block, compile_blocks, repeated_blocks

if TYPE_CHECKING:
    from comera_compile.logs import GraphReport

__all__ = ["comera_backend", "rewritten_graphs", "OPTIONS", "inductor_config", "compile_step", "register", "keep_freed_memory",
           "repeated_blocks", "compile_block", "CudaGraphCaptures"]

# Every option the backend takes, with its default and what it does.
OPTIONS: dict[str, tuple[Any, str]] = {
    "cudagraphs": (True, "on CUDA inputs, replay the compiled graphs with CUDA Graphs (Inductor's cudagraph "
                         "trees); ignored on CPU"),
    "contraction": (True, "expand TT-layer call_module nodes into their planned contractions"),
    "inductor": ({}, "extra Inductor config patches, e.g. {'max_autotune': True}"),
    "fast_dropout": (True, "dropout masks from an integer hash of the element index computed inside Inductor's "
                           "kernels (ops.hash_dropout) instead of a per-element draw from torch's generator: same "
                           "distribution, different bits, several times cheaper; the backward recomputes "
                           "the masks from two saved words instead of saving them"),
    "recompute_materialized": (True, "AOTAutograd's partitioner may recompute a cheap pointwise result in the "
                                     "backward even where the backward needs it materialized, e.g. a LayerNorm's "
                                     "output that the next layer's weight gradient reads (functorch's "
                                     "ban_recompute_materialized_backward off): less memory kept for backward"),
    "materialize_casts": (True, "integer -> float casts (attention masks) computed once into a buffer "
                                "(passes.fx.materialize) instead of inside every kernel they are broadcast into"),
    "keep_memory": (True, "on CPU inputs, call keep_freed_memory(): glibc's malloc keeps freed buffers for the "
                          "next step instead of faulting their pages in again (process-wide, once)"),
    "profile": (False, "compile each TT layer's part of a graph as a graph of its own, run inside a profiler range "
                       "comera.<kind>[<layer>], so torch.profiler and cc.profile attribute compiled time "
                       "(forward and backward) to each layer; costs the fusion across layer boundaries and, "
                       "on CUDA, CUDA Graphs (every kernel shows): for profiling runs"),
    "memory": (False, "Tempo memory passes (GELU, LayerNorm, attention keep less for backward); their "
                      "autograd Functions run eagerly, so the graph then skips Inductor"),
}


def _check_options(options: dict[str, Any] | None) -> dict[str, Any]:
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        valid = "; ".join(f"{k} (default {v[0]!r}): {v[1]}" for k, v in OPTIONS.items())
        raise ValueError(f"unknown option(s) {unknown} for backend 'comera'; valid options: {valid}")
    out = {k: v[0] for k, v in OPTIONS.items()}
    out.update(options)
    flags = ("cudagraphs", "contraction", "fast_dropout", "recompute_materialized", "materialize_casts",
             "keep_memory", "memory", "profile")
    if not all(isinstance(out[k], bool) for k in flags):
        raise TypeError(f"options {', '.join(repr(k) for k in flags)} take True or False")
    if not isinstance(out["inductor"], dict):
        raise TypeError("option 'inductor' takes a dict of Inductor config patches")
    return out


def _devices(example_inputs: Sequence[Any]) -> set[str]:
    return {x.device.type for x in example_inputs if isinstance(x, torch.Tensor)}


def inductor_config(devices: set[str], mode: str | None, options: dict[str, Any] | None) -> dict[str, Any]:
    """The Inductor config patches the backend passes for inputs on these device types.

    CUDA Graphs go on for CUDA inputs unless options say otherwise (CoMERA replays whole steps).  The
    torch.compile mode's own settings come first, options' 'inductor' patches next; with fast_dropout the
    mask-recompute joint-graph pass runs after any joint_custom_pre_pass already set (chained into one pass,
    which every torch release takes)."""
    opts = _check_options(options)
    patches: dict[str, Any] = {}
    if mode is not None and mode != "default":
        from torch._inductor import list_mode_options

        patches.update(list_mode_options(mode))
    patches["triton.cudagraphs"] = bool(opts["cudagraphs"] and not opts["profile"] and "cuda" in devices)
    patches.update(opts["inductor"])
    if opts["fast_dropout"]:
        from torch._inductor import config as inductor

        from comera_compile.passes.joint.chain import chain_joint_passes
        from comera_compile.passes.joint.recompute import RecomputeHashMasks

        user = patches.get("joint_custom_pre_pass", inductor.joint_custom_pre_pass)
        patches["joint_custom_pre_pass"] = chain_joint_passes(user, RecomputeHashMasks())
    return patches


def _run_passes(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: dict[str, Any],
                then: str) -> tuple[torch.fx.GraphModule, "GraphReport"]:
    """comera's fx passes on dynamo's graph, as the options say; the graph they leave and a report of what
    each did (the code after each stage, the TT layers' contraction steps)."""
    from comera_compile.logs import GraphReport, listing, tt_contractions

    report = GraphReport(gm, tuple(sorted(_devices(example_inputs))), _compile_id(), then=then)
    report.stages.append(("dynamo", listing(gm)))

    def ran(name: str, result: Any) -> None:
        report.passes[name] = result.count
        if result.modified:   # an unchanged graph is not listed again
            report.stages.append((name, listing(result.graph_module)))

    if opts["contraction"]:
        from comera_compile.passes.fx.contraction import expand_contractions

        ran("contraction", expand_contractions(gm, example_inputs))
    if opts["memory"]:
        from comera_compile.passes.fx.tempo import tempo_graph

        result = tempo_graph(gm, example_inputs)
        ran("tempo", result)
        gm = report.graph_module = result.graph_module
    else:
        if opts["fast_dropout"]:
            from comera_compile.passes.fx.dropout import fast_dropout

            ran("fast_dropout", fast_dropout(gm, example_inputs))
        if opts["materialize_casts"]:
            from comera_compile.passes.fx.materialize import materialize_int_casts

            ran("materialize_casts", materialize_int_casts(gm, example_inputs))
    report.layers = tt_contractions(gm)
    return gm, report


def _compile_id() -> str | None:
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
        return None if cid is None else str(cid)
    except Exception:   # outside dynamo, or a release without compile ids: the report goes without one
        return None


def comera_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
                   options: dict[str, Any] | None = None) -> Callable:
    """torch.compile backend: comera's passes on the dynamo graph, then Inductor's compile_fx.  What the
    passes did goes to torch's logs when asked (comera_compile.logs: TORCH_LOGS, TORCH_TRACE)."""
    from comera_compile.logs import emit

    opts = _check_options(options)
    devices = _devices(example_inputs)
    on_cpu = devices == {"cpu"}
    if on_cpu and opts["keep_memory"]:
        keep_freed_memory()
    gm, report = _run_passes(gm, example_inputs, opts, then="eager (Tempo ops)" if opts["memory"] else "Inductor")
    emit(report)
    if opts["memory"]:
        compiled: Callable = lambda part, inputs: part.forward
    else:
        from torch._functorch import config as functorch_config
        from torch._inductor import config as inductor
        from torch._inductor.compile_fx import compile_fx

        patches = inductor_config(devices, mode, options)
        if on_cpu:
            _warm_cpu_compiler_early(bool(patches.get("cpp_wrapper", inductor.cpp_wrapper)))

        def compiled(graph: torch.fx.GraphModule, inputs: Sequence[Any]) -> Callable:
            # AOTAutograd partitions the joint graph inside this call, under this setting.
            with functorch_config.patch(ban_recompute_materialized_backward=not opts["recompute_materialized"]):
                return compile_fx(graph, list(inputs), config_patches=patches)

    if opts["profile"]:
        from comera_compile.profiling import split_by_layer

        return split_by_layer(gm, compiled)
    return compiled(gm, example_inputs)


def rewritten_graphs(model: Callable[..., Any], *args: Any, options: dict[str, Any] | None = None,
                     **kwargs: Any) -> list["GraphReport"]:
    """The graphs torch.compile(model, backend="comera") would hand Inductor for model(*args, **kwargs),
    after comera's passes, one GraphReport per graph dynamo captures (a graph break makes several): its
    code after each pass (``report.stages``), its TT layers' contraction steps with FLOPs (``report.layers``)
    and ``str(report)`` to print.  Works for any model dynamo can capture, transformers models included.
    Runs the model once, eagerly after the capture (nothing goes to Inductor); its buffers and torch's
    random state are restored afterwards, so the model is left as it was."""
    opts = _check_options(options)
    reports: list = []

    def capture(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        gm, report = _run_passes(gm, example_inputs, opts, then="(captured: not compiled)")
        reports.append(report)
        return gm.forward

    buffers = [(b, b.detach().clone()) for b in model.buffers()] if isinstance(model, torch.nn.Module) else []
    with torch.random.fork_rng(devices=[]):   # dropout draws: the user's generator state stays as it was
        torch.compile(model, backend=capture)(*args, **kwargs)
    with torch.no_grad():   # e.g. BatchNorm's running statistics, updated by a forward in training mode
        for buf, saved in buffers:
            buf.copy_(saved)
    return reports


_WARM_KERNEL = ('#include <torch/csrc/inductor/cpp_prefix.h>\n'
                'extern "C" void kernel(float* out_ptr0) { out_ptr0[0] = 0.0f; }\n')


def _warm_cpu_compiler(cpp_wrapper: bool) -> None:
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codecache import CppWrapperCodeCache
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    try:
        valid_vec_isa_list()
        if cpp_wrapper:   # loading the module would build it; asking for it builds only its header
            CppWrapperCodeCache.load_async(_WARM_KERNEL, "cpu", needs_vec_isa=True)
        else:
            AsyncCompile().cpp_pybinding(["float*"], _WARM_KERNEL)
    except Exception:  # a head start only: Inductor's own build reports any real failure
        pass


@functools.cache
def _warm_cpu_compiler_early(cpp_wrapper: bool) -> None:
    """Start, on a thread, what Inductor's first CPU graph waits for on a cold cache: its once-per-process
    check of the CPU's vector ISAs (a test library built and loaded, about 2 s) and the precompiled header
    of the code it generates (about 6 s more): the kernels' header, by building a one-line kernel the way
    generated code does, or with Inductor's C++ wrapper (cpp_wrapper) the wrapper's header, a different
    one.  Both then run while AOTAutograd traces the graph; Inductor finds them cached."""
    import threading

    threading.Thread(target=_warm_cpu_compiler, args=(cpp_wrapper,), name="comera-warm-cpu-compiler",
                     daemon=True).start()


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


def register() -> None:
    """Make backend="comera" available.  When the package is installed, dynamo finds the backend through
    its torch_dynamo_backends entry point and registers it on first use (registering here as well would
    collide); otherwise (running from a source tree) register it directly."""
    from importlib.metadata import entry_points

    if entry_points(group="torch_dynamo_backends", name="comera"):
        return   # checked first: importing dynamo's registry costs more than the rest of the package
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if "comera" not in _COMPILER_FNS:
        register_backend(name="comera")(comera_backend)


_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3   # glibc's mallopt parameters


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory in the process for reuse, as CUDA's caching allocator does on
    GPUs: buffers up to 32 MB come from the heap instead of fresh mmaps, and the heap is not trimmed back
    to the OS.  A CPU training step frees and re-allocates the same activations every step; by default
    each large buffer is a new mapping whose pages fault in again (about a fifth of a six-encoder step
    here).  Process-wide; resident memory stays at the high-water mark.  Returns whether it applied
    (False off glibc); applied once per process."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return all(libc.mallopt(param, value) == 1 for param, value in (
            (_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, 256 << 20)))
    except (OSError, AttributeError):
        return False


def compile_step(model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor],
                 optimizer: torch.optim.Optimizer, *, backend: str | Callable = "comera", fullgraph: bool = False,
                 options: dict[str, Any] | None = None, compile_optimizer: bool | None = None,
                 keep_memory: bool = True, regional: bool = True, mode: str | None = None,
                 autocast: torch.dtype | None = None) -> Callable[..., torch.Tensor]:
    """A training step -- forward, loss, backward, optimizer step, zero_grad -- compiled.

    ``step(*inputs, target)`` returns the loss (detached); loss_fn(output, target) -> scalar.  The forward
    and loss compile with the backend, and AOTAutograd compiles the backward with them.  The optimizer
    step compiles too when compile_optimizer is True; the default (None) does so on CUDA, where it joins
    the CUDA Graph replay, and not on CPU, where Inductor spends minutes on the per-parameter code of a
    TT model's hundreds of small tensors for no faster a step than the optimizer's own foreach kernels.
    Run eagerly, param groups left at torch's default implementation (on CPU a Python loop over the
    parameters, several times slower for a TT model's hundreds of small tensors) are switched to the
    fused one where the optimizer has it (``group["fused"] = True``: Adam, AdamW, SGD, Adagrad), else to
    the multi-tensor one (``group["foreach"] = True``); both compute the same update.
    keep_memory calls keep_freed_memory() for models on the CPU (process-wide; False leaves malloc alone).

    regional (default) compiles each of the model's repeated blocks on its own (regional.compile_blocks:
    transformers' KV cache off unless a call asks for it, so layers share a graph at any depth) and runs the rest -- embeddings, head, loss -- eagerly: blocks of one class and shape
    share one compiled graph, so a six-layer encoder compiles in the time of one layer (about a third of
    the whole-step compile's time here) and a rank re-allocation recompiles one block's graph.  The blocks
    stay compiled when the model is called outside the step.  regional=False, or a model without repeated
    blocks, compiles forward and loss as one graph: minutes for a deep model, a few percent faster per
    step at small batches.

    mode is torch.compile's (e.g. "reduce-overhead" for backend="inductor": CUDA Graphs; backend "comera"
    records them on CUDA by default).  autocast (e.g. torch.bfloat16) runs forward and loss under
    ``torch.autocast`` on the model's device type, as mixed-precision training does; backward and the
    optimizer step run outside it."""
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
            if use:
                state["fn"] = torch.compile(optimizer.step, backend=backend, **kwargs)
            else:
                from comera_compile.optim import prefer_fast_implementation

                prefer_fast_implementation(optimizer)
                state["fn"] = optimizer.step
        state["fn"]()

    def step(*args: Any) -> torch.Tensor:
        loss = fwd(*args)
        loss.backward()
        opt_step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step
