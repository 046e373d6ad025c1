"""Does rank adaptation beat guessing the small rank up front?  On the demo's code-MLM task at its default
size, three models train the same steps on the same batches: RankAdaptive at its defaults, the same model
without adaptation, and a model built at the ranks adaptation ended with (fresh random cores) -- the
control.  Reported: TT parameters at the start and end, held-out loss and accuracy with its standard error.

Opt-in (about 30 minutes on one thread at the default 2,000 steps): ``comera-compile bench --only
ra_control``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
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


def train(kind: str, cfg: Any, data: Any, ranks: dict[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    """Train the demo's CoMERA model for cfg.steps steps -- kind "adapt" (RankAdaptive at its defaults),
    "fixed" (no adaptation) or "final" (built at `ranks`) -- and evaluate it on every held-out batch."""
    from comera_compile.examples import code_mlm, demo_train

    _, model = code_mlm.build_models(cfg, data.vocab_size)
    if kind == "final":
        model = _build_at_ranks(model, ranks or {}, cfg.seed)
    start = sum(m.tt_params() for m in tt_layers(model).values())
    if cfg.compile:
        for block in cc.repeated_blocks(model):
            block.compile(backend="comera")
    opt = torch.optim.AdamW(cc.param_groups(model, lr=cfg.lr))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(cfg.warmup_steps, 1)))
    ra = cc.RankAdaptive(model, optimizer=opt) if kind == "adapt" else None
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
              "ranks": {name: m.spec.ranks for name, m in layers.items()}, **demo_train.evaluate(model, data)}
    n = result["masked_tokens"]
    result["accuracy_se"] = math.sqrt(result["accuracy"] * (1 - result["accuracy"]) / max(n, 1))
    return result


def run(quick: bool = False, steps: int | None = None, **overrides: Any) -> list[dict]:
    """The three runs (adapt, fixed, final) at the demo's default size: STEPS steps (QUICK_STEPS when
    quick), evaluated on every held-out block; overrides go to the demo's DemoConfig."""
    from comera_compile.examples import code_mlm

    steps = steps or (QUICK_STEPS if quick else STEPS)
    settings = {"minutes": None, "steps": steps, "eval_blocks": 10**6, "progress": False, **overrides}
    cfg = code_mlm.DemoConfig(**settings)
    data, _, _ = code_mlm.prepare_data(cfg, lambda s: None)
    adapt = train("adapt", cfg, data)
    fixed = train("fixed", cfg, data)
    final = train("final", cfg, data, ranks=adapt["ranks"])
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
    a, f, c = by["adapt"], by["fixed"], by["final"]
    lines.append(f"  adapt vs no adaptation: {a['tt_start'] / max(a['tt_end'], 1):.1f}x smaller, "
                 f"{100 * (a['accuracy'] - f['accuracy']):+.2f} points; vs the control: "
                 f"{100 * (a['accuracy'] - c['accuracy']):+.2f} points, loss {a['loss'] - c['loss']:+.3f} "
                 f"({a['masked_tokens']:,} masked tokens)")
    return "\n".join(lines)
