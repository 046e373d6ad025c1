"""A TT linear layer's whole product as one straight-line Python function per contraction program.

run_program interprets a program: a loop over Contraction records, each read field by field.  torch.compile
traces that interpreter bytecode by bytecode, about a hundred inlined calls per layer, and eager mode pays
the same Python on every call.  tt_linear_runner writes the product (the gates folded into the cores, their
zero padding, the program's sums, permutes and GEMMs, the bias, the output slice) as the body of one
generated function with every size a literal or ``rows`` times one, so dynamo traces a few dozen lines; the
graph holds run_program's GEMMs and only the reshapes that change a layout.  Generated functions live as
attributes of RUNNERS under a name made from their source: a compiled layer reads ``getattr(RUNNERS, name)``,
which dynamo guards on that one attribute, so generating another layer's function later recompiles nothing.
"""

from __future__ import annotations

import hashlib
import sys
import types
from functools import lru_cache
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..tt import TTSpec, constant_under_compile, gemm_core_padding, gemm_spec
from .. import networks  # its tt_linear_program and tt_linear_segments, read at each call (see below)
from .plan import Dim, Program, fuses_bias

__all__ = ["RUNNERS", "tt_linear_source", "tt_linear_runner", "tt_linear_runner_names", "eager_tt_linear_runner"]

# The generated functions, by name (a module, so that dynamo reads each as a guarded global attribute).
RUNNERS = types.ModuleType(__name__ + ".runners")
sys.modules[RUNNERS.__name__] = RUNNERS


def _size(dims: Sequence[Dim]) -> str:
    parts = [("rows" if f == 1 else f"rows * {f}") if scaled else str(f) for f, scaled in dims]
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def _fixed(shape: Sequence[int]) -> tuple[Dim, ...]:
    return tuple((int(s), False) for s in shape)


def _as(name: str, shape: tuple[Dim, ...], target: Sequence[Dim]) -> str:
    """name's tensor (of this shape) reshaped to target: nothing when the shapes are equal."""
    return name if shape == tuple(target) else f"{name}.reshape({_size(target)})"


def tt_linear_source(spec: TTSpec, program: Program, has_bias: bool) -> str:
    """The source of ``run(x, c0.., g0.., bias, rows)``: x is the input as (rows, in_padded), c and g the
    layer's cores and gates at spec's ranks; returns (rows, out_features), bias added.  The program runs at
    gemm_spec(spec)'s ranks, the cores zero-padded to them as TTLinear pads them.

    Every tensor is carried with the shape it has and the shape the program sees it in, and a reshape is
    written only where an operation needs another layout: a reshape of a reshape is one, and one to the
    shape a tensor has is none (the program's records reshape every operand and result, most of them views
    of the layout they already have)."""
    n = spec.num_cores
    shapes = [_fixed(s) for s in gemm_spec(spec).core_shapes]
    # as TTLinear's operands were made: every gate folded, then the zero padding (the boundary ranks, 1, are
    # dropped by the reshapes the program's first use of those cores writes)
    lines = [f"o{k} = c{k} * g{k}" for k in range(n - 1)]
    names = [f"o{k}" for k in range(n - 1)] + [f"c{n - 1}"]
    for k, pad in enumerate(gemm_core_padding(spec)):
        if pad is not None:
            lines.append(f"o{k} = F.pad({names[k]}, {pad!r})")
            names[k] = f"o{k}"
    vals = [("x", ((1, True), (spec.in_padded, False)), ((1, True), *_fixed(spec.in_modes)))]
    vals += [(names[k], shapes[k], shapes[k][(k == 0):len(shapes[k]) - (k == n - 1)]) for k in range(n)]
    fused = has_bias and fuses_bias(program[-1].recipe, spec.out_features)
    for k, step in enumerate(program):
        pair = vals[step.i], vals[step.j]
        for pos in sorted((step.i, step.j), reverse=True):
            vals.pop(pos)
        r = step.recipe
        args = []
        for side, (name, shape, logical), op in (("a", pair[0], r.a), ("b", pair[1], r.b)):
            dims = op.dims if r.batched else op.dims[1:]
            if op.pre_sum or op.perm is not None:
                expr = _as(name, shape, logical)
                expr += f".sum(dim={op.pre_sum!r})" if op.pre_sum else ""
                expr += f".permute{op.perm!r}" if op.perm is not None else ""
                expr += f".reshape({_size(dims)})"
            else:
                expr = _as(name, shape, dims)
            if op.transposed:
                expr += ".transpose(-1, -2)"
                dims = (*dims[:-2], dims[-1], dims[-2])
            if expr != name:
                lines.append(f"{side}{k} = {expr}")
                expr = f"{side}{k}"
            args.append((expr, dims))
        (a, da), (b, db) = args
        last = k == len(program) - 1
        lines.append(f"z{k} = " + (f"torch.addmm(bias, {a}, {b})" if fused and last else f"torch.matmul({a}, {b})"))
        shape = (*da[:-1], db[-1])
        if r.final is not None:
            lines.append(f"z{k} = {_as(f'z{k}', shape, r.out_shape)}.permute{r.final!r}")
            shape = tuple(r.out_shape[i] for i in r.final)
            vals.append((f"z{k}", shape, shape))
        else:
            vals.append((f"z{k}", shape, tuple(r.out_shape)))
    name, shape, _ = vals[0]
    lines.append(f"y = {_as(name, shape, ((1, True), (spec.out_padded, False)))}")
    if spec.out_padded != spec.out_features:
        lines.append(f"y = y[:, :{spec.out_features}]")
    if has_bias and not fused:
        lines.append("y = y + bias.to(y.dtype)")  # under autocast y is in the autocast dtype, as nn.Linear's output
    args = ", ".join([*(f"c{k}" for k in range(n)), *(f"g{k}" for k in range(n - 1))])
    return f"def run(x, {args}, bias, rows):\n" + "".join(f"    {line}\n" for line in lines) + "    return y\n"


@lru_cache(maxsize=4096)
def _runner(spec: TTSpec, program: Program, has_bias: bool) -> tuple[str, Callable[..., torch.Tensor]]:
    src = tt_linear_source(spec, program, has_bias)
    name = "tt_linear_" + hashlib.sha1(src.encode()).hexdigest()[:16]
    fn = getattr(RUNNERS, name, None)
    if fn is None:
        scope = {"torch": torch, "F": F}
        exec(compile(src, f"<comera {name}>", "exec"), scope)
        fn = scope["run"]
        fn.__name__ = fn.__qualname__ = name
        fn.__module__ = RUNNERS.__name__
        setattr(RUNNERS, name, fn)
    return name, fn


def tt_linear_runner(spec: TTSpec, program: Program, has_bias: bool) -> Callable[..., torch.Tensor]:
    """The generated function running `program` for a TT linear layer of this spec (made once, then cached)."""
    return _runner(spec, program, has_bias)[1]


def eager_tt_linear_runner(spec: TTSpec, rows: int, training: bool, input_requires_grad: bool,
                           has_bias: bool) -> Callable[..., torch.Tensor]:
    """The runner of networks.tt_linear_program's plan for exactly this many rows (the eager path).  The
    planner's functions are read from the package at each call, as the layers always read them: the
    six-encoder benchmark swaps them for the reference's fixed order (benchmarks.six_encoder_step)."""
    return _runner(spec, networks.tt_linear_program(spec, rows, training, input_requires_grad), has_bias)[1]


@constant_under_compile
def tt_linear_runner_names(token: str, training: bool, input_requires_grad: bool, has_bias: bool
                           ) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """networks.tt_linear_segments' thresholds and, for each segment's program, the name of its runner in
    RUNNERS: constants under torch.compile, which picks the runner by comparing the row count with the
    thresholds."""
    thresholds, programs = networks.tt_linear_segments(token, training, input_requires_grad)
    spec = TTSpec.of(token)
    return thresholds, tuple(_runner(spec, p, has_bias)[0] for p in programs)
