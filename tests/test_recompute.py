"""passes.joint.recompute.recompute_gelu: the backward recomputes GELU outputs instead of saving them, with
the gradients of eager PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera_compile  # noqa: F401  (registers the backend)
from comera_compile.passes.joint.recompute import recompute_gelu


def _tagged_by(pass_fn, fn, *args, decomposed: bool = False) -> dict[str, bool]:
    """Run fn under AOTAutograd (with Inductor's decompositions when `decomposed`, as Inductor's joint graph
    has them) with pass_fn applied to its joint graph; the nodes it tagged MUST_RECOMPUTE, each with whether
    it depends on a tangent (a backward node)."""
    from torch._inductor.decomposition import select_decomp_table
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition, must_recompute

    tagged: dict[str, bool] = {}

    def partition(joint, joint_inputs, **kwargs):
        pass_fn(joint.graph)
        tangents = [n for n in joint.graph.nodes if n.name.startswith("tangents")]
        tagged.update({str(n.target): any(t in n.all_input_nodes for t in tangents)
                       for n in joint.graph.nodes if must_recompute(n)})
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=lambda g, _: g, partition_fn=partition,
                           decompositions=select_decomp_table() if decomposed else {})
    out = torch.compile(fn, backend=backend)(*args)
    out.sum().backward()
    return tagged


@pytest.mark.parametrize("decomposed", [False, True])
def test_pass_tags_the_forward_gelu_and_its_relayouts_only(decomposed):
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(8, 12, requires_grad=True)
    tagged = _tagged_by(recompute_gelu, lambda x, w: F.gelu(x @ w).t() @ x, x, w, decomposed=decomposed)
    gelu = "aten.erf.default" if decomposed else "aten.gelu.default"
    assert gelu in tagged and ("aten.t.default" in tagged or "aten.permute.default" in tagged), tagged
    assert "aten.mm.default" not in tagged, tagged                  # the GEMMs around it are not recomputed
    assert not any(tagged.values()), tagged                         # no backward node
    tanh = _tagged_by(recompute_gelu, lambda x, w: F.gelu(x @ w, approximate="tanh") @ w.t(), x, w,
                      decomposed=decomposed)
    assert tanh == {}


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
    and the compiled step saves one rows x hidden tensor less than with recompute_gelu off."""
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
        compiled = torch.compile(ffn, backend="comera", options={"recompute_gelu": recompute})
        got, saved = _saved_numels(compiled, x)
        got.backward(upstream)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        for g, t in zip(eager, (x, *ffn.parameters())):
            torch.testing.assert_close(t.grad, g, rtol=1e-12, atol=1e-12)
        hidden_saved[recompute] = saved.count(rows * hidden)
    assert hidden_saved == {True: 1, False: 2}, hidden_saved        # GELU's input; and its output when saved
