"""A training step's call as compile_step runs it: its positional and keyword arguments as one flat tuple
(``pack``), that tuple split into micro-batches along the batch dimension (``split_batch``), each weighed by
its share of the label tokens where a transformers model computes a token-mean loss (``label_counts``; of
every process's tokens under DDP or FSDP2, ``tokens_everywhere``), the gradient reduction of DDP and FSDP2
held back until the last micro-batch (``gradient_sync_off``), and the gradients kept out of memory a CUDA
graph replay reuses between micro-batches (``own_gradients``).  The step itself is
comera_compile.step's; docs/method.md section 7 says why the batch is split inside the call."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch._dynamo.eval_frame import OptimizedModule

__all__ = ["pack", "unpack", "named", "split_batch", "label_counts", "weigh", "averaging_processes",
           "tokens_everywhere", "gradient_sync_off", "own_gradients"]

IGNORE_INDEX = -100   # transformers' label for a position no loss counts


def pack(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """A call's positional and keyword arguments as one flat tuple, ``(names, *args, *values)``: what the
    compiled forward, the whole-step graph (which keys its captures on the names) and the micro-batch split
    take."""
    return (tuple(kwargs), *args, *kwargs.values())


def unpack(flat: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    names, rest = flat[0], flat[1:]
    cut = len(rest) - len(names)
    return rest[:cut], dict(zip(names, rest[cut:]))


def named(flat: tuple[Any, ...], i: int) -> str:
    """How the user passed flat argument i: 'argument k' (positional) or 'keyword argument name'."""
    names, positional = flat[0], len(flat) - 1 - len(flat[0])
    return f"argument {i - 1}" if i - 1 < positional else f"keyword argument {names[i - 1 - positional]!r}"


def split_batch(args: tuple[Any, ...], parts: int,
                name: Callable[[int], str] = lambda i: f"argument {i}") -> list[tuple[tuple[Any, ...], float]]:
    """``args`` split along the first dimension into ``parts`` micro-batches (as ``torch.tensor_split``: sizes
    differ by at most one row), each with its share of the rows.  Every tensor of one or more dimensions must
    have the batch (the first such tensor's rows) as its first dimension; other arguments go to every
    micro-batch whole.  ``name(i)`` says how argument i was passed, for the errors."""
    batched = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.dim() > 0]
    if not batched:
        raise ValueError(f"compile_step(micro_batches={parts}) splits the call's tensors along their first "
                         f"dimension, and this call has none: pass the batch as tensors, or micro_batches=1")
    rows = args[batched[0]].shape[0]
    for i in batched:
        if args[i].shape[0] != rows:
            raise ValueError(f"compile_step(micro_batches={parts}) splits every tensor argument along its first "
                             f"dimension, the batch, but {name(i)} has shape {tuple(args[i].shape)} against "
                             f"{rows} rows in {name(batched[0])}: give every tensor argument the batch first, "
                             f"or reach the others from the model or loss_fn instead of passing them")
    if rows < parts:
        raise ValueError(f"compile_step(micro_batches={parts}) got a batch of {rows} row(s), fewer than the "
                         f"micro-batches: give at least {parts} rows, or fewer micro-batches")
    pieces = {i: torch.tensor_split(args[i], parts) for i in batched}
    return [(tuple(pieces[i][k] if i in pieces else a for i, a in enumerate(args)),
             pieces[batched[0]][k].shape[0] / rows) for k in range(parts)]


def label_counts(model: torch.nn.Module, calls: list[dict[str, Any]]) -> list[torch.Tensor] | None:
    """How many label tokens a transformers model's own loss averages over in each micro-batch's keyword
    arguments: the ``labels`` other than -100, each row's first left out where the loss shifts them (causal
    LMs, as transformers' Trainer counts), or the ``shift_labels`` given.  Device tensors, so weighing the
    micro-batches by them reads nothing on the host.  None (weigh by rows) where the model is not
    transformers' or a call has no labels tensor."""
    inner = model
    while isinstance(inner, (torch.nn.parallel.DistributedDataParallel, OptimizedModule)):
        inner = inner.module if isinstance(inner, torch.nn.parallel.DistributedDataParallel) else inner._orig_mod
    if not any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(inner).__mro__):
        return None
    shifts = _loss_shifts_labels(inner)
    counts = []
    for kw in calls:
        labels = kw.get("shift_labels", kw.get("labels"))
        if not isinstance(labels, torch.Tensor) or labels.dim() == 0:
            return None
        if shifts and "shift_labels" not in kw:
            labels = labels[..., 1:]
        counts.append(labels.ne(IGNORE_INDEX).sum())
    return counts


def _loss_shifts_labels(model: torch.nn.Module) -> bool:
    """Whether a transformers model's loss predicts label i+1 from position i (a decoder-only causal LM)."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:   # transformers before its loss module: the causal LMs shift in their own forward
        return type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))
    return getattr(model, "loss_function", None) is ForCausalLMLoss


def weigh(loss: torch.Tensor, count: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """A micro-batch's token-mean loss times its share ``count / total`` of the batch's label tokens; zero
    (and no gradient) where it has none, whose mean is NaN."""
    share = count.to(loss.dtype) / total.to(loss.dtype)
    return torch.where(count > 0, loss * share, torch.zeros((), dtype=loss.dtype, device=loss.device))


def averaging_processes(model: torch.nn.Module) -> int:
    """How many processes' gradients the model's wrapper averages (DistributedDataParallel's process group,
    or the default group for FSDP2), else 1."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return dist.get_world_size(model.process_group)
    return dist.get_world_size() if _fsdp2_modules(model) else 1


def tokens_everywhere(tokens: torch.Tensor) -> torch.Tensor:
    """The label tokens of every process's batch, summed: one all-reduce on the device, nothing read on the
    host."""
    import torch.distributed as dist

    total = tokens.clone()
    dist.all_reduce(total)
    return total


@contextlib.contextmanager
def gradient_sync_off(model: torch.nn.Module) -> Any:
    """No gradient reduction across processes inside the block: DistributedDataParallel's ``no_sync``, or
    FSDP2's ``set_requires_gradient_sync(False)`` on each of its sharded modules (set back on after).  A
    model of one process runs as it is."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
        return
    sharded = _fsdp2_modules(model)
    for m in sharded:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for m in sharded:
            m.set_requires_gradient_sync(True, recurse=False)


def _fsdp2_modules(model: torch.nn.Module) -> list[Any]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:   # a torch built without distributed
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def own_gradients(model: torch.nn.Module, owned: dict[int, torch.Tensor]) -> None:
    """Each parameter's .grad replaced by a copy the step owns, once per tensor (``owned`` holds the copies
    by id): the next micro-batch's backward then adds into memory no CUDA graph replay overwrites."""
    for p in model.parameters():
        g = p.grad
        if g is not None and id(g) not in owned:
            p.grad = g.clone()
            owned[id(p.grad)] = p.grad
