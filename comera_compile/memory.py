"""Memory figures that work on any device, CPU included: bytes saved for backward, and peak live tensor bytes.

CPU PyTorch keeps no allocator counters, so both figures are counted from the tensors themselves, and each
storage is counted once however many tensors (views, a tensor saved by two ops) point into it.

- ``SavedTensors`` / ``saved_bytes``: what autograd keeps for the backward pass, seen through
  ``torch.autograd.graph.saved_tensors_hooks``.  Custom autograd Functions count too, for what they pass to
  ``ctx.save_for_backward`` (tensors stashed as plain ctx attributes are invisible to autograd and to this).
- ``PeakMemory`` / ``peak_bytes``: the live bytes of every tensor created while active, and their peak, seen
  through a ``TorchDispatchMode`` (every aten op, forward and backward); storages are followed with weak
  references, so a tensor counts from the op that allocates it until its memory is freed.  Tensors that
  existed before (parameters, inputs) are not counted, nor are views of them.

And one setting for CPU training: ``keep_freed_memory`` (glibc's malloc keeps freed buffers for the next step;
compile_step and the backend's keep_memory option call it).

Example::

    from comera_compile.memory import saved_bytes, peak_bytes
    saved = saved_bytes(model, x, exclude=model)            # activations only: parameters left out
    def step():
        model(x).sum().backward()
    peak = peak_bytes(step)                                  # activations, gradients and temporaries
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["SavedTensors", "saved_bytes", "PeakMemory", "peak_bytes", "storage_key", "keep_freed_memory"]

_Key = tuple[str, int, int]


def storage_key(t: torch.Tensor) -> tuple[_Key, int]:
    """(identity of t's storage, its size in bytes): tensors sharing memory share the key."""
    try:
        st = t.untyped_storage()
        return (t.device.type, t.device.index or 0, st.data_ptr()), st.nbytes()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage of their own
        return ("id", 0, id(t)), t.element_size() * t.numel()


class _Held:
    """What the pack hook hands autograd in place of a saved tensor: alive exactly as long as autograd keeps
    the tensor for a backward pass (the tensor itself may live on elsewhere, e.g. as a forward output)."""

    __slots__ = ("tensor", "version", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.version = tensor._version

    def unpack(self) -> torch.Tensor:
        """The tensor, after autograd's own check (which saved-tensor hooks switch off) that it was not
        modified in place since it was saved."""
        if self.tensor._version != self.version:
            raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an "
                               f"inplace operation: a tensor of shape {tuple(self.tensor.shape)} is at version "
                               f"{self.tensor._version}; expected version {self.version} instead")
        return self.tensor


def _excluded_keys(exclude: Iterable[torch.Tensor | nn.Module] | torch.Tensor | nn.Module) -> set[_Key]:
    if isinstance(exclude, (torch.Tensor, nn.Module)):
        exclude = [exclude]
    keys = set()
    for item in exclude:
        if isinstance(item, nn.Module):
            tensors = [*item.parameters(), *item.buffers()]
        elif isinstance(item, torch.Tensor):
            tensors = [item]
        else:
            raise TypeError(f"exclude takes tensors and nn.Modules (whose parameters and buffers are left "
                            f"out), got {type(item).__name__}")
        keys.update(storage_key(t)[0] for t in tensors)
    return keys


class SavedTensors:
    """Context manager: the tensors autograd saves for backward while it is active, each storage once.

    ``bytes`` counts the storages that are still held for a backward pass (saved by a graph that is alive),
    so read it while the forward's outputs are alive.  Storages of the tensors (or of the parameters and
    buffers of the modules) in `exclude` are left out: pass the model to count activations only."""

    def __init__(self, exclude: Iterable[torch.Tensor | nn.Module] | torch.Tensor | nn.Module = ()) -> None:
        self._exclude = _excluded_keys(exclude)
        self._entries: dict[_Key, tuple[int, list[weakref.ref], str]] = {}
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def _pack(self, t: torch.Tensor) -> _Held:
        held = _Held(t)
        key, nbytes = storage_key(t)
        if key not in self._exclude:
            entry = self._entries.get(key)
            if entry is None or not any(r() is not None for r in entry[1]):
                # A new storage, or memory freed and reused since: start afresh.
                entry = (nbytes, [], f"{tuple(t.shape)} {t.dtype}")
                self._entries[key] = entry
            entry[1].append(weakref.ref(held))
        return held

    def __enter__(self) -> SavedTensors:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _Held.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def _live(self) -> list[tuple[int, str]]:
        return [(n, desc) for n, refs, desc in self._entries.values() if any(r() is not None for r in refs)]

    @property
    def bytes(self) -> int:
        """Bytes of the distinct storages currently held for backward."""
        return sum(n for n, _ in self._live())

    @property
    def storages(self) -> int:
        """Number of distinct storages currently held for backward."""
        return len(self._live())

    def breakdown(self) -> list[tuple[str, int]]:
        """(shape and dtype of the first tensor saved from it, bytes) per live storage, largest first."""
        return sorted(((desc, n) for n, desc in self._live()), key=lambda e: -e[1])


def saved_bytes(fn: Callable[..., Any], *args: Any,
                exclude: Iterable[torch.Tensor | nn.Module] | torch.Tensor | nn.Module = (),
                **kwargs: Any) -> int:
    """Bytes autograd holds for backward after ``fn(*args, **kwargs)`` (each storage once), leaving out the
    storages of `exclude` (tensors, or modules: their parameters and buffers).  fn's output is dropped."""
    with SavedTensors(exclude) as saved:
        out = fn(*args, **kwargs)
        nbytes = saved.bytes
    del out
    return nbytes


class PeakMemory(TorchDispatchMode):
    """Dispatch mode counting the live bytes of tensors created while it is active, and their peak.

    Every aten op's outputs are inspected; an output whose storage is new (not shared with the op's inputs
    and not already known) is counted until that storage is freed.  ``current``: bytes live now; ``peak``:
    the most live at once since entering (or since ``reset_peak``); ``allocated``: all bytes ever counted."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self.allocated = 0
        self._live: dict[_Key, tuple[int, weakref.ref]] = {}
        self._lock = threading.Lock()

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now."""
        self.peak = self.current

    def _freed(self, key: _Key, ref: weakref.ref) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is not None and entry[1] is ref:
                del self._live[key]
                self.current -= entry[0]

    def _track(self, t: torch.Tensor, input_keys: set[_Key]) -> None:
        key, nbytes = storage_key(t)
        if key in input_keys or key[0] == "id":
            return
        with self._lock:
            entry = self._live.get(key)
            if entry is not None and entry[1]() is not None:
                if entry[0] != nbytes:  # resized in place (an out= op growing its output)
                    self.current += nbytes - entry[0]
                    self.allocated += max(0, nbytes - entry[0])
                    self._live[key] = (nbytes, entry[1])
            else:
                if entry is not None:  # freed, its callback not run yet: the memory was reused
                    self.current -= entry[0]
                ref = weakref.ref(t.untyped_storage(), lambda r, k=key: self._freed(k, r))
                self._live[key] = (nbytes, ref)
                self.current += nbytes
                self.allocated += nbytes
            self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat_in, _ = tree_flatten((args, kwargs))
        input_keys = {storage_key(a)[0] for a in flat_in if isinstance(a, torch.Tensor)}
        out = func(*args, **kwargs)
        flat_out, _ = tree_flatten(out)
        for t in flat_out:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self._track(t, input_keys)
        return out


def peak_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Peak live bytes of the tensors created by ``fn(*args, **kwargs)`` (each storage once, counted from
    allocation to release), e.g. of a whole training step; tensors existing before the call do not count."""
    with PeakMemory() as mode:
        fn(*args, **kwargs)
    return mode.peak


_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3   # glibc's mallopt parameters


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory in the process for reuse, as CUDA's caching allocator does on
    GPUs: buffers up to 32 MB come from the heap instead of fresh mmaps, and the heap is not trimmed back
    to the OS.  A CPU training step frees and re-allocates the same activations every step; by default
    each large buffer is a new mapping whose pages fault in again (docs/method.md section 7 has the cost).
    Process-wide; resident memory stays at the high-water mark.  Returns whether it applied (False off
    glibc); applied once per process."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return all(libc.mallopt(param, value) == 1 for param, value in (
            (_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, 256 << 20)))
    except (OSError, AttributeError):
        return False
