"""One command for a GPU machine (``make gpu-check``): the tests marked ``cuda`` and the device benchmark suite,
on the machine's own python and torch, written up as a markdown report and a JSON file.

Such machines often have no network: nothing here installs or downloads anything.  GaLore's optimizer
(galore-torch) is optional: without it the benchmark leaves GaLore out and says so.
``--device cpu`` runs the same tests and benchmarks on the CPU (their CPU code paths, reduced sizes).

Each row of the device step table (a precision and batch) runs in a process of its own, so a row that breaks
its process's CUDA state (a failed graph capture does) cannot take the rows after it down; every part is
kept under ``--out`` as it finishes.  Lent GPUs come with time limits: the rows run headline first
(``common.row_plan``: bf16 at batch 8, then the other batches, then fp32) and the per-layer benchmarks after
them; ``--budget SECONDS`` starts no part that would not fit, and ``--resume`` (the same command again)
keeps what an earlier run finished and runs only the rest, so a check cut in parts still ends in one
report.  The exit status is 0 only when the tests passed and every part was measured.

    python -m comera_compile.benchmarks.gpu_check [--device cuda|cpu] [--out DIR] [--quick] [--budget S]
                                                  [--resume]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch

__all__ = ["run_tests", "device_rows", "machine", "report_markdown", "main"]

TEST_FILE_TIMEOUT_S = 1800
FIRST_ROW_S = 120.0   # what a device row is assumed to take before one has been timed
OTHER_BENCH_S = 60.0  # what the per-layer benchmarks after the table are assumed to take, each


def device_rows(device: str, out: Path, quick: bool, deadline: float) -> dict[str, Any]:
    """The device step table, each (precision, batch) row measured by a child process into out/rows/ (a row
    already there is kept); a row is started only if the time to `deadline` (time.monotonic()) is at least
    the longest row so far.  Returns {"rows": [...], "missing": ["fp32 b32", ...]}."""
    from .common import row_plan, table_shape

    (out / "rows").mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    missing: list[str] = []
    longest = FIRST_ROW_S
    for precision, batch, _ in row_plan(table_shape(quick, device == "cuda")[0]):
        path = out / "rows" / f"{precision}_b{batch}.json"
        left = deadline - time.monotonic()
        if not path.exists() and left >= longest:
            print(f"device_step {precision} b{batch} ...", flush=True)
            cmd = [sys.executable, "-m", "comera_compile.benchmarks.gpu_check", "--device", device, "--out",
                   str(out), "--row", precision, str(batch), *(["--quick"] if quick else [])]
            t0 = time.monotonic()
            try:
                done = subprocess.run(cmd, capture_output=True, text=True,
                                      timeout=max(1.0, left) if left < float("inf") else None)
            except subprocess.TimeoutExpired:   # cut at the budget: missing, for --resume, not failed
                done = None
            longest = max(longest, time.monotonic() - t0)
            if done is not None and not path.exists():
                rows.append({"benchmark": f"device_step {precision} b{batch}",
                             "error": f"exit {done.returncode}: {done.stderr[-1500:]}"})
                continue
        if path.exists():
            rows.append(json.loads(path.read_text()))
        else:
            missing.append(f"{precision} b{batch}")
    return {"rows": rows, "missing": missing}


def _measure_row(device: str, out: Path, quick: bool, precision: str, batch: int) -> int:
    """One row of the device step table, written to out/rows/ (the child process of device_rows)."""
    from .common import row_plan, table_shape
    from .device_step import format_rows, step_row

    batches, seq, layers = table_shape(quick, device == "cuda")
    extras = next((e for p, b, e in row_plan(batches) if (p, b) == (precision, batch)), frozenset())
    row = step_row(batch, seq, layers, torch.device(device), precision, quick or device != "cuda", extras)
    print(format_rows([row]), flush=True)
    (out / "rows" / f"{precision}_b{batch}.json").write_text(json.dumps(row, indent=1, default=str) + "\n")
    return 0


def machine(device: str) -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda": torch.version.cuda, "platform": platform.platform(),
                            "threads": torch.get_num_threads()}
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), multiprocessors=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1), capability=f"{props.major}.{props.minor}")
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    else:
        info["device"] = f"CPU ({platform.processor() or platform.machine()})"
    return info


def run_tests(device: str, out: Path, workers: int = 1) -> dict[str, Any]:
    """``pytest -m cuda --device DEVICE`` in a child process (over `workers` processes where pytest-xdist is
    installed); counts and failures from its JUnit XML."""
    xml = out / "tests.xml"
    root = Path(__file__).resolve().parents[1]
    tests = root / "tests"
    if not tests.is_dir():   # an installed copy: the tests live in the source tree only
        return {"error": f"no tests/ beside {root}; run from the source tree (make gpu-check)"}
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "--device", device, "-q", "-p", "no:cacheprovider",
           f"--junitxml={xml}", str(tests)]
    if workers > 1 and importlib.util.find_spec("xdist") is not None:
        cmd[3:3] = ["-n", str(workers)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=TEST_FILE_TIMEOUT_S)
    result: dict[str, Any] = {"command": " ".join(["python", *cmd[1:]]), "returncode": done.returncode,
                              "seconds": time.perf_counter() - t0, "tail": done.stdout[-4000:] + done.stderr[-2000:]}
    if xml.exists():
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        cases = []
        for case in suite.iter("testcase"):
            status = "passed"
            for kind in ("failure", "error", "skipped"):
                el = case.find(kind)
                if el is not None:
                    status = {"failure": "failed", "error": "errors", "skipped": "skipped"}[kind]
                    cases.append({"test": case.get("name"), "status": status,
                                  "message": (el.get("message") or "")[:300]})
                    break
            else:
                cases.append({"test": case.get("name"), "status": status, "message": ""})
        result["cases"] = cases
        for s in ("passed", "failed", "errors", "skipped"):
            result[s] = sum(c["status"] == s for c in cases)
    return result


def report_markdown(report: dict[str, Any]) -> str:
    """The report as markdown: machine, test counts and failures, then each benchmark row as a table."""
    m = report["machine"]
    lines = [f"# comera-compile GPU check ({report['date']})", "",
             f"Device: **{m.get('device')}**; torch {m['torch']} (CUDA {m.get('cuda')}), Python {m['python']}, "
             f"{m['platform']}.", "", f"Command: `{report['command']}`", ""]
    t = report["tests"]
    if "error" in t:
        lines += [f"Tests: not run ({t['error']})", ""]
    else:
        lines += [f"## Tests (`{t['command']}`)", "",
                  f"{t.get('passed', 0)} passed, {t.get('failed', 0) + t.get('errors', 0)} failed, "
                  f"{t.get('skipped', 0)} skipped in {t['seconds']:.0f} s (exit {t['returncode']}).", ""]
        for c in t.get("cases", []):
            if c["status"] != "passed":
                lines.append(f"- {c['status']}: `{c['test']}` {c['message']}")
        lines.append("")
    if report.get("missing"):
        lines += [f"**Incomplete:** {report['missing']}.", ""]
    for name, block in report["bench"].items():
        lines += [f"## {name}", ""]
        if "error" in block:
            lines += [f"failed: {block['error']}", ""]
            continue
        for row in block["rows"]:
            if "error" in row:   # a row whose process failed
                lines += [f"### {row['benchmark']}", "", f"failed: {row['error']}", ""]
                continue
            variants = [k[:-3] for k in row if k.endswith(" ms")]
            if "precision" in row:   # the device step: one table per batch and precision
                from .device_step import RATIO_KEYS, breakdown_cells

                lines += [f"### {row['benchmark']} ({row['device']})", "",
                          "| variant | step ms (median) | launches per step | kernels per step | device idle | "
                          "matmul share of busy | TFLOP/s | of matmul peak | peak MiB | first call s |",
                          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
                for v in variants:
                    mem, launches = row.get(f"{v} MiB"), row.get(f"{v} launches")
                    cells = breakdown_cells(row.get(f"{v} breakdown"))
                    more = " | ".join(cells.get(k, "-") for k in ("kernels", "idle", "matmul", "TFLOP/s", "of peak"))
                    lines.append(f"| {v} | {row[v + ' ms']:.2f} | {'-' if launches is None else f'{launches:.0f}'} | "
                                 f"{more} | {'-' if mem is None else f'{mem:.1f}'} | {row[v + ' first s']:.1f} |")
                if "matmul peak TFLOP/s" in row:
                    lines += ["", f"Matmul peak measured here: {row['matmul peak TFLOP/s']:.1f} TFLOP/s "
                                  f"({row['precision']}, a square product, cc.matmul_peak); FLOPs per step from "
                                  f"cc.count_flops (dense {_gflop(row, 'dense eager')}, CoMERA "
                                  f"{_gflop(row, 'CoMERA')} GFLOP)."]
                lines += [f"| {k[:-6]} | failed: {v} | | | | | | | | |" for k, v in row.items() if k.endswith(" error")]
                ratios = [f"{k} **{row[k]:.2f}x**" for k in row if k.startswith(RATIO_KEYS)]
                lines += ["", "; ".join(ratios) + f" (best CoMERA: {row.get('best CoMERA')}).", ""]
                if row.get("note"):
                    lines += [row["note"], ""]
            else:
                lines.append("- " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                              for k, v in row.items()))
        lines.append("")
    return "\n".join(lines)


def _gflop(row: dict, variant: str) -> str:
    flops = (row.get(f"{variant} breakdown") or {}).get("flops") or {}
    return f"{flops['total'] / 1e9:.2f}" if "total" in flops else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", type=Path, default=Path("gpu-check"))
    p.add_argument("--quick", action="store_true", help="smaller benchmark sizes and fewer repeats")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="start no device row that would end past this many seconds from the start")
    p.add_argument("--resume", action="store_true",
                   help="keep the tests and benchmarks an earlier run left under --out; run only the rest")
    p.add_argument("--workers", type=int, default=4 if torch.cuda.is_available() else 1,
                   help="pytest-xdist processes for the tests, where it is installed (default 4 on a GPU)")
    p.add_argument("--row", nargs=2, metavar=("PRECISION", "BATCH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu-check: torch {torch.__version__} sees no CUDA device; --device cpu runs the same code paths "
              f"on the CPU", file=sys.stderr)
        return 2
    if args.row:
        return _measure_row(args.device, args.out, args.quick, args.row[0], int(args.row[1]))
    deadline = time.monotonic() + (args.budget if args.budget is not None else float("inf"))
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.resume:   # a fresh check measures everything anew
        for old in [args.out / "tests.json", *args.out.glob("bench_*.json"), *args.out.glob("rows/*.json")]:
            old.unlink(missing_ok=True)
    from .suite import run_suite

    report: dict[str, Any] = {"command": " ".join(["python -m comera_compile.benchmarks.gpu_check", *(argv or sys.argv[1:])]),
                              "date": _dt.datetime.now().isoformat(timespec="seconds"),
                              "machine": machine(args.device), "bench": {}}
    kept = args.out / "tests.json"
    if args.skip_tests:
        report["tests"] = {"error": "skipped (--skip-tests)"}
    elif kept.exists():
        report["tests"] = json.loads(kept.read_text())
    else:
        report["tests"] = run_tests(args.device, args.out, args.workers)
        kept.write_text(json.dumps(report["tests"], indent=1) + "\n")
    if "error" not in report["tests"]:
        t = report["tests"]
        print(f"tests: {t.get('passed', 0)} passed, {t.get('failed', 0) + t.get('errors', 0)} failed, "
              f"{t.get('skipped', 0)} skipped", flush=True)
    missing: list[str] = []
    if not args.skip_bench:
        from .suite import DEVICE_SUITE

        # one at a time, the step table first (the figures the check is for): a failure leaves the others'
        for name in sorted(DEVICE_SUITE, key=lambda n: n != "device_step"):
            if name == "device_step":
                report["bench"][name] = device_rows(args.device, args.out, args.quick, deadline)
                missing = list(report["bench"][name]["missing"])
                continue
            path = args.out / f"bench_{name}.json"
            if not path.exists() and deadline - time.monotonic() < OTHER_BENCH_S:
                missing.append(name)
                continue
            if not path.exists():
                try:
                    path.write_text(json.dumps(run_suite(quick=args.quick, only=[name], device=args.device)
                                               ["results"][name], indent=1, default=str) + "\n")
                except Exception as e:  # reported, not raised: the rest of the check still runs
                    report["bench"][name] = {"error": f"{type(e).__name__}: {e}"}
                    print(f"{name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                    continue
            report["bench"][name] = json.loads(path.read_text())
    if missing:
        report["missing"] = (f"not measured within --budget: {', '.join(missing)}; run the same command with "
                             f"--resume (make gpu-check GPU_ARGS=--resume) to measure only those")
        print(report["missing"], flush=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (args.out / "report.md").write_text(report_markdown(report) + "\n")
    print(f"wrote {args.out / 'report.md'} and {args.out / 'report.json'}")
    t = report["tests"]
    failed_rows = any("error" in r for r in report["bench"].get("device_step", {}).get("rows", []))
    if failed_rows or not ("error" in t or t["returncode"] == 0):
        return 1
    return 3 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
