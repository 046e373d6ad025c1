"""One command for a GPU machine (``make gpu-check``): the tests marked ``cuda`` and the device benchmark suite,
on the machine's own python and torch, written up as a markdown report and a JSON file.

Such machines often have no network: nothing here installs or downloads anything.  GaLore's optimizer
(galore-torch) is optional: without it the benchmark leaves GaLore out and says so.
``--device cpu`` runs the same tests and benchmarks on the CPU (their CPU code paths, reduced sizes).

    python -m comera_compile.benchmarks.gpu_check [--device cuda|cpu] [--out DIR] [--quick]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch

__all__ = ["run_tests", "machine", "report_markdown", "main"]

TEST_FILE_TIMEOUT_S = 1800


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


def run_tests(device: str, out: Path) -> dict[str, Any]:
    """``pytest -m cuda --device DEVICE`` in a child process; counts and failures from its JUnit XML."""
    xml = out / "tests.xml"
    root = Path(__file__).resolve().parents[1]
    tests = root / "tests"
    if not tests.is_dir():   # an installed copy: the tests live in the source tree only
        return {"error": f"no tests/ beside {root}; run from the source tree (make gpu-check)"}
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "--device", device, "-q", "-p", "no:cacheprovider",
           f"--junitxml={xml}", str(tests)]
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
    for name, block in report["bench"].items():
        lines += [f"## {name}", ""]
        if "error" in block:
            lines += [f"failed: {block['error']}", ""]
            continue
        for row in block["rows"]:
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
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu-check: torch {torch.__version__} sees no CUDA device; --device cpu runs the same code paths "
              f"on the CPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    from .suite import run_suite

    report: dict[str, Any] = {"command": " ".join(["python -m comera_compile.benchmarks.gpu_check", *(argv or sys.argv[1:])]),
                              "date": _dt.datetime.now().isoformat(timespec="seconds"),
                              "machine": machine(args.device), "bench": {}}
    report["tests"] = {"error": "skipped (--skip-tests)"} if args.skip_tests else run_tests(args.device, args.out)
    if "error" not in report["tests"]:
        t = report["tests"]
        print(f"tests: {t.get('passed', 0)} passed, {t.get('failed', 0) + t.get('errors', 0)} failed, "
              f"{t.get('skipped', 0)} skipped", flush=True)
    if not args.skip_bench:
        from .suite import DEVICE_SUITE

        for name in DEVICE_SUITE:   # one at a time: a failure leaves the others' figures
            try:
                report["bench"].update(run_suite(quick=args.quick, only=[name], device=args.device)["results"])
            except Exception as e:  # reported, not raised: the rest of the check still runs
                report["bench"][name] = {"error": f"{type(e).__name__}: {e}"}
                print(f"{name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (args.out / "report.md").write_text(report_markdown(report) + "\n")
    print(f"wrote {args.out / 'report.md'} and {args.out / 'report.json'}")
    t = report["tests"]
    return 0 if "error" in t or (t["returncode"] == 0) else 1


if __name__ == "__main__":
    sys.exit(main())
