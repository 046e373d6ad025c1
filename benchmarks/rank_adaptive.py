"""What a rank cut buys: one AdamW training step of a TT layer stack before and after RankAdaptive cuts
half of every internal rank (the switched-off slices removed from the cores for real)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import comera_compile as cc
from comera_compile.examples import six_encoder

from .common import compare

__all__ = ["run", "format_rows"]


def run(quick: bool = False, batch: int = 8, seq: int = 128) -> list[dict]:
    """Median step times of the six-encoder model (one layer in quick mode) before and after a cut."""
    torch.manual_seed(0)
    base = cc.tensorize(six_encoder.build(layers=1 if quick else 6), preset="comera-six-encoder")
    ids, seg, mask = six_encoder.example_inputs(base, batch=batch, seq=seq)
    target = torch.randint(0, 3, (batch,))
    models = {"before cut": base, "after cut": copy.deepcopy(base)}
    cut = models["after cut"]
    opt_cut = torch.optim.AdamW(cc.param_groups(cut))
    ra = cc.RankAdaptive(cut, optimizer=opt_cut, cut_every=1)
    with torch.no_grad():
        for layer in ra.layers.values():
            for g in layer.gates:
                g[g.numel() // 2:] = 0.0  # switch off the second half of every bond
    ra.step()
    steps = {}
    for name, model in models.items():
        opt = opt_cut if model is cut else torch.optim.AdamW(cc.param_groups(model))

        def step(model=model, opt=opt):
            nn.functional.cross_entropy(model(ids, seg, mask), target).backward()
            opt.step()
            opt.zero_grad()
        steps[name] = step
    m = compare(steps, warmup=1, repeat=3 if quick else 5)
    before, after = cc.explain(base, rows=batch * seq), cc.explain(cut, rows=batch * seq)
    return [_ra_step_row(base, m["before cut"].median), {
        "benchmark": "rank_cut_step", "before_ms": m["before cut"].median * 1e3,
        "after_ms": m["after cut"].median * 1e3, "speedup": m["before cut"].median / m["after cut"].median,
        "params_before": before.total_params, "params_after": after.total_params,
        "tt_flops_per_row_before": sum(r.flops_per_row for r in before.rows),
        "tt_flops_per_row_after": sum(r.flops_per_row for r in after.rows),
    }]


def _ra_step_row(model: nn.Module, step_s: float) -> dict:
    """RankAdaptive.step's own time, beside the training step it follows: a plain step (proximal step, masks,
    penalty), and the mean over one whole check cycle (cut_every = 100 calls: ten re-balancings and a check),
    measured on a copy of the model whose optimizer holds state, after one step's warm-up."""
    import time

    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(cc.param_groups(model))
    ra = cc.RankAdaptive(model, optimizer=opt, realloc_at=None)
    for p in model.parameters():   # the optimizer's state, which re-balancings carry and checks restart
        p.grad = torch.zeros_like(p)
    opt.step()
    ra.step()
    times = []
    for _ in range(ra.cut_every):
        t0 = time.perf_counter()
        ra.step()
        times.append(time.perf_counter() - t0)
    plain = sorted(t for i, t in enumerate(times, start=2) if (i - 1) % 10 and i % ra.cut_every)
    return {"benchmark": "ra_step", "gates": sum(len(layer.gates) for layer in ra.layers.values()),
            "plain_ms": plain[len(plain) // 2] * 1e3, "cycle_ms": sum(times) / len(times) * 1e3,
            "train_step_ms": step_s * 1e3}


def format_rows(rows: list[dict]) -> str:
    r, cut = rows[0], rows[1]
    return (f"RankAdaptive.step ({r['gates']} gates): {r['plain_ms']:.2f} ms a plain step, {r['cycle_ms']:.2f} ms "
            f"a step over a check cycle ({r['cycle_ms'] / r['train_step_ms']:.1%} of a {r['train_step_ms']:.0f} ms "
            f"training step)\n" + _cut_line(cut))


def _cut_line(r: dict) -> str:
    return (f"rank cut (every internal rank halved): step {r['before_ms']:.1f} ms -> {r['after_ms']:.1f} ms "
            f"({r['speedup']:.2f}x); parameters {r['params_before']:,} -> {r['params_after']:,}; "
            f"TT FLOPs/row {r['tt_flops_per_row_before']:,.0f} -> {r['tt_flops_per_row_after']:,.0f}")


if __name__ == "__main__":
    print(format_rows(run()))
