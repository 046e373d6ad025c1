"""What `comera-compile pretrain` reports: the comparison read off each method's validation curve (equal
time, equal tokens, time to reach the first method's final perplexity), the table and the plot."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from comera_compile.examples.demo_report import (NO_STEADY_STEP, budget_line, ended_by, precision_words, ratio,
                                                 reach_time, skipped_words, smooth, wall_words)

__all__ = ["LABELS", "mean_rank", "summarize", "end_row", "format_table", "plot"]

LABELS = {"dense": "dense", "comera": "CoMERA", "galore": "GaLore"}


def mean_rank(ranks: dict[str, list[int]] | None) -> float | None:
    """The mean internal TT rank over every bond of every layer (the boundary ranks of 1 left out)."""
    if not ranks:
        return None
    inner = [r for rs in ranks.values() for r in rs[1:-1]]
    return statistics.fmean(inner) if inner else None


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Per method, against the first method run (dense when it ran): speed per step, perplexity at equal
    time and at the first method's final token count, and when (seconds, tokens) its validation loss
    first reached the first method's final one."""
    runs = result["runs"]
    base_name = next(iter(runs))
    base = runs[base_name]
    out: dict[str, Any] = {"baseline": base_name, "baseline_val_loss": base["val_loss"],
                           "baseline_val_ppl": base["val_ppl"], "baseline_tokens": base["tokens"],
                           "baseline_time_s": base["time_s"], "methods": {}}
    for name, r in runs.items():
        at_tokens = next((e for e in r["evals"] if e["tokens"] == base["tokens"]), None)
        reach_s = reach_time(r["evals"], base["val_loss"])
        reach_tokens = reach_time(r["evals"], base["val_loss"], key="tokens")
        m = {
            "step_speedup": ratio(base["median_step_s"], r["median_step_s"]),
            "ppl_ratio_equal_time": r["val_ppl"] / base["val_ppl"],
            "equal_tokens": at_tokens,
            "ppl_ratio_equal_tokens": None if at_tokens is None else at_tokens["ppl"] / base["val_ppl"],
            "reach_s": reach_s,
            "reach_fraction": None if reach_s is None else reach_s / base["time_s"],
            "reach_tokens": reach_tokens,
            "decoder_compression": result["dense_params"]["decoder"] / r["params_decoder"],
        }
        if "tt_params_start" in r:
            m["tt_fall"] = r["tt_params_start"] / max(1, r["tt_params_end"])
            m["mean_rank_start"] = mean_rank(r["ranks_start"])
            m["mean_rank_end"] = mean_rank(r["ranks_end"])
        out["methods"][name] = m
    return out


def end_row(result: dict[str, Any]) -> str:
    """The table's label of the final perplexities, by the budget that ended the runs: "at equal time" or "at
    equal steps" where one ended them all (with --minutes and a --steps cap, the one reached first), else each
    run's ("at the end of each run (dense: the 600-step cap, CoMERA: 12 min)")."""
    cfg, runs = result["config"], result["runs"]
    ends = {name: ended_by(run, cfg) for name, run in runs.items()}
    if len(set(ends.values())) == 1:
        return f"val perplexity (loss) at equal {next(iter(ends.values()))}"
    each = ", ".join(f"{LABELS.get(n, n)}: " + (f"{cfg['minutes']:g} min" if e == "time" else
                                                 f"the {cfg['steps']:,}-step cap") for n, e in ends.items())
    return f"val perplexity (loss) at the end of each run ({each})"


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f} MiB"


def _ppl(e: dict[str, Any] | None) -> str:
    return "n/a" if e is None else f"{e['ppl']:.2f} ({e['loss']:.3f})"


def _ratio(x: float | None, what: str = "x dense's") -> str:
    return "" if x is None else f" ({x:.2f}{what})"


def format_table(result: dict[str, Any]) -> str:
    """The end-of-run table (Markdown) and the lines under it."""
    runs, s = result["runs"], result["summary"]
    names = list(runs)
    base = s["baseline"]
    b = LABELS[base]
    dense = result["dense_params"]
    k_tokens = f"{s['baseline_tokens'] / 1e6:.2f}M" if s["baseline_tokens"] >= 1e5 else f"{s['baseline_tokens']:,}"

    def cell(name: str, key: str) -> str:
        r, m = runs[name], s["methods"][name]
        first = name == base
        if key == "execution":
            return r["execution"]
        if key == "time":
            return f"{r['time_s']:.0f} s"
        if key == "steps":
            return f"{r['steps']:,} / {r['tokens']:,}"
        if key == "passes":
            return "n/a" if r.get("passes") is None else f"{r['passes']:.2f}"
        if key == "step":
            if r["median_step_s"] is None:
                return NO_STEADY_STEP
            return f"{r['median_step_s'] * 1e3:.0f} ms" + ("" if first or m["step_speedup"] is None
                                                          else f" ({m['step_speedup']:.2f}x {b}'s speed)")
        if key == "tps":
            at_median = "n/a" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}"
            return f"{at_median} ({r['tokens_per_s_overall']:,.0f})"
        if key == "compile":
            return f"{r['compile_s']:.1f} s"
        if key == "memory":
            peak = r["peak_cuda_bytes"] if r.get("peak_cuda_bytes") is not None else r["peak_rss_bytes"]
            return _mib(peak)
        if key == "state":
            return _mib(r["state_bytes"])
        if key == "total":
            return f"{r['params_total_start']:,}" + (
                "" if r["params_total"] == r["params_total_start"] else f" -> {r['params_total']:,}")
        if key == "decoder":
            if r["params_decoder"] == r["params_decoder_start"] == dense["decoder"]:
                return f"{dense['decoder']:,}"
            return (f"{r['params_decoder_start']:,} -> {r['params_decoder']:,} "
                    f"({m['decoder_compression']:.0f}x fewer than dense)")
        if key == "tt":
            if "tt_params_start" not in r:
                return "-"
            return f"{r['tt_params_start']:,} -> {r['tt_params_end']:,} ({m['tt_fall']:.2f}x fewer)"
        if key == "rank":
            if "tt_params_start" not in r:
                return "-"
            return f"{m['mean_rank_start']:.1f} -> {m['mean_rank_end']:.1f}"
        if key == "time_ppl":
            return _ppl(r["evals"][-1]) + ("" if first else _ratio(m["ppl_ratio_equal_time"], f"x {b}'s"))
        if key == "token_ppl":
            if m["equal_tokens"] is None:
                return f"not reached ({r['tokens']:,} tokens)"
            return _ppl(m["equal_tokens"]) + ("" if first else _ratio(m["ppl_ratio_equal_tokens"], f"x {b}'s"))
        if key == "reach":
            if first:
                return f"{r['time_s']:.0f} s (its end)"
            if m["reach_s"] is None:
                return "not reached"
            return (f"{m['reach_s']:.0f} s ({100 * m['reach_fraction']:.0f}% of {b}'s time), "
                    f"{m['reach_tokens']:,.0f} tokens")
        raise KeyError(key)

    rows = [
        ("execution", "execution"),
        ("training time (compiles included, evaluations not)", "time"),
        ("steps / tokens", "steps"),
        ("passes over the training text", "passes"),
        ("median step time", "step"),
        ("tokens/s at the median step (overall, compiles included)", "tps"),
        ("compile time (inside the budget)", "compile"),
        ("peak " + ("CUDA memory" if result.get("device", "cpu") != "cpu" else "process RSS while training"),
         "memory"),
        ("parameters + optimizer state", "state"),
        ("parameters, total", "total"),
        ("decoder-layer parameters, start -> end", "decoder"),
        ("active TT parameters, start -> end", "tt"),
        ("mean active TT rank, start -> end", "rank"),
        # the budget's end: equal time on a wall-clock budget, equal steps (and tokens) where the steps ended it
        (end_row(result), "time_ppl"),
        (f"val perplexity (loss) at {b}'s {k_tokens} tokens", "token_ppl"),
        (f"time to reach {b}'s final val perplexity {s['baseline_val_ppl']:.2f}", "reach"),
    ]
    table = [[label] + [cell(n, key) for n in names] for label, key in rows]
    header = [""] + [LABELS[n] for n in names]
    widths = [max(len(r[i]) for r in table + [header]) for i in range(len(header))]
    lines = ["| " + " | ".join(f"{h:<{widths[0]}}" if i == 0 else f"{h:>{widths[i]}}" for i, h in enumerate(header))
             + " |",
             "| " + " | ".join("-" * widths[0] if i == 0 else "-" * (widths[i] - 1) + ":" for i in range(len(header)))
             + " |"]
    lines += ["| " + " | ".join(f"{c:<{widths[0]}}" if i == 0 else f"{c:>{widths[i]}}" for i, c in enumerate(r))
              + " |" for r in table]
    cfg, model, data = result["config"], result["model"], result["data"]
    where = result["device"] if result.get("device", "cpu") != "cpu" else f"{result['threads']} thread(s)"
    if result.get("processes", 1) > 1:
        where += f" per process, {result['processes']} processes (DDP)"
    lrs = ", ".join(f"{LABELS[n]} {runs[n]['lr']:g}" for n in names)
    if "comera" in runs and "tt_cores" in runs["comera"].get("lr_groups", {}):
        groups = runs["comera"]["lr_groups"]
        lrs += f" (CoMERA's TT cores {groups['tt_cores']:g}, rank gates {groups['rank_gates']:g})"
    first = " that ends first" if cfg["minutes"] is not None and cfg["steps"] is not None else ""
    parts = cfg.get("micro_batches", 1)
    accumulated = f" (each in {parts} micro-batches, gradients accumulated)" if parts > 1 else ""
    lines += [
        "",
        f"Llama {cfg['preset']!r}: hidden {model['hidden']}, intermediate {model['intermediate']}, {model['heads']} "
        f"heads, {model['layers']} layers, vocabulary {model['vocab_size']:,}; dense {dense['total']:,} parameters "
        f"({dense['decoder']:,} in the decoder layers)."
        + (f" CoMERA from TT rank {cfg['rank']}." if "comera" in runs else "")
        + (f" GaLore rank {cfg['galore_rank']}, refresh every {cfg['galore_gap']} steps, scale "
           f"{cfg['galore_scale']:g}." if "galore" in runs else ""),
        f"{budget_line(cfg, runs, LABELS)}; batches of {cfg['batch']} x {cfg['seq_len']} tokens{accumulated}, the "
        f"same order for every model, in {precision_words(runs[names[0]])}; AdamW-family, peak lr {lrs}, "
        f"{runs[names[0]].get('warmup_steps', cfg['warmup_steps'])} warm-up steps then cosine to "
        f"{cfg['min_lr_ratio']:g}x over the budget{first}, gradient clipping "
        f"{'off' if cfg['clip'] is None else cfg['clip']}; seed {cfg['seed']}; {where}.",
        f"Validation: {data['val_blocks']} blocks ({data['val_tokens']:,} predicted tokens) of documents never "
        f"trained on, evaluated eagerly; perplexity = exp(mean next-token loss). Data: {data['source']}. "
        f"W{wall_words(result, LABELS)[1:]}.",
    ]
    repeated = [f"{LABELS[n]} {runs[n]['passes']:.1f}" for n in names if (runs[n].get("passes") or 0) > 1]
    if repeated:
        lines.append(f"Batches repeated (passes over the training text: {', '.join(repeated)}): validation perplexity "
                     f"then rewards memorising the training text too; give more text (--data, --max-bytes) to "
                     f"compare on one pass, as the papers do.")
    skipped = skipped_words({n: runs[n] for n in names}, LABELS)
    if skipped:
        lines.append(skipped)
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Validation perplexity against tokens and against training seconds (log scale; training perplexity
    smoothed, faint), and CoMERA's active TT parameters against seconds when it ran (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, s = result["runs"], result["summary"]
    tt = "comera" in runs
    fig, axes = plt.subplots(1, 3 if tt else 2, figsize=(17 if tt else 12, 4.8))
    colors = {"dense": "tab:blue", "comera": "tab:orange", "galore": "tab:green"}
    for name, r in runs.items():
        h, ev = r["history"], r["evals"]
        for ax, key in ((axes[0], "tokens"), (axes[1], "time_s")):
            train_ppl = [math.exp(min(x, 50.0)) for x in smooth(h["loss"])]
            ax.plot(h[key], train_ppl, color=colors[name], alpha=0.25, linewidth=0.9)
            ax.plot([e[key] for e in ev], [e["ppl"] for e in ev], "o-", color=colors[name],
                    label=f"{LABELS[name]}, validation")
    base = LABELS[s["baseline"]]
    for ax in axes[:2]:
        ax.axhline(s["baseline_val_ppl"], color=colors[s["baseline"]], linestyle="--", linewidth=0.8,
                   label=f"{base}'s final validation perplexity")
        ax.set_yscale("log")
        ax.set_ylabel("perplexity (faint: training, smoothed)")
        ax.legend(fontsize=8)
    axes[0].axvline(s["baseline_tokens"], color="gray", linestyle=":", linewidth=0.8)
    from matplotlib.ticker import EngFormatter

    axes[0].xaxis.set_major_formatter(EngFormatter())
    axes[0].set_xlabel("tokens (dotted: equal tokens)")
    axes[0].set_title("validation perplexity against tokens")
    for name, m in s["methods"].items():
        if m["reach_s"] is not None and name != s["baseline"]:
            axes[1].axvline(m["reach_s"], color=colors[name], linestyle="--", linewidth=0.8)
    axes[1].set_xlabel("training seconds (compiles included)")
    axes[1].set_title("validation perplexity at equal time")
    if tt:
        c = runs["comera"]
        axes[2].plot(c["history"]["time_s"], c["history"]["active_tt_params"], color=colors["comera"])
        for step in c["compile_steps"][1:]:
            axes[2].axvline(c["history"]["time_s"][step - 1], color="gray", linewidth=0.6, linestyle=":")
        axes[2].set_xlabel("training seconds (dotted: re-allocation, one recompile)")
        axes[2].set_ylabel("active TT parameters")
        axes[2].set_title("CoMERA's TT parameters")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
