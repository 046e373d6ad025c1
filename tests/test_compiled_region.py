"""A TT layer that a compiled region (a compiled block, compile_step's forward and loss) runs eagerly is said,
once per region, and nothing computed changes; code dynamo compiles on past a graph break, and an eager run
the user asked for, say nothing.  (The suite makes the warning an error everywhere else: pyproject.toml.)"""

from __future__ import annotations

import copy
import warnings
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import comera_compile as cc
from comera_compile.compiled_region import RanEagerlyWarning

WIDTH, LAYERS = 32, 4


def _net(how: str) -> nn.Module:
    """Four residual blocks of two TT layers (float64); `how` says what dynamo meets in each block: "disabled"
    (the first layer called through a torch.compiler.disable-d method), "break" (a graph break between the
    layers) or "plain".  A class of its own per call: a warning is said once per block class."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

        @torch.compiler.disable
        def untraced(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc1(x)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.untraced(x) if how == "disabled" else self.fc1(x)
            if how == "break":
                torch._dynamo.graph_break()
            return x + self.fc2(torch.tanh(h))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(LAYERS))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    return cc.tensorize(Net().double(), rank=4, min_features=16)


def _steps(model: nn.Module, step=None, n: int = 2) -> list[torch.Tensor]:
    """n SGD steps on fixed batches, by `step` (a compile_step) or eagerly; the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if step is None else None
    losses = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        x, y = (torch.randn(8, WIDTH, generator=g, dtype=torch.float64) for _ in range(2))
        if step is not None:
            losses.append(step(x, y))
            continue
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _compiled(model: nn.Module, regional: bool):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return cc.compile_step(model, F.mse_loss, opt, regional=regional, backend="eager")


@pytest.mark.parametrize("regional", [True, False], ids=["blocks", "whole-model"])
def test_a_tt_layer_a_compiled_region_runs_eagerly_is_said_once_and_trains_as_eager(regional, fresh_dynamo):
    model = _net("disabled")
    eager = copy.deepcopy(model)
    with pytest.warns(RanEagerlyWarning) as said:
        got = _steps(model, _compiled(model, regional))
    ours = [w for w in said if w.category is RanEagerlyWarning]
    assert len(ours) == 1, [str(w.message) for w in ours]   # four blocks, two steps: one warning
    message = str(ours[0].message)
    assert ("compiled block layers.0 (Block) ran its TT layer fc1 " if regional
            else "compiled forward and loss ran its TT layer layers.0.fc1 ") in message
    assert "TORCH_LOGS=graph_breaks" in message and "fullgraph=True" in message
    torch.testing.assert_close(torch.stack(got), torch.stack(_steps(eager)), rtol=1e-10, atol=1e-12)


def test_tt_layers_compiled_on_past_a_graph_break_say_nothing(fresh_dynamo):
    model = _net("break")
    eager = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RanEagerlyWarning)
        got = _steps(model, _compiled(model, regional=True))
    assert counters["stats"]["unique_graphs"] >= 2   # the block's graph was broken
    torch.testing.assert_close(torch.stack(got), torch.stack(_steps(eager)), rtol=1e-10, atol=1e-12)


def test_an_eager_stance_the_user_asked_for_says_nothing_and_compiled_runs_still_check(fresh_dynamo):
    model = _net("disabled")
    step = _compiled(model, regional=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RanEagerlyWarning)
        with torch.compiler.set_stance("force_eager"):
            _steps(model, step, n=1)
    with pytest.warns(RanEagerlyWarning, match="compiled block layers.0"):
        _steps(model, step, n=1)


def test_a_model_compiled_whole_keeps_compiled_through_every_contraction_order_in_training_and_evaluation(
        fresh_dynamo):
    """torch.compile(model) on a tensorized model, row counts reaching every segment of its TT layers' plans
    (a graph each, by design) in training and then in evaluation: more graphs than dynamo's recompile limit of
    8, yet none of its calls falls back to eager (the limit hit is an error here), and every loss, gradient and
    output is the eager model's (float64).  At the limit the whole model used to run eagerly from then on."""
    from comera_compile import networks
    from comera_compile.layers import TTLinear

    torch.manual_seed(0)
    model = cc.tensorize(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).double(), rank=8)
    twin = copy.deepcopy(model)
    specs = {m.spec.token for m in model.modules() if isinstance(m, TTLinear)}
    thresholds = sorted({t for spec in specs for t in networks.tt_linear_segments(spec, True, False)[0]})
    assert len(thresholds) >= 4
    rows = [thresholds[-1] + 30, thresholds[-1] + 31] + [t - 1 for t in thresholds]   # every segment
    compiled = torch.compile(model, backend="eager")
    with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=True):
        for n in rows:
            x = torch.randn(n, 64, dtype=torch.float64)
            loss, twin_loss = compiled(x).square().mean(), twin(x).square().mean()
            loss.backward()
            twin_loss.backward()
            torch.testing.assert_close(loss, twin_loss, rtol=1e-10, atol=1e-12)
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12)
        with torch.no_grad():
            for n in rows:
                x = torch.randn(n, 64, dtype=torch.float64)
                torch.testing.assert_close(compiled(x), twin(x), rtol=1e-10, atol=1e-12)
    assert counters["stats"]["unique_graphs"] > 8


def test_a_step_compiled_whole_past_the_recompile_limit_says_so_and_trains_as_eager(fresh_dynamo):
    """compile_step(regional=False) at a recompile limit of 1: the second batch size matches no graph and
    dynamo runs forward and loss eagerly; the warning names the limit and how to find the guard (not the
    causes of code dynamo cannot trace), once, and the steps train as eager ones."""
    model = _net("plain")
    eager = copy.deepcopy(model)
    opt, eager_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager))
    step = cc.compile_step(model, F.mse_loss, opt, regional=False, backend="eager")
    g = torch.Generator().manual_seed(0)
    with torch._dynamo.config.patch(recompile_limit=1), pytest.warns(RanEagerlyWarning) as said:
        for n in (8, 9, 10):
            x, y = (torch.randn(n, WIDTH, generator=g, dtype=torch.float64) for _ in range(2))
            loss = F.mse_loss(eager(x), y)
            loss.backward()
            eager_opt.step()
            eager_opt.zero_grad()
            torch.testing.assert_close(step(x, y), loss.detach(), rtol=1e-10, atol=1e-12)
    ours = [str(w.message) for w in said if w.category is RanEagerlyWarning]
    assert len(ours) == 1, ours
    assert "dynamo's recompile limit (1) was reached" in ours[0] and "TORCH_LOGS=recompiles" in ours[0]
    assert "disable-d" not in ours[0]


def test_after_a_cut_a_compiled_block_s_limit_leaves_out_the_segments_of_its_new_ranks(fresh_dynamo):
    """A compiled block's call runs under dynamo's recompile limit raised by the graphs its TT layers add by
    design (one per plan segment a changing row count reaches, over the four grad modes).  A rank cut changes
    the plans: these layers' plans have 14 such thresholds at rank 4 and 16 at rank 2, and after the cut the
    limit the block compiles under leaves out the new ranks' 16, not the old 14."""
    import itertools

    from helpers import BlockNet

    from comera_compile import networks
    from comera_compile.layers import TTLinear

    limits = []

    def backend(gm: torch.fx.GraphModule, example_inputs) -> Callable:
        limits.append(torch._dynamo.config.recompile_limit)
        return gm.forward

    def segments() -> int:
        return len({(mode, t) for m in model.blocks[0].modules() if isinstance(m, TTLinear)
                    for mode in itertools.product((True, False), repeat=2)
                    for t in networks.tt_linear_segments(m.spec.token, *mode)[0]})

    torch.manual_seed(0)
    model = cc.tensorize(BlockNet(width=128), rank=4, min_features=16)
    ra = cc.RankAdaptive(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), cut_every=1,
                         realloc_at=1.0)
    cc.compile_blocks(model, backend=backend)
    x, base, before = torch.randn(8, 16), torch._dynamo.config.recompile_limit, segments()
    model(x)
    assert limits == [base + before]
    with torch.no_grad():   # rank 2 on every bond: the cut check cuts the rest out
        for layer in ra.layers.values():
            for gate in layer.gates:
                gate[2:] = 0.0
    assert ra.step()
    after = segments()
    assert (before, after) == (14, 16)
    model(x)
    assert limits == [base + before, base + after]
