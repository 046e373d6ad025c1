"""Backend option recompute_materialized: the backward recomputes cheap pointwise results (GELU's and
LayerNorm's outputs, which the next layer's weight gradient reads) instead of keeping them, with the
gradients of eager PyTorch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import comera_compile  # noqa: F401  (registers the backend)


def _saved_numels(fn, *args) -> tuple[torch.Tensor, list[int]]:
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, saved


@pytest.mark.parametrize("rows", [5, 64])
def test_ffn_saves_one_hidden_activation_less_with_eagers_gradients(rows):
    """Linear -> GELU -> Linear under backend "comera" in float64: output and every gradient equal eager's,
    and the compiled step keeps one rows x hidden tensor less than with recompute_materialized off."""
    torch.manual_seed(0)
    hidden = 96
    ffn = nn.Sequential(nn.Linear(16, hidden), nn.GELU(), nn.Linear(hidden, 16)).double()
    x = torch.randn(rows, 16, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(rows, 16, dtype=torch.float64)
    want = ffn(x)
    want.backward(upstream)
    eager = [t.grad.clone() for t in (x, *ffn.parameters())]
    hidden_saved = {}
    for recompute in (True, False):
        torch._dynamo.reset()
        for t in (x, *ffn.parameters()):
            t.grad = None
        compiled = torch.compile(ffn, backend="comera", options={"recompute_materialized": recompute})
        got, saved = _saved_numels(compiled, x)
        got.backward(upstream)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        for g, t in zip(eager, (x, *ffn.parameters())):
            torch.testing.assert_close(t.grad, g, rtol=1e-12, atol=1e-12)
        hidden_saved[recompute] = saved.count(rows * hidden)
    assert hidden_saved == {True: 1, False: 2}, hidden_saved        # GELU's input; and its output when saved


def test_layer_norm_output_is_recomputed_for_the_next_weight_gradient_with_eagers_gradients():
    """Linear -> LayerNorm -> Linear under backend "comera" in float64: output and gradients equal eager's,
    and the step keeps one rows x width tensor less than with recompute_materialized off (the LayerNorm's
    output, which the second layer's weight gradient reads, comes back from its input and statistics)."""
    torch.manual_seed(0)
    rows, width = 24, 40
    net = nn.Sequential(nn.Linear(16, width), nn.LayerNorm(width), nn.Linear(width, 16)).double()
    x = torch.randn(rows, 16, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(rows, 16, dtype=torch.float64)
    want = net(x)
    want.backward(upstream)
    eager = [t.grad.clone() for t in (x, *net.parameters())]
    kept = {}
    for recompute in (True, False):
        torch._dynamo.reset()
        for t in (x, *net.parameters()):
            t.grad = None
        compiled = torch.compile(net, backend="comera", options={"recompute_materialized": recompute})
        got, saved = _saved_numels(compiled, x)
        got.backward(upstream)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        for g, t in zip(eager, (x, *net.parameters())):
            torch.testing.assert_close(t.grad, g, rtol=1e-12, atol=1e-12)
        kept[recompute] = saved.count(rows * width)
    assert kept[True] == kept[False] - 1, kept
