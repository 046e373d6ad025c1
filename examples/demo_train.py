"""The demo's training loop: seeded masked batches, held-out evaluation, and ``train_one``, which trains
one model on a wall-clock (or step) budget and records its curve, step times, compile time and memory.

Used by comera_compile.examples.code_mlm (configuration, models, the run itself).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from comera_compile.examples.code_data import mask_batch
from comera_compile.examples.demo_dist import World, agree, autocast_dtype, skipped_in_a_row, wrap
from comera_compile.examples.demo_report import step_figures
from comera_compile.micro_batches import accumulate, pack, unpack
from comera_compile.optim import scaled_step

if TYPE_CHECKING:
    from comera_compile.examples.code_mlm import DemoConfig

__all__ = ["Data", "batches", "evaluate", "train_one", "encoder_params", "total_params"]


def encoder_params(model: nn.Module) -> int:
    """Parameters of the encoder layers (attention and FFN, their LayerNorms included)."""
    return sum(p.numel() for p in model.layers.parameters())


def total_params(model: nn.Module) -> int:
    """Every parameter of the model."""
    return sum(p.numel() for p in model.parameters())


@dataclass
class Data:
    """Token blocks for training, fixed masked batches for held-out evaluation, and the ids that matter."""

    train: torch.Tensor  # (n, seq_len)
    heldout: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (inputs, positions, labels) batches
    vocab_size: int
    mask_id: int


def batches(data: Data, cfg: DemoConfig) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Masked training batches in a seeded order (a fresh permutation every epoch): the same sequence for
    every model trained with the same config."""
    g = torch.Generator().manual_seed(cfg.seed)
    n = data.train.shape[0]
    while True:
        order = torch.randperm(n, generator=g)
        for i in range(0, n - cfg.batch + 1, cfg.batch):
            yield mask_batch(data.train[order[i: i + cfg.batch]], g, data.mask_id, data.vocab_size)


@torch.no_grad()
def evaluate(model: nn.Module, data: Data) -> dict[str, float]:
    """Held-out MLM loss (mean cross-entropy) and accuracy over every masked position, eagerly."""
    was_training = model.training
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    with torch.compiler.set_stance("force_eager"):
        for inputs, positions, labels in data.heldout:
            logits = model(inputs, positions).reshape(-1, data.vocab_size)
            flat = labels.reshape(-1)
            loss_sum += float(F.cross_entropy(logits, flat, reduction="sum"))
            correct += int((logits.argmax(dim=-1) == flat).sum())
            count += flat.numel()
    model.train(was_training)
    return {"loss": loss_sum / count, "accuracy": correct / count, "masked_tokens": count}


def _mlm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Mean cross-entropy over the masked positions (labels elsewhere are ignored, -100)."""
    return F.cross_entropy(logits.reshape(-1, vocab_size), labels.reshape(-1))


def _task_loss(model: nn.Module, inputs: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor,
               vocab_size: int) -> torch.Tensor:
    return _mlm_loss(model(inputs, positions), labels, vocab_size)


def _peak_step_bytes(model: nn.Module, batch: tuple[torch.Tensor, ...], vocab_size: int,
                     autocast: Callable[[], ContextManager] = contextlib.nullcontext) -> int:
    """Peak tracked tensor memory of one eager forward + backward (gradients included), in bytes, with the
    forward under `autocast` as the training steps' (bf16 activations are half fp32's)."""
    from comera_compile.memory import peak_bytes

    def step() -> None:
        with autocast():
            loss = _task_loss(model, *batch, vocab_size)
        loss.backward()

    with torch.compiler.set_stance("force_eager"):
        peak = peak_bytes(step)
    model.zero_grad(set_to_none=True)
    return peak


def rss_bytes() -> int | None:
    """The process's resident memory now (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _active_encoder_params(model: nn.Module, ra: Any) -> int:
    """Encoder parameters counting only the active rank slices of the TT layers (what a cut leaves)."""
    allocated_cores = sum(m.spec.core_params() for m in ra.layers.values())
    return encoder_params(model) - allocated_cores + ra.size()


class _EagerStep:
    """The eager step as compile_step's callable looks: step(*batch) -> loss, with .skipped (fp16: the loss
    scaler skipped the optimizer step).  The flag lives on this object, not on the step function, which then
    holds no reference to itself: a self-referencing closure is a cycle that keeps the model, its optimizer
    state and its gradients alive after the run, until the garbage collector happens to run."""

    def __init__(self, step: Callable[..., tuple[torch.Tensor, bool]]) -> None:
        self.step, self.skipped = step, False

    def __call__(self, *batch: torch.Tensor) -> torch.Tensor:
        loss, self.skipped = self.step(*batch)
        return loss


def train_one(name: str, model: nn.Module, cfg: DemoConfig, data: Data, dense_encoder: int,
              eval_steps: tuple[int, ...] = (), world: World = World()) -> dict[str, Any]:
    """Train `model` for cfg's budget (minutes and/or steps); returns its history and figures.

    name "comera": the model is tensorized, RankAdaptive runs at its defaults and the encoder layers compile
    with backend "comera" (one compiled layer serves them all).  Otherwise the dense model trains with
    cfg.dense_lr, eagerly or compiled by cfg.dense_backend.  Held-out evaluations run at cfg.evals equal
    marks of the budget and at eval_steps (the other model's step count, for a comparison at equal steps);
    the clock stops while they run.  With several processes (`world`), each trains on its rows of every
    global batch with the model wrapped by DDP or FSDP2, and the figures are every process's alike."""
    import comera_compile as cc
    from tqdm.auto import tqdm

    comera = name == "comera"
    ra = None
    device = next(model.parameters()).device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    forward = wrap(model, world)  # the module a step calls (FSDP2 shards `model` itself, before compiling)
    if comera:
        opt = torch.optim.AdamW(cc.param_groups(model, lr=cfg.lr, weight_decay=0.0))
        ra = cc.RankAdaptive(model, target_ratio=cfg.target_ratio, cut_every=cfg.cut_every, optimizer=opt)
        start_tt = ra.size()
        backend = "comera" if cfg.compile else None
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.dense_lr, weight_decay=0.0)
        backend = None if cfg.dense_backend == "eager" else cfg.dense_backend
    warm = max(1, cfg.warmup_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    # forward and loss under autocast with --precision bf16 or fp16; backward and the optimizer step outside it,
    # fp16's through a GradScaler (compile_step's own, or the eager step's)
    dtype = autocast_dtype(cfg.arithmetic())
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype is not None else contextlib.nullcontext
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # the task loss: RankAdaptive's penalty works by its proximal step, and ra.loss() would only add its value
        return _mlm_loss(logits, labels, data.vocab_size)

    def make_step() -> Callable[..., Any]:
        """cc.compile_step: the encoder layers compiled one by one (one compiled layer serves them all) and,
        on one GPU, the whole step replayed as one CUDA graph where it can be ("auto"); or an eager step.
        Either runs each step's rows in cfg.micro_batches forward and backward passes."""
        if backend is not None:
            graphs = "auto" if device.type == "cuda" and world.size == 1 else None
            # FSDP2's hooks around each layer are not traced: a graph break there, the layer compiled between
            sharded = world.size > 1 and world.parallel == "fsdp"
            # every block predicts as many masked tokens (mask_batch), so micro-batches weigh by rows
            return cc.compile_step(forward, loss_fn, opt, backend=backend, fullgraph=not sharded, autocast=dtype,
                                   cuda_graphs=graphs, micro_batches=cfg.micro_batches, scaler=scaler)

        def part_loss(*flat: Any) -> torch.Tensor:
            (inputs, positions, labels), _ = unpack(flat)
            with autocast():
                return loss_fn(forward(inputs, positions), labels)

        def eager(inputs: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, bool]:
            scale = scaler.scale if scaler is not None else (lambda loss: loss)
            before = scaler.get_scale() if scaler is not None else 0.0   # read before the step's kernels queue
            if cfg.micro_batches > 1:   # the accumulation compile_step runs, uncompiled
                loss = accumulate(part_loss, pack((inputs, positions, labels), {}), forward, loss_fn,
                                  cfg.micro_batches, "rows", scale=scale)
            else:
                loss = part_loss(*pack((inputs, positions, labels), {}))
                scale(loss).backward()
            skipped = False
            if scaler is None:
                opt.step()
            else:
                skipped = scaled_step(scaler, opt, before)
            opt.zero_grad(set_to_none=True)
            return loss.detach(), skipped

        return _EagerStep(eager)

    step_fn = make_step()

    budget = cfg.minutes * 60.0 if cfg.minutes is not None else None
    # cfg.evals marks of each budget given; an evaluation each time the run passes its next mark of either, so a
    # run ended by its step cap before its time (or the reverse) is evaluated cfg.evals times all the same
    time_marks = [budget * (i + 1) / cfg.evals for i in range(cfg.evals)] if budget is not None else []
    cap_marks = ([max(1, round(cfg.steps * (i + 1) / cfg.evals)) for i in range(cfg.evals)]
                 if cfg.steps is not None else [])
    marks_passed = 0
    step_marks = set(eval_steps)   # the other model's step count: a comparison at equal steps
    history: dict[str, list] = {"step": [], "time_s": [], "loss": [], "step_time_s": [], "active_tt_params": [],
                                "encoder_compression": []}
    evals: list[dict[str, Any]] = []
    stream = batches(data, cfg)
    first_batch = None
    elapsed = 0.0  # training seconds: wall time with the held-out evaluations left out
    start_encoder = encoder_params(model)
    compile_steps: list[int] = []  # steps that compiled (0-based): the first ones, those after a re-allocation
    rss_start = rss_bytes()
    rss_peak = rss_start or 0
    total = cfg.steps if budget is None else None
    bar = tqdm(total=total if total is not None else round(budget), desc=f"{name:>6}",
               disable=not (cfg.progress and world.main),
               dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 10.0, file=sys.stderr,
               unit="step" if total is not None else "s")

    def active_tt() -> int:
        return ra.size() if ra is not None else 0

    def record_eval(step: int) -> None:
        e = evaluate(model, data)
        enc = _active_encoder_params(model, ra) if ra is not None else encoder_params(model)
        evals.append({"step": step, "time_s": elapsed, **e, "active_tt_params": active_tt(),
                      "encoder_params": enc})

    model.train()
    rows = world.rows(cfg.batch)
    step = skips = skipped_steps = 0   # skips: steps the loss scaler skipped in a row (fp16)
    while (cfg.steps is None or step < cfg.steps) and (budget is None or elapsed < budget):
        step += 1
        inputs, positions, labels = (t[rows].to(device, non_blocking=True) for t in next(stream))
        if first_batch is None:   # its first micro-batch: what one forward and backward hold at once
            first_batch = tuple(t[:t.shape[0] // cfg.micro_batches] for t in (inputs, positions, labels))
        sync()
        t0 = time.perf_counter()
        task = step_fn(inputs, positions, labels)
        compiled = getattr(step_fn, "last_call_compiled", False)   # compiled, probed or captured: not steady
        skipped = step_fn.skipped   # fp16: the loss scaler skipped the optimizer step (gradients overflowed)
        skips = skipped_in_a_row(skipped, skips, name)
        skipped_steps += skipped
        if not skipped:   # the schedules count optimizer steps, as accelerate's wrapper counts them
            sched.step()
        reallocated = ra.step(task) if ra is not None and not skipped else False   # the task loss feeds the late stage
        if reallocated and forward is not model:
            forward = wrap(model, world)  # DDP holds the replaced Parameters: a new wrapper and step
            step_fn = make_step()
        sync()   # on CUDA the step's time is its device work's
        dt, step_loss = agree(world, time.perf_counter() - t0, float(task))
        elapsed += dt
        if compiled:
            compile_steps.append(step - 1)
        if ra is not None and cfg.target_ratio is not None and ra.stage == "early" and ra.late_stage_at is None:
            if (budget is not None and elapsed >= cfg.late_stage_at * budget) or (
                    budget is None and step >= cfg.late_stage_at * cfg.steps):
                ra.late_stage_at = ra.steps + 1  # the late stage starts at the next step
        rss_peak = max(rss_peak, rss_bytes() or 0)
        enc = _active_encoder_params(model, ra) if ra is not None else encoder_params(model)
        history["step"].append(step)
        history["time_s"].append(elapsed)
        history["loss"].append(None if skipped else step_loss)   # a skipped step trained nothing
        history["step_time_s"].append(dt)
        history["active_tt_params"].append(active_tt())
        history["encoder_compression"].append(dense_encoder / enc)
        bar.set_postfix(loss=f"{step_loss:.3f}", step=f"{dt * 1e3:.0f}ms", enc=f"{dense_encoder / enc:.0f}x",
                        refresh=False)
        bar.update(1 if total is not None else min(round(elapsed), round(budget)) - bar.n)
        passed = max(sum(elapsed >= m for m in time_marks), sum(step >= m for m in cap_marks))
        due = step in step_marks or passed > marks_passed
        marks_passed = passed
        if due or (cfg.steps is not None and step == cfg.steps):
            record_eval(step)
    bar.close()
    if not evals or evals[-1]["step"] != step:
        record_eval(step)
    if backend is None:
        execution = "eager"
    else:
        execution = f"cc.compile_step, {backend!r} per layer"
        if getattr(step_fn, "cuda_graphs", None) == "step":
            execution += ", the whole step one CUDA graph"
    execution += world.describe()
    if ra is not None:
        ra.cut(share=False)  # what is switched off goes for real: the parameter counts below are the model's
    median, compile_s = step_figures(history["step_time_s"], compile_steps)   # median None: no steady step
    result = {
        "name": name,
        "execution": execution,
        "precision": cfg.arithmetic(),
        "steps": step,
        "ended_by": "steps" if cfg.steps is not None and step >= cfg.steps else "time",   # the budget that ended it
        "time_s": elapsed,
        "params_model": total_params(model),
        "params_encoder": encoder_params(model),
        "params_encoder_start": start_encoder,
        "compression_encoder": dense_encoder / encoder_params(model),
        "median_step_s": median,
        "compile_s": compile_s,
        "compile_steps": [i + 1 for i in compile_steps],
        "skipped_steps": skipped_steps,   # fp16: steps the loss scaler skipped (their loss: None in history)
        "peak_bytes": _peak_step_bytes(model, first_batch, data.vocab_size, autocast),
        "peak_rss_bytes": rss_peak or None,
        "rss_start_bytes": rss_start,   # the process's RSS as the run started: peak - start is the run's own
        "device": str(device),
        "peak_cuda_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "heldout_loss": evals[-1]["loss"],
        "heldout_accuracy": evals[-1]["accuracy"],
        "evals": evals,
        "history": history,
    }
    if ra is not None:
        result["active_tt_params_start"] = start_tt
        result["active_tt_params_end"] = ra.size()
        result["ranks"] = {k: list(v) for k, v in ra.ranks().items()}
        result["cuts"] = ra.cuts
        result["stage"] = ra.stage
    return result
