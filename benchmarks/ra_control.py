"""Does rank adaptation beat guessing the small rank up front?  On the demo's code-MLM task at its default
size, three models train the same steps on the same batches: RankAdaptive at its defaults, the same model
without adaptation, and a model built at the ranks adaptation ended with (fresh random cores) -- the
control.  Reported: TT parameters at the start and end, held-out loss and accuracy with its standard error,
and adapt's differences from the other two paired token by token on the same held-out set, each with its
standard error (clustered by held-out block: tokens of one sequence are not independent), so a difference
can be read against its noise.

Opt-in (about 30 minutes on one thread at the default 2,000 steps): ``comera-compile bench --only
ra_control``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import comera_compile as cc
from comera_compile.layers import TTLinear
from comera_compile.optim import tt_layers

__all__ = ["run", "format_rows", "train"]

STEPS, QUICK_STEPS = 2000, 200


def _build_at_ranks(model: nn.Module, ranks: dict[str, tuple[int, ...]], seed: int) -> nn.Module:
    """model with every TT layer replaced by a fresh one (same shape, modes and bias) at the given ranks."""
    torch.manual_seed(seed)
    for name, r in ranks.items():
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent)
        old = getattr(owner, attr)
        new = TTLinear(old.in_features, old.out_features, old.bias is not None, rank=list(r[1:-1]),
                       in_modes=old.spec.in_modes, out_modes=old.spec.out_modes)
        if old.bias is not None:
            with torch.no_grad():
                new.bias.copy_(old.bias)
        setattr(owner, attr, new)
    return model


def token_scores(model: nn.Module, data: Any) -> dict[str, torch.Tensor]:
    """Per masked held-out token, in a fixed order: its cross-entropy, whether the prediction is right, and
    the index of its held-out block, the sequence it is in (the cluster for standard errors)."""
    was_training = model.training
    model.eval()
    losses, correct, blocks, seen = [], [], [], 0
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        for inputs, positions, labels in data.heldout:  # labels: (blocks, masked positions per block)
            logits = model(inputs, positions).reshape(-1, data.vocab_size)
            flat = labels.reshape(-1)
            losses.append(F.cross_entropy(logits.double(), flat, reduction="none"))
            correct.append((logits.argmax(dim=-1) == flat).double())
            blocks.append((seen + torch.arange(labels.shape[0])).repeat_interleave(labels[0].numel()))
            seen += labels.shape[0]
    model.train(was_training)
    return {"loss": torch.cat(losses), "correct": torch.cat(correct), "block": torch.cat(blocks)}


def paired_difference(a: torch.Tensor, b: torch.Tensor, clusters: torch.Tensor) -> tuple[float, float]:
    """Mean of a - b over paired observations and its standard error, clustered (observations within a
    cluster may correlate; clusters are taken as independent)."""
    d = (a - b).double()
    _, idx = torch.unique(clusters, return_inverse=True)
    k = int(idx.max()) + 1
    sums = torch.zeros(k, dtype=torch.float64).index_add_(0, idx, d)
    counts = torch.zeros(k, dtype=torch.float64).index_add_(0, idx, torch.ones_like(d))
    mean = float(d.mean())
    if k < 2:
        return mean, float("nan")
    resid = sums - mean * counts
    return mean, math.sqrt(k / (k - 1) * float(resid.square().sum())) / d.numel()


def train(kind: str, cfg: Any, data: Any, ranks: dict[str, tuple[int, ...]] | None = None,
          adapt_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train the demo's CoMERA model for cfg.steps steps -- kind "adapt" (RankAdaptive at its defaults, or
    with ``adapt_kwargs``), "fixed" (no adaptation) or "final" (built at `ranks`) -- and evaluate it on every
    held-out batch (the per-token scores under "tokens")."""
    from comera_compile.examples import code_mlm, demo_train

    _, model = code_mlm.build_models(cfg, data.vocab_size)
    if kind == "final":
        model = _build_at_ranks(model, ranks or {}, cfg.seed)
    start = sum(m.tt_params() for m in tt_layers(model).values())
    if cfg.compile:
        for block in cc.repeated_blocks(model):
            cc.compile_block(block, backend="comera")
    opt = torch.optim.AdamW(cc.param_groups(model, lr=cfg.lr))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(cfg.warmup_steps, 1)))
    ra = cc.RankAdaptive(model, optimizer=opt, **(adapt_kwargs or {})) if kind == "adapt" else None
    stream = demo_train.batches(data, cfg)
    for _ in range(cfg.steps):
        loss = demo_train._task_loss(model, *next(stream), data.vocab_size)
        (ra.loss(loss) if ra else loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if ra is not None:
            ra.step()
    if ra is not None:
        ra.cut(share=False)
    layers = tt_layers(model)
    result = {"run": kind, "tt_start": start, "tt_end": sum(m.tt_params() for m in layers.values()),
              "ranks": {name: m.spec.ranks for name, m in layers.items()}, "tokens": token_scores(model, data)}
    tokens = result["tokens"]
    n = result["masked_tokens"] = tokens["loss"].numel()
    result["loss"], result["accuracy"] = float(tokens["loss"].mean()), float(tokens["correct"].mean())
    result["accuracy_se"] = math.sqrt(result["accuracy"] * (1 - result["accuracy"]) / max(n, 1))
    return result


def run(quick: bool = False, steps: int | None = None, adapt_kwargs: dict[str, Any] | None = None,
        **overrides: Any) -> list[dict]:
    """The three runs (adapt, fixed, final) at the demo's default size: STEPS steps (QUICK_STEPS when
    quick), evaluated on every held-out block; adapt_kwargs go to RankAdaptive, overrides to the demo's
    DemoConfig.  The adapt row carries its paired differences from the others under "vs_fixed" and
    "vs_control"."""
    from comera_compile.examples import code_mlm

    steps = steps or (QUICK_STEPS if quick else STEPS)
    settings = {"minutes": None, "steps": steps, "eval_blocks": 10**6, "progress": False, **overrides}
    cfg = code_mlm.DemoConfig(**settings)
    data, _, _ = code_mlm.prepare_data(cfg, lambda s: None)
    adapt = train("adapt", cfg, data, adapt_kwargs=adapt_kwargs)
    fixed = train("fixed", cfg, data)
    final = train("final", cfg, data, ranks=adapt["ranks"])
    a = adapt["tokens"]
    for key, other in (("vs_fixed", fixed), ("vs_control", final)):
        o = other["tokens"]
        loss, loss_se = paired_difference(a["loss"], o["loss"], a["block"])
        acc, acc_se = paired_difference(a["correct"], o["correct"], a["block"])
        adapt[key] = {"loss": loss, "loss_se": loss_se, "accuracy": acc, "accuracy_se": acc_se}
    for row in (adapt, fixed, final):
        del row["tokens"]
    return [adapt, fixed, final]


def format_rows(rows: list[dict]) -> str:
    by = {r["run"]: r for r in rows}
    names = {"adapt": "RankAdaptive at its defaults", "fixed": "no adaptation",
             "final": "built at adapt's final ranks"}
    lines = [f"  {'run':<30} {'TT params start -> end':>24} {'held-out loss':>14} {'accuracy':>16}"]
    for key in ("adapt", "fixed", "final"):
        r = by[key]
        lines.append(f"  {names[key]:<30} {r['tt_start']:>11,} -> {r['tt_end']:<9,} {r['loss']:>14.3f} "
                     f"{100 * r['accuracy']:>8.2f}% ± {100 * r['accuracy_se']:.2f}")
    a = by["adapt"]
    lines.append(f"  adapt is {a['tt_start'] / max(a['tt_end'], 1):.1f}x smaller than no adaptation; paired on "
                 f"the same {a['masked_tokens']:,} masked tokens (± one standard error):")
    for key, label in (("vs_fixed", "adapt - no adaptation"), ("vs_control", "adapt - control")):
        d = a[key]
        lines.append(f"    {label:<22} accuracy {100 * d['accuracy']:+.2f} ± {100 * d['accuracy_se']:.2f} points, "
                     f"loss {d['loss']:+.4f} ± {d['loss_se']:.4f}")
    return "\n".join(lines)
