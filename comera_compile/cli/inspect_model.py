"""`comera-compile inspect`: tensorize a model and print its rewritten graph and layer table."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import torch
from torch import nn

EXAMPLES = ("six-encoder",)


def _load_factory(spec: str) -> nn.Module:
    """Build a model from MODULE:FACTORY (a class or a function taking no arguments)."""
    if ":" not in spec:
        raise SystemExit(f"comera-compile: expected MODULE:FACTORY (e.g. mypkg.models:build), got {spec!r}")
    mod_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:   # the installed script: the folder it runs in, as -m
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise SystemExit(f"comera-compile: cannot import {mod_name!r}: {e}") from e
    factory = getattr(module, attr, None)
    if factory is None:
        raise SystemExit(f"comera-compile: {mod_name!r} has no attribute {attr!r}")
    try:
        model = factory()
    except Exception as e:   # the user's code: say what it raised, and how FACTORY is called
        raise SystemExit(f"comera-compile: {spec}() raised {type(e).__name__}: {e} (FACTORY is called with no "
                         f"arguments: point at a function that builds the model)") from e
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

    try:
        reports = cc.rewritten_graphs(model, *call[0], **call[1])
    except Exception as e:   # the inputs do not fit the model: say so in a line
        raise SystemExit(f"comera-compile inspect: running {type(model).__name__} on the --input tensors raised "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} (give one --input per "
                         f"forward argument, in its dtype: SHAPE[:DTYPE], e.g. 2x16:long)") from e
    for k, report in enumerate(reports, 1):
        print(f"# graph {k} of {len(reports)} that torch.compile(backend='comera') captures of "
              f"{type(model).__name__}, after comera's passes (dynamo)")
        print(report)
        print()


def run(args: argparse.Namespace) -> int:
    import comera_compile as cc
    from comera_compile.layers import tt_layers

    t0 = time.perf_counter()
    for spec in args.input or ():   # checked before anything is built
        _parse_input(spec)
    if args.input and args.graph == "fx":
        raise SystemExit("comera-compile inspect: --input is what the dynamo graph runs the model on; with "
                         "--graph fx it would go unused: drop it, or use --graph dynamo (or auto)")
    kwargs = {}
    if args.example == "six-encoder":
        from comera_compile.examples import six_encoder

        model = six_encoder.build(layers=args.layers)
        kwargs["preset"] = "comera-six-encoder"
    else:
        model = _load_factory(args.model)
    built_tensorized = bool(tt_layers(model))
    if args.rank is not None:
        if built_tensorized:   # tensorize leaves TT layers as they are: the rank would go unused
            raise SystemExit(f"comera-compile inspect: {args.model} returned a model with TT layers already, "
                             f"which keep their ranks: drop --rank, or have the factory return the dense model")
        kwargs["rank"] = args.rank
    dense_params = sum(p.numel() for p in model.parameters())
    try:
        tt = cc.tensorize(model, inplace=True, **kwargs)
    except cc.TensorizeError as e:
        raise SystemExit(f"comera-compile inspect: {e}") from e
    # auto: the torch.fx module graph where torch.fx traces the model (compact: TT layers as named calls),
    # else the graph torch.compile captures, contractions expanded, for which the model needs inputs.
    shown = args.graph == "fx" or args.graph == "auto" and not args.input   # inputs given: for the dynamo graph
    shown = shown and _show_fx(tt)
    if not shown and args.graph != "fx":
        call = _example_call(tt, args)
        need = (f"{type(model).__name__} needs example inputs for torch.compile's graph; pass --input "
                f"SHAPE[:DTYPE] once per forward argument (e.g. --input 2x128:long)")
        if call is None and args.graph == "dynamo":   # the graph asked for cannot be shown: an error
            raise SystemExit(f"comera-compile inspect: --graph dynamo: {need}")
        if call is None:
            print(f"# no graph: {need}\n")
        else:
            _show_dynamo(tt, call)
    print(cc.explain(tt, rows=args.rows))
    what = "parameters as the factory built it" if built_tensorized else "dense parameters"
    print(f"\n{type(model).__name__}: {dense_params:,} {what}; done in {time.perf_counter() - t0:.1f} s")
    return 0


def _positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="tensorize a model and print its rewritten graph and layer table")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--example", choices=EXAMPLES, help="a built-in example model")
    src.add_argument("model", nargs="?", metavar="MODULE:FACTORY",
                     help="import MODULE and call FACTORY() for the model")
    p.add_argument("--rank", type=int, default=None, help="TT rank (default: 30, or the example's preset)")
    p.add_argument("--layers", type=_positive, default=6, help="encoder layers of the example model (default 6)")
    p.add_argument("--rows", type=_positive, default=1024, help="row count the FLOPs are reported for")
    p.add_argument("--graph", choices=("auto", "fx", "dynamo"), default="auto",
                   help="which graph to print: fx, the module graph torch.fx traces (TT layers as calls); dynamo, "
                        "each graph torch.compile(backend='comera') captures, after comera's passes, with every TT "
                        "layer's contraction steps and FLOPs (runs the model once); auto (default): dynamo where "
                        "--input is given, else fx where torch.fx can trace the model, else dynamo")
    p.add_argument("--input", action="append", metavar="SHAPE[:DTYPE]", default=None,
                   help="an example forward argument for --graph dynamo, e.g. 2x128:long (once per argument; "
                        "default: the example's inputs, or a transformers model's dummy_inputs)")
