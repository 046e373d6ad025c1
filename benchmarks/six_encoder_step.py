"""One AdamW training step of the six-encoder model (PAPERS.md), batch 8 x 128 tokens, four ways:
dense eager, dense under torch.compile (Inductor), tensorized eager, tensorized under backend "comera".

All four run in one process, interleaved, medians after warm-up; first-compile times are reported.  The
compiled steps come from compile_step, which sets keep_freed_memory() for the whole process before any
variant is timed, so all four run with the same allocator settings."""

from __future__ import annotations

import time

import torch
from torch import nn

import comera_compile as cc
from comera_compile.examples import six_encoder

from .common import compare, eager_step, format_flat_rows as format_rows

__all__ = ["run", "format_rows"]


def _step_fn(model: nn.Module, compiled_backend: str | None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    loss_fn = nn.CrossEntropyLoss()
    if compiled_backend is None:
        return eager_step(model, opt, loss_fn)
    return cc.compile_step(model, loss_fn, opt, backend=compiled_backend)


def run(quick: bool = False, batch: int = 8, seq: int = 128, layers: int | None = None) -> list[dict]:
    """Median step times (ms) of the four variants, the speedups, parameter counts, compile times.
    layers defaults to the paper's 6, or 1 when quick (compiling six layers takes minutes); quick also
    leaves out dense Inductor, which no ratio uses and whose cold compile alone takes about 25 s here."""
    layers = layers if layers is not None else (1 if quick else 6)
    torch.manual_seed(0)
    dense = six_encoder.build(layers=layers)
    tt = cc.tensorize(dense, preset="comera-six-encoder")
    dense_c = six_encoder.build(layers=layers)
    tt_c = cc.tensorize(six_encoder.build(layers=layers), preset="comera-six-encoder", inplace=True)
    ids, seg, mask = six_encoder.example_inputs(dense, batch=batch, seq=seq)
    target = torch.randint(0, 3, (batch,))
    batch_args = (ids, seg, mask, target)
    variants = {
        "dense eager": _step_fn(dense, None),
        "dense inductor": _step_fn(dense_c, "inductor"),
        "tensorized eager": _step_fn(tt, None),
        "tensorized comera": _step_fn(tt_c, "comera"),
    }
    if quick:
        del variants["dense inductor"]
    compile_s = {}
    for name in [n for n in ("dense inductor", "tensorized comera") if n in variants]:
        t0 = time.perf_counter()
        variants[name](*batch_args)
        compile_s[name] = time.perf_counter() - t0
    m = compare({k: (lambda f=f: f(*batch_args)) for k, f in variants.items()},
                warmup=1 if quick else 2, repeat=3 if quick else 7)
    ms = {k: v.median * 1e3 for k, v in m.items()}
    return [{
        "benchmark": f"six_encoder_step_b{batch}x{seq}_l{layers}", **{f"{k} ms": v for k, v in ms.items()},
        "comera vs dense eager": ms["dense eager"] / ms["tensorized comera"],
        "comera vs tensorized eager": ms["tensorized eager"] / ms["tensorized comera"],
        "dense params": sum(p.numel() for p in dense.parameters()),
        "tensorized params": sum(p.numel() for p in tt.parameters()),
        **{f"first compile s ({k})": v for k, v in compile_s.items()},
    }]


if __name__ == "__main__":
    print(format_rows(run()))
