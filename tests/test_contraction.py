"""passes.fx.contraction: TT-layer nodes expanded into their planned pairwise contractions."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import comera_compile as cc
from comera_compile.examples import six_encoder
from comera_compile.layers import TTLinear
from comera_compile.passes.fx.contraction import expand_contractions


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(37, 120)     # 37 is prime: padded input modes
        self.down = nn.Linear(120, 53)   # padded output modes
        self.tail = nn.Linear(53, 8, bias=False)

    def forward(self, x):
        return self.tail(torch.tanh(self.down(torch.relu(self.up(x)))))


def _grads(model, x):
    x = x.clone().requires_grad_(True)
    out = model(x)
    g = torch.randn_like(out, generator=torch.Generator().manual_seed(1))
    out.backward(g)
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("shape", [(5, 37), (3, 4, 37), (1, 37), (64, 37)])
@pytest.mark.parametrize("training", [True, False])
def test_expanded_graph_matches_layer_outputs_and_gradients(shape, training):
    torch.manual_seed(0)
    dense = TwoLayer().double()
    gm = cc.tensorize(dense, rank=4, min_features=1, trace=True).train(training)
    expanded = expand_contractions(copy.deepcopy(gm), (torch.zeros(shape, dtype=torch.float64),)).graph_module
    assert not any(n.op == "call_module" and isinstance(expanded.get_submodule(n.target), TTLinear)
                   for n in expanded.graph.nodes)
    x = torch.randn(shape, dtype=torch.float64)
    y0, gx0, gp0 = _grads(gm, x)
    y1, gx1, gp1 = _grads(expanded, x)
    torch.testing.assert_close(y1, y0, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gx1, gx0, rtol=1e-10, atol=1e-12)
    assert gp0.keys() == gp1.keys() and any(".cores." in k for k in gp0)
    for k in gp0:
        torch.testing.assert_close(gp1[k], gp0[k], rtol=1e-10, atol=1e-12)
    # and against the dense weights the TT layers stand for (computed another way)
    h = torch.relu(x @ gm.up.to_dense().t() + gm.up.bias)
    h = torch.tanh(h @ gm.down.to_dense().t() + gm.down.bias)
    ref = h @ gm.tail.to_dense().t()
    torch.testing.assert_close(y1, ref, rtol=1e-10, atol=1e-12)


def test_expanded_code_shows_the_order_with_flops():
    torch.manual_seed(0)
    gm = cc.tensorize(TwoLayer(), rank=4, min_features=1, trace=True)
    expanded = expand_contractions(gm, (torch.zeros(16, 37),)).graph_module
    code = expanded.code
    plan = gm.up.plan(16)
    for k, eq in enumerate(plan.equations):
        assert f"# up contraction {k}: {eq}," in code
    assert "torch.matmul(" in code and "einsum" not in code
    assert "FLOP fwd" in code and "fwd+bwd" in code
    up_nodes = [n for n in expanded.graph.nodes if "comera_flops" in n.meta][: len(plan.steps)]  # first layer
    assert [n.meta["comera_contraction"] for n in up_nodes] == list(plan.equations)
    assert sum(n.meta["comera_flops"] for n in up_nodes) == plan.flops


def test_plan_follows_the_real_row_count():
    gm = cc.tensorize(nn.Sequential(nn.Linear(768, 3072)), rank=30, min_features=1, trace=True)
    small = expand_contractions(copy.deepcopy(gm), (torch.zeros(1, 768),)).graph_module
    large = expand_contractions(copy.deepcopy(gm), (torch.zeros(4096, 768),)).graph_module
    eq = lambda g: [n.meta["comera_contraction"] for n in g.graph.nodes if "comera_contraction" in n.meta]
    assert eq(small) != eq(large)


def test_six_encoder_expands_and_matches():
    torch.manual_seed(0)
    m = six_encoder.build(layers=1, vocab_size=100, d_model=48, heads=4, ffn=96, max_positions=32).double()
    gm = cc.tensorize(m, rank=5, min_features=40, trace=True).eval()
    ids, seg, mask = six_encoder.example_inputs(m, batch=2, seq=5)
    expanded = expand_contractions(copy.deepcopy(gm), (ids, seg, mask)).graph_module
    torch.testing.assert_close(expanded(ids, seg, mask), gm(ids, seg, mask), rtol=1e-10, atol=1e-12)


def test_needs_shapes_and_a_graph_module():
    gm = cc.tensorize(TwoLayer(), rank=4, min_features=1, trace=True)
    with pytest.raises(ValueError, match="example_inputs"):
        expand_contractions(gm)
    with pytest.raises(TypeError, match="GraphModule"):
        expand_contractions(TwoLayer())


def test_graph_without_tt_layers_is_left_alone():
    gm = torch.fx.symbolic_trace(TwoLayer())
    before = gm.code
    assert expand_contractions(gm, (torch.zeros(2, 37),)).graph_module.code == before


def test_an_expanded_graph_checks_its_input_shape_and_keeps_autocast_s_dtypes():
    """The expanded graph is planned for the example's shape: another shape of the same row count ((3, 2) for
    (2, 3)), which it reshaped into the example's leading dimensions, and another row count are errors that
    say so.  Under autocast an unfused bias is added in the output's dtype, as the eager layer adds it."""
    torch.manual_seed(0)
    gm = cc.tensorize(TwoLayer(), rank=4, min_features=1, trace=True)
    ref = copy.deepcopy(gm)
    x = torch.randn(2, 3, 37)
    expand_contractions(gm, (x,))
    torch.testing.assert_close(gm(x), ref(x))
    for other in (torch.randn(3, 2, 37), torch.randn(5, 37)):
        with pytest.raises(AssertionError, match=r"planned this graph for inputs of shape \(2, 3, 37\); expand it"):
            gm(other)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = gm(x), ref(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)

