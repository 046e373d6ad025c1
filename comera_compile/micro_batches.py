"""A training step's call as compile_step runs it: its positional and keyword arguments as one flat tuple
(``pack``), that tuple split into micro-batches along the batch dimension (``split_batch``) and run forward
and backward one after another (``accumulate``), each weighed as its loss needs (``resolve_weights``): by
rows, added up, or by its share of the tokens of a token mean (``token_counts``: a loss_fn's target, or a
transformers model's labels, ``label_counts``; of every process's tokens under DDP or FSDP2,
``tokens_everywhere``), the gradient reduction of DDP and FSDP2 held back until the last micro-batch
(``gradient_sync_off``), and the gradients kept out of memory a CUDA graph replay reuses between
micro-batches (``own_gradients``).  The step itself is comera_compile.step's; docs/method.md section 7 says
why the batch is split inside the call."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch._dynamo.eval_frame import OptimizedModule
from torch.utils import _pytree as pytree

from comera_compile.graphs import capturing

__all__ = ["pack", "unpack", "named", "split_batch", "label_counts", "weigh", "averaging_processes", "averaging_group",
           "tokens_everywhere", "gradient_sync_off", "own_gradients", "WEIGHTS", "resolve_weights", "token_counts",
           "accumulate", "check_row_weights"]

IGNORE_INDEX = -100   # transformers' label for a position no loss counts (and F.cross_entropy's default)
WEIGHTS = (None, "rows", "tokens", "sum")   # compile_step's micro_batch_weights


def _mean_ignoring(loss_fn: Any) -> int | None:
    """The index a loss module averages around: an nn.CrossEntropyLoss or nn.NLLLoss taking the mean, without
    class weights, averages over its target's entries other than its ignore_index; None for any other."""
    if isinstance(loss_fn, (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)) and loss_fn.reduction == "mean" \
            and loss_fn.weight is None:
        return loss_fn.ignore_index
    return None


def resolve_weights(loss_fn: Any, weights: str | None) -> str:
    """How compile_step weighs its micro-batches' losses: "rows" (each by its share of the rows), "tokens" (by
    its share of the target entries a token mean counts), "labels" (a transformers model's own loss, loss_fn
    None: by its share of the label tokens, else by rows) or "sum" (added as they are).  None chooses: "sum"
    for a torch loss module that sums, "tokens" for nn.CrossEntropyLoss / nn.NLLLoss taking the mean, "labels"
    without a loss_fn, else "rows".  A choice that cannot be right for loss_fn is a ValueError."""
    if weights not in WEIGHTS:
        raise ValueError(f"micro_batch_weights={weights!r}: choose 'rows' (a loss averaging over rows), 'tokens' (a "
                         f"mean over the target entries other than {IGNORE_INDEX}), 'sum' (a loss summing over the "
                         f"batch) or None (chosen from loss_fn)")
    reduction = getattr(loss_fn, "reduction", None) if isinstance(loss_fn, torch.nn.Module) else None
    if reduction == "sum" and weights in ("rows", "tokens") or reduction == "mean" and weights == "sum":
        raise ValueError(f"micro_batch_weights={weights!r} with {type(loss_fn).__name__}(reduction={reduction!r}): "
                         f"the loss {'sums' if reduction == 'sum' else 'averages'}, so its micro-batches "
                         f"{'add up as they are' if reduction == 'sum' else 'weigh by their share'}; leave "
                         f"micro_batch_weights at None")
    if weights == "tokens" and getattr(loss_fn, "weight", None) is not None:
        raise ValueError(f"micro_batch_weights='tokens' with {type(loss_fn).__name__}(weight=...): a class-weighted "
                         f"mean divides by the weights of the targets, not by their count, which the micro-batches "
                         f"cannot weigh; use micro_batches=1, or reduction='sum' and divide by the weights yourself")
    if weights is not None:
        return "labels" if weights == "tokens" and loss_fn is None else weights
    if loss_fn is None:
        return "labels"
    if reduction == "sum":
        return "sum"
    return "tokens" if _mean_ignoring(loss_fn) is not None else "rows"


def accumulate(fwd: Callable[..., torch.Tensor], flat: tuple[Any, ...], model: torch.nn.Module, loss_fn: Any,
               micro_batches: int, weights: str, processes: int = 1, asked: bool = False,
               between: Callable[[], None] | None = None,
               scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
               outputs: Callable[..., Any] | None = None) -> torch.Tensor:
    """Forward and backward of a call's packed arguments `flat` in `micro_batches` parts, gradients added to
    .grad; returns the whole batch's loss (detached).  ``fwd(*part)`` is a part's loss; each counts by
    `weights` (resolve_weights), a token mean against every process's tokens where `processes` (DDP's or
    FSDP2's, whose reduction waits for the last part) average the gradients.  ``between()`` runs after each
    backward but the last; `asked`: the user chose the weighting (token_counts' errors); ``scale(loss)`` is what
    each backward starts from (a GradScaler's scaled loss); ``outputs(*part)`` is a part's model output
    without the loss (for a part without tokens under DDP or FSDP2, see _zero_backward)."""
    parts = split_batch(flat, micro_batches, lambda i: named(flat, i)) if micro_batches > 1 else [(flat, 1.0)]
    counts = token_counts(model, loss_fn, weights, [unpack(part) for part, _ in parts], asked=asked)
    tokens = torch.stack(counts).sum() if counts is not None else None
    # DDP or FSDP2 averages `processes` gradients: each counts its tokens against every process's
    spread = tokens is not None and processes > 1
    empty = [False] * len(parts)   # parts whose written-out token mean is 0/0 and that still run (spread)
    if counts is not None and weights == "tokens" and _mean_ignoring(loss_fn) is None:
        if spread and outputs is not None:   # every process runs every part: collectives stay paired
            empty = _without_tokens(counts)
        elif len(parts) > 1:
            parts, counts = _parts_with_tokens(parts, counts)
    everywhere = tokens_everywhere(tokens, averaging_group(model)) if spread else None
    total = None
    for i, (part, share) in enumerate(parts):
        last = i == len(parts) - 1
        with contextlib.nullcontext() if last else gradient_sync_off(model):
            if empty[i]:
                mean = _zero_backward(outputs(*part))
                total = mean if total is None else total + mean
                continue
            loss = fwd(*part)
            mean = weigh(loss, counts[i], tokens) if counts is not None else (   # this process's
                loss if weights == "sum" else loss * share)
            part_loss = weigh(loss, counts[i] * processes, everywhere) if spread else mean
            (part_loss if scale is None else scale(part_loss)).backward()
        if not last and between is not None:
            between()
        total = mean.detach() if total is None else total + mean.detach()
    return total


def _parts_with_tokens(parts: list, counts: list[torch.Tensor]) -> tuple[list, list[torch.Tensor]]:
    """The micro-batches that hold tokens (all, where none does), where the host may read their counts.  A
    token mean written as a function divides by zero on a part without tokens, and 0/0's backward is NaN
    whatever weight the part gets; the part's share is zero, so leaving it out is the whole batch's
    gradient.  One host read per call; none while a CUDA graph is captured or the step compiled, where such
    a part stays in (the whole-step graph cannot skip one)."""
    empty = _without_tokens(counts)
    if not any(empty) or all(empty):
        return parts, counts
    return [p for p, e in zip(parts, empty) if not e], [c for c, e in zip(counts, empty) if not e]


def _without_tokens(counts: list[torch.Tensor]) -> list[bool]:
    """Which parts hold no token, in one host read (none while a CUDA graph is captured or the step
    compiled: there every part runs its loss)."""
    if capturing() or torch.compiler.is_compiling() or \
            (counts[0].is_cuda and torch.cuda.is_current_stream_capturing()):
        return [False] * len(counts)
    return torch.stack(counts).eq(0).tolist()


def _zero_backward(output: Any) -> torch.Tensor:
    """A backward of zeros from every output of the model that needs a gradient, for a part whose share of a
    token mean is nothing: under DDP or FSDP2 every process must run as many forwards and backwards as the
    others (their collectives pair up), and the part's own loss, 0/0, would send NaN into the reduced
    gradients whatever weight it got.  Returns the part's share of the loss, zero."""
    leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    if leaves:
        torch.autograd.backward(leaves, [torch.zeros_like(t) for t in leaves])
    first = next((t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()),
                 None)
    if first is None:
        return torch.zeros(())
    return torch.zeros((), dtype=torch.promote_types(first.dtype, torch.float32), device=first.device)


def check_row_weights(target: Any, micro_batches: int) -> None:
    """Warn where micro-batches weighed by rows by default meet a target holding -100, a token mean's ignore
    index: a loss_fn averaging over the other entries would get another gradient than the whole batch's.
    compile_step calls it at its first call only (one host read, before anything is captured)."""
    if isinstance(target, torch.Tensor) and not target.is_floating_point() and bool(target.eq(IGNORE_INDEX).any()):
        warnings.warn(f"compile_step(micro_batches={micro_batches}) weighs each micro-batch's loss by its share of "
                      f"the rows, and the target holds {IGNORE_INDEX} entries (an ignore index): if loss_fn "
                      f"averages over the other entries (a token mean, as cross-entropy over padding is), pass "
                      f"micro_batch_weights='tokens' for the whole batch's gradient; if it averages over rows, "
                      f"pass micro_batch_weights='rows' to silence this", stacklevel=3)


def token_counts(model: torch.nn.Module, loss_fn: Any, weights: str, calls: list[tuple[tuple, dict]],
                 asked: bool) -> list[torch.Tensor] | None:
    """Each micro-batch's count of the tokens its token-mean loss averages over, from its (args, kwargs): the
    target's entries (the last positional argument) other than loss_fn's ignore index (-100 for a plain
    function) under "tokens", the label tokens under "labels"; None to weigh by rows.  Device tensors: nothing
    is read on the host.  ``asked``: the user asked for "tokens", so a call without them is an error."""
    if weights == "labels":
        counts = label_counts(model, [kw for _, kw in calls])
        if counts is None and asked:
            raise ValueError("compile_step(micro_batch_weights='tokens') without a loss_fn counts a transformers "
                             "model's label tokens, and this model is not one or the call passes no labels "
                             "tensor; give a loss_fn (its target is counted), or micro_batch_weights='rows'")
        return counts
    if weights != "tokens":
        return None
    ignore = _mean_ignoring(loss_fn)
    ignore = IGNORE_INDEX if ignore is None else ignore
    counts = []
    for args, _ in calls:
        target = args[-1] if args else None
        if (not isinstance(target, torch.Tensor) or target.dim() == 0) and not asked:
            return None
        if not isinstance(target, torch.Tensor) or target.dim() == 0:
            raise ValueError(f"compile_step(micro_batch_weights='tokens') counts the target's entries other than "
                             f"{ignore}, and this call's target (its last positional argument) is "
                             f"{type(target).__name__ if not isinstance(target, torch.Tensor) else 'a 0-dim tensor'}"
                             f": pass the target as a tensor with the batch first, or micro_batch_weights='rows'")
        counts.append(target.ne(ignore).sum())
    return counts


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
    differ by at most one row), each with its share of the rows.  Tensors inside lists, tuples and dicts (a
    target ``{"labels": y, "weights": w}``) are split as the arguments are; every tensor of one or more
    dimensions must have the batch (the first such tensor's rows) as its first dimension; anything else goes
    to every micro-batch whole.  ``name(i)`` says how argument i was passed, for the errors."""
    leaves, spec = pytree.tree_flatten_with_path(args)
    where = [name(path[0].idx) + pytree.keystr(path[1:]) for path, _ in leaves]
    leaves = [leaf for _, leaf in leaves]
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, Mapping) and any(isinstance(v, torch.Tensor) for v in leaf.values()):
            raise ValueError(f"compile_step(micro_batches={parts}) splits tensors inside dicts, lists and tuples, "
                             f"and {where[i]} is a {type(leaf).__name__} holding tensors, which it cannot look "
                             f"inside: pass dict(...) of it, or its items as keyword arguments (**batch)")
    batched = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor) and a.dim() > 0]
    if not batched:
        raise ValueError(f"compile_step(micro_batches={parts}) splits the call's tensors along their first "
                         f"dimension, and this call has none: pass the batch as tensors, or micro_batches=1")
    rows = leaves[batched[0]].shape[0]
    for i in batched:
        if leaves[i].shape[0] != rows:
            raise ValueError(f"compile_step(micro_batches={parts}) splits every tensor argument along its first "
                             f"dimension, the batch, but {where[i]} has shape {tuple(leaves[i].shape)} against "
                             f"{rows} rows in {where[batched[0]]}: give every tensor argument the batch first, "
                             f"or reach the others from the model or loss_fn instead of passing them")
    if rows < parts:
        raise ValueError(f"compile_step(micro_batches={parts}) got a batch of {rows} row(s), fewer than the "
                         f"micro-batches: give at least {parts} rows, or fewer micro-batches")
    pieces = {i: torch.tensor_split(leaves[i], parts) for i in batched}
    return [(pytree.tree_unflatten([pieces[i][k] if i in pieces else a for i, a in enumerate(leaves)], spec),
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
    where it has none, whose mean is NaN (a NaN the loss's own backward makes there still flows: accumulate
    leaves such parts out, or runs them without their loss, _zero_backward)."""
    wide = torch.promote_types(loss.dtype, torch.float32)   # a 16-bit dtype rounds counts (bf16) or overflows
    share = count.to(wide) / total.to(wide)
    weighed = (loss.to(wide) * share).to(loss.dtype)
    return torch.where(count > 0, weighed, torch.zeros((), dtype=loss.dtype, device=loss.device))


def averaging_processes(model: torch.nn.Module) -> int:
    """How many processes' gradients the model's wrapper averages (DistributedDataParallel's process group,
    FSDP2's mesh), else 1."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel) and not _fsdp2_modules(model):
        return 1
    return dist.get_world_size(averaging_group(model))


def averaging_group(model: torch.nn.Module) -> Any:
    """The process group whose gradients the model's wrapper averages: DistributedDataParallel's, a 1-D FSDP2
    mesh's, else None (the default group: a 2-D mesh's reduction spans it)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.process_group
    for module in _fsdp2_modules(model):
        for p in module.parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None:
                return mesh.get_group() if mesh.ndim == 1 else None
    return None


def tokens_everywhere(tokens: torch.Tensor, group: Any = None) -> torch.Tensor:
    """The label tokens of every averaging process's batch (`group`'s, averaging_group), summed: one
    all-reduce on the device, nothing read on the host."""
    import torch.distributed as dist

    total = tokens.clone()
    dist.all_reduce(total, group=group)
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
