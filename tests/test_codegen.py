"""The generated TT linear runners (comera_compile.networks.codegen): every program of every row-count segment
computes the dense product and its gradients, runs run_program's GEMMs with fewer reshapes, and a runner generated
after a layer was compiled recompiles nothing."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import comera_compile as cc
from comera_compile import networks
from comera_compile.networks import codegen
from comera_compile.tt import cores_to_dense, gemm_core_padding, gemm_spec


@st.composite
def layers(draw):
    """A float64 TTLinear with gates away from 1 (some zero), ranks that gemm padding may round up (30 -> 32)."""
    torch.manual_seed(draw(st.integers(0, 2**16)))
    in_f, out_f = draw(st.integers(1, 96)), draw(st.integers(1, 96))
    rank = draw(st.sampled_from([1, 3, 8, 30]))
    layer = cc.TTLinear(in_f, out_f, bias=draw(st.booleans()), rank=rank, d=draw(st.sampled_from([None, 2, 3])),
                        dtype=torch.float64)
    with torch.no_grad():
        for g in layer.gates:
            g.copy_(torch.randn_like(g) * (torch.rand_like(g) > 0.2))
    return layer


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layer=layers(), rows=st.integers(1, 70), training=st.booleans(), input_grad=st.booleans())
def test_every_segment_s_runner_computes_the_dense_product_and_its_gradients(layer, rows, training, input_grad):
    """Each program of tt_linear_segments (what a compiled layer may pick, whatever the row count it was
    planned for), run at `rows` rows, against x @ W + b with W the full tensor of the cores (float64)."""
    spec = layer.spec
    params = [*layer.cores, *layer.gates]
    x = torch.randn(rows, layer.in_features, dtype=torch.float64, requires_grad=True)
    x_padded = torch.nn.functional.pad(x, (0, spec.in_padded - layer.in_features))
    gy = torch.randn(rows, layer.out_features, dtype=torch.float64)

    ref = x @ cores_to_dense(list(layer.cores), list(layer.gates), spec)
    if layer.bias is not None:
        ref = ref + layer.bias
    ref_grads = torch.autograd.grad((ref * gy).sum(), [x, *params])

    _, programs = networks.tt_linear_segments(spec.token, training, input_grad)
    for program in programs:
        run = codegen.tt_linear_runner(spec, program, layer.bias is not None)
        y = run(x_padded, *params, layer.bias, rows)
        torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)
        grads = torch.autograd.grad((y * gy).sum(), [x, *params])
        for g, g_ref in zip(grads, ref_grads):
            torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-10)


def _graph(fn, *args) -> tuple[list, int]:
    """The GEMMs of fn's aten graph with their operand shapes, in order, and the count of its views."""
    graph = torch.fx.experimental.proxy_tensor.make_fx(fn)(*args).graph
    aten = torch.ops.aten
    gemms = [(n.target, [tuple(a.meta["val"].shape) for a in n.args if isinstance(a, torch.fx.Node)])
             for n in graph.nodes if n.target in (aten.mm.default, aten.bmm.default, aten.addmm.default)]
    views = sum(n.target in (aten.view.default, aten._unsafe_view.default, aten.clone.default) for n in graph.nodes)
    return gemms, views


@pytest.mark.parametrize("rank", [8, 30])
def test_a_runner_runs_run_program_s_gemms_with_fewer_reshapes(rank):
    """The generated body is run_program unrolled: the same GEMMs on operands of the same shapes, in order
    (gates folded and the padding of rank 30 to 32 included), with the reshapes that only restate a
    layout left out."""
    torch.manual_seed(0)
    layer = cc.TTLinear(96, 80, rank=rank)
    spec, rows = layer.spec, 24
    x = torch.randn(rows, spec.in_padded)
    assert (gemm_spec(spec) != spec) == (rank == 30)   # the rank padding is exercised
    for program in networks.tt_linear_segments(spec.token, True, True)[1]:
        def interpreted(x, *params):
            cores = [c * g for c, g in zip(params, params[spec.num_cores:])] + [params[spec.num_cores - 1]]
            for k, pad in enumerate(gemm_core_padding(spec)):
                if pad is not None:
                    cores[k] = torch.nn.functional.pad(cores[k], pad)
            cores[0] = cores[0].reshape(cores[0].shape[1:])
            cores[-1] = cores[-1].reshape(cores[-1].shape[:-1])
            fused = networks.fuses_bias(program[-1].recipe, spec.out_features)
            ops = [x.reshape(rows, *spec.in_modes), *cores]
            y = networks.run_program(program, ops, rows, layer.bias if fused else None)
            y = y.reshape(rows, spec.out_padded)[:, :spec.out_features] if spec.out_padded != spec.out_features \
                else y.reshape(rows, spec.out_padded)
            return y if fused else y + layer.bias

        run = codegen.tt_linear_runner(spec, program, True)
        params = [*layer.cores, *layer.gates]
        gemms, views = _graph(lambda x, *p: run(x, *p, layer.bias, rows), x, *params)
        gemms_ref, views_ref = _graph(interpreted, x, *params)
        assert gemms == gemms_ref and len(gemms) == len(program)
        assert views < views_ref


def test_a_runner_generated_after_a_layer_compiled_recompiles_nothing():
    """Runners are attributes of one namespace that compiled layers read by name: a layer of new shapes run
    later (eager or compiled) adds one, and the first layer's graph stays valid."""
    torch._dynamo.reset()
    first = cc.TTLinear(48, 40, rank=4)
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(first, backend=counter)
    x = torch.randn(6, 48)
    torch.testing.assert_close(compiled(x), first(x))
    assert counter.frame_count == 1
    other = cc.TTLinear(52, 36, rank=5)
    other(torch.randn(6, 52))                                       # a new runner, eagerly
    torch.compile(other, backend="eager")(torch.randn(6, 52))     # and one traced
    torch.testing.assert_close(compiled(x), first(x))
    assert counter.frame_count == 1


def test_a_parametrized_core_is_an_error_that_says_so():
    """The forward reads the cores from their list's parameters: a core moved out of them by
    torch.nn.utils.parametrize is refused with a message, not run with the wrong operands."""
    layer = cc.TTLinear(16, 12, rank=3)

    class Scale(torch.nn.Module):
        def forward(self, core):
            return 2 * core

    torch.nn.utils.parametrize.register_parametrization(layer.cores, "1", Scale())
    with pytest.raises(RuntimeError, match="parametrization of a core"):
        layer(torch.randn(2, 16))
