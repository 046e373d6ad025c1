"""Does rank adaptation beat guessing the small rank up front?  On the demo's code-MLM task at its default
size, three models train the same steps on the same batches: RankAdaptive at its defaults, the same model
without adaptation, and a model built at the ranks adaptation ended with (fresh random cores) -- the
control.  Optionally a frontier of uniform-rank models (``frontier=(4, 8, ...)``), each trained the same
way without adaptation, so adaptation's (size, held-out loss) point can be read against what guessing one
rank for every bond buys at each size.  Reported: TT parameters at the start and end, adaptation's size
trajectory (every rounding), held-out loss and accuracy with its standard error, and adapt's differences
from every other run paired token by token on the same held-out set, each with its standard error
(clustered by held-out block: tokens of one sequence are not independent), so a difference can be read
against its noise.

Opt-in (about 30 minutes on one thread at the default 2,000 steps): ``comera-compile bench --only
ra_control``.  The long preset's run with a frontier, on a GPU: ``ra_control.run(preset="long",
frontier=(4, 6, 8, 12, 16), device="cuda")``.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import comera_compile as cc
from comera_compile.layers import TTLinear
from comera_compile.optim import tt_layers

__all__ = ["run", "compare", "format_rows", "plot", "train", "frontier_at", "last_quarter_change"]

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
            losses.append(F.cross_entropy(logits.double(), flat, reduction="none").cpu())
            correct.append((logits.argmax(dim=-1) == flat).double().cpu())
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
    """Train the demo's CoMERA model for cfg.steps steps on cfg.device -- kind "adapt" (RankAdaptive at its
    defaults, or with ``adapt_kwargs``), "fixed" (no adaptation, at cfg's rank) or "final" (built at
    `ranks`) -- and evaluate it on every held-out batch (the per-token scores under "tokens"; data.heldout
    must be on cfg.device).  An adapt run's active TT core parameters (``RankAdaptive.size()``) after every
    rounding are under "trajectory"; "tt_end" counts the cut model's TT parameters, gates included."""
    from comera_compile.examples import code_mlm, demo_train

    device = torch.device(cfg.device)
    t0 = time.perf_counter()
    _, model = code_mlm.build_models(cfg, data.vocab_size)
    if kind == "final":
        model = _build_at_ranks(model, ranks or {}, cfg.seed)
    model.to(device)
    start = sum(m.tt_params() for m in tt_layers(model).values())
    if cfg.compile:
        for block in cc.repeated_blocks(model):
            cc.compile_block(block, backend="comera")
    opt = torch.optim.AdamW(cc.param_groups(model, lr=cfg.lr))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(cfg.warmup_steps, 1)))
    ra = cc.RankAdaptive(model, optimizer=opt, **(adapt_kwargs or {})) if kind == "adapt" else None
    stream = demo_train.batches(data, cfg)
    for _ in range(cfg.steps):
        batch = (t.to(device, non_blocking=True) for t in next(stream))
        loss = demo_train._task_loss(model, *batch, data.vocab_size)
        (ra.loss(loss) if ra else loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if ra is not None:
            ra.step()
    if ra is not None:
        ra.cut(share=False)
    layers = tt_layers(model)
    result = {"run": kind, "rank": cfg.model_size().rank if kind == "fixed" else None, "tt_start": start,
              "tt_end": sum(m.tt_params() for m in layers.values()),
              "ranks": {name: m.spec.ranks for name, m in layers.items()}, "tokens": token_scores(model, data),
              "trajectory": [(r.step, r.size) for r in ra.history if r.step % ra.cut_every == 0] if ra else [],
              "seconds": time.perf_counter() - t0}
    tokens = result["tokens"]
    n = result["masked_tokens"] = tokens["loss"].numel()
    result["loss"], result["accuracy"] = float(tokens["loss"].mean()), float(tokens["correct"].mean())
    result["accuracy_se"] = math.sqrt(result["accuracy"] * (1 - result["accuracy"]) / max(n, 1))
    return result


def frontier_at(size: int, frontier: Sequence[dict]) -> dict[str, Any] | None:
    """The uniform-rank frontier's held-out loss at `size` TT parameters: linear in log(size) between the two
    uniform runs that bracket it (the run itself where one has exactly that size), with those runs' ranks;
    None when `size` lies outside the frontier's range (no guess of the frontier beyond what was trained)."""
    pts = sorted((r["tt_end"], r["loss"], r["rank"]) for r in frontier)
    for (s0, l0, r0), (s1, l1, r1) in zip(pts, pts[1:]):
        if s0 <= size <= s1:
            w = 0.0 if s1 == s0 else (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
            return {"loss": l0 + w * (l1 - l0), "between": (r0, r1)}
    if len(pts) == 1 and pts[0][0] == size:
        return {"loss": pts[0][1], "between": (pts[0][2], pts[0][2])}
    return None


def last_quarter_change(trajectory: Sequence[tuple[int, int]], steps: int) -> float | None:
    """Relative change of the TT size over the last quarter of `steps`: |size at the end - size at the last
    rounding at or before 3/4 of the run| / that size (None with no rounding that early)."""
    early = [size for step, size in trajectory if step <= 0.75 * steps]
    if not early or not trajectory:
        return None
    return abs(trajectory[-1][1] - early[-1]) / max(early[-1], 1)


def run(quick: bool = False, steps: int | None = None, adapt_kwargs: dict[str, Any] | None = None,
        preset: str = "demo", frontier: Sequence[int] = (), device: str | None = None, control: bool = True,
        save_dir: str | Path | None = None, **overrides: Any) -> list[dict]:
    """The runs at the demo's default size: adapt, fixed, final (the control; skipped when not `control`)
    and one uniform-rank model per rank in `frontier`, all on `device` (default the CPU), for `steps` steps
    (QUICK_STEPS when quick; default the preset's steps, or STEPS), evaluated on every held-out block.
    adapt_kwargs go to RankAdaptive; preset names code_mlm's preset ("long": rank 32, 3,000 steps) and
    overrides go on top of it.  The adapt row carries its paired differences from the others under
    "vs_fixed", "vs_control" and "vs_uniform" (by rank), and the frontier's loss at its size under
    "frontier".  With save_dir, each run is saved there as it finishes (<name>.pt, its per-token scores
    included) and a run already saved under the same settings is loaded instead of trained again, so a long
    benchmark cut short resumes where it stopped; the plot (``plot``) goes there too, as frontier.png."""
    from comera_compile.examples import code_mlm

    steps = steps or (QUICK_STEPS if quick else code_mlm.PRESETS.get(preset, {}).get("steps") or STEPS)
    settings = {"minutes": None, "steps": steps, "eval_blocks": 10**6, "progress": False, **overrides}
    if device is not None:
        settings["device"] = device
    cfg = code_mlm.preset(preset, **settings)
    cfg.check()
    data, _, _ = code_mlm.prepare_data(cfg, lambda s: None)
    data.heldout = [tuple(t.to(cfg.device) for t in b) for b in data.heldout]
    key = {"config": repr(cfg), "adapt_kwargs": repr(adapt_kwargs)}

    def once(name: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        path = Path(save_dir) / f"{name}.pt" if save_dir is not None else None
        if path is not None and path.exists():
            saved = torch.load(path, weights_only=False)
            if saved["key"] == key:
                return saved["row"]
        row = train(*args, **kwargs)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"key": key, "row": row}, path)
        return row

    adapt = once("adapt", "adapt", cfg, data, adapt_kwargs=adapt_kwargs)
    others = [once("fixed", "fixed", cfg, data)]
    if control:
        others.append(once("final", "final", cfg, data, ranks=adapt["ranks"]))
    uniform = [once(f"uniform{r}", "fixed", replace(cfg, rank=r), data) for r in frontier]
    for row in uniform:
        row["run"] = "uniform"
    rows = compare([adapt, *others, *uniform], steps)
    if save_dir is not None:
        plot(rows, Path(save_dir) / "frontier.png")
    return rows


def compare(rows: Sequence[dict], steps: int) -> list[dict]:
    """The report from trained runs (``train``'s rows, per-token scores included; the adapt run first): the
    adapt row gets its paired differences from every other run, the uniform frontier's loss at its size and
    its size change over the last quarter of `steps`.  The frontier is the uniform runs and, with them, the
    run without adaptation: a uniform-rank model at the starting rank, the frontier's largest point, so that a
    size between the largest uniform run and the start is read against it.  Rows come back without their
    per-token scores."""
    adapt, *rest = [dict(r) for r in rows]
    if adapt["run"] != "adapt":
        raise ValueError(f"the first row must be the adapt run, got {adapt['run']!r}")
    a = adapt["tokens"]
    adapt["vs_uniform"] = {}
    for other in rest:
        o = other["tokens"]
        loss, loss_se = paired_difference(a["loss"], o["loss"], a["block"])
        acc, acc_se = paired_difference(a["correct"], o["correct"], a["block"])
        d = {"loss": loss, "loss_se": loss_se, "accuracy": acc, "accuracy_se": acc_se}
        if other["run"] == "uniform":
            adapt["vs_uniform"][other["rank"]] = d
        else:
            adapt["vs_fixed" if other["run"] == "fixed" else "vs_control"] = d
    frontier = _frontier(rest)
    adapt["frontier"] = frontier_at(adapt["tt_end"], frontier) if frontier else None
    adapt["last_quarter_change"] = last_quarter_change(adapt["trajectory"], steps)
    adapt["steps"] = steps
    return [{k: v for k, v in row.items() if k != "tokens"} for row in [adapt, *rest]]


def _frontier(rows: Sequence[dict]) -> list[dict]:
    """The uniform runs and, when there are any, the run without adaptation (uniform at the starting rank,
    the frontier's largest point), by size."""
    uniform = [r for r in rows if r["run"] == "uniform"]
    if uniform:
        uniform += [r for r in rows if r["run"] == "fixed" and r.get("rank") is not None]
    return sorted(uniform, key=lambda r: r["tt_end"])


def format_rows(rows: list[dict]) -> str:
    names = {"adapt": "RankAdaptive at its defaults", "fixed": "no adaptation",
             "final": "built at adapt's final ranks"}
    lines = [f"  {'run':<30} {'TT params start -> end':>24} {'held-out loss':>14} {'accuracy':>16}"]
    for r in rows:
        name = names[r["run"]] if r["run"] in names else f"uniform rank {r['rank']}"
        lines.append(f"  {name:<30} {r['tt_start']:>11,} -> {r['tt_end']:<9,} {r['loss']:>14.3f} "
                     f"{100 * r['accuracy']:>8.2f}% ± {100 * r['accuracy_se']:.2f}")
    a = next(r for r in rows if r["run"] == "adapt")
    lines.append(f"  adapt is {a['tt_start'] / max(a['tt_end'], 1):.1f}x smaller than no adaptation; paired on "
                 f"the same {a['masked_tokens']:,} masked tokens (± one standard error):")
    pairs = [(k, label) for k, label in (("vs_fixed", "adapt - no adaptation"), ("vs_control", "adapt - control"))
             if k in a]
    pairs += [(r, f"adapt - uniform rank {r}") for r in a.get("vs_uniform", {})]
    for key, label in pairs:
        d = a[key] if isinstance(key, str) else a["vs_uniform"][key]
        lines.append(f"    {label:<22} accuracy {100 * d['accuracy']:+.2f} ± {100 * d['accuracy_se']:.2f} points, "
                     f"loss {d['loss']:+.4f} ± {d['loss_se']:.4f}")
    traj = a.get("trajectory") or []
    if traj:
        marks = traj[max(0, len(traj) // 8 - 1)::max(1, len(traj) // 8)]
        lines.append("  adapt's active TT core parameters by step: " + ", ".join(f"{s}: {n:,}" for s, n in marks))
    if a.get("last_quarter_change") is not None:
        lines.append(f"  their change over the last quarter of the run: {100 * a['last_quarter_change']:.1f}%")
    if a.get("frontier"):
        f = a["frontier"]
        verdict = "on or below" if a["loss"] <= f["loss"] else "above"
        lines.append(f"  uniform frontier at adapt's size (between ranks {f['between'][0]} and {f['between'][1]}): "
                     f"loss {f['loss']:.3f}; adapt {a['loss']:.3f}, {verdict} it")
    elif any(r["run"] == "uniform" for r in rows):
        lines.append("  adapt's size lies outside the frontier's range: add smaller or larger uniform ranks")
    return "\n".join(lines)


def plot(rows: Sequence[dict], path: str | Path) -> None:
    """The comparison as a PNG: held-out loss against TT parameters (log scale) -- the uniform-rank frontier
    (the uniform runs and the run without adaptation) as a line, adaptation, no adaptation and the control
    as points -- beside adaptation's active TT core parameters at every rounding, with the last quarter of
    the run shaded (where the size should settle)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_f, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
    uniform = _frontier(rows)
    if uniform:
        ax_f.plot([r["tt_end"] for r in uniform], [r["loss"] for r in uniform], "o-", color="tab:gray",
                  label="uniform ranks (frontier)")
        for r in uniform:
            ax_f.annotate(f"r{r['rank']}", (r["tt_end"], r["loss"]), textcoords="offset points", xytext=(4, 4),
                          fontsize=8, color="tab:gray")
    styles = {"adapt": ("*", "tab:orange", "RankAdaptive"), "fixed": ("s", "tab:blue", "no adaptation"),
              "final": ("^", "tab:green", "built at adapt's final ranks")}
    for r in rows:
        if r["run"] in styles:
            marker, color, label = styles[r["run"]]
            ax_f.plot([r["tt_end"]], [r["loss"]], marker, color=color, markersize=12 if marker == "*" else 8,
                      linestyle="none", label=label)
    ax_f.set_xscale("log")
    ax_f.set_xlabel("TT parameters at the end")
    ax_f.set_ylabel("held-out loss")
    ax_f.set_title("adaptation against the uniform-rank frontier")
    ax_f.legend(fontsize=8)
    adapt = next((r for r in rows if r["run"] == "adapt"), None)
    traj = adapt.get("trajectory") if adapt else None
    if traj:
        steps = adapt.get("steps") or traj[-1][0]
        ax_t.plot([s for s, _ in traj], [n for _, n in traj], "-", color="tab:orange")
        ax_t.axvspan(0.75 * steps, steps, color="tab:gray", alpha=0.15, label="last quarter")
        change = adapt.get("last_quarter_change")
        if change is not None:
            ax_t.set_title(f"adaptation's size: {100 * change:.0f}% change over the last quarter")
        ax_t.set_yscale("log")
        ax_t.legend(fontsize=8)
    ax_t.set_xlabel("step")
    ax_t.set_ylabel("active TT core parameters")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
