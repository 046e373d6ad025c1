"""TT linear layer vs nn.Linear, forward + backward, and the planner's own cost.

CoMERA's FFN up-projection 768 -> 3072 at r = 30 on several row counts: nn.Linear, TTLinear with the
searched plan, and the same cores contracted in the reference implementation's fixed order (merge the
input cores, merge the output cores, two GEMMs)."""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from comera_compile import networks as nw
from comera_compile.networks import codegen
from comera_compile.layers import TTLinear
from comera_compile.report import times_faster

from .common import compare, fixed_order_plan

__all__ = ["run", "cases", "format_rows"]


def cases(dense: nn.Linear, tt: TTLinear, x: torch.Tensor, grad: torch.Tensor) -> dict[str, Callable[[], None]]:
    """The timed calls on `x` (rows, in_features): forward and backward of nn.Linear, of TTLinear with its
    searched plan, and of the same cores in the fixed order.  Each call starts with every gradient unset (the
    layer's parameters' and x's), as a training step after ``zero_grad(set_to_none=True)``: its backward writes
    the gradients afresh rather than adding into those of the call before (one more pass over the weights)."""
    rows = x.shape[0]
    fixed = fixed_order_plan(tt.spec, rows)

    def fresh(layer: nn.Module) -> None:
        for p in layer.parameters():
            p.grad = None
        x.grad = None

    def run_dense() -> None:
        fresh(dense)
        dense(x).backward(grad)

    def run_tt() -> None:
        fresh(tt)
        tt(x).backward(grad)

    run_order = codegen.tt_linear_runner(tt.spec, fixed.program, tt.bias is not None)

    def run_fixed() -> None:  # the code TTLinear generates for a program, bias fusion included: only the order differs
        fresh(tt)
        run_order(x, *tt.cores, *tt.gates, tt.bias, rows).backward(grad)

    return {"nn.Linear": run_dense, "TT searched": run_tt, "TT fixed order": run_fixed}


def run(quick: bool = False, device: str | torch.device = "cpu") -> list[dict]:
    """Rows of figures: per row count, medians of fwd+bwd for dense, TT (searched) and TT (fixed order), on
    `device` (on CUDA each call is timed to the end of its device work; more rows, as a GPU wants)."""
    torch.manual_seed(0)
    device = torch.device(device)
    rows_list = [32, 1024] if quick else [1, 32, 128, 1024, 4096]
    if device.type == "cuda" and not quick:
        rows_list += [16384, 65536]
    repeat = 5 if quick else 15
    dense = nn.Linear(768, 3072, device=device)
    tt = TTLinear(768, 3072, rank=30, in_modes=(12, 8, 8), out_modes=(12, 16, 16), device=device)
    results = []
    for rows in rows_list:
        x = torch.randn(rows, 768, device=device, requires_grad=True)
        grad = torch.randn(rows, 3072, device=device)  # the upstream gradient a training step would bring
        m = compare(cases(dense, tt, x, grad), repeat=repeat, min_time=0.02, device=device)
        plan, fixed = tt.plan(rows), fixed_order_plan(tt.spec, rows)
        results.append({
            "benchmark": "tt_linear_768x3072_r30_fwd_bwd", "rows": rows, "device": device.type,
            "dense_ms": m["nn.Linear"].median * 1e3, "tt_ms": m["TT searched"].median * 1e3,
            "fixed_order_ms": m["TT fixed order"].median * 1e3,
            "speedup_vs_dense": m["nn.Linear"].median / m["TT searched"].median,
            "speedup_vs_fixed_order": m["TT fixed order"].median / m["TT searched"].median,
            "tt_train_gflop": plan.training_flops / 1e9, "fixed_train_gflop": fixed.training_flops / 1e9,
            "dense_train_gflop": 3 * 2 * rows * 768 * 3072 / 1e9,
        })
    # Planning cost: a cold search for one layer shape, and the cache hit for a second layer.
    nw.plan_tt_linear.cache_clear()
    other = TTLinear(768, 3072, rank=30, in_modes=(12, 8, 8), out_modes=(12, 16, 16), device=device)
    t0 = time.perf_counter()
    tt.plan(777)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    other.plan(777)
    warm = time.perf_counter() - t0
    results.append({"benchmark": "plan_one_layer", "cold_ms": cold * 1e3, "cached_ms": warm * 1e3,
                    "cache_hits": nw.plan_tt_linear.cache_info().hits})
    return results


def format_rows(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        if r["benchmark"] == "plan_one_layer":
            lines.append(f"planning one layer: {r['cold_ms']:.1f} ms cold, {r['cached_ms']:.3f} ms for a second "
                         f"layer of the same shapes (cache hits: {r['cache_hits']})")
        else:
            lines.append(f"768->3072 r=30 fwd+bwd, {r['rows']:>5} rows: nn.Linear {r['dense_ms']:8.2f} ms | "
                         f"TT {r['tt_ms']:7.2f} ms ({r['speedup_vs_dense']:.2f}x vs dense) | fixed order "
                         f"{r['fixed_order_ms']:7.2f} ms (searched {times_faster(r['speedup_vs_fixed_order'], 2)})")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_rows(run()))
