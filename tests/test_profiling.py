"""Profiler ranges named after each TT layer, and cc.profile's per-layer table."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import comera_compile as cc
from comera_compile.layers import TTLayer, TTLinear


class _Model(nn.Module):
    """A word embedding, a 2-layer encoder and a head: TT embedding and TT linears once tensorized."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(500, 128)
        layer = nn.TransformerEncoderLayer(128, 4, 512, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(128, 300)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)))


def _tensorized() -> nn.Module:
    torch.manual_seed(0)
    return cc.tensorize(_Model(), rank=8)


def _tt_names(model: nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, TTLayer)}


def _ids() -> torch.Tensor:
    return torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(1))


def test_the_profiler_names_every_tt_layer_in_eager_mode():
    model = _tensorized()
    names = _tt_names(model)
    assert len(names) == 6 and "embed" in names   # the embedding, 2 x 2 FFN linears, the head
    with torch.profiler.profile() as prof:
        model(_ids()).sum().backward()
    events = {e.name for e in prof.events()}
    for name in names:
        kind = "tt_embedding" if name == "embed" else "tt_linear"
        assert f"comera.{kind}[{name}]" in events, name


def test_outputs_and_gradients_are_the_same_with_the_profiler_on_or_off():
    model = _tensorized()
    ids = _ids()
    out = model(ids)
    out.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with torch.profiler.profile():
        out_on = model(ids)
        out_on.sum().backward()
    assert torch.equal(out, out_on)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))


def test_no_range_is_opened_while_the_profiler_is_off(monkeypatch):
    model = _tensorized()
    opened = []
    real = torch.profiler.record_function
    monkeypatch.setattr(torch.profiler, "record_function", lambda *a, **k: opened.append(a) or real(*a, **k))
    model(_ids()).sum().backward()
    assert opened == []
    with torch.profiler.profile():
        model(_ids())
    assert len(opened) == 6


def test_profile_table_has_every_layer_with_its_forward_and_backward():
    model = _tensorized()
    ids = _ids()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        model(ids).sum().backward()
        opt.step()
        opt.zero_grad()

    table = cc.profile(step, model=model, steps=2)
    assert {t.name for t in table.layers} == _tt_names(model)
    for t in table.layers:
        assert t.calls == 2 and t.forward_ms > 0, t
        assert t.backward_ms > 0, t   # autograd's ops linked to the layer's forward ops
    assert 0 < sum(t.total_ms for t in table.layers) < table.step_ms
    text = str(table)
    assert all(name in text for name in _tt_names(model))


def test_a_layer_built_by_hand_is_named_by_its_class_until_profile_names_it():
    layer = TTLinear(256, 256, rank=4)
    with torch.profiler.profile() as prof:
        layer(torch.randn(3, 256))
    assert "comera.tt_linear[TTLinear]" in {e.name for e in prof.events()}
    model = nn.Sequential(nn.ReLU(), layer)
    table = cc.profile(lambda: model(torch.randn(3, 256)), model=model, steps=1, warmup=0)
    assert [t.name for t in table.layers] == ["1"]


def test_compiled_graphs_are_the_same_with_and_without_the_hooks():
    from comera_compile.benchmarks.profiling import without_hooks

    ids = _ids()
    with_hooks = [r.code for r in cc.rewritten_graphs(_tensorized(), ids)]
    plain = [r.code for r in cc.rewritten_graphs(without_hooks(_tensorized()), ids)]
    assert with_hooks == plain and len(with_hooks) == 1


def test_a_compiled_model_s_profile_says_how_to_see_its_layers():
    model = _tensorized()
    compiled = torch.compile(model, backend="comera")
    ids = _ids()
    table = cc.profile(lambda: compiled(ids).sum().backward(), model=model, steps=1)
    assert table.layers == [] and "Inductor removes profiler ranges" in str(table)
    assert "options={'profile': True}" in str(table)


def _sgd_step(model: nn.Module, how: str):
    """An SGD step on sum(model(ids)): eager, or compiled with the backend's profile option (the whole model
    as one graph, or compile_step's way: the encoder's blocks compiled, one graph for both; embedding and
    head eager)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    loss_fn = lambda out, target: out.sum()
    if how == "compile_step":
        step = cc.compile_step(model, loss_fn, opt, options={"profile": True})
        return lambda ids: step(ids, None)
    forward = model if how == "eager" else torch.compile(model, backend="comera", options={"profile": True})

    def step(ids: torch.Tensor) -> None:
        loss_fn(forward(ids), None).backward()
        opt.step()
        opt.zero_grad()

    return step


@pytest.mark.parametrize("how", ["whole", "compile_step"])
def test_a_compiled_profile_names_every_tt_layer_and_computes_what_eager_does(how):
    """With options={"profile": True} each TT layer's part of a compiled graph runs in its own range: the
    table has every TT layer (the blocks' graph is shared, yet each block's layers keep their own names),
    with forward and backward time; the step lands where the eager step does.  The parts are compiled as
    dynamo compiles a graph, so Inductor's and AOTAutograd's caches serve them in the next run."""
    ids = _ids()
    eager = _tensorized()
    _sgd_step(eager, "eager")(ids)
    model = _tensorized()
    step = _sgd_step(model, how)
    counters.clear()
    step(ids)
    assert counters["inductor"]["fxgraph_cache_bypass"] == 0 < counters["aot_autograd"]["total"]
    assert counters["aot_autograd"]["autograd_cache_bypass"] == 0
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p - q).norm() <= 1e-5 * q.norm(), name
    table = cc.profile(step, ids, model=model, steps=2)
    assert {t.name for t in table.layers} == _tt_names(model), str(table)
    for t in table.layers:
        assert t.calls == 2 and t.forward_ms > 0 and t.backward_ms > 0, t
    assert 0 < sum(t.total_ms for t in table.layers) < table.step_ms


def test_a_tt_layer_compiled_on_its_own_is_named_in_a_compiled_profile():
    model = nn.Sequential(nn.ReLU(), TTLinear(256, 256, rank=4))
    model[1].compile(backend="comera", options={"profile": True})
    x = torch.randn(3, 256, requires_grad=True)
    table = cc.profile(lambda: model(x).sum().backward(), model=model, steps=1)
    assert [t.name for t in table.layers] == ["1"] and table.layers[0].backward_ms > 0


def test_the_profile_option_opens_no_range_while_the_profiler_is_off(monkeypatch):
    step = _sgd_step(_tensorized(), "whole")
    step(_ids())
    opened = []
    real = torch.profiler.record_function
    monkeypatch.setattr(torch.profiler, "record_function", lambda *a, **k: opened.append(a) or real(*a, **k))
    step(_ids())
    assert opened == []


@pytest.mark.slow   # the compiled profiles above check the rows; this is the command's printing
def test_bench_profile_prints_a_row_per_tt_layer_eager_and_compiled(capsys):
    from comera_compile.cli import main

    assert main(["bench", "--profile", "1", "--quick"]) == 0
    out = capsys.readouterr().out
    eager, compiled = out.split("the same step compiled")
    for table in (eager, compiled):
        rows = [line.split() for line in table.splitlines()
                if line.split()[1:2] in (["tt_linear"], ["tt_embedding"])]
        names = {r[0] for r in rows}
        assert {"layers.0.ffn_up", "layers.1.ffn_down", "word"} <= names, out
        assert "TT layers:" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is absent")
def test_bench_profile_on_a_missing_cuda_device_says_what_to_do():
    from comera_compile.cli import main

    with pytest.raises(SystemExit, match="no CUDA device.*--device cpu"):
        main(["bench", "--profile", "1", "--device", "cuda"])


def test_the_profile_option_under_dynamic_shapes_computes_what_eager_does():
    """With dynamic=True dynamo hands LayerNorm's eps to the graph as a tensor read by .item(); each profiled
    part bakes the value in (it failed to compile: a data-dependent guard in layer_norm).  Outputs and
    gradients are eager's (float64), for two batch sizes."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.norm, self.fc2 = nn.Linear(64, 128), nn.LayerNorm(128, eps=1e-3), nn.Linear(128, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(self.norm(torch.relu(self.fc1(x))))

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = cc.tensorize(Net(), rank=8, min_features=16).double()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="comera", dynamic=True, options={"profile": True})
    for rows in (6, 11):
        x = torch.randn(rows, 64, dtype=torch.float64)
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-12, atol=1e-12)
        compiled(x).square().sum().backward()
        eager(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
    torch._dynamo.reset()
