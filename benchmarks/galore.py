"""CoMERA against GaLore (the memory-efficient baseline of the paper) at batch 1, on the six-encoder model.

Three ways to train the same model, one AdamW-family step each on 1 x 128 tokens, in one process:
- dense + torch.optim.AdamW, eager (context);
- dense + GaLore's AdamW (galore-torch; rank 128 projections of every encoder weight matrix, the paper's
  setting; projections refreshed every 200 steps), eager;
- CoMERA: tensorized (preset "comera-six-encoder", r = 30) + AdamW, the step compiled by backend "comera"
  (eager with ``quick``: a cold compile of the batch-1 step alone takes about a minute here).
Step times are interleaved medians after warm-up (GaLore's SVD refresh, once per 200 steps, falls in the
warm-up, as it would amortise in training).

Tracked memory of a step = persistent bytes (parameters and optimizer state, each storage once) + the peak
live bytes of every tensor the step creates (activations, gradients, temporaries: comera_compile.memory.
PeakMemory).  Inductor's compiled kernels allocate out of sight of a dispatch mode, so the step is tracked
in eager mode, the same computation the compiled step runs (which fuses, and so keeps no more).
"""

from __future__ import annotations

import time
from typing import Iterator

import torch
from torch import nn

import comera_compile as cc
from comera_compile.examples import six_encoder
from comera_compile.memory import peak_bytes, storage_key

from .common import compare, eager_step, format_flat_rows as format_rows

__all__ = ["run", "format_rows", "galore_optimizer", "persistent_bytes"]

MIB = 2.0**20


def galore_optimizer(model: nn.Module, rank: int = 128, lr: float = 1e-4) -> torch.optim.Optimizer:
    """GaLore's AdamW with the encoder's 2-D Linear weights projected to `rank` (the paper's recipe)."""
    from galore_torch import GaLoreAdamW

    low_rank = [m.weight for name, m in model.named_modules()
                if isinstance(m, nn.Linear) and name.startswith("layers.")]
    ids = {id(p) for p in low_rank}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return GaLoreAdamW([{"params": rest},
                        {"params": low_rank, "rank": rank, "update_proj_gap": 200, "scale": 0.25,
                         "proj_type": "std"}], lr=lr, weight_decay=0.0, no_deprecation_warning=True)


def _tensors_in(value: object, visited: set[int]) -> Iterator[torch.Tensor]:
    """Every tensor an optimizer-state value holds: the value itself, inside lists, tuples and dicts, or as an
    attribute of an object kept in the state (GaLore's projector and its ``ortho_matrix``, a list [U, V] for
    its "full" projection), each object visited once."""
    if isinstance(value, torch.Tensor):
        yield value
        return
    if id(value) in visited or isinstance(value, (str, bytes, int, float, bool, type(None))):
        return
    visited.add(id(value))
    if isinstance(value, dict):
        items = value.values()
    elif isinstance(value, (list, tuple, set)):
        items = value
    else:
        items = getattr(value, "__dict__", {}).values()
    for item in items:
        yield from _tensors_in(item, visited)


def persistent_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters, buffers and optimizer state tensors (those held by objects in the state too,
    such as GaLore's projection matrices), each storage once: a view counts its whole storage, which it keeps
    alive (GaLore's projector is a slice of the SVD's factor)."""
    seen: dict = {}
    visited: set[int] = set()
    tensors = [*model.parameters(), *model.buffers()]
    for state in optimizer.state.values():
        tensors += list(_tensors_in(state, visited))
    for t in tensors:
        key, size = storage_key(t)
        seen[key] = size
    return sum(seen.values())


def run(quick: bool = False, seq: int = 128) -> list[dict]:
    """Median step time and tracked memory of dense AdamW, GaLore and CoMERA at batch 1."""
    layers = 1 if quick else 6
    loss_fn = nn.CrossEntropyLoss()
    torch.manual_seed(0)
    dense = six_encoder.build(layers=layers)
    galore = six_encoder.build(layers=layers)
    galore.load_state_dict(dense.state_dict())
    tt_eager = cc.tensorize(dense, preset="comera-six-encoder")
    tt = cc.tensorize(dense, preset="comera-six-encoder")
    tt.load_state_dict(tt_eager.state_dict())
    ids, seg, mask = six_encoder.example_inputs(dense, batch=1, seq=seq)
    batch = (ids, seg, mask, torch.tensor([1]))

    opts = {"dense AdamW": torch.optim.AdamW(dense.parameters(), lr=1e-4),
            "GaLore": galore_optimizer(galore), "CoMERA": torch.optim.AdamW(tt.parameters(), lr=1e-4),
            "CoMERA eager": torch.optim.AdamW(tt_eager.parameters(), lr=1e-4)}
    steps = {"dense AdamW": eager_step(dense, opts["dense AdamW"], loss_fn),
             "GaLore": eager_step(galore, opts["GaLore"], loss_fn),
             "CoMERA": (eager_step(tt, opts["CoMERA"], loss_fn) if quick
                        else cc.compile_step(tt, loss_fn, opts["CoMERA"], backend="comera"))}
    t0 = time.perf_counter()
    steps["CoMERA"](*batch)
    compile_s = time.perf_counter() - t0
    m = compare({k: (lambda f=f: f(*batch)) for k, f in steps.items()},
                warmup=1 if quick else 2, repeat=3 if quick else 7)
    ms = {k: v.median * 1e3 for k, v in m.items()}

    # memory: the CoMERA step in eager mode (same computation), after a warm-up step made optimizer state
    eager_steps = {"dense AdamW": steps["dense AdamW"], "GaLore": steps["GaLore"],
                   "CoMERA": eager_step(tt_eager, opts["CoMERA eager"], loss_fn)}
    eager_steps["CoMERA"](*batch)
    models = {"dense AdamW": dense, "GaLore": galore, "CoMERA": tt_eager}
    mem = {}
    for k, f in eager_steps.items():
        opt = opts["CoMERA eager"] if k == "CoMERA" else opts[k]
        mem[k] = (persistent_bytes(models[k], opt) + peak_bytes(f, *batch)) / MIB
    return [{
        "benchmark": f"galore_b1x{seq}_l{layers}",
        **{f"{k} ms": v for k, v in ms.items()},
        **{f"{k} MiB": v for k, v in mem.items()},
        "CoMERA speedup vs GaLore": ms["GaLore"] / ms["CoMERA"],
        "CoMERA memory reduction vs GaLore": mem["GaLore"] / mem["CoMERA"],
        "CoMERA execution": "eager (--quick)" if quick else "backend comera",
        **({} if quick else {"first compile s (CoMERA)": compile_s}),
    }]


if __name__ == "__main__":
    print(format_rows(run()))
