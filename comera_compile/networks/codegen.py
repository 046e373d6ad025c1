"""A TT linear layer's whole product as one straight-line Python function per contraction program.

run_program interprets a program: a loop over Contraction records, each read field by field.  torch.compile
traces that interpreter bytecode by bytecode, about a hundred inlined calls per layer, and eager mode pays
the same Python on every call.  tt_linear_runner writes the same ops (the gates folded into the cores, their
zero padding, the program's reshapes, permutes and GEMMs, the bias, the output slice) as the body of one
generated function with every size a literal or ``rows`` times one, so dynamo traces a few dozen lines and
the graph holds exactly the ops run_program's would.  Generated functions live as attributes of RUNNERS
under a name made from their source: a compiled layer reads ``getattr(RUNNERS, name)``, which dynamo guards
on that one attribute, so generating another layer's function later recompiles nothing.
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
from .plan import Dim, Program, fuses_bias
from .segments import tt_linear_program, tt_linear_segments

__all__ = ["RUNNERS", "tt_linear_source", "tt_linear_runner", "tt_linear_runner_names", "eager_tt_linear_runner"]

# The generated functions, by name (a module, so that dynamo reads each as a guarded global attribute).
RUNNERS = types.ModuleType(__name__ + ".runners")
sys.modules[RUNNERS.__name__] = RUNNERS


def _size(dims: Sequence[Dim]) -> str:
    parts = [("rows" if f == 1 else f"rows * {f}") if scaled else str(f) for f, scaled in dims]
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def tt_linear_source(spec: TTSpec, program: Program, has_bias: bool) -> str:
    """The source of ``run(x, c0.., g0.., bias, rows)``: x is the input as (rows, *in_modes), c and g the
    layer's cores and gates at spec's ranks; returns (rows, out_features), bias added.  The program runs at
    gemm_spec(spec)'s ranks, the cores zero-padded to them as TTLinear pads them."""
    n = spec.num_cores
    shapes = gemm_spec(spec).core_shapes
    # as TTLinear's operands were made: every gate folded, then the zero padding, then the boundary ranks dropped
    lines = [f"o{k} = c{k} * g{k}" if k < n - 1 else f"o{k} = c{k}" for k in range(n)]
    lines += [f"o{k} = F.pad(o{k}, {pad!r})" for k, pad in enumerate(gemm_core_padding(spec)) if pad is not None]
    lines += [f"o0 = o0.reshape{shapes[0][1:]!r}", f"o{n - 1} = o{n - 1}.reshape{shapes[-1][:-1]!r}"]
    fused = has_bias and fuses_bias(program[-1].recipe, spec.out_features)
    names = ["x", *(f"o{k}" for k in range(n))]
    for k, step in enumerate(program):
        pair = names[step.i], names[step.j]
        for pos in sorted((step.i, step.j), reverse=True):
            names.pop(pos)
        r = step.recipe
        for side, name, op in (("a", pair[0], r.a), ("b", pair[1], r.b)):
            expr = name
            if op.pre_sum:
                expr += f".sum(dim={op.pre_sum!r})"
            if op.perm is not None:
                expr += f".permute{op.perm!r}"
            expr += f".reshape({_size(op.dims if r.batched else op.dims[1:])})"
            if op.transposed:
                expr += ".transpose(-1, -2)"
            lines.append(f"{side}{k} = {expr}")
        gemm = f"torch.addmm(bias, a{k}, b{k})" if fused and k == len(program) - 1 else f"torch.matmul(a{k}, b{k})"
        lines.append(f"z{k} = {gemm}.reshape({_size(r.out_shape)})" + ("" if r.final is None else f".permute{r.final!r}"))
        names.append(f"z{k}")
    lines.append(f"y = {names[0]}.reshape(rows, {spec.out_padded})")
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


@lru_cache(maxsize=4096)
def eager_tt_linear_runner(spec: TTSpec, rows: int, training: bool, input_requires_grad: bool,
                           has_bias: bool) -> Callable[..., torch.Tensor]:
    """The runner of tt_linear_program's plan for exactly this many rows (the eager path)."""
    return _runner(spec, tt_linear_program(spec, rows, training, input_requires_grad), has_bias)[1]


@lru_cache(maxsize=4096)
def _names(token: str, training: bool, input_requires_grad: bool, has_bias: bool
           ) -> tuple[tuple[int, ...], tuple[str, ...]]:
    spec = TTSpec.of(token)
    thresholds, programs = tt_linear_segments(token, training, input_requires_grad)
    return thresholds, tuple(_runner(spec, p, has_bias)[0] for p in programs)


@constant_under_compile
def tt_linear_runner_names(token: str, training: bool, input_requires_grad: bool, has_bias: bool
                           ) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """tt_linear_segments' thresholds and, for each segment's program, the name of its runner in RUNNERS:
    constants under torch.compile, which picks the runner by comparing the row count with the thresholds."""
    return _names(token, training, input_requires_grad, has_bias)
