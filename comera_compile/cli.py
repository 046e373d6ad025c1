"""The `comera-compile` command line: train dense vs CoMERA side by side (demo: a masked LM; pretrain: a
Llama-style causal LM, GaLore beside them), inspect a model's TT rewrite, run the benchmark suite."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

__all__ = ["main", "build_parser"]

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


_DTYPES = {"long": torch.long, "int": torch.int, "float": torch.float32, "float32": torch.float32,
           "bfloat16": torch.bfloat16, "float64": torch.float64, "bool": torch.bool}


def _parse_input(spec: str) -> torch.Tensor:
    """SHAPE[:DTYPE] (e.g. 2x128:long) -> a tensor: random ids in [0, 100) for integer dtypes, N(0, 1) else."""
    shape_text, _, dtype_text = spec.partition(":")
    try:
        shape = tuple(int(n) for n in shape_text.lower().split("x"))
    except ValueError:
        shape = ()
    dtype = _DTYPES.get(dtype_text or "float")
    if not shape or min(shape) < 1 or dtype is None:
        raise SystemExit(f"comera-compile inspect: --input takes SHAPE[:DTYPE], e.g. 2x128:long or 4x16x64; "
                         f"dtypes: {', '.join(_DTYPES)}; got {spec!r}")
    if dtype.is_floating_point:
        return torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    return torch.randint(0, 2 if dtype == torch.bool else 100, shape,
                         generator=torch.Generator().manual_seed(0)).to(dtype)


def _example_call(model: nn.Module, args: argparse.Namespace) -> tuple[tuple, dict] | None:
    """The arguments the model is run with for dynamo's graph: --input, the example's own, or a
    transformers model's dummy_inputs; None when there is none."""
    if args.input:
        return tuple(_parse_input(spec) for spec in args.input), {}
    if args.example == "six-encoder":
        from comera_compile.examples import six_encoder

        return six_encoder.example_inputs(model, batch=2), {}
    dummy = getattr(model, "dummy_inputs", None)   # transformers' PreTrainedModel
    if isinstance(dummy, dict) and dummy and all(isinstance(v, torch.Tensor) for v in dummy.values()):
        return (), dict(dummy)
    return None


def _show_fx(model: nn.Module) -> bool:
    try:  # the module graph: TT layers as named calls, traced on demand for display
        from comera_compile.passes.module.trace import trace_model

        code = trace_model(model).code.strip()
    except Exception as e:  # torch.fx raises many kinds of errors for untraceable code
        print(f"# {type(model).__name__}: torch.fx cannot trace it ({type(e).__name__}: {str(e)[:200]})\n")
        return False
    print(f"# rewritten graph of {type(model).__name__} (torch.fx; TT layers as tt_<name> calls)")
    print(code)
    print()
    return True


def _show_dynamo(model: nn.Module, call: tuple[tuple, dict]) -> None:
    import comera_compile as cc

    reports = cc.rewritten_graphs(model, *call[0], **call[1])
    for k, report in enumerate(reports, 1):
        print(f"# graph {k} of {len(reports)} that torch.compile(backend='comera') captures of "
              f"{type(model).__name__}, after comera's passes (dynamo)")
        print(report)
        print()


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
    # auto: the torch.fx module graph where torch.fx traces the model (compact: TT layers as named calls),
    # else the graph torch.compile captures, contractions expanded, for which the model needs inputs.
    shown = args.graph != "dynamo" and _show_fx(tt)
    if not shown and args.graph != "fx":
        call = _example_call(tt, args)
        if call is None:
            print(f"# no graph: {type(model).__name__} needs example inputs for torch.compile's graph; pass "
                  f"--input SHAPE[:DTYPE] once per forward argument (e.g. --input 2x128:long)\n")
        else:
            _show_dynamo(tt, call)
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
    if args.profile:
        from comera_compile.benchmarks.profiling import six_encoder_profile

        layers = 2 if args.quick else 6
        print(f"per-layer time of the six-encoder's eager AdamW step, batch {args.profile} x 128 (cc.profile):")
        print(six_encoder_profile(batch=args.profile, layers=layers))
        print(f"\nthe same step compiled (cc.compile_step, backend option profile: each TT layer's part of the "
              f"graph compiled on its own, inside its range):")
        print(six_encoder_profile(batch=args.profile, layers=layers, compiled=True))
        return 0
    try:
        run_suite(quick=args.quick, only=args.only, json_path=args.json, device=args.device)
    except ValueError as e:
        raise SystemExit(f"comera-compile bench: {e}") from e
    return 0


def _launch(nproc: int, argv: list[str], device: str, command: str = "demo") -> int:
    """`demo --nproc N` (or pretrain's): the same command under torchrun on N local processes (its options but
    --nproc)."""
    import subprocess

    if device == "cuda" and torch.cuda.device_count() < nproc:
        raise SystemExit(f"comera-compile {command}: --nproc {nproc} --device cuda needs {nproc} GPUs, this machine "
                         f"shows {torch.cuda.device_count()}")
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "comera_compile", *rest]
    print(f"comera-compile {command}: " + " ".join(["torchrun", *cmd[3:]]), flush=True)
    return subprocess.call(cmd)


def _demo(args: argparse.Namespace, argv: list[str]) -> int:
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
    try:
        cfg = code_mlm.preset(args.preset, **given)
        if args.nproc is not None and "WORLD_SIZE" not in os.environ:  # not yet under torchrun: start it
            if args.nproc < 1:
                raise SystemExit(f"comera-compile demo: --nproc must be at least 1, got {args.nproc}")
            cfg.check(args.nproc)
            return _launch(args.nproc, argv, cfg.device)
        _set_threads("demo", args.threads)
        code_mlm.run(cfg)
    except code_mlm.DemoError as e:
        raise SystemExit(f"comera-compile demo: {e}") from e
    return 0


def _pretrain(args: argparse.Namespace, argv: list[str]) -> int:
    from comera_compile.examples import lm_pretrain

    given = {name: getattr(args, name) for name in _PRETRAIN_OPTIONS if getattr(args, name) is not None}
    if args.methods is not None:
        given["methods"] = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    if args.no_clip:
        given["clip"] = None
    if args.no_progress:
        given["progress"] = False
    if args.steps is not None and args.minutes is None:
        given["minutes"] = None  # --steps alone: a step budget, not the preset's time budget with a step cap
    try:
        cfg = lm_pretrain.preset(args.preset, **given)
        if args.nproc is not None and "WORLD_SIZE" not in os.environ:  # not yet under torchrun: start it
            if args.nproc < 1:
                raise SystemExit(f"comera-compile pretrain: --nproc must be at least 1, got {args.nproc}")
            cfg.check(args.nproc)
            return _launch(args.nproc, argv, cfg.device, "pretrain")
        lm_pretrain.run(cfg)
    except lm_pretrain.DemoError as e:
        raise SystemExit(f"comera-compile pretrain: {e}") from e
    return 0


# Options of `pretrain` that map one to one onto PretrainConfig fields (None: the preset's value).
_PRETRAIN_OPTIONS = ("data", "tokenizer", "text_column", "out", "minutes", "steps", "batch", "seq_len", "vocab_size",
                     "lr", "comera_lr", "comera_core_lr", "comera_gate_lr", "galore_lr", "warmup_steps", "clip", "rank", "galore_rank", "evals",
                     "eval_blocks", "max_bytes", "val_fraction", "seed", "device", "threads")


def _add_pretrain(sub: argparse._SubParsersAction) -> None:
    from comera_compile.examples.lm_pretrain import METHODS, PRESETS, SHAPES

    p = sub.add_parser(
        "pretrain", help="Llama-style causal-LM pretraining: dense vs CoMERA vs GaLore on equal wall-clock",
        description="Train a Llama-style decoder (transformers' LlamaForCausalLM, built from its config) from "
                    "scratch three ways from one seed and batch order -- dense (Inductor), CoMERA (tensorize + "
                    "RankAdaptive + backend 'comera') and GaLore (GaLoreAdamW) -- each on the same budget, with "
                    "validation perplexity at equal time and equal tokens; writes table.md, curves.png and "
                    "results.json to runs/pretrain-<timestamp>/.")
    p.add_argument("--preset", choices=list(PRESETS), default="tiny",
                   help="model shape and budget: " + "; ".join(
                       f"{k}: hidden {SHAPES[k].hidden}, intermediate {SHAPES[k].intermediate}, {SHAPES[k].heads} "
                       f"heads, {SHAPES[k].layers} layers, "
                       + (f"{v['minutes']:g} min" if v.get("minutes") else f"{v.get('steps')} steps")
                       + f", batch {v.get('batch')}" for k, v in PRESETS.items()) + " (default tiny; options below override the preset's)")
    p.add_argument("--methods", default=None, metavar="LIST",
                   help=f"comma-separated methods to train, run in the order {','.join(METHODS)} (default: all)")
    p.add_argument("--data", default=None, metavar="SOURCE",
                   help="text to train on, as examples.lm_data reads it (default: the Python standard library's "
                        "source)")
    p.add_argument("--tokenizer", default=None, metavar="NAME",
                   help="tokenizer to use (default: a byte-level BPE of --vocab-size trained on the training text)")
    p.add_argument("--text-column", default=None, metavar="NAME", help="the text column of a dataset (default text)")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="output directory (default: runs/pretrain-<YYYYmmdd-HHMMSS> under the current directory)")
    for flag, kind, what in (
            ("--minutes", float, "training budget per model, wall clock with compiles, without evaluations"),
            ("--steps", int, "training steps per model (alone: the budget, and the schedule runs on steps; with "
                             "--minutes: a cap)"),
            ("--batch", int, "sequences per step (global, over --nproc processes)"),
            ("--seq-len", int, "tokens per sequence (default 256)"),
            ("--vocab-size", int, "BPE vocabulary trained on the data (default 4096)"),
            ("--lr", float, "peak learning rate of dense AdamW, and of CoMERA's cc.param_groups(model, lr) "
                            "(TT cores 2x, rank gates 20x) and GaLore unless given below (default 1e-3)"),
            ("--comera-lr", float, "CoMERA's peak learning rate, cc.param_groups(model, lr) (default: the preset's, "
                                   "else --lr)"),
            ("--comera-core-lr", float, "CoMERA's TT cores' peak learning rate (default: the preset's, else "
                                        "param_groups' 2 x --comera-lr)"),
            ("--comera-gate-lr", float, "CoMERA's rank gates' peak learning rate (default: the preset's, else "
                                        "param_groups' 20 x --comera-lr)"),
            ("--galore-lr", float, "GaLore's peak learning rate (default: the preset's)"),
            ("--warmup-steps", int, "linear warm-up steps before the cosine decay (default: the preset's; a tenth "
                                    "of --steps with --steps alone)"),
            ("--clip", float, "gradient-norm clipping (default 1.0)"),
            ("--rank", int, "initial TT rank of CoMERA's decoder linears (default: the preset's)"),
            ("--galore-rank", int, "GaLore's projection rank (default: the preset's)"),
            ("--evals", int, "validation evaluations per model at equal marks of the budget (default 6)"),
            ("--eval-blocks", int, "validation blocks evaluated (default: the preset's)"),
            ("--max-bytes", int, "training text read, in bytes (default 8,000,000)"),
            ("--val-fraction", float, "fraction of the documents held out for validation (default 0.05)"),
            ("--seed", int, "seed of the initialisation and the batch order (default 0)")):
        p.add_argument(flag, type=kind, default=None, help=what)
    p.add_argument("--no-clip", action="store_true", help="no gradient clipping")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op CPU threads (default: the preset's; tiny: 1, the others: torch's, all cores)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="where the models train (default cpu)")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="train data-parallel (DDP) on N local processes started through torchrun, each on its rows "
                        "of every global batch, as demo --nproc")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


# Options of `demo` that map one to one onto DemoConfig fields (None: the preset's value).
_DEMO_OPTIONS = ("data", "out", "size", "minutes", "steps", "batch", "seq_len", "vocab_size", "rank", "lr", "dense_lr",
                 "warmup_steps", "target_ratio", "cut_every", "evals", "eval_blocks", "seed", "max_bytes",
                 "dense_backend", "device", "parallel")


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (its subcommands demo, pretrain, inspect and bench)."""
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
    d.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="train data-parallel on N local processes (started through torchrun; gloo on CPU, nccl on "
                        "CUDA), each on its rows of every global batch of --batch rows; on several machines "
                        "run torchrun -m comera_compile demo yourself (README: Distributed)")
    d.add_argument("--parallel", choices=("ddp", "fsdp"), default=None,
                   help="with several processes: DistributedDataParallel (default) or FSDP2 (fully_shard per "
                        "encoder layer, then the model)")
    d.add_argument("--no-compile", action="store_true",
                   help="run the CoMERA model eagerly instead of under torch.compile(backend='comera')")
    d.add_argument("--no-progress", action="store_true", help="no progress bars")
    _add_pretrain(sub)
    p = sub.add_parser("inspect", help="tensorize a model and print its rewritten graph and layer table")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--example", choices=EXAMPLES, help="a built-in example model")
    src.add_argument("model", nargs="?", metavar="MODULE:FACTORY",
                     help="import MODULE and call FACTORY() for the model")
    p.add_argument("--rank", type=int, default=None, help="TT rank (default: 30, or the example's preset)")
    p.add_argument("--layers", type=int, default=6, help="encoder layers of the example model (default 6)")
    p.add_argument("--rows", type=int, default=1024, help="row count the FLOPs are reported for")
    p.add_argument("--graph", choices=("auto", "fx", "dynamo"), default="auto",
                   help="which graph to print: fx, the module graph torch.fx traces (TT layers as calls); dynamo, "
                        "each graph torch.compile(backend='comera') captures, after comera's passes, with every TT "
                        "layer's contraction steps and FLOPs (runs the model once); auto (default): fx where "
                        "torch.fx can trace the model, else dynamo")
    p.add_argument("--input", action="append", metavar="SHAPE[:DTYPE]", default=None,
                   help="an example forward argument for --graph dynamo, e.g. 2x128:long (once per argument; "
                        "default: the example's inputs, or a transformers model's dummy_inputs)")
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
                        "cc.profile's tables")
    b.add_argument("--threads", type=int, default=None, help="intra-op CPU threads (default: torch's, all cores)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv) if argv is not None else sys.argv[1:]
    args = build_parser().parse_args(argv)
    if args.command == "inspect":
        return _inspect(args)
    if args.command == "bench":
        return _bench(args)
    if args.command == "demo":
        return _demo(args, argv)
    if args.command == "pretrain":
        return _pretrain(args, argv)
    return 2


if __name__ == "__main__":
    sys.exit(main())
