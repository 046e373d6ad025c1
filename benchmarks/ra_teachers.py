"""Does rank adaptation allocate?  Teachers whose TT layers have known, different ranks; a student of the
same architecture allocated at rank 16 everywhere learns them with RankAdaptive at its defaults (the
learning rate set once through ``param_groups``).  Reported per case: the ranks found against the teacher's,
held-out MSE over the noise, TT parameters at the end, and the uniform-rank frontier: the same architecture
at one rank for every bond, no adaptation, trained the same steps on the same batches, with the best
held-out MSE among the uniform models at least as large as adaptation's final size.

Opt-in: ``comera-compile bench --only ra_teachers`` (a few minutes on one thread; ``--quick`` runs two
cases).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from comera_compile.layers import TTLinear
from comera_compile.optim import param_groups
from comera_compile.rank_adaptive import RankAdaptive

__all__ = ["CASES", "Case", "Net", "run", "format_rows", "fit", "teacher_data"]

NOISE = 0.05
STEPS, BATCH, TRAIN, TEST = 3000, 256, 4096, 1024
UNIFORM = (1, 2, 3, 4, 6, 8, 12, 16)


@dataclass(frozen=True)
class Case:
    """layers: (in, out, teacher rank) per TT layer, the rank None for a dense low-rank teacher of rank 5;
    topology "side" (each layer on its own slice of the input, outputs concatenated: every layer's ranks
    are identifiable from the data) or "stack" (in a row, tanh between)."""

    name: str
    topology: str
    layers: tuple[tuple[int, int, int | None], ...]


CASES = (
    Case("two side by side, ranks 8 and 2", "side", ((64, 64, 8), (64, 64, 2))),
    Case("six side by side, ranks 1 to 6", "side", tuple((64, 64, r) for r in (1, 2, 3, 4, 5, 6))),
    Case("three widths 64/256/1024, ranks 2/6/4", "side", ((64, 64, 2), (256, 256, 6), (1024, 1024, 4))),
    Case("dense rank 5 beside TT rank 3", "side", ((64, 64, None), (64, 64, 3))),
    Case("stacked 64-64-64, ranks 6 and 3", "stack", ((64, 64, 6), (64, 64, 3))),
    Case("stacked 64-256-64, ranks 4 and 2", "stack", ((64, 256, 4), (256, 64, 2))),
)


class _DenseLowRank(nn.Module):
    def __init__(self, n_in: int, n_out: int, rank: int = 5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, rank) @ torch.randn(rank, n_in) / math.sqrt(rank * n_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


class Net(nn.Module):
    """A case's architecture: TT layers at `rank` (an int, or per layer), or the teacher's ranks."""

    def __init__(self, case: Case, rank: int | None = None) -> None:
        super().__init__()
        self.topology = case.topology
        layers = []
        for n_in, n_out, r in case.layers:
            if rank is None and r is None:
                layers.append(_DenseLowRank(n_in, n_out))
            else:
                layers.append(TTLinear(n_in, n_out, bias=False, rank=r if rank is None else rank))
        self.layers = nn.ModuleList(layers)
        self.widths = [n_in for n_in, _, _ in case.layers]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.topology == "side":
            return torch.cat([layer(part) for layer, part in zip(self.layers, x.split(self.widths, dim=1))], 1)
        for k, layer in enumerate(self.layers):
            x = layer(x) if k == 0 else layer(torch.tanh(x))
        return x


def teacher_data(case: Case, seed: int = 0):
    """(teacher, x, y, x_test, y_test): targets are the teacher's outputs scaled to unit std, plus noise of
    std NOISE.  A stacked teacher's hidden layer is scaled to unit std too (tanh in its curved range)."""
    torch.manual_seed(seed)
    teacher = Net(case)
    n_in = sum(teacher.widths) if case.topology == "side" else case.layers[0][0]
    x, x_test = torch.randn(TRAIN, n_in), torch.randn(TEST, n_in)
    with torch.no_grad():
        if case.topology == "stack":
            for layer in teacher.layers[:-1]:
                probe = layer(x if layer is teacher.layers[0] else torch.tanh(x))
                for core in layer.cores[:1]:
                    core.div_(probe.std())
        scale = teacher(x).std()
        y = teacher(x) / scale + NOISE * torch.randn(TRAIN, teacher(x).shape[1])
        y_test = teacher(x_test) / scale + NOISE * torch.randn(TEST, y.shape[1])
    return teacher, x, y, x_test, y_test


def exact_ranks(weight: torch.Tensor, like: TTLinear) -> tuple[int, ...]:
    """The TT ranks of a dense weight in `like`'s modes: the numerical ranks of its bond unfoldings (the
    gates of the exact TT-SVD, rotated to each bond's singular basis, above 1e-5 of the bond's largest, as
    float32 weights allow)."""
    from comera_compile.gauge import canonicalize

    exact = TTLinear.from_dense(weight.double(), rank=10**9, in_modes=like.spec.in_modes,
                                out_modes=like.spec.out_modes)
    canonicalize(exact)
    return (1, *(int((g.abs() > 1e-5 * g.abs().max()).sum()) for g in exact.gates), 1)


def tt_size(model: nn.Module, ranks: dict[str, tuple[int, ...]] | None = None) -> int:
    """TT parameters (cores, at the active ranks if given)."""
    total = 0
    for name, m in model.named_modules():
        if isinstance(m, TTLinear):
            r = ranks[name] if ranks is not None else m.ranks
            total += sum(math.prod(s[1:-1]) * r[k] * r[k + 1] for k, s in enumerate(m.spec.core_shapes))
    return total


def fit(model: nn.Module, data, adapt: bool, steps: int = STEPS, seed: int = 1,
        progress: Callable[[int], None] | None = None) -> RankAdaptive | None:
    """Train at the defaults: one lr for param_groups; RankAdaptive with nothing but its optimizer."""
    _, x, y, _, _ = data
    opt = torch.optim.AdamW(param_groups(model, lr=1e-3))
    ra = RankAdaptive(model, optimizer=opt) if adapt else None
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        idx = torch.randint(0, x.shape[0], (BATCH,), generator=g)
        loss = ((model(x[idx]) - y[idx]) ** 2).mean()
        (ra.loss(loss) if ra is not None else loss).backward()
        opt.step()
        opt.zero_grad()
        if ra is not None:
            ra.step()
        if progress is not None:
            progress(step)
    return ra


def held_out(model: nn.Module, data) -> float:
    """Held-out MSE over the noise's variance (1.0: the noise floor)."""
    _, _, _, x_test, y_test = data
    with torch.no_grad():
        return ((model(x_test) - y_test) ** 2).mean().item() / NOISE**2


def run_case(case: Case, steps: int = STEPS, uniform: tuple[int, ...] = UNIFORM) -> dict:
    data = teacher_data(case)
    teacher = data[0]
    torch.manual_seed(100)
    student = Net(case, rank=16)
    diverged = None
    try:
        ra = fit(student, data, adapt=True, steps=steps)
        found = ra.ranks()
    except FloatingPointError as error:   # RankAdaptive's divergence check: reported, not raised
        diverged = str(error)
        found = {name: None for name, m in student.named_modules() if isinstance(m, TTLinear)}
    need = {}
    for name, m in teacher.named_modules():
        if isinstance(m, TTLinear):
            need[name] = m.ranks
        elif isinstance(m, _DenseLowRank):
            need[name] = exact_ranks(m.weight, student.get_submodule(name))
    size = tt_size(student, None if diverged else found)
    mse = float("inf") if diverged else held_out(student, data)
    frontier = []
    for r in uniform:
        torch.manual_seed(100)
        model = Net(case, rank=r)
        fit(model, data, adapt=False, steps=steps)
        frontier.append({"rank": r, "size": tt_size(model), "mse": held_out(model, data)})
    bigger = [f for f in frontier if f["size"] >= size]
    best = min(bigger, key=lambda f: f["mse"]) if bigger else None
    return {"case": case.name, "steps": steps, "found": {k: found[k] for k in sorted(found)},
            "need": {k: need[k] for k in sorted(need)}, "mse": mse, "size": size, "diverged": diverged,
            "frontier": frontier, "best_uniform": best}


def run(quick: bool = False, steps: int | None = None) -> list[dict]:
    cases = CASES[:2] if quick else CASES
    return [run_case(c, steps or (STEPS // 3 if quick else STEPS)) for c in cases]


def format_rows(rows: list[dict]) -> str:
    out = []
    for row in rows:
        best = row["best_uniform"]
        ratio = f"{row['mse'] / best['mse']:.2f}x" if best else "-"
        out.append(f"{row['case']} ({row['steps']} steps): MSE {row['mse']:.2f}x noise at {row['size']:,} TT "
                   f"params; best uniform at least as large: "
                   + (f"rank {best['rank']}, {best['size']:,} params, MSE {best['mse']:.2f}x ({ratio})" if best
                      else "none"))
        if row.get("diverged"):
            out.append(f"    diverged: {row['diverged']}")
        for name in row["found"]:
            found = row["found"][name] or "- (diverged)"
            out.append(f"    {name or '(model)'}: found {found}, teacher {row['need'].get(name)}")
        out.append("    frontier: " + ", ".join(f"r{f['rank']} {f['size']:,}: {f['mse']:.2f}" for f in row["frontier"]))
    return "\n".join(out)
