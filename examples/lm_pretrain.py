"""Decoder-LM pretraining as the field reports it: a Llama-style causal LM trained from scratch three ways on
equal wall-clock budgets -- dense (compiled with Inductor), CoMERA (TT decoder layers, RankAdaptive, backend
"comera") and GaLore (GaLoreAdamW on the dense model) -- with validation perplexity at equal time and at
equal tokens.

The recipe is the GaLore / SLTrain papers' (AdamW, linear warm-up then cosine decay to 10% of the peak,
sequence length 256, gradient clipping at 1.0), with their model shapes as presets and a ``tiny`` preset
that finishes on a 2-core CPU in minutes.  Every method starts from the same seed and sees the same batches
in the same order; the first model's (dense's) final token count is an extra evaluation point for the
others.  Writes ``table.md``, ``curves.png`` and ``results.json`` to ``runs/pretrain-<timestamp>/``.

Run it: ``comera-compile pretrain`` (options: ``comera-compile pretrain --help``).
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from comera_compile.examples.code_data import DemoError
from comera_compile.examples.demo_dist import World, agree, from_env, shutdown, wrap

__all__ = ["METHODS", "SHAPES", "PRESETS", "PretrainConfig", "LlamaShape", "DemoError", "preset", "lr_factor",
           "Schedule", "build_model", "causal_lm_loss", "evaluate", "batches", "train_one", "run"]

METHODS = ("dense", "comera", "galore")


# --------------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LlamaShape:
    """A Llama decoder's shape (multi-head attention: as many key/value heads as query heads)."""

    hidden: int
    intermediate: int
    heads: int
    layers: int
    max_positions: int = 1024  # the GaLore configs' max_sequence_length


SHAPES: dict[str, LlamaShape] = {
    # Wide enough for TT layers to pay (a 768 x 2048 SwiGLU), shallow enough for minutes on 2 CPU cores.
    "tiny": LlamaShape(hidden=768, intermediate=2048, heads=12, layers=2),
    # The Llama models of the GaLore and SLTrain papers (their configs/llama_60m.json etc.).
    "60m": LlamaShape(hidden=512, intermediate=1376, heads=8, layers=8),
    "130m": LlamaShape(hidden=768, intermediate=2048, heads=12, layers=12),
    "350m": LlamaShape(hidden=1024, intermediate=2736, heads=16, layers=24),
}

# CoMERA's learning rates, from a sweep on the tiny preset (200 steps, validation perplexity): the dense parts
# (embeddings, head, norms) at 2e-3, the TT cores at 1e-3 and the rank gates at 1e-2 beat every single
# cc.param_groups(model, lr) tried (lr 2.5e-4 / 5e-4 / 1e-3 / 3e-3: cores 2x, gates 20x); the cores and gates
# are the sensitive ones (cores at 2e-3 or gates at 2e-2 are clearly worse).
_COMERA_LRS = {"comera_lr": 2e-3, "comera_core_lr": 1e-3, "comera_gate_lr": 1e-2}

# Per preset, the PretrainConfig fields that differ from its defaults.  The papers train the dense model at
# lr 1e-3, GaLore at lr 1e-2 with scale 0.25 and rank 128 / 256 / 256, on batches of 512 x 256 tokens; here
# the batch is scaled down to what one machine runs (32; 4 for tiny) and those learning rates are kept.
# tiny runs on one thread: on a shared 2-core machine two OpenMP threads stall each other whenever another
# process takes a core, and CoMERA's many small kernels suffer most (median step at batch 8 x 256: 0.54 s on
# one thread, 4.4 s on two under load; dense 1.46 s and 1.78 s).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"minutes": 2.5, "batch": 4, "rank": 16, "galore_rank": 128, "lr": 1e-3, **_COMERA_LRS,
             "galore_lr": 1e-2, "warmup_steps": 20, "eval_blocks": 64, "threads": 1},
    "60m": {"minutes": 30.0, "batch": 32, "rank": 16, "galore_rank": 128, "lr": 1e-3, **_COMERA_LRS,
            "galore_lr": 1e-2, "warmup_steps": 200, "eval_blocks": 256},
    "130m": {"minutes": 60.0, "batch": 32, "rank": 24, "galore_rank": 256, "lr": 1e-3, **_COMERA_LRS,
             "galore_lr": 1e-2, "warmup_steps": 200, "eval_blocks": 256},
    "350m": {"minutes": 120.0, "batch": 32, "rank": 32, "galore_rank": 256, "lr": 1e-3, **_COMERA_LRS,
             "galore_lr": 1e-2, "warmup_steps": 200, "eval_blocks": 256},
}


@dataclass
class PretrainConfig:
    """Everything a pretraining run depends on; ``comera-compile pretrain`` fills it from its options."""

    preset: str = "tiny"
    data: str | None = None        # None: the Python standard library's source (examples.lm_data)
    tokenizer: str | None = None   # None: a byte-level BPE trained on the training text
    text_column: str = "text"
    out: Path | None = None        # None: runs/pretrain-<YYYYmmdd-HHMMSS>
    methods: tuple[str, ...] = METHODS
    # Budget per model: wall-clock minutes (compiles included, evaluations excluded), or steps (alone).
    minutes: float | None = 2.0
    steps: int | None = None
    batch: int = 8
    seq_len: int = 256
    vocab_size: int = 4096
    lr: float = 1e-3               # peak learning rate: dense AdamW, and CoMERA's cc.param_groups(model, lr)
    comera_lr: float | None = None  # None: lr; CoMERA's cc.param_groups(model, comera_lr, core_lr, gate_lr)
    comera_core_lr: float | None = None  # None: param_groups' default, 2 x comera_lr
    comera_gate_lr: float | None = None  # None: param_groups' default, 20 x comera_lr
    galore_lr: float | None = None  # None: lr
    warmup_steps: int | None = 20  # None: a tenth of --steps (a step budget) or 20
    min_lr_ratio: float = 0.1      # the cosine decays to this fraction of the peak at the end of the budget
    clip: float | None = 1.0       # gradient norm clipping (None: off)
    weight_decay: float = 0.0
    rank: int = 16                 # initial TT rank of CoMERA's decoder linears
    galore_rank: int = 128
    galore_gap: int = 200          # GaLore's projection refresh (update_proj_gap)
    galore_scale: float = 0.25
    evals: int = 6                 # validation evaluations at equal marks of the budget
    eval_blocks: int | None = 64   # validation blocks evaluated (None: all)
    max_bytes: int = 8_000_000
    val_fraction: float = 0.05
    seed: int = 0
    device: str = "cpu"
    threads: int | None = None     # intra-op CPU threads (None: torch's default, every core)
    progress: bool = True

    def shape(self) -> LlamaShape:
        if self.preset not in SHAPES:
            raise DemoError(f"unknown preset {self.preset!r}; choose one of {', '.join(SHAPES)}")
        return SHAPES[self.preset]

    def peak_lr(self, method: str) -> float:
        return {"comera": self.comera_lr, "galore": self.galore_lr}.get(method) or self.lr

    def warmup(self) -> int:
        """Warm-up steps: the option, or a tenth of a step budget."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return max(1, round(0.1 * self.steps)) if self.minutes is None and self.steps else 20

    def check(self, processes: int = 1) -> None:
        """Raise DemoError for settings that cannot run, saying which option to change."""
        s = self.shape()
        bad = [m for m in self.methods if m not in METHODS]
        checks = [
            (not bad and len(self.methods) > 0,
             f"--methods takes a comma-separated subset of {','.join(METHODS)}, got {','.join(self.methods)!r}"),
            (self.minutes is not None or self.steps is not None,
             "give a budget: --minutes (wall clock per model) or --steps (steps per model)"),
            (self.minutes is None or self.minutes > 0, f"--minutes must be positive, got {self.minutes}"),
            (self.steps is None or self.steps >= 1, f"--steps must be at least 1, got {self.steps}"),
            (self.batch >= 1, f"--batch must be at least 1, got {self.batch}"),
            (self.seq_len >= 2, f"--seq-len must be at least 2 (a token and its successor), got {self.seq_len}"),
            (self.seq_len <= s.max_positions,
             f"--seq-len {self.seq_len} is above the model's {s.max_positions} positions (preset {self.preset!r}, "
             f"max_position_embeddings); use --seq-len {s.max_positions} or less"),
            (self.tokenizer is not None or self.vocab_size >= 257,
             f"--vocab-size must be at least 257 (256 byte symbols and the end-of-text token), got {self.vocab_size}"),
            (0 < self.val_fraction < 1, f"--val-fraction must lie strictly between 0 and 1, got {self.val_fraction}"),
            (all(v is None or v > 0 for v in (self.lr, self.comera_lr, self.comera_core_lr, self.comera_gate_lr,
                                               self.galore_lr)),
             f"learning rates must be positive, got --lr {self.lr}, --comera-lr {self.comera_lr}, --comera-core-lr "
             f"{self.comera_core_lr}, --comera-gate-lr {self.comera_gate_lr}, --galore-lr {self.galore_lr}"),
            (self.warmup_steps is None or self.warmup_steps >= 0,
             f"--warmup-steps must be >= 0, got {self.warmup_steps}"),
            (self.minutes is not None or self.steps is None or self.warmup() < self.steps,
             f"--warmup-steps {self.warmup()} leaves no step of the {self.steps}-step budget for the cosine decay; "
             f"give fewer warm-up steps or more --steps"),
            (0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}"),
            (self.clip is None or self.clip > 0, f"--clip must be positive, got {self.clip}"),
            (self.rank >= 1, f"--rank must be a positive integer, got {self.rank}"),
            (self.galore_rank >= 1, f"--galore-rank must be a positive integer, got {self.galore_rank}"),
            (self.threads is None or self.threads >= 1, f"--threads must be at least 1, got {self.threads}"),
            (self.evals >= 1, f"--evals must be at least 1, got {self.evals}"),
            (self.eval_blocks is None or self.eval_blocks >= 1, f"--eval-blocks must be at least 1, got {self.eval_blocks}"),
            (self.max_bytes >= 1000, f"--max-bytes must be at least 1000, got {self.max_bytes}"),
            (self.device in ("cpu", "cuda"), f"--device must be 'cpu' or 'cuda', got {self.device!r}"),
            (self.device != "cuda" or torch.cuda.is_available(),
             "--device cuda: no CUDA device is visible to torch; leave --device out to train on the CPU"),
            (self.batch % processes == 0,
             f"--batch {self.batch} does not split evenly over {processes} processes; give a global batch that is "
             f"a multiple of the process count (e.g. --batch {-(-self.batch // processes) * processes})"),
        ]
        for ok, message in checks:
            if not ok:
                raise DemoError(message)


def preset(name: str, **overrides: Any) -> PretrainConfig:
    """The PretrainConfig of a preset, with overrides (options the user gave) on top."""
    if name not in PRESETS:
        raise DemoError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    unknown = set(overrides) - {f.name for f in fields(PretrainConfig)}
    if unknown:
        raise TypeError(f"PretrainConfig has no field(s) {sorted(unknown)}")
    return PretrainConfig(**{"preset": name, **PRESETS[name], **overrides})


# --------------------------------------------------------------------------------------------------------
# Learning-rate schedule
# --------------------------------------------------------------------------------------------------------
def lr_factor(step: int, progress: float, warmup_steps: int, warmup_end: float, floor: float = 0.1) -> float:
    """The multiplier of the peak learning rate for 1-based `step`: linear warm-up over `warmup_steps`
    steps (step / warmup_steps), then a cosine from 1 down to `floor` as `progress` (the fraction of the
    budget used) goes from `warmup_end` (the fraction used when the warm-up ended) to 1.

    On a budget of T steps, progress = step / T and warmup_end = warmup_steps / T: the usual
    cosine-with-warm-up schedule by steps.  On a time budget both are fractions of the wall clock, so the
    schedule ends at the floor when the time does, whatever the step count turns out to be."""
    if step <= warmup_steps:
        return step / max(1, warmup_steps)
    q = 1.0 if warmup_end >= 1 else min(1.0, max(0.0, (progress - warmup_end) / (1.0 - warmup_end)))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * q))


class Schedule:
    """Sets every param group's lr to its peak (the group's lr when the optimizer was built) times
    lr_factor, before each step; groups keep their ratios (CoMERA's cores 2x, gates 20x)."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int, floor: float,
                 budget_s: float | None, steps: int | None) -> None:
        self.optimizer, self.warmup_steps, self.floor = optimizer, warmup_steps, floor
        self.budget_s, self.steps = budget_s, steps
        self.warmup_end: float | None = None
        for g in optimizer.param_groups:
            g.setdefault("peak_lr", g["lr"])

    def progress(self, step: int, elapsed: float) -> float:
        """The fraction of the budget used: of the time budget when the step starts, else of the steps once
        it is taken."""
        return elapsed / self.budget_s if self.budget_s is not None else step / self.steps

    def before(self, step: int, elapsed: float) -> float:
        """Set the learning rates of 1-based `step`, starting at `elapsed` training seconds; returns the
        factor."""
        p = self.progress(step, elapsed)
        if self.warmup_end is None and step > self.warmup_steps:
            # the warm-up's end, in the budget's unit: on a step budget W / T, on a time budget the clock then
            self.warmup_end = self.warmup_steps / self.steps if self.budget_s is None else p
        f = lr_factor(step, p, self.warmup_steps, self.warmup_end if self.warmup_end is not None else 0.0,
                      self.floor)
        for g in self.optimizer.param_groups:
            g["lr"] = g["peak_lr"] * f
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


def _rss_bytes() -> int | None:
    from comera_compile.examples.demo_train import _rss_bytes as rss

    return rss()


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
def train_one(method: str, model: nn.Module, cfg: PretrainConfig, train: torch.Tensor, val: torch.Tensor,
              eval_tokens: tuple[int, ...] = (), world: World = World()) -> dict[str, Any]:
    """Train `model` by `method` for cfg's budget and return its curve and figures.

    dense: AdamW, the step compiled by cc.compile_step with Inductor.  comera: `model` already tensorized;
    AdamW on cc.param_groups(model, lr), cc.RankAdaptive at its defaults, cc.compile_step with backend
    "comera", ra.loss / ra.step around it.  galore: GaLoreAdamW, the model compiled with Inductor as dense's,
    the optimizer eager.  Validation at cfg.evals equal marks of the budget and when the token count
    reaches each of `eval_tokens` (the first method's final count); the clock stops while it runs."""
    import comera_compile as cc
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ra = None
    task: dict[str, torch.Tensor] = {}

    def loss_fn(output: Any, ids: torch.Tensor) -> torch.Tensor:
        task["loss"] = _loss_of_output(output, ids)
        return ra.loss(task["loss"]) if ra is not None else task["loss"]

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
    step_fn = cc.compile_step(forward, loss_fn, opt, backend=backend)
    execution = {"dense": "AdamW; cc.compile_step, Inductor",
                 "comera": "AdamW (cc.param_groups) + RankAdaptive; cc.compile_step, backend 'comera'",
                 "galore": "GaLoreAdamW (eager); model by cc.compile_step, Inductor"}[method] + world.describe()

    budget = cfg.minutes * 60.0 if cfg.minutes is not None else None
    warmup = cfg.warmup()
    schedule = Schedule(opt, warmup, cfg.min_lr_ratio, budget, None if budget is not None else cfg.steps)
    tokens_per_step = cfg.batch * cfg.seq_len
    if budget is not None:
        time_marks = [budget * (i + 1) / cfg.evals for i in range(cfg.evals)]
        step_marks: set[int] = set()
    else:
        time_marks = []
        step_marks = {max(1, round(cfg.steps * (i + 1) / cfg.evals)) for i in range(cfg.evals)}
    step_marks |= {-(-t // tokens_per_step) for t in eval_tokens}
    history: dict[str, list] = {"step": [], "tokens": [], "time_s": [], "loss": [], "lr": [], "step_time_s": [],
                                "active_tt_params": []}
    evals: list[dict[str, Any]] = []
    stream = batches(train, cfg.batch, cfg.seed)
    rows = world.rows(cfg.batch)
    elapsed, step = 0.0, 0
    compiling, compile_steps = True, []
    rss_peak = _rss_bytes() or 0
    start_decoder, start_total = decoder_params(model), total_params(model)
    total = cfg.steps if budget is None else None
    bar = tqdm(total=total if total is not None else round(budget), desc=f"{method:>6}",
               disable=not (cfg.progress and world.main), dynamic_ncols=True,
               mininterval=0.5 if sys.stderr.isatty() else 10.0, file=sys.stderr,
               unit="step" if total is not None else "s")

    def record_eval() -> None:
        e = evaluate(model, val, cfg.batch)
        evals.append({"step": step, "tokens": step * tokens_per_step, "time_s": elapsed, **e,
                      "active_tt_params": ra.size() if ra is not None else None})

    model.train()
    while (cfg.steps is None or step < cfg.steps) and (budget is None or elapsed < budget):
        step += 1
        ids = next(stream)[rows].to(device, non_blocking=True)
        lr = schedule.before(step, elapsed)
        sync()
        t0 = time.perf_counter()
        step_fn(ids, ids)
        reallocated = ra.step() if ra is not None else False
        if reallocated and forward is not model:  # DDP holds the replaced Parameters: a new wrapper and step
            forward = wrap(model, world)
            step_fn = cc.compile_step(forward, loss_fn, opt, backend=backend)
        sync()
        dt, step_loss = agree(world, time.perf_counter() - t0, float(task["loss"].detach()))
        elapsed += dt
        if compiling:
            compile_steps.append(step)
        compiling = reallocated
        rss_peak = max(rss_peak, _rss_bytes() or 0)
        for key, value in (("step", step), ("tokens", step * tokens_per_step), ("time_s", elapsed),
                           ("loss", step_loss), ("lr", lr * cfg.peak_lr(method)), ("step_time_s", dt),
                           ("active_tt_params", ra.size() if ra is not None else None)):
            history[key].append(value)
        if not math.isfinite(step_loss):
            bar.close()
            raise DemoError(f"{method}: the training loss is {step_loss} at step {step}; lower the learning rate "
                            f"(--lr, --comera-lr, --galore-lr)")
        bar.set_postfix(loss=f"{step_loss:.3f}", step=f"{dt * 1e3:.0f}ms", refresh=False)
        bar.update(1 if total is not None else min(round(elapsed), round(budget)) - bar.n)
        due = step in step_marks
        while time_marks and elapsed >= time_marks[0]:
            time_marks.pop(0)
            due = True
        if due:
            record_eval()
    bar.close()
    if not evals or evals[-1]["step"] != step:
        record_eval()
    ranks_end = None
    if ra is not None:
        ranks_end = {k: list(v) for k, v in ra.ranks().items()}
        end_tt = ra.size()
        ra.cut(share=False)  # what is switched off goes for real: the parameter counts below are the model's
    times = history["step_time_s"]
    steady = [t for i, t in enumerate(times, 1) if i not in compile_steps] or times
    median = statistics.median(steady)
    result: dict[str, Any] = {
        "method": method,
        "execution": execution,
        "lr": cfg.peak_lr(method),
        "lr_groups": {g.get("name", str(i)): g["peak_lr"] for i, g in enumerate(opt.param_groups)},
        "warmup_steps": warmup,
        "steps": step,
        "tokens": step * tokens_per_step,
        "time_s": elapsed,
        "median_step_s": median,
        "tokens_per_s": tokens_per_step / median,
        "tokens_per_s_overall": step * tokens_per_step / elapsed,
        "compile_s": sum(max(0.0, times[i - 1] - median) for i in compile_steps),
        "compile_steps": compile_steps,
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


# --------------------------------------------------------------------------------------------------------
# The whole run
# --------------------------------------------------------------------------------------------------------
def default_out_dir() -> Path:
    return Path("runs") / ("pretrain-" + _dt.datetime.now().strftime("%Y%m%d-%H%M%S"))


def _model_for(method: str, cfg: PretrainConfig, vocab_size: int, device: torch.device) -> nn.Module:
    """Every method's model starts from the same seeded dense model; CoMERA's decoder linears are then
    tensorized at cfg.rank (TT cores at nn.Linear's variance, seeded), the rest kept as it is."""
    import comera_compile as cc

    model = build_model(cfg.shape(), vocab_size, cfg.seed)
    if method == "comera":
        torch.manual_seed(cfg.seed)
        model = cc.tensorize(model, rank=cfg.rank, include="model.layers.*", inplace=True)
    return model.to(device)


def run(cfg: PretrainConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole comparison: data, each method's training (dense first: the others are also evaluated at its
    final token count), and the table, PNG and JSON in cfg.out.  Under torchrun every process trains on its
    rows of every global batch (DDP); the first logs and writes."""
    cfg.check()
    if cfg.threads is not None and "OMP_NUM_THREADS" not in os.environ:  # torchrun's choice stands
        torch.set_num_threads(cfg.threads)
    world = from_env(cfg.device)
    clean = False
    try:
        cfg.check(world.size)
        result = _run(cfg, world, log if world.main else (lambda _: None))
        clean = True
        return result
    finally:
        shutdown(world, clean)


def _run(cfg: PretrainConfig, world: World, log: Callable[[str], None]) -> dict[str, Any]:
    from comera_compile.examples import demo_report, lm_report
    from comera_compile.examples.lm_data import load_lm_data

    t_start = time.perf_counter()
    out = Path(cfg.out) if cfg.out is not None else default_out_dir()
    if out.exists() and not out.is_dir():
        raise DemoError(f"--out {str(out)!r} is a file; give a directory (created if missing)")
    shape = cfg.shape()
    data = load_lm_data(cfg.data, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size, tokenizer=cfg.tokenizer,
                        text_column=cfg.text_column, val_fraction=cfg.val_fraction, max_bytes=cfg.max_bytes,
                        seed=cfg.seed, max_positions=shape.max_positions)
    if data.train.shape[0] < cfg.batch:
        raise DemoError(f"the training text makes {data.train.shape[0]} blocks of {cfg.seq_len} tokens, fewer than "
                        f"one batch of {cfg.batch}; use more data (--data, --max-bytes) or a smaller --batch/--seq-len")
    if data.val.shape[0] < 1:
        raise DemoError(f"the validation text makes no full block of {cfg.seq_len} tokens; use more data")
    val = data.val
    if cfg.eval_blocks is not None and val.shape[0] > cfg.eval_blocks:
        pick = torch.randperm(val.shape[0], generator=torch.Generator().manual_seed(cfg.seed + 1))
        val = val[pick[: cfg.eval_blocks].sort().values]
    device = world.device(cfg.device)
    log(f"data: {data.source}; {data.train.shape[0]:,} training blocks, {val.shape[0]} of the "
        f"{data.val.shape[0]:,} validation blocks evaluated")
    methods = [m for m in METHODS if m in cfg.methods]
    budget = f"{cfg.minutes:g} min" if cfg.minutes is not None else f"{cfg.steps} steps"
    where = (torch.cuda.get_device_name(device) if cfg.device == "cuda" else f"{torch.get_num_threads()} thread(s)")
    if world.size > 1:
        where += f" per process, {world.size} processes (DDP), {cfg.batch // world.size} rows each"
    log(f"model: Llama {cfg.preset!r} {asdict(shape)}; budget {budget} per model, batch {cfg.batch} x "
        f"{cfg.seq_len}; methods {', '.join(methods)}; {where}")
    with torch.device("meta"):  # the dense counts, whichever methods run
        dense = build_model(shape, data.vocab_size, cfg.seed)
    dense_params = {"total": total_params(dense), "decoder": decoder_params(dense)}
    del dense
    log(f"dense: {dense_params['total']:,} parameters, {dense_params['decoder']:,} in the decoder layers")
    runs: dict[str, dict[str, Any]] = {}
    for method in methods:
        torch._dynamo.reset()  # each method compiles its own graphs, inside its own budget
        model = _model_for(method, cfg, data.vocab_size, device)
        if method == "comera":
            log(f"CoMERA: the decoder layers' {decoder_params(model):,} parameters with TT linears at rank "
                f"{cfg.rank}")
        first = runs.get(methods[0])
        eval_tokens = (first["tokens"],) if first is not None else ()
        runs[method] = train_one(method, model, cfg, data.train, val, eval_tokens=eval_tokens, world=world)
        del model
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    config["out"] = str(out)
    config["warmup_steps"] = cfg.warmup()
    result: dict[str, Any] = {
        "config": config,
        "model": asdict(shape) | {"vocab_size": data.vocab_size, "seq_len": cfg.seq_len},
        "data": {"source": data.source, "documents": list(data.documents), "train_blocks": int(data.train.shape[0]),
                 "train_tokens": data.train_tokens(), "val_blocks": int(val.shape[0]),
                 "val_tokens": int(val.shape[0] * (cfg.seq_len - 1))},
        "dense_params": dense_params,
        "threads": torch.get_num_threads(),
        "processes": world.size,
        "device": torch.cuda.get_device_name(device) if cfg.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "runs": runs,
    }
    result["summary"] = lm_report.summarize(result)
    result["wall_time_s"] = time.perf_counter() - t_start
    if not world.main:
        return result
    demo_report.write_outputs(result, out, lm_report.format_table, lm_report.plot, log)
    return result
