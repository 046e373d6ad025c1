"""The `comera-compile` command line: train dense vs CoMERA side by side (demo), inspect a model's TT rewrite,
run the benchmark suite."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

__all__ = ["main"]

EXAMPLES = ("six-encoder",)
CUDA_DEMO_BATCH = 32   # demo --device cuda: the paper's MNLI batch, unless --batch says otherwise


def _load_factory(spec: str) -> nn.Module:
    """Build a model from MODULE:FACTORY (a class or a function taking no arguments)."""
    if ":" not in spec:
        raise SystemExit(f"comera-compile: expected MODULE:FACTORY (e.g. mypkg.models:build), got {spec!r}")
    mod_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise SystemExit(f"comera-compile: cannot import {mod_name!r}: {e}") from e
    factory = getattr(module, attr, None)
    if factory is None:
        raise SystemExit(f"comera-compile: {mod_name!r} has no attribute {attr!r}")
    model = factory()
    if not isinstance(model, nn.Module):
        raise SystemExit(f"comera-compile: {spec} returned a {type(model).__name__}, not an nn.Module")
    return model


def _inspect(args: argparse.Namespace) -> int:
    import comera_compile as cc

    t0 = time.perf_counter()
    kwargs = {}
    if args.example == "six-encoder":
        from comera_compile.examples import six_encoder

        model = six_encoder.build(layers=args.layers)
        kwargs["preset"] = "comera-six-encoder"
    else:
        model = _load_factory(args.model)
    if args.rank is not None:
        kwargs["rank"] = args.rank
    dense_params = sum(p.numel() for p in model.parameters())
    tt = cc.tensorize(model, inplace=True, **kwargs)
    try:  # the rewritten graph, traced on demand for display
        from comera_compile.passes.module.trace import trace_model

        code = trace_model(tt).code.strip()
        print(f"# rewritten graph of {type(model).__name__} (torch.fx)")
        print(code)
        print()
    except Exception as e:  # torch.fx raises many kinds of errors for untraceable code
        print(f"# {type(model).__name__}: no torch.fx graph to show ({type(e).__name__}); its layers were "
              f"rewritten module by module\n")
    print(cc.explain(tt, rows=args.rows))
    print(f"\n{type(model).__name__}: {dense_params:,} dense parameters; done in {time.perf_counter() - t0:.1f} s")
    return 0


def _set_threads(command: str, threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise SystemExit(f"comera-compile {command}: --threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)


def _bench(args: argparse.Namespace) -> int:
    from comera_compile.benchmarks.suite import run_suite

    _set_threads("bench", args.threads)
    try:
        run_suite(quick=args.quick, only=args.only, json_path=args.json, device=args.device)
    except ValueError as e:
        raise SystemExit(f"comera-compile bench: {e}") from e
    return 0


def _demo(args: argparse.Namespace) -> int:
    from comera_compile.examples import code_mlm

    given = {name: getattr(args, name) for name in _DEMO_OPTIONS if getattr(args, name) is not None}
    if args.no_compile:
        given["compile"] = False
    if args.no_progress:
        given["progress"] = False
    if args.device == "cuda" and args.batch is None:
        given["batch"] = CUDA_DEMO_BATCH   # a GPU wants more rows per step than the CPU default
    if args.steps is not None and args.minutes is None:
        given["minutes"] = None  # --steps alone: a step budget, not the preset's time budget with a step cap
    _set_threads("demo", args.threads)
    try:
        code_mlm.run(code_mlm.preset(args.preset, **given))
    except code_mlm.DemoError as e:
        raise SystemExit(f"comera-compile demo: {e}") from e
    return 0


# Options of `demo` that map one to one onto DemoConfig fields (None: the preset's value).
_DEMO_OPTIONS = ("data", "out", "size", "minutes", "steps", "batch", "seq_len", "vocab_size", "rank", "lr", "dense_lr",
                 "warmup_steps", "target_ratio", "cut_every", "evals", "eval_blocks", "seed", "max_bytes",
                 "dense_backend", "device")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="comera-compile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="masked-language-model pretraining on code, dense vs CoMERA side by side",
                       description="Train a BERT-like encoder on masked-language modelling of code twice -- dense, "
                                   "and CoMERA-style (tensorize + RankAdaptive + backend 'comera') -- and write a "
                                   "table, a plot and a JSON of every figure to runs/<timestamp>/.")
    from comera_compile.examples.code_mlm import PRESETS, SIZES, DemoConfig

    defaults = DemoConfig()
    d.add_argument("--preset", choices=list(PRESETS), default="demo",
                   help="demo: equal wall-clock budgets, minutes; long: equal steps, 1-2 hours on 2 cores, the "
                        "README's quality figure (options below override the preset's)")
    d.add_argument("--data", type=Path, default=None, metavar="DIR",
                   help="folder of text or code files (default: the Python standard library's *.py files)")
    d.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="output directory (default: runs/<YYYYmmdd-HHMMSS> under the current directory)")
    d.add_argument("--size", choices=list(SIZES), default=None,
                   help="model size: " + "; ".join(f"{k}: d_model {v.d_model}, {v.layers} layers, FFN {v.ffn}, "
                                                   f"rank {v.rank}" for k, v in SIZES.items())
                        + f" (default {defaults.size})")
    # (option, type, what it sets), each a DemoConfig field; the default shown is the demo preset's.
    for flag, kind, what in (
            ("--minutes", float, "training budget per model, wall clock with compiles, without evaluations"),
            ("--steps", int, "training steps per model (alone: the budget; with --minutes: a cap)"),
            ("--batch", int, "sequences per step"),
            ("--seq-len", int, "tokens per sequence"),
            ("--vocab-size", int, "BPE vocabulary trained on the data"),
            ("--rank", int, "initial TT rank of the CoMERA encoder (default: the size's)"),
            ("--lr", float, "CoMERA's learning rate, cc.param_groups(model, lr): TT cores 2x, gates 20x"),
            ("--dense-lr", float, "the dense model's learning rate (the best of the README's sweep)"),
            ("--warmup-steps", int, "linear learning-rate warm-up, both models"),
            ("--target-ratio", float, "start RankAdaptive's late stage halfway through, steering the TT size "
                                      "toward this fraction (0, 1] of its size then (default: early stage only)"),
            ("--cut-every", int, "steps between RankAdaptive's rank checks"),
            ("--evals", int, "held-out evaluations per model, at equal marks of the budget"),
            ("--eval-blocks", int, "held-out blocks evaluated"),
            ("--seed", int, "seed of split, init, data order, masks"),
            ("--max-bytes", int, "training text read, in bytes")):
        default = getattr(defaults, flag[2:].replace("-", "_"))
        shown = "" if default is None or "default" in what else f" (default {default:g})" if isinstance(
            default, float) else f" (default {default})"
        d.add_argument(flag, type=kind, default=None, help=what + shown)
    d.add_argument("--threads", type=int, default=None, help="intra-op CPU threads (default: torch's, all cores)")
    d.add_argument("--dense-backend", choices=("inductor", "eager"), default=None,
                   help="how the dense model runs: eager, or its encoder layers under torch.compile's Inductor "
                        f"(default {defaults.dense_backend})")
    d.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help=f"where both models train (default cpu); cuda also makes --batch default to "
                        f"{CUDA_DEMO_BATCH} and times each step to the end of its GPU work")
    d.add_argument("--no-compile", action="store_true",
                   help="run the CoMERA model eagerly instead of under torch.compile(backend='comera')")
    d.add_argument("--no-progress", action="store_true", help="no progress bars")
    p = sub.add_parser("inspect", help="tensorize a model and print its rewritten graph and layer table")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--example", choices=EXAMPLES, help="a built-in example model")
    src.add_argument("model", nargs="?", metavar="MODULE:FACTORY",
                     help="import MODULE and call FACTORY() for the model")
    p.add_argument("--rank", type=int, default=None, help="TT rank (default: 30, or the example's preset)")
    p.add_argument("--layers", type=int, default=6, help="encoder layers of the example model (default 6)")
    p.add_argument("--rows", type=int, default=1024, help="row count the FLOPs are reported for")
    b = sub.add_parser("bench", help="run the benchmark suite: every figure a median beside its baseline")
    b.add_argument("--quick", action="store_true", help="smaller models and fewer repeats (under 2 minutes)")
    b.add_argument("--json", metavar="PATH", default=None, help="also write every figure to this JSON file")
    b.add_argument("--only", nargs="+", metavar="NAME", default=None,
                   help="run only these benchmarks (tt_linear, embeddings, memory_passes, rank_adaptive, "
                        "six_encoder_step, galore; and, only when named, ra_control: rank adaptation against "
                        "a model built at its final ranks, about 30 minutes; device_step: see --device)")
    b.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="run the device suite on this device: TT linear, embeddings, and the six-encoder step at "
                        "batch 1/8/32 x 128 in fp32 (TF32) and bf16 autocast against dense eager, dense "
                        "torch.compile (CUDA Graphs), GaLore, CUDA Graphs off and the fixed order; cpu runs the "
                        "same code paths at reduced sizes")
    b.add_argument("--threads", type=int, default=None, help="intra-op CPU threads (default: torch's, all cores)")
    args = parser.parse_args(argv)
    if args.command == "inspect":
        return _inspect(args)
    if args.command == "bench":
        return _bench(args)
    if args.command == "demo":
        return _demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
