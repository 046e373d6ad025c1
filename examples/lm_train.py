"""One method's pretraining run: the learning-rate schedule, the model, its loss and evaluation, the optimizers
(AdamW, CoMERA's groups with RankAdaptive, GaLore) and the training loop on a wall-clock or step budget."""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from comera_compile.examples.code_data import DemoError
from comera_compile.examples.demo_dist import World, agree, autocast_dtype, skipped_in_a_row, wrap
from comera_compile.examples.demo_report import step_figures
from comera_compile.examples.demo_train import rss_bytes
from comera_compile.examples.lm_config import LlamaShape, PretrainConfig



# --------------------------------------------------------------------------------------------------------
# Learning-rate schedule
# --------------------------------------------------------------------------------------------------------
def lr_factor(step: int, progress: float, warmup_steps: int, warmup_end: float, floor: float = 0.1) -> float:
    """The multiplier of the peak learning rate for 1-based `step`: linear warm-up over `warmup_steps`
    steps (step / warmup_steps), then a cosine from 1 down to `floor` as `progress` (the fraction of the
    budget used) goes from `warmup_end` (the fraction used when the warm-up ended) to 1.

    On a budget of T steps, progress = step / T and warmup_end = warmup_steps / T: the usual
    cosine-with-warm-up schedule by steps.  On a time budget both are fractions of the wall clock, so the
    schedule ends at the floor when the time does, whatever the step count turns out to be.  With both (a
    step cap on a time budget), Schedule passes the larger of the two fractions: the schedule runs over
    whichever budget ends the run."""
    if step <= warmup_steps:
        return step / max(1, warmup_steps)
    q = 1.0 if warmup_end >= 1 else min(1.0, max(0.0, (progress - warmup_end) / (1.0 - warmup_end)))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * q))


class Schedule:
    """Sets every param group's lr to its peak (the group's lr when the optimizer was built) times
    lr_factor, before each step; groups keep their ratios (CoMERA's cores, gates and the rest).  The budget
    is `budget_s` seconds, `steps` steps, or both (whichever ends first)."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int, floor: float,
                 budget_s: float | None, steps: int | None) -> None:
        self.optimizer, self.warmup_steps, self.floor = optimizer, warmup_steps, floor
        self.budget_s, self.steps = budget_s, steps
        self.warmup_end: float | None = None
        for g in optimizer.param_groups:   # a float: a tensor rate is filled in place at each step
            g.setdefault("peak_lr", float(g["lr"]))

    def progress(self, step: int, elapsed: float) -> float:
        """The fraction of the budget used: of the time budget when the step starts, of the steps once it is
        taken; with both, the larger (the budget nearer its end, which ends the run if the pace holds)."""
        return self._fraction(step, elapsed)

    def _fraction(self, steps: float, elapsed: float) -> float:
        time = elapsed / self.budget_s if self.budget_s is not None else 0.0
        return max(time, steps / self.steps if self.steps is not None else 0.0)

    def before(self, step: int, elapsed: float) -> float:
        """Set the learning rates of 1-based `step`, starting at `elapsed` training seconds; returns the
        factor."""
        p = self.progress(step, elapsed)
        if self.warmup_end is None and step > self.warmup_steps:
            # the warm-up's end, in the budget's unit: on a step budget W / T, on a time budget the clock then
            # (with both, the larger)
            self.warmup_end = self._fraction(self.warmup_steps, elapsed)
        f = lr_factor(step, p, self.warmup_steps, self.warmup_end if self.warmup_end is not None else 0.0,
                      self.floor)
        for g in self.optimizer.param_groups:
            lr = g["peak_lr"] * f
            if isinstance(g["lr"], torch.Tensor):   # as torch's schedulers do: a captured step reads it there
                g["lr"].fill_(lr)
            else:
                g["lr"] = lr
        return f


# --------------------------------------------------------------------------------------------------------
# Model, loss, data order, evaluation
# --------------------------------------------------------------------------------------------------------
def build_model(shape: LlamaShape, vocab_size: int, seed: int) -> nn.Module:
    """A LlamaForCausalLM built from its config (no weights downloaded), seeded: RMSNorm, SwiGLU, rotary
    embeddings, untied input embedding and head, as in the GaLore configs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.heads, max_position_embeddings=shape.max_positions,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def causal_lm_loss(logits: torch.Tensor, ids: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy: the logits at positions 0..s-2 against the tokens at 1..s-1."""
    v = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, v).float(), ids[:, 1:].reshape(-1), reduction=reduction)


def _loss_of_output(output: Any, ids: torch.Tensor) -> torch.Tensor:
    return causal_lm_loss(output.logits, ids)


def decoder_params(model: nn.Module) -> int:
    """Parameters of the decoder layers (attention, SwiGLU and their RMSNorms)."""
    return sum(p.numel() for p in model.model.layers.parameters())


def total_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def batches(train: torch.Tensor, batch: int, seed: int) -> Iterator[torch.Tensor]:
    """Training batches in a seeded order (a fresh permutation every epoch): the same sequence for every
    method trained with the same seed."""
    g = torch.Generator().manual_seed(seed)
    n = train.shape[0]
    while True:
        order = torch.randperm(n, generator=g)
        for i in range(0, n - batch + 1, batch):
            yield train[order[i: i + batch]]


@torch.no_grad()
def evaluate(model: nn.Module, val: torch.Tensor, batch: int = 8) -> dict[str, float]:
    """Validation loss (mean next-token cross-entropy over every predicted token of `val`'s blocks) and its
    perplexity exp(loss); run eagerly (torch.compiler's force_eager stance) without a KV cache."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with torch.compiler.set_stance("force_eager"):
        for i in range(0, val.shape[0], batch):
            ids = val[i: i + batch].to(device)
            logits = model(input_ids=ids, use_cache=False).logits
            total += float(causal_lm_loss(logits, ids, reduction="sum"))
            count += ids.shape[0] * (ids.shape[1] - 1)
    model.train(was_training)
    loss = total / count
    return {"loss": loss, "ppl": math.exp(loss), "predicted_tokens": count}


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters, buffers and optimizer state, each storage once."""
    from comera_compile.benchmarks.galore import persistent_bytes

    return persistent_bytes(model, optimizer)


def galore_optimizer(model: nn.Module, cfg: PretrainConfig) -> torch.optim.Optimizer:
    """galore-torch's GaLoreAdamW: the decoder layers' Linear weights projected to cfg.galore_rank (refreshed
    every cfg.galore_gap steps, scale cfg.galore_scale, proj_type "std"), the rest plain AdamW; as
    benchmarks/galore.py does, for the decoder's module names."""
    try:
        from galore_torch import GaLoreAdamW
    except ImportError as e:
        raise DemoError("--methods galore needs the 'galore-torch' package: pip install 'comera-compile[bench]', "
                        "or leave galore out of --methods") from e
    low_rank = [m.weight for m in model.model.layers.modules() if isinstance(m, nn.Linear)]
    ids = {id(p) for p in low_rank}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return GaLoreAdamW([{"params": rest},
                        {"params": low_rank, "rank": cfg.galore_rank, "update_proj_gap": cfg.galore_gap,
                         "scale": cfg.galore_scale, "proj_type": "std"}],
                       lr=cfg.peak_lr("galore"), weight_decay=cfg.weight_decay, no_deprecation_warning=True)


def _clip_hook(max_norm: float) -> Callable[..., None]:
    """An optimizer step pre-hook clipping the gradients of the optimizer's parameters (read at each step:
    RankAdaptive's re-allocations replace the cores) to a total norm of max_norm."""

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)

    return hook


# --------------------------------------------------------------------------------------------------------
# One method's training run
# --------------------------------------------------------------------------------------------------------
def steps_per_pass(train_blocks: int, batch: int) -> int:
    """Steps of `batch` blocks in one pass over the training text (``batches`` drops each pass's last partial
    batch)."""
    return max(1, train_blocks // batch)


def passes(steps: int, train_blocks: int, batch: int) -> float:
    """Passes over the training text that `steps` global batches make."""
    return steps / steps_per_pass(train_blocks, batch)


def train_one(method: str, model: nn.Module, cfg: PretrainConfig, train: torch.Tensor, val: torch.Tensor,
              eval_tokens: tuple[int, ...] = (), world: World = World(),
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train `model` by `method` for cfg's budget and return its curve and figures.

    dense: AdamW, the step compiled by cc.compile_step with Inductor.  comera: `model` already tensorized;
    AdamW on cc.param_groups(model, lr), cc.RankAdaptive at its defaults, cc.compile_step with backend
    "comera", ra.loss / ra.step around it.  galore: GaLoreAdamW, the model compiled with Inductor as dense's,
    the optimizer eager.  Validation at cfg.evals equal marks of the budget (with --minutes and a --steps cap,
    of either: cfg.evals marks of whichever ends the run) and when the token count reaches each of
    `eval_tokens` (the first method's final count); the clock stops while it runs.  With a step cap, the
    warm-up is cut to leave at least one step of the cap for the cosine decay.  The step
    that starts a second pass over the training text is logged: from there batches repeat, and validation
    perplexity no longer measures learning from new text alone."""
    import comera_compile as cc
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ra = None

    def loss_fn(output: Any, ids: torch.Tensor) -> torch.Tensor:
        # the task loss: RankAdaptive's penalty works by its proximal step, and ra.loss() would only add its value
        return _loss_of_output(output, ids)

    if method == "comera":
        opt = torch.optim.AdamW(cc.param_groups(model, lr=cfg.peak_lr("comera"), core_lr=cfg.comera_core_lr,
                                                gate_lr=cfg.comera_gate_lr, weight_decay=cfg.weight_decay))
        ra = cc.RankAdaptive(model, optimizer=opt)
        backend, start_tt = "comera", ra.size()
        ranks_start = {k: list(v) for k, v in ra.ranks().items()}
    elif method == "galore":
        opt = galore_optimizer(model, cfg)
        backend = "inductor"
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.peak_lr("dense"), weight_decay=cfg.weight_decay)
        backend = "inductor"
    if cfg.clip is not None:
        opt.register_step_pre_hook(_clip_hook(cfg.clip))
    forward = wrap(model, world)
    autocast = autocast_dtype(cfg.arithmetic())
    # fp16: one loss scaler for the run, kept when a re-allocation rebuilds the step
    scaler = torch.amp.GradScaler(device.type) if autocast == torch.float16 else None
    # on one GPU the whole step is one CUDA graph where it can be (GaLore's optimizer is not capturable)
    graphs = "auto" if device.type == "cuda" and world.size == 1 and method != "galore" else None
    step_fn = cc.compile_step(forward, loss_fn, opt, backend=backend, autocast=autocast, cuda_graphs=graphs,
                              micro_batches=cfg.micro_batches, scaler=scaler)
    execution = {"dense": "AdamW; cc.compile_step, Inductor",
                 "comera": "AdamW (cc.param_groups) + RankAdaptive; cc.compile_step, backend 'comera'",
                 "galore": "GaLoreAdamW (eager); model by cc.compile_step, Inductor"}[method]

    budget = cfg.minutes * 60.0 if cfg.minutes is not None else None
    warmup = cfg.warmup()
    if cfg.steps is not None and warmup >= cfg.steps:   # a warm-up the cap cuts short would never decay
        warmup = max(0, cfg.steps - 1)
        if world.main:
            log(f"{method}: the warm-up ({cfg.warmup()} steps) is cut to {warmup} to leave the {cfg.steps}-step cap a "
                f"step of cosine decay")
    schedule = Schedule(opt, warmup, cfg.min_lr_ratio, budget, cfg.steps)   # over whichever budget ends first
    tokens_per_step = cfg.batch * cfg.seq_len
    per_pass = steps_per_pass(train.shape[0], cfg.batch)
    # cfg.evals marks of each budget given; an evaluation each time the run passes its next mark of either, so a
    # run ended by its step cap before its time (or the reverse) is evaluated cfg.evals times all the same
    time_marks = [budget * (i + 1) / cfg.evals for i in range(cfg.evals)] if budget is not None else []
    cap_marks = ([max(1, round(cfg.steps * (i + 1) / cfg.evals)) for i in range(cfg.evals)]
                 if cfg.steps is not None else [])
    marks_passed = 0
    step_marks = {-(-t // tokens_per_step) for t in eval_tokens}   # the first method's tokens: equal tokens
    history: dict[str, list] = {"step": [], "tokens": [], "time_s": [], "loss": [], "lr": [], "step_time_s": [],
                                "active_tt_params": []}
    evals: list[dict[str, Any]] = []
    stream = batches(train, cfg.batch, cfg.seed)
    rows = world.rows(cfg.batch)
    elapsed, step = 0.0, 0
    skips = skipped_steps = 0   # steps the loss scaler skipped (fp16): in a row, and in all
    compile_steps: list[int] = []
    rss_peak = rss_bytes() or 0
    start_decoder, start_total = decoder_params(model), total_params(model)
    total = cfg.steps if budget is None else None
    bar = tqdm(total=total if total is not None else round(budget), desc=f"{method:>6}",
               disable=not (cfg.progress and world.main), dynamic_ncols=True,
               mininterval=0.5 if sys.stderr.isatty() else 10.0, file=sys.stderr,
               unit="step" if total is not None else "s")

    def record_eval() -> None:
        e = evaluate(model, val, cfg.micro_batch())   # forwards no larger than a micro-batch's
        evals.append({"step": step, "tokens": step * tokens_per_step, "time_s": elapsed, **e,
                      "active_tt_params": ra.size() if ra is not None else None})

    model.train()
    while (cfg.steps is None or step < cfg.steps) and (budget is None or elapsed < budget):
        step += 1
        ids = next(stream)[rows].to(device, non_blocking=True)
        if step == per_pass + 1 and world.main:
            log(f"{method}: step {step} starts a second pass over the training text ({per_pass:,} steps, "
                f"{per_pass * tokens_per_step:,} tokens a pass): from here batches repeat, so validation "
                f"perplexity rewards memorising them too; give more text (--data, --max-bytes) to compare on one "
                f"pass")
        lr = schedule.before(step, elapsed)
        sync()
        t0 = time.perf_counter()
        task = step_fn(ids, ids)
        compiled = step_fn.last_call_compiled   # compiled, probed or captured: not a steady step
        skipped = step_fn.skipped   # fp16: the loss scaler skipped the optimizer step (gradients overflowed)
        skips = skipped_in_a_row(skipped, skips, method)
        skipped_steps += skipped
        reallocated = ra.step(task) if ra is not None and not skipped else False   # the loss feeds the late stage
        if reallocated and forward is not model:  # DDP holds the replaced Parameters: a new wrapper and step
            forward = wrap(model, world)
            step_fn = cc.compile_step(forward, loss_fn, opt, backend=backend, autocast=autocast,
                                      micro_batches=cfg.micro_batches, scaler=scaler)
        sync()
        dt, step_loss = agree(world, time.perf_counter() - t0, float(task))
        elapsed += dt
        if compiled:
            compile_steps.append(step)
        rss_peak = max(rss_peak, rss_bytes() or 0)
        for key, value in (("step", step), ("tokens", step * tokens_per_step), ("time_s", elapsed),
                           ("loss", None if skipped else step_loss),   # a skipped step trained nothing
                           ("lr", lr * cfg.peak_lr(method)), ("step_time_s", dt),
                           ("active_tt_params", ra.size() if ra is not None else None)):
            history[key].append(value)
        if not skipped and not math.isfinite(step_loss):
            bar.close()
            flags = {"dense": "--lr", "comera": "--comera-lr, --comera-core-lr, --comera-gate-lr",
                     "galore": "--galore-lr"}[method]
            raise DemoError(f"{method}: the training loss is {step_loss} at step {step}; lower its learning rate "
                            f"({flags})")
        bar.set_postfix(loss=f"{step_loss:.3f}", step=f"{dt * 1e3:.0f}ms", refresh=False)
        bar.update(1 if total is not None else min(round(elapsed), round(budget)) - bar.n)
        passed = max(sum(elapsed >= m for m in time_marks), sum(step >= m for m in cap_marks))
        due = step in step_marks or passed > marks_passed
        marks_passed = passed
        if due or (cfg.steps is not None and step == cfg.steps):
            record_eval()
    bar.close()
    if not evals or evals[-1]["step"] != step:
        record_eval()
    ranks_end = None
    if ra is not None:
        ranks_end = {k: list(v) for k, v in ra.ranks().items()}
        end_tt = ra.size()
        ra.cut(share=False)  # what is switched off goes for real: the parameter counts below are the model's
    if step_fn.cuda_graphs == "step":
        execution += ", the whole step one CUDA graph"
    execution += world.describe()
    median, compile_s = step_figures(history["step_time_s"], [i - 1 for i in compile_steps])
    if median is None and world.main:
        log(f"{method}: each of its {step} step(s) compiled: the budget ended before a steady step, so its step time "
            f"is not measured; raise --minutes or --steps")
    result: dict[str, Any] = {
        "method": method,
        "execution": execution,
        "precision": cfg.arithmetic(),
        "lr": cfg.peak_lr(method),
        "lr_groups": {g.get("name", str(i)): g["peak_lr"] for i, g in enumerate(opt.param_groups)},
        "warmup_steps": warmup,
        "steps": step,
        "tokens": step * tokens_per_step,
        "passes": passes(step, train.shape[0], cfg.batch),
        "time_s": elapsed,
        "ended_by": "steps" if cfg.steps is not None and step >= cfg.steps else "time",   # the budget that ended it
        "median_step_s": median,
        "tokens_per_s": None if median is None else tokens_per_step / median,
        "tokens_per_s_overall": step * tokens_per_step / elapsed,
        "compile_s": compile_s,
        "compile_steps": compile_steps,
        "skipped_steps": skipped_steps,
        "params_total": total_params(model),
        "params_total_start": start_total,
        "params_decoder": decoder_params(model),
        "params_decoder_start": start_decoder,
        "state_bytes": _state_bytes(model, opt),
        "peak_rss_bytes": rss_peak or None,
        "peak_cuda_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "device": str(device),
        "val_loss": evals[-1]["loss"],
        "val_ppl": evals[-1]["ppl"],
        "evals": evals,
        "history": history,
    }
    if ra is not None:
        result.update(tt_params_start=start_tt, tt_params_end=end_tt, ranks_start=ranks_start, ranks_end=ranks_end,
                      cuts=ra.cuts, stage=ra.stage)
    return result
