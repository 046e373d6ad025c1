"""passes.fx.materialize: integer -> float casts of a dynamo graph go through an opaque copy, which changes no
value, and backend "comera" compiles such graphs to the eager results."""

from __future__ import annotations

import torch

import comera_compile  # noqa: F401  (registers the backend)
from comera_compile.ops.materialize import materialize
from comera_compile.passes.fx.materialize import materialize_int_casts


def _attention_probs(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    add = (1.0 - mask[:, None, None, :].to(scores.dtype)) * torch.finfo(scores.dtype).min
    return torch.softmax(scores + add, dim=-1) * scores.sigmoid()


def _inputs():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 5, 5, generator=g, requires_grad=True)
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, 3:] = 0
    return scores, mask


def test_pass_routes_integer_casts_only_and_keeps_values():
    seen = []

    def backend(gm, example_inputs):
        seen.append(materialize_int_casts(gm).count)
        assert any(n.target is torch.ops.comera.opaque_copy.default for n in gm.graph.nodes)
        copies = sum(n.target is torch.ops.comera.opaque_copy.default for n in gm.graph.nodes)
        assert materialize_int_casts(gm).count == 0   # a second run routes nothing twice
        assert sum(n.target is torch.ops.comera.opaque_copy.default for n in gm.graph.nodes) == copies
        return gm.forward

    torch._dynamo.reset()
    f = torch.compile(_attention_probs, backend=backend, fullgraph=True)
    scores, mask = _inputs()
    torch.testing.assert_close(f(scores, mask), _attention_probs(scores, mask), rtol=0, atol=0)
    assert seen == [1]   # the mask's cast; scores.to(scores.dtype) and the float ops are left alone


def test_backend_matches_eager_forward_and_gradient():
    torch._dynamo.reset()
    scores, mask = _inputs()
    ref = _attention_probs(scores, mask)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), scores)
    out = torch.compile(_attention_probs, backend="comera")(scores, mask)
    (g,) = torch.autograd.grad(out.square().sum(), scores)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)
    assert (out[1, :, :, 3:] == 0).all()


def test_materialize_is_a_copy():
    t = torch.arange(6).reshape(2, 3)
    c = materialize(t)
    assert torch.equal(c, t) and c.data_ptr() != t.data_ptr()


class _Masked(torch.nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x * mask.float()


def test_a_torch_fx_trace_is_routed_given_example_inputs_and_warned_about_without():
    """A torch.fx trace carries no values: with example_inputs the pass propagates them and routes the cast
    (values unchanged); without, it says it rewrote nothing instead of returning a silent 0."""
    import pytest

    x, mask = torch.randn(2, 3, dtype=torch.float64), (torch.rand(2, 3) > 0.5).long()
    gm = torch.fx.symbolic_trace(_Masked())
    assert materialize_int_casts(gm, (x, mask)).count == 1
    torch.testing.assert_close(gm(x, mask), x * mask.to(x.dtype), rtol=0, atol=0)
    with pytest.warns(UserWarning, match="materialize_int_casts: the graph's nodes carry no values"):
        assert materialize_int_casts(torch.fx.symbolic_trace(_Masked())).count == 0
