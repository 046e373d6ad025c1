"""The whole training step replayed as one CUDA graph: ``StepGraph`` (``compile_step(..., cuda_graphs="step")``).

For each input signature the step first runs as it is (compiled pieces and all) for a few warm-up calls on a
side stream, then one call is captured into a ``torch.cuda.CUDAGraph`` -- forward, loss, backward, optimizer
step and zero_grad -- and from then on a call copies its batch into the graph's static input buffers and
replays the graph: one graph launch per step.  Before every replay StepGraph checks what a captured graph
bakes in -- the optimizer's parameters and state, its hyperparameters, train/eval mode, RankAdaptive's stage
-- and captures anew where any changed (a rank re-allocation, ``optimizer.load_state_dict``, a changed
weight decay), so no graph replays stale parameters.  Learning rates become 0-dim tensors on the device,
which LR schedulers update in place, so a schedule needs no re-capture.

The capture itself is the ``CudaGraphs`` object's; StepGraph's own logic (warm-up, static buffers, the checks,
re-capture) runs on any device with another object of the same three methods, which the CPU tests use.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["StepGraph", "CudaGraphs", "GraphCapture", "HostReadError", "capturing", "check_capturable",
           "make_capturable"]

_CAPTURING = [False]


def capturing() -> bool:
    """True while StepGraph captures a step, or runs the warm-up call that probes it for host reads: code in
    the step must not read device values on the host then (``float(t)``, ``.item()``, a data-dependent
    shape), which a capture forbids and a replay would not repeat."""
    return _CAPTURING[0]


def _stream_capturing() -> bool:   # one function for probe and capture alike: code that reads it sees one object
    return True


@contextlib.contextmanager
def _capturing() -> Iterator[None]:
    """While a step is probed or captured: ``capturing()`` is true, and so is
    ``torch.cuda.is_current_stream_capturing()``, which libraries read to take their capture-safe paths
    (transformers' mask helpers skip their host-side checks): the probe then runs the paths the capture
    will, and a simulated capture on the CPU does too."""
    real = torch.cuda.is_current_stream_capturing
    _CAPTURING[0] = True
    torch.cuda.is_current_stream_capturing = _stream_capturing
    try:
        yield
    finally:
        _CAPTURING[0] = False
        torch.cuda.is_current_stream_capturing = real


class HostReadError(RuntimeError):
    """The probing warm-up call found host reads, so the step was not captured.  The call itself ran: ``loss``
    is its result; ``reads`` says where each read was ("file:line: what")."""

    def __init__(self, message: str, reads: list[str], loss: torch.Tensor) -> None:
        super().__init__(message)
        self.reads, self.loss = reads, loss


class GraphCapture(Protocol):
    """How StepGraph runs warm-up calls, captures a call and replays it (and, if it has ``reset()``, is told
    that every graph it captured was dropped)."""

    def warmup(self, fn: Callable[[], Any]) -> Any: ...

    def capture(self, fn: Callable[[], Any]) -> tuple[Any, Any]: ...

    def replay(self, graph: Any) -> None: ...

    def probe(self, fn: Callable[[], Any]) -> tuple[Any, list[str]]:
        """A warm-up call that also returns where it read device values on the host (optional: without it
        StepGraph captures without probing first)."""


class CudaGraphs:
    """torch.cuda.CUDAGraph as StepGraph uses it: warm-up calls on a side stream (as torch's capture needs),
    captures that share one memory pool (one graph replays at a time), and replays."""

    def __init__(self, device: torch.device | None) -> None:
        if device is None or device.type != "cuda":
            raise ValueError(f"cuda_graphs='step' captures CUDA graphs: the model's parameters are on {device}; "
                             f"move the model to a CUDA device, or leave cuda_graphs at its default")
        self.device = device
        self.pool: Any = None
        self._stream: torch.cuda.Stream | None = None

    def warmup(self, fn: Callable[[], Any]) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            out = fn()
        current.wait_stream(self._stream)
        return out

    def probe(self, fn: Callable[[], Any]) -> tuple[Any, list[str]]:
        """A warm-up call under torch's CUDA sync debug mode: the synchronizing operations it runs (the host
        reads a capture would fail on, and fail for good: a failed capture leaves the process's CUDA state
        unusable) come back as "file:line: message"."""
        before = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = self.warmup(fn)
            finally:
                torch.cuda.set_sync_debug_mode(before)
        reads = [f"{w.filename}:{w.lineno}: {w.message}" for w in seen if "synchroniz" in str(w.message)]
        for w in seen:   # the rest as they would have been shown
            if "synchroniz" not in str(w.message):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return out, reads

    def capture(self, fn: Callable[[], Any]) -> tuple[Any, Any]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out

    def replay(self, graph: Any) -> None:
        graph.replay()

    def reset(self) -> None:
        """The graphs were dropped: the next capture starts a pool of its own."""
        self.pool = None


def check_capturable(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Raise ValueError, saying what to do, where the step cannot be captured as one CUDA graph."""
    name = type(optimizer).__name__
    if not any("capturable" in g for g in optimizer.param_groups) and not isinstance(optimizer, torch.optim.SGD):
        raise ValueError(f"cuda_graphs='step' needs an optimizer whose step can run inside a CUDA graph (torch's "
                         f"optimizers with a 'capturable' option, or SGD); {name} has none, so its step may read "
                         f"device values on the host or keep counters in Python, which a replay would not "
                         f"update.  Use cuda_graphs='compiled' (each compiled graph replayed by Inductor) with it")
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        raise ValueError("cuda_graphs='step' does not capture DistributedDataParallel's gradient all-reduce; use "
                         "cuda_graphs='compiled' for a data-parallel model")
    from .distributed import is_sharded

    if any(is_sharded(p) for p in model.parameters()):
        raise ValueError("cuda_graphs='step' does not capture FSDP2's collectives; use cuda_graphs='compiled' "
                         "for a sharded model")


def make_capturable(optimizer: torch.optim.Optimizer) -> None:
    """Turn the groups' ``capturable`` on (moving existing step counters to their parameter's device) and make
    float learning rates 0-dim tensors on the parameters' device where the implementation reads them there
    (capturable or fused: SGD made fused by compile_step too): LR schedulers fill those in place, so a captured
    step reads each new rate.  Other rates stay floats, checked before each replay."""
    try:
        from torch.optim.optimizer import _get_capturable_supported_devices
        supported = _get_capturable_supported_devices()
    except ImportError:   # a release without the helper: CUDA is the device capturable steps run on
        supported = ["cuda"]
    for group in optimizer.param_groups:
        if not group["params"]:
            continue
        device = group["params"][0].device
        if "capturable" in group and not group["capturable"] and device.type in supported:
            group["capturable"] = True
            for p in group["params"]:
                step = optimizer.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor) and step.device != p.device:
                    optimizer.state[p]["step"] = step.to(device=p.device, dtype=torch.float32)
        # torch reads a tensor rate on the device in its capturable and fused implementations (SGD's
        # single-tensor and foreach ones would read it on the host: a float stays there, checked per replay)
        if isinstance(group.get("lr"), float) and (group.get("capturable") or group.get("fused")):
            group["lr"] = torch.tensor(group["lr"], dtype=torch.float32, device=device)


def _hyper(group: dict[str, Any]) -> tuple:
    """A group's settings as a captured step sees them: tensors by identity, the rest by value."""
    return tuple((k, id(v) if isinstance(v, torch.Tensor) else v) for k, v in group.items() if k != "params")


@dataclass
class _World:
    """What a captured step bakes in besides its static inputs (compared before every replay)."""

    params: list[torch.Tensor]
    firsts: list[int]
    state: Any
    hyper: list[tuple]
    extra: tuple


def _what_changed(old: _World, optimizer: torch.optim.Optimizer, extra: tuple) -> str:
    """The first thing a captured step baked in that differs now, in words (for the warning)."""
    groups = optimizer.param_groups
    params = [p for g in groups for p in g["params"]]
    if len(params) != len(old.params) or any(p is not q for p, q in zip(params, old.params)):
        return "the optimizer's parameters were replaced (a rank re-allocation, or groups added)"
    if [g["params"][0].data_ptr() if g["params"] else 0 for g in groups] != old.firsts:
        return "a parameter's storage moved"
    if optimizer.state is not old.state:
        return "the optimizer's state was replaced (load_state_dict)"
    for i, (before, g) in enumerate(zip(old.hyper, groups)):
        for (key, was), (_, now) in zip(before, _hyper(g)):
            if was != now:
                shown = "" if isinstance(g[key], torch.Tensor) else f" ({was!r} -> {now!r})"
                return f"param group {i}'s {key!r} changed{shown}"
    names = ("train/eval mode", "grad mode")
    for i, (was, now) in enumerate(zip(old.extra, extra)):
        if was != now:
            return f"the {names[i] if i < len(names) else 'rank-adaptive stage'} changed"
    return "what the step baked in changed"


@dataclass
class _Captured:
    graph: Any
    inputs: list[Any]
    loss: torch.Tensor


class StepGraph:
    """``StepGraph(step, model, optimizer)(*batch)``: the training step ``step(*batch)`` (forward, loss,
    backward, optimizer step, zero_grad with set_to_none; returns the detached loss) replayed as one CUDA graph.

    ``warmup`` calls of each new input signature run the step as it is; the next is captured.  ``extra()``,
    if given, returns more of what the step bakes in (RankAdaptive's stage): a change re-captures.  Where
    that changes at every call, so that nothing is ever captured, ``never_captured(why)`` is called once (by
    default a warning that says so).  Counts:
    ``captures`` (graphs captured so far), ``replays``, ``warmups``.  The loss returned is the step's own
    tensor, not the graph's static output, so keeping it across steps is safe."""

    def __init__(self, step: Callable[..., torch.Tensor], model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 warmup: int = 2, graphs: GraphCapture | None = None,
                 extra: Callable[[], tuple] | None = None,
                 never_captured: Callable[[str], None] | None = None) -> None:
        if warmup < 1:
            raise ValueError(f"warmup must be at least 1 (the first call compiles), got {warmup}")
        if graphs is None:
            graphs = CudaGraphs(next((p.device for g in optimizer.param_groups for p in g["params"]), None))
        check_capturable(optimizer, model)
        make_capturable(optimizer)
        self._step, self.model, self.optimizer = step, model, optimizer
        self.warmup, self._graphs_api, self._extra = warmup, graphs, extra or (lambda: ())
        self._graphs: dict[tuple, _Captured] = {}
        self._warm: dict[tuple, int] = {}
        self._world: _World | None = None
        self.captures = self.replays = self.warmups = 0
        self._changes_in_a_row, self._warned, self._many_shapes_said = 0, False, False
        self._never_captured = never_captured or self._warn_never_captured

    def _same_world(self) -> bool:
        w = self._world
        if w is None:
            return False
        groups = self.optimizer.param_groups
        params = itertools.chain.from_iterable(g["params"] for g in groups)
        return (self.optimizer.state is w.state and sum(len(g["params"]) for g in groups) == len(w.params)
                and all(map(operator.is_, params, w.params))
                and [g["params"][0].data_ptr() if g["params"] else 0 for g in groups] == w.firsts
                and [_hyper(g) for g in groups] == w.hyper and self._world_extra() == w.extra)

    def _world_extra(self) -> tuple:
        return (self.model.training, torch.is_grad_enabled(), *self._extra())

    def _new_world(self) -> None:
        make_capturable(self.optimizer)   # a re-allocation's new groups or a loaded state: tensors again
        groups = self.optimizer.param_groups
        self._world = _World([p for g in groups for p in g["params"]],
                             [g["params"][0].data_ptr() if g["params"] else 0 for g in groups],
                             self.optimizer.state, [_hyper(g) for g in groups], self._world_extra())
        self._graphs.clear()   # their memory goes with them
        self._warm.clear()
        reset = getattr(self._graphs_api, "reset", None)
        if reset is not None:
            reset()

    def __call__(self, *args: Any) -> torch.Tensor:
        if not self._same_world():
            self._changed()
            self._new_world()
        else:
            self._changes_in_a_row = 0
        leaves, spec = pytree.tree_flatten(args)   # tensors inside dicts, lists and tuples are inputs too
        key = (spec, *((tuple(a.shape), a.dtype, a.device, a.stride()) if isinstance(a, torch.Tensor) else
                       ("value", a) for a in leaves))
        entry = self._graphs.get(key)
        if entry is None and self._warm.get(key, 0) >= self.warmup:
            entry = self._capture(key, args)
        if entry is None:
            self._warm[key] = self._warm.get(key, 0) + 1
            self.warmups += 1
            probe = getattr(self._graphs_api, "probe", None)
            if probe is None or self._warm[key] < self.warmup:
                return self._graphs_api.warmup(lambda: self._step(*args))
            with _capturing():   # the last warm-up runs as the capture will, and says where it reads the host
                loss, reads = probe(lambda: self._step(*args))
            if reads:
                self._warm[key] = 0
                raise HostReadError(
                    f"cuda_graphs='step': the step reads device values on the host, which a CUDA graph cannot "
                    f"capture (and a failed capture leaves the process's CUDA state unusable), so it was not "
                    f"captured; this call ran uncaptured.  {len(reads)} read(s), the first at {reads[0]}.  "
                    f"Move that read out of the step (or compute it on the device), or use "
                    f"cuda_graphs='compiled'", reads, loss)
            return loss
        for static, a in zip(pytree.tree_leaves(entry.inputs), leaves):
            if isinstance(static, torch.Tensor):
                static.copy_(a, non_blocking=True)
        self._graphs_api.replay(entry.graph)
        self.replays += 1
        return entry.loss.clone()

    def _changed(self) -> None:
        """A change before `warmup` + 1 calls in a row means no call is ever captured: every step then runs
        as a warm-up, uncaptured.  Say so once, naming what changed."""
        if self._world is None:
            return
        self._changes_in_a_row += 1
        if self._changes_in_a_row > self.warmup and not self._warned:
            self._warned = True
            self._never_captured(f"what the captured step bakes in changed at each of the last "
                                 f"{self._changes_in_a_row} calls (last change: "
                                 f"{_what_changed(self._world, self.optimizer, self._world_extra())})")

    @staticmethod
    def _warn_never_captured(why: str) -> None:
        warnings.warn(
            f"cuda_graphs='step': {why}, so no step is captured and each runs uncaptured.  A setting changed "
            f"every step must be a tensor the graph reads: learning rates become one where the optimizer takes "
            f"it (capturable, or SGD with fused=True); otherwise change the setting less often, or use "
            f"cuda_graphs='compiled'", stacklevel=4)

    def _capture(self, key: tuple, args: tuple) -> _Captured | None:
        """Capture the step for this input signature (the capture runs nothing); None where the capture changed
        what it must not (optimizer state created inside it, which every replay would create afresh): then
        the call runs as one more warm-up."""
        inputs = pytree.tree_map_only(torch.Tensor, lambda a: a.detach().clone(), args)
        for p in self._world.params:   # a captured backward must allocate the gradients, not add to them
            p.grad = None
        had_state = set(self.optimizer.state)
        try:
            with _capturing():
                graph, loss = self._graphs_api.capture(lambda: self._step(*inputs))
        except Exception as e:
            raise RuntimeError(
                f"cuda_graphs='step' could not capture the training step ({type(e).__name__}: {e}).  Code in the "
                f"step reads device values on the host (.item(), int(t), a data-dependent shape such as "
                f"torch.unique or nonzero), which a CUDA graph cannot hold: move it out of the step, or use "
                f"cuda_graphs='compiled'.  A failed capture can leave this process's CUDA state unusable") from e
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"the captured step must return the loss tensor, got {type(loss).__name__}")
        created = set(self.optimizer.state) - had_state
        if created or not self._same_world():
            for p in created:   # state the capture made with kernels it did not run: made again by a warm-up
                del self.optimizer.state[p]
            self._new_world()
            return None
        entry = self._graphs[key] = _Captured(graph, inputs, loss)
        self.captures += 1
        self._many_shapes()
        return entry

    def _many_shapes(self) -> None:
        """Say once when more input shapes were captured than torch's own CUDA graph trees capture before they
        warn (``torch._inductor.config.triton.cudagraph_dynamic_shape_warn_limit``, None: never): each new
        shape runs ``warmup`` uncaptured steps before its capture, so shapes that keep changing (batches
        padded to their longest row) leave most steps uncaptured."""
        try:
            from torch._inductor import config as inductor_config

            limit = inductor_config.triton.cudagraph_dynamic_shape_warn_limit
        except (ImportError, AttributeError):   # a torch without the setting: its default
            limit = 8
        if self._many_shapes_said or not limit or len(self._graphs) <= limit:
            return
        self._many_shapes_said = True
        warnings.warn(
            f"cuda_graphs='step' has captured the step for {len(self._graphs)} input shapes, and each new one "
            f"runs {self.warmup} step(s) uncaptured before its capture: pad batches to a few fixed shapes "
            f"(transformers' collators: pad_to_multiple_of=64, or padding='max_length'), or use "
            f"cuda_graphs='compiled'.  torch._inductor.config.triton.cudagraph_dynamic_shape_warn_limit=None "
            f"silences this warning, as it does torch's own", stacklevel=5)
