"""passes.fx.siblings: TT layers that read one input share their GEMMs.  The rewritten graph, run eagerly on
dynamo's capture, against the dense products (x @ W.T + b, W from the cores) and against eager autograd
through the layers as written; a transformers Llama through the whole backend; and the places nothing may
move across."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import comera_compile as cc
from comera_compile.backend import batches_siblings
from comera_compile.layers import TTLinear
from comera_compile.passes import node_shape
from comera_compile.passes.fx.siblings import batch_siblings

pytestmark = pytest.mark.usefixtures("single_thread")   # small tensors (see conftest.single_thread)

_PRODUCTS = {torch.matmul, operator.matmul, torch.bmm, torch.baddbmm, torch.addmm}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def shared(monkeypatch) -> list:
    """What every run of the pass inside the backend returned, in order."""
    import comera_compile.passes.fx.siblings as siblings

    results = []
    original = siblings.batch_siblings
    monkeypatch.setattr(siblings, "batch_siblings",
                        lambda gm, inputs=None: results.append(original(gm, inputs)) or results[-1])
    return results


class Siblings(nn.Module):
    """TT linear layers that all read the module's input; their outputs, in a list."""

    def __init__(self, in_features: int, widths: list[int], rank: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.layers = nn.ModuleList(TTLinear(in_features, w, bias=bias, rank=rank, dtype=dtype) for w in widths)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [layer(x) for layer in self.layers]


def _products(gm: torch.fx.GraphModule) -> int:
    return sum(n.op == "call_function" and n.target in _PRODUCTS for n in gm.graph.nodes)


def _rewritten(model: nn.Module, dynamic: bool = False):
    """model compiled with a backend that runs only batch_siblings and then the graph eagerly; the pass's
    result and the product counts before and after."""
    seen = {}

    def backend(gm: torch.fx.GraphModule, example_inputs):
        seen["before"] = _products(gm)
        seen["result"] = batch_siblings(gm, example_inputs)
        seen["after"] = _products(gm)
        return gm.forward

    return torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic), seen


def _perturb(model: nn.Module, seed: int) -> None:
    """Gates off 1 and biases off 0, so that every factor shows in the products."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gates" in name or name.endswith("bias"):
                p.add_(torch.rand(p.shape, generator=g, dtype=p.dtype))


@settings(max_examples=12, deadline=None)
@given(count=st.integers(2, 4), in_features=st.sampled_from([24, 36]), widths=st.lists(st.sampled_from([16, 24, 36]),
       min_size=4, max_size=4), equal=st.booleans(), rank=st.integers(2, 6), bias=st.booleans(),
       rows=st.sampled_from([1, 5, 12]), dtype=st.sampled_from([torch.float64, torch.float32]))
def test_siblings_share_their_gemms_and_compute_the_dense_products_and_eager_gradients(
        count, in_features, widths, equal, rank, bias, rows, dtype):
    torch._dynamo.reset()
    torch.manual_seed(0)
    widths = [widths[0]] * count if equal else widths[:count]
    model = Siblings(in_features, widths, rank, bias, dtype)
    _perturb(model, 1)
    x = torch.randn(rows, 3, in_features, dtype=dtype, requires_grad=True)
    weights = [torch.randn(rows, 3, w, dtype=dtype) for w in widths]

    compiled, seen = _rewritten(model)
    outs = compiled(x)
    # the first products share one GEMM; layers whose plans multiply cores of one shape (one width, or the
    # input side's cores of any width where the plan starts there) may share those products too
    assert seen["result"].count >= 1 and seen["after"] < seen["before"]
    eps = 1e-11 if dtype == torch.float64 else 1e-5

    def close(got, want):   # to the arithmetic's precision, relative to the tensor's scale
        torch.testing.assert_close(got, want, rtol=eps, atol=eps * float(want.detach().abs().max()))

    for layer, out in zip(model.layers, outs):   # against the dense product of the layer's weight
        dense = x.detach().double() @ layer.to_dense().double().t()
        if layer.bias is not None:
            dense = dense + layer.bias.detach().double()
        close(out.detach().double(), dense)
    sum((o * w).sum() for o, w in zip(outs, weights)).backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad(set_to_none=True)
    sum((layer(x) * w).sum() for layer, w in zip(model.layers, weights)).backward()   # eager, as written
    want = [x.grad] + [p.grad for p in model.parameters()]
    for a, b in zip(got, want):
        close(a, b)


def test_equal_siblings_with_biases_share_every_product_and_inductor_compiles_them():
    torch.manual_seed(0)
    model = Siblings(144, [144, 144, 144], 6, True, torch.float64)
    _perturb(model, 3)
    x = torch.randn(2, 128, 144, dtype=torch.float64)
    steps = [s.per_row for s in model.layers[0].plan(256).steps]
    assert steps == [False] * 4 + [True] * 2   # at these shapes: the cores' products, then two per x's rows
    compiled, seen = _rewritten(model)
    outs = compiled(x)
    # Shared: one GEMM of x, one batched GEMM (with the biases) for the three second steps, one batched
    # matmul per position of the cores' products: one layer's count of products for all three.
    assert seen["before"] == 3 * len(steps) and seen["after"] == len(steps)
    for layer, out in zip(model.layers, outs):
        torch.testing.assert_close(out, x @ layer.to_dense().t() + layer.bias.detach(), rtol=1e-11, atol=1e-11)
    # The backend, through Inductor: the products and the gradients of eager autograd through the layers.
    weights = [torch.randn(2, 128, 144, dtype=torch.float64) for _ in outs]
    x.requires_grad_(True)
    torch._dynamo.reset()
    inductor = torch.compile(model, backend="comera", options={"batch_siblings": True}, fullgraph=True)
    outs = inductor(x)
    sum((o * w).sum() for o, w in zip(outs, weights)).backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad(set_to_none=True)
    sum((layer(x) * w).sum() for layer, w in zip(model.layers, weights)).backward()
    for a, b in zip(got, [x.grad] + [p.grad for p in model.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12 * float(b.abs().max()))


def _llama(layers: int = 2, kv_heads: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=144, intermediate_size=288, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=32)
    model = cc.tensorize(LlamaForCausalLM(cfg), rank=6).double()
    _perturb(model, 2)
    return model


# multi-head (its Inductor leg) is slow: the 12-layer decoders below share their GEMMs through Inductor
@pytest.mark.parametrize("kv_heads", [pytest.param(4, marks=pytest.mark.slow), 2],
                         ids=["multi-head", "grouped-query"])
def test_a_llama_through_the_backend_shares_q_k_v_and_gate_up_and_trains_as_eager(kv_heads):
    """Multi-head: q, k and v share every product, and o their cores'.  Grouped-query (k and v half q's
    width): the three share the GEMM of the input; k and v, alike, share the rest, and q and o the cores'.
    The rewritten graph's loss and gradients are eager's in float64; multi-head's through Inductor too."""
    model = _llama(kv_heads=kv_heads)
    ids = torch.randint(0, 96, (2, 64))

    def loss_of(m):
        logits = m(input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, 96), ids[:, 1:].reshape(-1))

    (report,) = cc.rewritten_graphs(model, input_ids=ids)   # on CPU by default without the pass
    assert "batch_siblings" not in report.passes
    compiled, seen = _rewritten(model)
    compiled(input_ids=ids)
    layers = [m for m in model.model.layers.modules() if isinstance(m, TTLinear)]
    plans = {tuple(s.per_row for s in m.plan(128).steps) for m in layers}
    assert plans == {(False,) * 4 + (True,) * 2}   # the cores' four products, then two per row, in every layer
    shapes = {(m.in_features, m.out_features) for m in layers}   # 3 (multi-head) or 4 (k and v narrower)
    # Shared in each of the 2 layers: q/k/v's product of the input, one; their second products, one
    # batched GEMM where all three agree (multi-head), else q's and one for k and v; gate/up's two
    # products, one each; o and down alone.  And position by position, the cores' products of all the
    # layers of each shape, both layers' together.
    others = seen["before"] - sum(len(m.plan(128).steps) for m in layers)   # attention's, the TT head's
    per_layer = 1 + (1 if kv_heads == 4 else 2) + 2 + 2 + 2
    assert seen["after"] == others + 2 * per_layer + 4 * len(shapes)
    assert seen["result"].count == 4 + len(shapes)   # q/k/v and gate/up in each layer; each shape's layers

    eager = loss_of(model)
    eager.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    # The rewritten graph, run eagerly: the same loss and gradients to float64's precision.
    got = loss_of(compiled)
    got.backward()
    torch.testing.assert_close(got, eager, rtol=1e-12, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-10, atol=1e-12 * float(want[n].abs().max()), msg=n)
    # Through Inductor, in float32 (torch 2.11's Inductor fails a float64 Llama's attention backward on CPU,
    # with or without the pass): gradients as near the float64 ones as eager float32 autograd's.  (Both are
    # ~1e-3 of a gate's largest gradient off them; compared with each other at 1e-3, seeds failed.)  Once,
    # for multi-head: grouped-query's graph differs only in which batched GEMMs it holds, checked above.
    if kv_heads != 4:
        return
    truth = want

    def error(grads):   # the largest relative error of any parameter's gradient, against float64's
        return max(float((grads[n].double() - truth[n]).abs().max() / truth[n].abs().max()) for n in truth)

    model.float().zero_grad(set_to_none=True)
    loss_of(model).backward()
    eager_error = error({n: p.grad for n, p in model.named_parameters()})
    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    loss_of(torch.compile(model, backend="comera", options={"batch_siblings": True})).backward()
    assert error({n: p.grad for n, p in model.named_parameters()}) < 3 * eager_error < 3e-2


class _Boundary(nn.Module):
    """Two siblings with a grad-mode switch or an in-place update of their input between them."""

    def __init__(self, between: str) -> None:
        super().__init__()
        self.q = TTLinear(24, 24, rank=4, dtype=torch.float64)
        self.k = TTLinear(24, 24, rank=4, dtype=torch.float64)
        self.act = nn.ReLU(inplace=True)
        self.between = between

    def forward(self, x: torch.Tensor):
        h = x * 1.0
        a = self.q(h)
        if self.between == "no_grad":
            with torch.no_grad():
                b = self.k(h)
        elif self.between == "in_place":
            h.mul_(2.0)
            b = self.k(h)
        elif self.between == "in_place_operator":   # h *= 2: operator.imul in dynamo's graph, no "_" in its name
            h2 = h
            h *= 2.0
            b = self.k(h2)
        elif self.between == "relu_keyword":   # inplace=True: dynamo keeps the call as written
            torch.nn.functional.relu(h, inplace=True)
            b = self.k(h)
        elif self.between == "relu_positional":
            torch.nn.functional.relu(h, True)
            b = self.k(h)
        else:   # nn.ReLU(inplace=True), inlined by dynamo into F.relu(h, inplace=True)
            self.act(h)
            b = self.k(h)
        return a, b


@pytest.mark.parametrize("between", ["no_grad", "in_place", "in_place_operator", "relu_keyword", "relu_positional",
                                     "relu_module"])
def test_nothing_is_shared_across_a_grad_mode_switch_or_an_in_place_update(between):
    """An in-place call written with inplace=True (F.relu(h, inplace=True), nn.ReLU(inplace=True)) is a boundary
    too: batched before it, the second product read h before the ReLU (4.9 off on a small net)."""
    torch.manual_seed(0)
    model = _Boundary(between)
    x = torch.randn(5, 24, dtype=torch.float64)
    compiled, seen = _rewritten(model)
    a, b = compiled(x)
    assert seen["result"].count == 0
    seen_by_k = x if between == "no_grad" else torch.relu(x) if between.startswith("relu") else x * 2.0
    torch.testing.assert_close(b, model.k(seen_by_k), rtol=1e-12, atol=1e-12)
    assert b.requires_grad == (between != "no_grad") and a.requires_grad


class _Chain(nn.Module):
    """Two TT layers of one shape in a row (attention's q and its output projection, say): no input shared."""

    def __init__(self) -> None:
        super().__init__()
        self.q = TTLinear(144, 144, rank=6, dtype=torch.float64)
        self.o = TTLinear(144, 144, rank=6, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.tanh(self.q(x)))


def test_alike_layers_in_a_row_share_their_core_products_and_compute_what_eager_does():
    torch.manual_seed(0)
    model = _Chain()
    _perturb(model, 5)
    x = torch.randn(256, 144, dtype=torch.float64, requires_grad=True)
    steps = [s.per_row for s in model.q.plan(256).steps]
    assert steps == [False] * 4 + [True] * 2
    compiled, seen = _rewritten(model)
    out = compiled(x)
    # the four positions of the cores' products batched over both layers; the per-row products apart
    assert seen["result"].count == 1 and (seen["before"], seen["after"]) == (12, 4 + 2 * 2)
    q = torch.tanh(x @ model.q.to_dense().t() + model.q.bias)
    torch.testing.assert_close(out, q @ model.o.to_dense().t() + model.o.bias, rtol=1e-10, atol=1e-12)
    out.square().sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    for a, b in zip(got, [x.grad] + [p.grad for p in model.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12 * float(b.abs().max()))


def _symbolic_products(gm: torch.fx.GraphModule) -> int:
    """Products in the graph with a size that is not a plain int (a dynamic row count)."""
    return sum(n.op == "call_function" and n.target in _PRODUCTS and (
        node_shape(n) is None or any(type(d) is not int for d in node_shape(n))) for n in gm.graph.nodes)


def test_products_of_symbolic_shape_are_left_alone_and_a_dynamic_graph_computes_what_eager_does():
    """Under dynamic shapes only the cores' products (static) may be batched; each per-row product, whose row
    count is symbolic, stays as it was, and every row count gives eager's values."""
    torch.manual_seed(0)
    model = Siblings(24, [24, 24], 4, False, torch.float64)
    _perturb(model, 1)
    symbolic = {}

    def backend(gm: torch.fx.GraphModule, example_inputs):
        before = _symbolic_products(gm)
        batch_siblings(gm, example_inputs)
        symbolic[len(symbolic)] = (before, _symbolic_products(gm))
        return gm.forward

    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    for rows in (7, 13, 300):
        x = torch.randn(rows, 24, dtype=torch.float64)
        for got, layer in zip(compiled(x), model.layers):
            torch.testing.assert_close(got, x @ layer.to_dense().t(), rtol=1e-10, atol=1e-12)
    assert symbolic and all(before == after > 0 for before, after in symbolic.values())


def test_the_option_is_on_for_cuda_inputs_by_default_and_off_with_profiling_or_tempo():
    assert batches_siblings(None, {"cuda"}) and not batches_siblings(None, {"cpu"})
    assert batches_siblings({"batch_siblings": True}, {"cpu"})
    assert not batches_siblings({"batch_siblings": False}, {"cuda"})
    assert not batches_siblings({"batch_siblings": True, "profile": True}, {"cuda"})
    assert not batches_siblings({"batch_siblings": True, "memory": True}, {"cpu"})
    with pytest.raises(TypeError, match="batch_siblings"):
        batches_siblings({"batch_siblings": 1}, {"cpu"})


def test_under_bf16_autocast_the_shared_gemms_run_in_bf16_as_eager_autocast_does():
    torch.manual_seed(0)
    model = Siblings(144, [144, 144, 144], 6, True, torch.float32)
    _perturb(model, 3)
    x = torch.randn(2, 128, 144)
    compiled = torch.compile(model, backend="comera", options={"batch_siblings": True}, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = model(x), compiled(x)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=2e-2 * float(b.float().abs().max()))


class _GLUBlock(nn.Module):
    """A gated MLP block: gate and up read the block's input (siblings), down reads their product."""

    def __init__(self, width: int = 144) -> None:
        super().__init__()
        self.gate = nn.Linear(width, 2 * width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.silu(self.gate(x)) * self.up(x))


def test_the_whole_step_graph_with_shared_gemms_trains_as_eager_through_a_rank_cut(monkeypatch, shared):
    """compile_step's whole-step graph (its capture simulated on the CPU), the backend sharing the siblings'
    GEMMs as it does on CUDA by default, a rank cut at step 4 (the siblings' ranks then differ, and the
    graphs recompile): the eager loop's losses, step for step."""
    from comera_compile import graphs
    from comera_compile.optim import param_groups
    from helpers import BlockNet, SimulatedGraphs, eager_step_with

    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(128, 16, generator=g), torch.randint(0, 5, (128,), generator=g)) for _ in range(8)]

    def run(captured: bool):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = cc.tensorize(BlockNet(width=144, block=_GLUBlock), rank=6, min_features=16)
        groups = param_groups(model, lr=1e-3)
        for group in groups:   # the gates held still, so that a slice set to zero stays off
            group["lr"] = 0.0 if group["name"] == "rank_gates" else group["lr"]
        opt = torch.optim.AdamW(groups)
        ra = cc.RankAdaptive(model, optimizer=opt, cut_every=4, realloc_at=1.0, share_allocation=False)
        if captured:
            sim = SimulatedGraphs(model, opt, ra)
            monkeypatch.setattr(graphs, "CudaGraphs", lambda device: sim)
            step = cc.compile_step(model, nn.CrossEntropyLoss(), opt, cuda_graphs="step", rank_adaptive=ra,
                                   options={"batch_siblings": True})
        losses = []
        for i, (x, y) in enumerate(batches):
            loss = step(x, y) if captured else eager_step_with(model, F.cross_entropy, opt, ra, x, y)
            losses.append(float(loss))
            if i == 2:   # one slice of one sibling off: cut out at step 4, gate's rank is then below up's
                with torch.no_grad():
                    model.blocks[0].gate.gates[0][0] = 0.0
        return losses, ra

    losses, ra = run(True)
    ref_losses, ref_ra = run(False)
    assert ra.cuts == ref_ra.cuts == 1 and ra.ranks() == ref_ra.ranks()
    assert ra.ranks()["blocks.0.gate"] != ra.ranks()["blocks.0.up"]
    assert shared and all(r.count >= 1 for r in shared)   # before and after the cut
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)


class _Reused(nn.Module):
    """One TT layer called twice on the input (its products repeated) beside a sibling of the same shape."""

    def __init__(self) -> None:
        super().__init__()
        self.q = TTLinear(144, 144, rank=6, dtype=torch.float64)
        self.k = TTLinear(144, 144, rank=6, dtype=torch.float64)

    def forward(self, x: torch.Tensor):
        return self.q(x) * self.q(x) + self.k(x)


def test_a_layer_called_twice_beside_its_sibling_computes_what_eager_does():
    torch.manual_seed(0)
    model = _Reused()
    _perturb(model, 4)
    x = torch.randn(256, 144, dtype=torch.float64, requires_grad=True)
    compiled, seen = _rewritten(model)
    out = compiled(x)
    assert seen["result"].count >= 1 and seen["after"] < seen["before"]
    q, k = (x @ layer.to_dense().t() + layer.bias for layer in (model.q, model.k))
    torch.testing.assert_close(out, q * q + k, rtol=1e-10, atol=1e-10 * float(out.detach().abs().max()))
    out.sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    for a, b in zip(got, [x.grad] + [p.grad for p in model.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12 * float(b.abs().max()))


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_a_12_layer_decoder_trained_by_compile_step_shares_in_one_block_graph_and_trains_as_eager(
        family, shared):
    """compile_step at its defaults but for the pass (on, as on CUDA), on a 12-layer transformers decoder
    with grouped-query attention (Qwen2's q, k and v with biases): one compiled graph serves the 12 blocks,
    with q/k/v and gate/up (and alike layers' core products) shared in it, and three AdamW steps give the
    eager loop's losses."""
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}[family])(
        vocab_size=96, hidden_size=144, intermediate_size=288, num_hidden_layers=12, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 96, (2, 64), generator=g) for _ in range(3)]

    def run(compiled: bool) -> list[float]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = cc.tensorize(transformers.AutoModelForCausalLM.from_config(config), rank=6)
        opt = torch.optim.AdamW(cc.param_groups(model, lr=1e-3))
        step = cc.compile_step(model, None, opt, options={"batch_siblings": True}) if compiled else None
        losses = []
        for ids in batches:
            if compiled:
                losses.append(float(step(input_ids=ids, labels=ids)))
            else:
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(float(loss))
        return losses

    losses, ref = run(True), run(False)
    # one block graph: q/k/v and gate/up share their input's GEMMs; q and o, k and v, gate and up their cores'
    assert [r.count for r in shared if r.count] == [2 + 3]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-4, atol=0)
