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
    return [{
        "benchmark": "rank_cut_step", "before_ms": m["before cut"].median * 1e3,
        "after_ms": m["after cut"].median * 1e3, "speedup": m["before cut"].median / m["after cut"].median,
        "params_before": before.total_params, "params_after": after.total_params,
        "tt_flops_per_row_before": sum(r.flops_per_row for r in before.rows),
        "tt_flops_per_row_after": sum(r.flops_per_row for r in after.rows),
    }]


def format_rows(rows: list[dict]) -> str:
    r = rows[0]
    return (f"rank cut (every internal rank halved): step {r['before_ms']:.1f} ms -> {r['after_ms']:.1f} ms "
            f"({r['speedup']:.2f}x); parameters {r['params_before']:,} -> {r['params_after']:,}; "
            f"TT FLOPs/row {r['tt_flops_per_row_before']:,.0f} -> {r['tt_flops_per_row_after']:,.0f}")


if __name__ == "__main__":
    print(format_rows(run()))
