"""What the demo reports: the comparison read off the two runs' curves, the table and the plot."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Callable, Iterable

from comera_compile.report import times_faster

__all__ = ["precision_words", "reach_time", "step_figures", "ratio", "NO_STEADY_STEP", "summarize", "format_table",
           "smooth", "skipped_words", "plot", "write_outputs", "environment", "finish", "budget_words", "ended_by",
           "end_label", "budget_line"]


def precision_words(run: dict[str, Any]) -> str:
    """A run's precision (its results' "precision"; fp32 in runs that predate it) in the table's words."""
    return {"tf32": "fp32 with TF32 matmuls", "bf16": "bf16 autocast",
            "fp16": "fp16 autocast, loss scaled"}.get(run.get("precision", "fp32"), "fp32")


# The step-time cell of a run whose every step compiled (or captured): its budget ended before one ran steady.
NO_STEADY_STEP = "n/a (every step compiled; raise --minutes)"


def step_figures(times: list[float], compiled: Iterable[int]) -> tuple[float | None, float]:
    """A run's median step time over the steps that did not compile (0-based indexes in `compiled`), and its
    compile time: what the compiling steps took beyond that median.  Where every step compiled (a budget
    shorter than the first compile) there is no steady step: the median is None and the compile time is
    all of those steps' time, so no speed figure is read off compile times."""
    compiled = set(compiled)
    steady = [t for i, t in enumerate(times) if i not in compiled]
    if not steady:
        return None, float(sum(times))
    median = statistics.median(steady)
    return median, float(sum(max(0.0, times[i] - median) for i in compiled if i < len(times)))


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing."""
    return None if a is None or b is None else a / b


def reach_time(evals: list[dict[str, Any]], target: float, key: str = "time_s") -> float | None:
    """When (training seconds, or steps with key="step") the held-out loss first reached `target`, linearly
    interpolated between evaluations; None if it never did."""
    prev = None
    for e in evals:
        if e["loss"] <= target:
            if prev is None or prev["loss"] == e["loss"]:
                return float(e[key])
            frac = (prev["loss"] - target) / (prev["loss"] - e["loss"])
            return float(prev[key] + frac * (e[key] - prev[key]))
        prev = e
    return None


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The figures the demo is about: step speed-up, memory, compression, quality at equal time and equal
    steps, and when CoMERA reached dense's final held-out loss."""
    d, c = result["runs"]["dense"], result["runs"]["comera"]
    at_steps = [e for e in c["evals"] if e["step"] == d["steps"]]
    reach = reach_time(c["evals"], d["heldout_loss"])
    unigram = result["corpus"]["unigram"]
    return {
        "step_speedup": ratio(d["median_step_s"], c["median_step_s"]),
        "memory_ratio": c["peak_bytes"] / d["peak_bytes"],
        "encoder_compression_end": result["dense_params"]["encoder"] / c["params_encoder"],
        "active_tt_fall": c["active_tt_params_start"] / max(1, c["active_tt_params_end"]),
        "dense_final_loss": d["heldout_loss"],
        "comera_reach_s": reach,
        "comera_reach_fraction": None if reach is None else reach / d["time_s"],
        "equal_steps": d["steps"],
        "comera_at_equal_steps": at_steps[0] if at_steps else None,
        "comera_accuracy_vs_unigram": c["heldout_accuracy"] / max(unigram["accuracy"], 1e-12),
    }


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def _rss(run: dict[str, Any]) -> str:
    """Peak RSS, and what the run added to the process's RSS at its start (runs that predate it: the peak)."""
    peak, start = run["peak_rss_bytes"], run.get("rss_start_bytes")
    if peak is None or start is None:
        return _mib(peak)
    return f"{_mib(peak)} (+{(peak - start) / 2**20:.1f})"


def _step_cell(run: dict[str, Any]) -> str:
    return NO_STEADY_STEP if run["median_step_s"] is None else f"{run['median_step_s'] * 1e3:.0f} ms"


def _quality(e: dict[str, Any] | None) -> str:
    return "n/a" if e is None else f"{e['loss']:.3f} / {100 * e['accuracy']:.2f}%"


def format_table(result: dict[str, Any]) -> str:
    """The end-of-run table (Markdown) and the lines under it."""
    d, c, s = result["runs"]["dense"], result["runs"]["comera"], result["summary"]
    dense_enc = result["dense_params"]["encoder"]
    dense_at_steps = d["evals"][-1]
    rows = [
        ("execution", d["execution"], c["execution"]),
        ("training time (compiles included, evaluations not)", f"{d['time_s']:.0f} s", f"{c['time_s']:.0f} s"),
        ("steps", f"{d['steps']:,}", f"{c['steps']:,}"),
        ("median step time", _step_cell(d), _step_cell(c) + ("" if s["step_speedup"] is None
                                                             else f" ({times_faster(s['step_speedup'])})")),
        ("compile time", "-" if d["compile_s"] == 0 else f"{d['compile_s']:.1f} s", f"{c['compile_s']:.1f} s"),
        ("peak tracked memory, one eager fwd+bwd", _mib(d["peak_bytes"]),
         f"{_mib(c['peak_bytes'])} ({s['memory_ratio']:.2f}x)"),
        ("peak process RSS while training (its growth over the run's start)", _rss(d), _rss(c)),
        ("encoder parameters, start -> end", f"{dense_enc:,}",
         f"{c['params_encoder_start']:,} -> {c['params_encoder']:,} ({s['encoder_compression_end']:.0f}x fewer)"),
        ("active TT parameters, start -> end", "-",
         f"{c['active_tt_params_start']:,} -> {c['active_tt_params_end']:,} ({s['active_tt_fall']:.1f}x fewer)"),
        (end_label(result["config"], result["runs"], _LABELS), _quality(d["evals"][-1]), _quality(c["evals"][-1])),
        (f"held-out loss / accuracy at {d['steps']:,} steps", _quality(dense_at_steps),
         _quality(s["comera_at_equal_steps"])),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows + [("", "dense", "")])
    w2 = max(len(r[2]) for r in rows + [("", "", "CoMERA")])
    lines = [f"| {'':<{w0}} | {'dense':>{w1}} | {'CoMERA':>{w2}} |",
             f"| {'-' * w0} | {'-' * (w1 - 1)}: | {'-' * (w2 - 1)}: |"]
    lines += [f"| {a:<{w0}} | {b:>{w1}} | {x:>{w2}} |" for a, b, x in rows]
    uni = result["corpus"]["unigram"]
    cfg = result["config"]
    lines.append("")
    lines.append(f"Unigram baseline (no context): loss {uni['loss']:.3f}, accuracy {100 * uni['accuracy']:.2f}%; "
                 f"CoMERA's final accuracy is {s['comera_accuracy_vs_unigram']:.1f}x it.")
    if s["comera_reach_s"] is None:
        lines.append(f"CoMERA did not reach dense's final held-out loss ({s['dense_final_loss']:.3f}) in its budget.")
    else:
        share = s["comera_reach_fraction"]
        lines.append(f"CoMERA reached dense's final held-out loss ({s['dense_final_loss']:.3f}) after "
                     f"{_seconds(s['comera_reach_s'])} of training: "
                     + (f"{100 * share:.0f}% of dense's" if share <= 1 else f"{share:.1f}x dense's")
                     + f" {_seconds(d['time_s'])}.")
    where = result['device'] if result.get('device', 'cpu') != 'cpu' else f"{result['threads']} thread(s)"
    if result.get("processes", 1) > 1:
        where += f" per process, {result['processes']} processes ({cfg.get('parallel', 'ddp').upper()})"
    parts = cfg.get("micro_batches", 1)
    accumulated = f" (each in {parts} micro-batches, gradients accumulated)" if parts > 1 else ""
    lines.append(f"{budget_line(cfg, result['runs'], _LABELS)}; batches of {cfg['batch']} x {cfg['seq_len']} "
                 f"tokens{accumulated} in "
                 f"{precision_words(result['runs']['dense'])}; size "
                 f"{cfg['size']!r}, seed {cfg['seed']}, {where}; held-out: "
                 f"{result['corpus']['heldout_masked_tokens']} masked tokens of {result['corpus']['heldout_files']} "
                 f"files never trained on; {wall_words(result, _LABELS)}")
    skipped = skipped_words(result["runs"], _LABELS)
    if skipped:
        lines.append(skipped)
    return "\n".join(lines)


_LABELS = {"dense": "dense", "comera": "CoMERA"}


def budget_words(minutes: float | None, steps: int | None) -> str:
    """A budget per model in words: "5 min", "20 steps", or both ("5 min or 20 steps")."""
    words = ([f"{minutes:g} min"] if minutes is not None else []) + ([f"{steps:,} steps"] if steps is not None else [])
    return " or ".join(words)


def ended_by(run: dict[str, Any], config: dict[str, Any]) -> str:
    """Which budget ended a run: "steps" where it ran to config's step cap, else "time" (its run's own
    "ended_by"; inferred from its step count in runs that predate it)."""
    if run.get("ended_by"):
        return run["ended_by"]
    return "steps" if config.get("steps") is not None and run["steps"] >= config["steps"] else "time"


def end_label(config: dict[str, Any], runs: dict[str, dict[str, Any]], labels: dict[str, str]) -> str:
    """The table's label of the final evaluations: "end of equal time" or "end of equal steps" by the budget
    that ended both runs, each run's budget where they differ."""
    ends = {name: ended_by(run, config) for name, run in runs.items()}
    if len(set(ends.values())) == 1:
        return f"held-out loss / accuracy, end of equal {next(iter(ends.values()))}"
    each = ", ".join(f"{labels.get(n, n)}: {_end_words(e, config)}" for n, e in ends.items())
    return f"held-out loss / accuracy, end of each run ({each})"


def _end_words(end: str, config: dict[str, Any]) -> str:
    return f"{config['minutes']:g} min" if end == "time" else f"the {config['steps']:,}-step cap"


def budget_line(config: dict[str, Any], runs: dict[str, dict[str, Any]], labels: dict[str, str]) -> str:
    """"Budget ... per model", with, where both a time and a step budget were given, which ended each run."""
    line = f"Budget {budget_words(config['minutes'], config['steps'])} per model"
    if config["minutes"] is None or config["steps"] is None:
        return line
    ends = {name: ended_by(run, config) for name, run in runs.items()}
    if len(set(ends.values())) == 1:
        which = f"both stopped at {_end_words(next(iter(ends.values())), config)}"
    else:
        which = ", ".join(f"{labels.get(n, n)} stopped at {_end_words(e, config)}" for n, e in ends.items())
    return f"{line}, whichever ends first ({which})"


def wall_words(result: dict[str, Any], labels: dict[str, str]) -> str:
    """The command's wall time, and under --resume which runs it kept from an earlier command (their time is
    not in it)."""
    words = f"wall time {result['wall_time_s']:.0f} s"
    kept = result.get("resumed") or []
    if kept:
        words += (f" for this command, which kept {', '.join(labels.get(n, n) for n in kept)} from an earlier one "
                  f"(--resume)")
    return words


def skipped_words(runs: dict[str, dict[str, Any]], labels: dict[str, str]) -> str | None:
    """The sentence a table ends with where an fp16 run's loss scaler skipped steps (None where none did)."""
    counts = [f"{labels.get(name, name)} {run['skipped_steps']}" for name, run in runs.items()
              if run.get("skipped_steps")]
    if not counts:
        return None
    return (f"Steps the fp16 loss scaler skipped (gradients overflowed: no update, time counted): "
            f"{', '.join(counts)}.")


def smooth(values: list[float | None]) -> list[float]:
    """A training curve's moving average over a 25th of its length, of the steps that have a loss (a step the
    fp16 loss scaler skipped has None); NaN where a window has none (a gap in the plot)."""
    window = max(1, len(values) // 25)
    out = []
    for i in range(len(values)):
        kept = [v for v in values[max(0, i - window + 1): i + 1] if v is not None and math.isfinite(v)]
        out.append(statistics.fmean(kept) if kept else math.nan)
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    """Held-out loss against training seconds and against steps, held-out accuracy against seconds (with
    the unigram baseline), and CoMERA's active TT parameters against seconds (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (ax_t, ax_s), (ax_acc, ax_size) = axes
    colors = {"dense": "tab:blue", "comera": "tab:orange"}
    labels = {"dense": "dense", "comera": "CoMERA"}
    uni = result["corpus"]["unigram"]
    for name, run_ in result["runs"].items():
        h, ev = run_["history"], run_["evals"]
        for ax, x_key in ((ax_t, "time_s"), (ax_s, "step")):
            ax.plot(h[x_key], smooth(h["loss"]), color=colors[name], alpha=0.3, linewidth=0.9,
                    label=f"{labels[name]}, training (smoothed)")
            ax.plot([e[x_key] for e in ev], [e["loss"] for e in ev], "o-", color=colors[name],
                    label=f"{labels[name]}, held-out")
        ax_acc.plot([e["time_s"] for e in ev], [100 * e["accuracy"] for e in ev], "o-", color=colors[name],
                    label=labels[name])
    s = result["summary"]
    for ax in (ax_t, ax_s):
        ax.axhline(uni["loss"], color="gray", linestyle=":", label="unigram baseline")
        ax.axhline(s["dense_final_loss"], color=colors["dense"], linestyle="--", linewidth=0.8,
                   label="dense's final held-out loss")
        ax.set_ylabel("MLM loss")
        ax.legend(fontsize=8)
    if s["comera_reach_s"] is not None:
        ax_t.axvline(s["comera_reach_s"], color=colors["comera"], linestyle="--", linewidth=0.8)
    ax_t.set_xlabel("training seconds (compiles included)")
    ax_t.set_title("held-out loss at equal time")
    ax_s.set_xlabel("step")
    ax_s.set_title("held-out loss at equal steps")
    ax_acc.axhline(100 * uni["accuracy"], color="gray", linestyle=":", label="unigram baseline")
    ax_acc.set_xlabel("training seconds")
    ax_acc.set_ylabel("held-out accuracy (%)")
    ax_acc.set_title("masked-token accuracy")
    ax_acc.legend(fontsize=8)
    c = result["runs"]["comera"]
    ax_size.plot(c["history"]["time_s"], c["history"]["active_tt_params"], color=colors["comera"])
    for step in c["compile_steps"][1:]:
        ax_size.axvline(c["history"]["time_s"][step - 1], color="gray", linewidth=0.6, linestyle=":")
    ax_size.set_xlabel("training seconds (dotted: re-allocation, one recompile)")
    ax_size.set_ylabel("active TT parameters")
    ax_size.set_yscale("log")
    ax_size.set_title(f"CoMERA's TT parameters: {s['active_tt_fall']:.1f}x fewer by the end")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(result: dict[str, Any], out: Path, format_table: Callable[[dict[str, Any]], str],
                  plot: Callable[[dict[str, Any], Path], None], log: Callable[[str], None]) -> None:
    """Write a run's table.md, curves.png and results.json to out (their paths into result["files"]), then
    print the table and the paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"table": out / "table.md", "plot": out / "curves.png", "json": out / "results.json"}
    result["files"] = {k: str(v) for k, v in paths.items()}
    table = format_table(result)
    paths["table"].write_text(table + "\n")
    plot(result, paths["plot"])
    paths["json"].write_text(json.dumps(result, indent=1) + "\n")
    log("")
    log(table)
    log("")
    for key, p in paths.items():
        log(f"{key:>5}: {p}")


def environment(processes: int, device: Any) -> dict[str, Any]:
    """Where a run ran, for its results.json: intra-op threads, processes, the device's name, torch's version."""
    import torch

    return {"threads": torch.get_num_threads(), "processes": processes,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__}


def finish(result: dict[str, Any], summarize: Callable[[dict[str, Any]], dict[str, Any]], main: bool, out: Path,
           t_start: float, format_table: Callable[[dict[str, Any]], str],
           plot: Callable[[dict[str, Any], Path], None], log: Callable[[str], None]) -> dict[str, Any]:
    """A run's summary and wall time into result; on the main process, its table, plot and JSON written
    (write_outputs).  Returns result."""
    import time

    result["summary"] = summarize(result)
    result["wall_time_s"] = time.perf_counter() - t_start
    if main:
        write_outputs(result, out, format_table, plot, log)
    return result


def _seconds(t: float) -> str:
    """A duration in seconds, with a decimal under 10 s (a short run's 0.4 s is not "0 s")."""
    return f"{t:.1f} s" if t < 10 else f"{t:.0f} s"
