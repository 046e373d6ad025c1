"""Buffers of the Tempo ops' elementwise loops: slice-sized scratch reused across slices, and the
incoming gradient's own buffer reused for the input gradient when nothing else can see it.

Elementwise work runs in slices of 2^17 (forward: 2^19) elements with reused scratch buffers (fresh memory
costs a page fault per 4 KiB on first touch, as much as the arithmetic), and a backward writes its result
into the incoming gradient's buffer when nothing else can see that buffer.
"""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Callable, Iterator

import torch

__all__ = ["FLOATS", "HALF_FLOATS", "TempoDtypeWarning", "dtype_fallback", "exporting", "traced", "plain_ops",
           "autocast_dtype", "Scratch", "chunks", "forward_chunk", "take_grad", "boxing_supported", "may_box",
           "new_buffer_backward", "boxed_variant", "first_order"]


FLOATS = (torch.float32, torch.float64)
HALF_FLOATS = (torch.bfloat16, torch.float16)
# Elements per slice of the elementwise loops (multiples of 8: whole bytes of bits).  Backward passes, which
# run at the step's memory peak, take smaller slices (less scratch); forward passes larger (fewer ops).
_CHUNK = 1 << 17
_CHUNK_FORWARD = 1 << 19


class TempoDtypeWarning(UserWarning):
    """A Tempo op ran torch's own op, which keeps what it always keeps, because of its input's dtype."""


_WARNED: set[tuple[str, torch.dtype]] = set()


def dtype_fallback(op: str, dtype: torch.dtype, why: str = "it takes float32 and float64") -> None:
    """Warn, once per (op, dtype) and process, that a Tempo op falls back to torch's op at this dtype: the
    pass's summary counts the site as replaced, but it saves nothing there (bf16 autocast or bf16 weights)."""
    if (op, dtype) in _WARNED or torch.compiler.is_compiling():
        return
    _WARNED.add((op, dtype))
    warnings.warn(f"Tempo {op} got {str(dtype).replace('torch.', '')} input and runs torch's own op, which saves "
                  f"for backward what it always saves ({why})", TempoDtypeWarning, stacklevel=3)


def exporting() -> bool:
    """Whether torch.export is tracing: ``torch.compiler.is_exporting()``, read so that every release's dynamo
    sees the truth.  Dynamo of torch 2.11 and 2.12 folds that call to True under any torch.compile; where
    torch keeps the flag it returns (``torch.compiler._is_exporting_flag``, set by torch.export alone), the
    flag is read instead, which dynamo reads as a plain module global (feature detection, not a version
    check)."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else bool(flag)


def traced() -> bool:
    """Whether torch.export or torch.compile is tracing, where the Tempo ops run torch's own ops.  An exported
    program has no use for the saved-tensor tricks.  Under torch.compile, Inductor's partitioner and the
    backend's passes choose what the backward keeps (less than the Tempo ops keep eagerly: docs/method.md
    section 5), and the ops' data-dependent shapes and random draws would break the graph."""
    return exporting() or torch.compiler.is_compiling()


def plain_ops(*tensors: torch.Tensor | None) -> bool:
    """Whether a Tempo op should run torch's own ops: nothing needs a gradient (no_grad, or no input requires
    one), or torch.export or torch.compile is tracing (traced)."""
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)) or traced()


_AUTOCAST_OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"softmax": lambda t: torch.softmax(t, -1)}
_AUTOCAST_DTYPES: dict[tuple[str, str, torch.dtype, torch.dtype], torch.dtype] = {}


def autocast_dtype(op: str, x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast runs `op` (one of _AUTOCAST_OPS) at for input `x`, or None where autocast is off for
    x's device.  Autocast's lists differ by device and release (CUDA runs softmax at float32; the CPU at
    bfloat16 for bfloat16 input), so the answer is read from torch once per setting, on a 1-element tensor."""
    kind = x.device.type
    if not torch.is_autocast_enabled(kind):
        return None
    key = (op, kind, torch.get_autocast_dtype(kind), x.dtype)
    if key not in _AUTOCAST_DTYPES:
        with torch.no_grad():
            _AUTOCAST_DTYPES[key] = _AUTOCAST_OPS[op](torch.ones(1, 1, dtype=x.dtype, device=x.device)).dtype
    return _AUTOCAST_DTYPES[key]


def chunks(n: int, size: int = _CHUNK) -> Iterator[tuple[int, int]]:
    """(start, stop) slices of range(n)."""
    for start in range(0, n, size):
        yield start, min(start + size, n)


def forward_chunk(n: int) -> int:
    """Slice length for a forward loop over n elements: large, but at most a quarter of the tensor (scratch
    buffers a few times the slice would otherwise outweigh what the pass saves on mid-sized tensors)."""
    return max(_CHUNK, min(_CHUNK_FORWARD, (n // 4 + 7) // 8 * 8))


class Scratch:
    """Slice-sized buffers reused across the slices of one call: raw bytes per name, viewed as any dtype,
    so loops run one after another share them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}
        self.counter: torch.Tensor | None = None   # the random stream's word counters (times the constant)

    def get(self, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = n * dtype.itemsize
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1 << 14), dtype=torch.uint8, device=self.device)
            self.buffers[name] = buf
        return buf[:nbytes].view(dtype)


# ---------------------------------------------------------------------------------------------------------
# Gradient buffers: a backward may write its result into the incoming gradient when nothing else can see it


def _ref_counts(t: torch.Tensor) -> tuple[int, ...]:
    """Python and C++ reference counts of t, of its storage and of its base (if t is a view)."""
    base = t._base
    counts = (sys.getrefcount(t), t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata))
    if base is not None:
        counts += (sys.getrefcount(base), base._use_count())
    return counts


def _sole_owner_counts(make: Callable[[], torch.Tensor]) -> tuple[int, ...]:
    """_ref_counts of a tensor referenced by nothing but a local variable, reached as in take_grad."""
    grads = [make()]
    grad = grads.pop()
    return _ref_counts(grad)


def _sole_counts(view: bool) -> tuple[int, ...] | None:
    """The counts of a sole-owned tensor (a view when `view`), measured now: the interpreter's own
    references to a frame's locals can change during a run (after a failed torch.compile, for one), so
    a baseline taken once at import would stop matching.  None without the private APIs."""
    try:
        return _sole_owner_counts((lambda: torch.empty(8).view(2, 4)) if view else (lambda: torch.empty(8)))
    except (AttributeError, RuntimeError, TypeError):
        return None


_REFCOUNTS = _sole_counts(False) is not None   # without them, gradients are never reused (always new)


def take_grad(grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(gradient, buffer for the input gradient) from a boxed backward's gradient list (emptied).

    The buffer is the gradient itself when no one else holds it, its storage or its base (no hook kept
    it, it is not expanded, not shared with another consumer): as autograd's AccumulateGrad steals a
    gradient it owns, this saves a full-size allocation at the backward pass's peak.  Otherwise a new one."""
    grad = grads.pop()
    grads.clear()
    if _REFCOUNTS and grad.is_contiguous() and not grad.requires_grad and \
            _ref_counts(grad) == _sole_counts(grad._base is not None):
        return grad, grad
    grad = grad.contiguous()
    return grad, torch.empty_like(grad)


_BOXING: list[bool] = []   # boxing_supported's answer, once found


def boxing_supported() -> bool:
    """Whether this torch's autograd hands a Function with ``boxed_grads_call = True`` its gradients as a
    list it may take them from (torch 2.13 on).  Found by running one such backward on a one-element tensor
    (feature detection, not a version check), once per process; where it is missing (2.11, 2.12) the Tempo
    ops take their gradients as ordinary arguments and write the input gradient into a new buffer:
    identical results, one more gradient-sized allocation at the backward's peak.  A probe that cannot run
    where it is first asked (inside a tracing mode, say) answers False without settling the question."""
    if _BOXING:
        return _BOXING[0]
    seen: list[type] = []

    class _Probe(torch.autograd.Function):
        boxed_grads_call = True

        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx, *grads):
            seen.append(type(grads[0]))
            return grads[0].pop() if isinstance(grads[0], list) else grads[0]

    try:
        with torch.inference_mode(False), torch.enable_grad():
            x = torch.zeros(1, device="cpu", requires_grad=True)
            _Probe.apply(x).sum().backward()
    except Exception:   # not here: do not box this time, and ask again next time
        return False
    _BOXING.append(seen == [list])
    return _BOXING[0]


def may_box() -> bool:
    """Whether the Functions may take their gradients boxed: where torch supports it (boxing_supported), and
    not under torch.compile or compiled autograd, which do not."""
    if torch.compiler.is_compiling() or not boxing_supported():
        return False
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return not (ca is not None and getattr(ca, "compiled_autograd_enabled", False))


def first_order(backward: Callable[..., tuple]) -> Callable[..., tuple]:
    """A Tempo op's backward, which computes first derivatives only (from saved outputs and bit masks, with
    no graph of its own): under create_graph=True (a double backward, such as a gradient penalty) it raises.
    torch's once_differentiable would not: it misses gradients given as a list (the boxed backward), and
    ``autograd.grad(..., inputs=...)`` can skip its error node, leaving a gradient silently wrong."""

    @functools.wraps(backward)
    def checked(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "a double backward (create_graph=True, e.g. a gradient penalty) reached one of comera's memory-"
                "saving ops (GELU, LayerNorm, dropout or attention from memory=True or cc.tempo), which compute "
                "first derivatives only: compute that loss on the model without them (no memory=True, or the "
                "model before cc.tempo)")
        with torch.no_grad():
            return backward(ctx, *grads)

    return checked


def new_buffer_backward(backward_into: Callable[..., tuple]) -> staticmethod:
    """An autograd Function's backward from ``backward_into(ctx, grad, out)``, which writes the input gradient
    into ``out``: here a new buffer (the gradient arrives unboxed, so its buffer cannot be claimed)."""

    @first_order
    def backward(ctx, grad: torch.Tensor) -> tuple:
        grad = grad.contiguous()
        return backward_into(ctx, grad, torch.empty_like(grad))

    return staticmethod(backward)


def boxed_variant(function: type, backward_into: Callable[..., tuple]) -> type:
    """``function`` taking its gradient boxed: ``backward_into`` writes the input gradient into the incoming
    gradient's own buffer when nothing else holds it (take_grad), else into a new one."""

    @first_order
    def backward(ctx, grads: list[torch.Tensor]) -> tuple:
        return backward_into(ctx, *take_grad(grads))

    return type(f"{function.__name__}Boxed", (function,), {"boxed_grads_call": True, "backward": staticmethod(backward),
                                                          "__module__": function.__module__})

