"""The "comera" torch.compile backend: comera's graph passes, then AOTAutograd + Inductor.

``torch.compile(model, backend="comera")`` works on any model, tensorized or not.  Dynamo inlines the TT
layers' forward, whose contraction order was planned for the traced shapes (a constant at trace time), so
the graph Inductor sees already holds the planned matmuls; TT-layer nodes left as call_module (graphs built
by hand or by torch.fx) are expanded by passes.fx.contraction first.  On CUDA inputs Inductor's CUDA Graph
trees replay the compiled forward and backward with no per-kernel launch cost.  A whole training step is
compiled by comera_compile.step.compile_step; regional compilation is comera_compile.regional.
"""

from __future__ import annotations

import functools
import itertools
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.fx

from comera_compile.memory import keep_freed_memory
from comera_compile.regional import compile_block, compile_blocks, repeated_blocks  # noqa: F401  (their old home)

if TYPE_CHECKING:
    from comera_compile.logs import GraphReport
    from comera_compile.step import CudaGraphCaptures, compile_step  # noqa: F401

# compile_step, CudaGraphCaptures (comera_compile.step), keep_freed_memory (comera_compile.memory),
# repeated_blocks and compile_block (comera_compile.regional) stay importable from here.
__all__ = ["comera_backend", "rewritten_graphs", "OPTIONS", "inductor_config", "batches_siblings", "register",
           "compile_step", "keep_freed_memory", "repeated_blocks", "compile_block", "CudaGraphCaptures"]


def __getattr__(name: str) -> Any:
    # The step's names, from their own module when first asked for (the backend does not use them).
    if name in ("compile_step", "CudaGraphCaptures"):
        from comera_compile import step

        return getattr(step, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Every option the backend takes, with its default and what it does.
OPTIONS: dict[str, tuple[Any, str]] = {
    "cudagraphs": (True, "on CUDA inputs, replay the compiled graphs with CUDA Graphs (Inductor's cudagraph "
                         "trees); ignored on CPU"),
    "contraction": (True, "expand TT-layer call_module nodes into their planned contractions"),
    "inductor": ({}, "extra Inductor config patches, e.g. {'max_autotune': True} (Inductor's config names are also "
                     "taken beside the options here, as torch.compile takes them for Inductor)"),
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
    "batch_siblings": (None, "TT layers that read one input (q, k and v; gate and up) contract it in one GEMM, "
                             "their cores side by side, and their next step as a batched GEMM; the cores' "
                             "products of all layers of one shape batched too (passes.fx.siblings): over 40% "
                             "fewer GEMMs, forward and backward. "
                             "None: on for CUDA inputs, where a TT step's many small GEMMs cost their launches; "
                             "off on CPU, where it measured no faster"),
    "keep_memory": (True, "on CPU inputs, call keep_freed_memory(): glibc's malloc keeps freed buffers for the "
                          "next step instead of faulting their pages in again (process-wide, once)"),
    "profile": (False, "compile each TT layer's part of a graph as a graph of its own, run inside a profiler range "
                       "comera.<kind>[<layer>], so torch.profiler and cc.profile attribute compiled time "
                       "(forward and backward) to each layer; costs the fusion across layer boundaries and, "
                       "on CUDA, CUDA Graphs (every kernel shows): for profiling runs"),
    "memory": (False, "Tempo memory passes (GELU, LayerNorm, RMSNorm, SwiGLU, attention keep less for backward); their "
                      "autograd Functions run eagerly, so the graph then skips Inductor"),
}


def _check_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """The backend's options with their defaults filled in.  Inductor's own config names given beside them
    (``options={"max_autotune": True}``, as torch.compile takes them for Inductor) join the 'inductor'
    patches; a name that is neither is an error listing the valid ones."""
    from torch._inductor import list_options

    if options is not None and not isinstance(options, dict):
        raise TypeError(f"backend 'comera' takes its options as a dict, e.g. options={{'memory': True}}; got "
                        f"{options!r}")
    options = dict(options or {})
    unknown = set(options) - set(OPTIONS)
    config = unknown & set(list_options())
    if unknown - config:
        valid = "; ".join(f"{k} (default {v[0]!r}): {v[1]}" for k, v in OPTIONS.items())
        raise ValueError(f"unknown option(s) {sorted(unknown - config)} for backend 'comera' (not an Inductor config "
                         f"name either); valid options: {valid}")
    if config:
        given = dict(options.get("inductor") or {})
        clash = sorted(k for k in config if k in given and given[k] != options[k])
        if clash:
            raise ValueError(f"options {clash} given twice, beside 'inductor' and inside it, with different values; "
                             f"give each once")
        options["inductor"] = {**given, **{k: options.pop(k) for k in config}}
    out = {k: v[0] for k, v in OPTIONS.items()}
    out.update(options)
    flags = ("cudagraphs", "contraction", "fast_dropout", "recompute_materialized", "materialize_casts",
             "keep_memory", "memory", "profile")
    if not all(isinstance(out[k], bool) for k in flags):
        raise TypeError(f"options {', '.join(repr(k) for k in flags)} take True or False")
    if not (out["batch_siblings"] is None or isinstance(out["batch_siblings"], bool)):
        raise TypeError("option 'batch_siblings' takes None (on for CUDA inputs), True or False")
    if not isinstance(out["inductor"], dict):
        raise TypeError("option 'inductor' takes a dict of Inductor config patches")
    return out


def _devices(example_inputs: Sequence[Any]) -> set[str]:
    return {x.device.type for x in example_inputs if isinstance(x, torch.Tensor)}


def inductor_config(devices: set[str], mode: str | None, options: dict[str, Any] | None) -> dict[str, Any]:
    """The Inductor config patches the backend passes for inputs on these device types.

    CUDA Graphs go on for CUDA inputs unless options or a "-no-cudagraphs" mode say otherwise (CoMERA
    replays whole steps).  The
    torch.compile mode's own settings come first, options' 'inductor' patches next; with fast_dropout the
    mask-recompute joint-graph pass runs after any joint_custom_pre_pass already set (chained into one pass,
    which every torch release takes).  Functions of ours and torch's that AOTAutograd's cache would refuse
    are marked cacheable (_cache_marks), beside any the user marked."""
    from torch._inductor import config as inductor

    opts = _check_options(options)
    patches: dict[str, Any] = {}
    if mode is not None and mode != "default":
        from torch._inductor import list_mode_options

        patches.update(list_mode_options(mode))
    no_graphs = mode is not None and mode.endswith("no-cudagraphs")   # as torch's own modes of that name say
    patches["triton.cudagraphs"] = bool(opts["cudagraphs"] and not opts["profile"] and not no_graphs
                                        and "cuda" in devices)
    patches.update(opts["inductor"])
    if opts["fast_dropout"]:
        from comera_compile.passes.joint.chain import chain_joint_passes
        from comera_compile.passes.joint.recompute import RecomputeHashMasks

        user = patches.get("joint_custom_pre_pass", inductor.joint_custom_pre_pass)
        patches["joint_custom_pre_pass"] = chain_joint_passes(user, RecomputeHashMasks())
    if hasattr(inductor, "unsafe_marked_cacheable_functions"):
        marked = patches.get("unsafe_marked_cacheable_functions", inductor.unsafe_marked_cacheable_functions)
        patches["unsafe_marked_cacheable_functions"] = {**marked, **_cache_marks(opts["fast_dropout"])}
    return patches


def _cache_marks(fast_dropout: bool) -> dict[str, str]:
    """Functions in the graphs the backend compiles that AOTAutograd's cache does not know to be safe, marked
    cacheable so that a graph holding one is served from the cache instead of traced again in every process
    and every run: torch's own autocast enter/exit (what they do is set by their arguments, constants in the
    graph; keyed by torch's version), and with fast_dropout hash_dropout's functions (keyed by a hash of
    their source)."""
    from torch.amp import autocast_mode

    marks = {f"{f.__module__}.{f.__name__}": f"torch-{torch.__version__}"
             for f in (getattr(autocast_mode, name, None) for name in ("_enter_autocast", "_exit_autocast"))
             if f is not None}
    if fast_dropout:
        from comera_compile.ops.hash_dropout import cache_marks

        marks.update(cache_marks())
    return marks


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
    report.layers = tt_contractions(gm)   # each layer's own steps, before siblings share their GEMMs
    if batches_siblings(opts, _devices(example_inputs)):
        from comera_compile.passes.fx.siblings import batch_siblings

        ran("batch_siblings", batch_siblings(gm, example_inputs))
    return gm, report


def batches_siblings(options: dict[str, Any] | None, devices: set[str]) -> bool:
    """Whether the backend runs passes.fx.siblings on a graph with inputs on these device types: the option
    batch_siblings where set, else on CUDA only; never with the Tempo passes (they run eagerly) or per-layer
    profiling (which wants each layer's GEMMs apart)."""
    opts = _check_options(options)
    wanted = "cuda" in devices if opts["batch_siblings"] is None else opts["batch_siblings"]
    return wanted and not opts["memory"] and not opts["profile"]


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


_CAPTURES = itertools.count()


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

    def call(*a: Any, **kw: Any) -> Any:
        return model(*a, **kw)

    # dynamo keeps a capture's graph on the code object it starts at: a code object of this call's own (dropped
    # with it), not the model's forward, where every capture would count toward dynamo's recompile limit
    # until the model itself ran eagerly under torch.compile
    call.__code__ = call.__code__.replace(co_name=f"rewritten_graphs_{next(_CAPTURES)}")
    buffers = [(b, b.detach().clone()) for b in model.buffers()] if isinstance(model, torch.nn.Module) else []
    tensors = [*(model.parameters() if isinstance(model, torch.nn.Module) else ()), *args, *kwargs.values()]
    cuda = sorted({t.device.index or 0 for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda})
    with torch.random.fork_rng(devices=cuda):   # dropout draws: the user's generator states stay as they were
        torch.compile(call, backend=capture)(*args, **kwargs)
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
    check of the CPU's vector ISAs (a test library built and loaded) and the precompiled header of the code
    it generates: the kernels' header, by building a one-line kernel the way generated code does, or with
    Inductor's C++ wrapper (cpp_wrapper) the wrapper's header, a different one.  Both then run while
    AOTAutograd traces the graph; Inductor finds them cached (docs/method.md section 7: seconds saved)."""
    import threading

    threading.Thread(target=_warm_cpu_compiler, args=(cpp_wrapper,), name="comera-warm-cpu-compiler",
                     daemon=True).start()


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
