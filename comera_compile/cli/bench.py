"""`comera-compile bench`: the benchmark suite, every figure a median beside its baseline."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from comera_compile.cli.launch import set_threads


def run(args: argparse.Namespace) -> int:
    from comera_compile.benchmarks.suite import run_suite

    set_threads("bench", args.threads)
    if args.profile is not None and args.profile < 1:
        raise SystemExit(f"comera-compile bench: --profile takes a batch of at least 1, got {args.profile}")
    if args.json is not None:   # found before the suite runs, not after
        target = Path(args.json)
        if target.is_dir():
            raise SystemExit(f"comera-compile bench: --json {args.json!r} is a folder; give a file path")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SystemExit(f"comera-compile bench: --json {args.json!r}: cannot make its folder "
                             f"({e.strerror or e})") from e
        if not os.access(target.parent, os.W_OK):
            raise SystemExit(f"comera-compile bench: --json {args.json!r}: its folder is not writable")
    if args.profile is not None:
        if args.json is not None or args.only:
            raise SystemExit("comera-compile bench: --profile prints the per-layer profile tables only; --json and "
                             "--only are for the suite: run them without --profile")
        from comera_compile.benchmarks.device_step import resolve_device
        from comera_compile.benchmarks.profiling import six_encoder_profile

        try:
            device = str(resolve_device(args.device or "cpu"))
        except ValueError as e:
            raise SystemExit(f"comera-compile bench: {e}") from e
        layers = 2 if args.quick else 6
        print(f"per-layer time of the six-encoder's eager AdamW step, batch {args.profile} x 128, on {device} "
              f"(cc.profile):")
        print(six_encoder_profile(batch=args.profile, layers=layers, device=device))
        print(f"\nthe same step compiled (cc.compile_step, backend option profile: each TT layer's part of the "
              f"graph compiled on its own, inside its range):")
        print(six_encoder_profile(batch=args.profile, layers=layers, compiled=True, device=device))
        return 0
    try:
        run_suite(quick=args.quick, only=args.only, json_path=args.json, device=args.device)
    except ValueError as e:
        raise SystemExit(f"comera-compile bench: {e}") from e
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="run the benchmark suite: every figure a median beside its baseline")
    b.add_argument("--quick", action="store_true", help="smaller models and fewer repeats (under 2 minutes)")
    b.add_argument("--json", metavar="PATH", default=None, help="also write every figure to this JSON file")
    b.add_argument("--only", nargs="+", metavar="NAME", default=None,
                   help="run only these benchmarks (tt_linear, embeddings, memory_passes, rank_adaptive, "
                        "six_encoder_step, galore; and, only when named, ra_control: rank adaptation against "
                        "a model built at its final ranks, about 30 minutes; ra_teachers: ranks found on teachers of "
                        "known ranks, against uniform ranks; profiling: what the TT layers' "
                        "profiler hooks cost with the profiler off; device_step: see --device)")
    b.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="run the device suite on this device: TT linear, embeddings, and the six-encoder step at "
                        "batch 1/8/32 x 128 in fp32 (TF32) and bf16 autocast against dense eager, dense "
                        "torch.compile (CUDA Graphs), GaLore, CUDA Graphs off and the fixed order; cpu runs the "
                        "same code paths at reduced sizes")
    b.add_argument("--profile", type=int, nargs="?", const=8, default=None, metavar="BATCH",
                   help="instead of the suite, time each TT layer (forward and backward) of the six-encoder's "
                        "training step at BATCH x 128 (default 8) under torch's profiler, eager and compiled: "
                        "cc.profile's tables (with --device cuda: each layer's kernel time on the GPU)")
    b.add_argument("--threads", type=int, default=None, help="intra-op CPU threads (default: torch's, all cores)")

