"""The whole step as one CUDA graph (``compile_step(..., cuda_graphs="step")``, comera_compile.graphs), on the CPU.

Everything but the capture runs here: warm-up, static input buffers, the checks before each replay, the new
captures.  The capture is simulated by ``SimulatedGraphs``, which keeps CUDA graph semantics strictly: a
capture runs no kernel (the step runs and is undone), a replay re-runs the captured work on the tensors the
capture saw and writes the captured loss tensor; and every replay first checks, on its own, that nothing a
real graph bakes in has changed since the capture, failing the test where a real graph would replay stale
parameters or settings.  References are eager training loops, step for step.  The CUDA side (a real
capture, launches counted by the profiler) is tests/test_device.py's.
"""

from __future__ import annotations

import copy
import importlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera_compile as cc
from comera_compile import graphs
from comera_compile.optim import param_groups
from helpers import Block, BlockNet, SimulatedGraphs, StaleReplay, eager_step_with

pytestmark = pytest.mark.usefixtures("single_thread", "fresh_dynamo")


@pytest.fixture
def fresh_dynamo():
    """Each test's blocks compile afresh: the tests share one Block class, whose graphs would otherwise add
    up to dynamo's recompile limit and leave later tests' blocks eager."""
    torch._dynamo.reset()


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return cc.tensorize(BlockNet(), rank=4, min_features=16)


def _batches(n: int, rows=(12,)):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(rows[i % len(rows)], 16, generator=g),
             torch.randint(0, 5, (rows[i % len(rows)],), generator=g)) for i in range(n)]


def _captured_step(monkeypatch, model, opt, ra=None, **kwargs):
    """compile_step(cuda_graphs="step") on the CPU, its graphs simulated."""
    sim = SimulatedGraphs(model, opt, ra)
    monkeypatch.setattr(graphs, "CudaGraphs", lambda device: sim)
    kwargs.setdefault("backend", "eager")
    return cc.compile_step(model, nn.CrossEntropyLoss(), opt, cuda_graphs="step", **kwargs), sim


def _eager_step(model, opt):
    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def _train_both(step, eager, batches, schedulers=()):
    """Both steps over the batches, each scheduler stepped after every step: their losses, stacked."""
    losses, ref_losses = [], []
    for x, y in batches:
        losses.append(step(x, y))
        ref_losses.append(eager(x, y))
        for sched in schedulers:
            sched.step()
    return torch.stack(losses), torch.stack(ref_losses)


def _assert_same_params(model, ref):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("backend", ["eager", "comera"])
def test_whole_step_trains_as_the_eager_loop_under_a_schedule(monkeypatch, backend):
    """Two warm-up calls, one capture, replays for the rest: the losses and parameters of an eager AdamW loop
    with the same cosine schedule, step for step (the rate is a tensor the scheduler fills: no new capture)."""
    batches = _batches(8)
    ref = _net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.01)
    ref_sched = torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, T_max=8)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8)
    step, sim = _captured_step(monkeypatch, model, opt, backend=backend)
    losses, ref_losses = _train_both(step, _eager_step(ref, ref_opt), batches, (sched, ref_sched))
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    _assert_same_params(model, ref)
    g = step.graph
    assert (g.warmups, g.captures, g.replays) == (2, 1, 6) and sim.captured == 1
    assert all(p.grad is None for p in model.parameters())
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)   # (capturable too, on CUDA)


def test_each_batch_shape_is_captured_once(monkeypatch):
    batches = _batches(14, rows=(12, 7))
    ref = _net()
    ref_opt = torch.optim.AdamW(param_groups(ref, lr=1e-3))
    model = _net()
    opt = torch.optim.AdamW(param_groups(model, lr=1e-3))
    step, _ = _captured_step(monkeypatch, model, opt)
    eager = _eager_step(ref, ref_opt)
    losses, compiled, steady = [], [], []
    for x, y in batches:
        replays, captures = step.graph.replays, step.graph.captures
        losses.append(step(x, y))
        compiled.append(step.last_call_compiled)
        steady.append(step.graph.replays > replays and step.graph.captures == captures)   # a replay alone
    ref_losses = [eager(x, y) for x, y in batches]
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-5, atol=1e-6)
    _assert_same_params(model, ref)
    assert (step.graph.warmups, step.graph.captures, step.graph.replays) == (4, 2, 10)
    # the two warm-ups and the capture of each shape are what a timing loop leaves out as compiling
    assert compiled == [not s for s in steady] and compiled == [True] * 6 + [False] * 8


@pytest.mark.parametrize("limit", [8, None])
def test_many_input_shapes_are_said_once_past_torch_s_own_limit(monkeypatch, limit):
    """Ten batch sizes, three calls each (two warm-ups, one capture): the step trains as the eager loop, and
    past torch's own limit for CUDA graphs of distinct shapes (8; None: never) one warning says that each
    new shape runs uncaptured first, and how to pad batches to a few shapes."""
    import torch._inductor.config as inductor_config

    batches = [b for rows in range(3, 13) for b in _batches(3, rows=(rows,))]
    ref = _net()
    ref_opt = torch.optim.AdamW(param_groups(ref, lr=1e-3))
    model = _net()
    opt = torch.optim.AdamW(param_groups(model, lr=1e-3))
    step, _ = _captured_step(monkeypatch, model, opt)
    with inductor_config.patch({"triton.cudagraph_dynamic_shape_warn_limit": limit}), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, ref_losses = _train_both(step, _eager_step(ref, ref_opt), batches)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    _assert_same_params(model, ref)
    assert step.graph.captures == 10
    said = [w for w in caught if "input shapes" in str(w.message)]
    if limit is None:
        assert said == []
    else:
        assert len(said) == 1 and "for 9 input shapes" in str(said[0].message)
        assert "pad_to_multiple_of" in str(said[0].message) and said[0].filename == __file__   # the caller's line


class WithLoss(nn.Module):
    """A model that computes its own loss from keyword labels, as transformers' models do."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x, labels):
        return F.cross_entropy(self.net(x), labels)


@pytest.mark.parametrize("loss", ["model", "loss_fn"])
def test_micro_batches_are_captured_in_the_one_whole_step_graph(monkeypatch, loss):
    """compile_step(model, None, cuda_graphs="step", micro_batches=3) called as step(x, labels=y): the three
    forward and backward passes, the gradients they add up (allocated by the first in the capture) and the
    one AdamW step are one graph, captured once and replayed: the losses and parameters of eager steps on the
    whole batch.  With nn.CrossEntropyLoss as loss_fn and targets of which a third are -100 (ignored), the
    micro-batches weigh by their tokens inside the capture, reading nothing on the host."""
    ref = _net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.01)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sim = SimulatedGraphs(model, opt)
    monkeypatch.setattr(graphs, "CudaGraphs", lambda device: sim)
    batches = _batches(7)
    if loss == "model":
        step = cc.compile_step(WithLoss(model), None, opt, backend="eager", cuda_graphs="step", micro_batches=3)
        call = lambda x, y: step(x, labels=y)  # noqa: E731
    else:
        step = call = cc.compile_step(model, nn.CrossEntropyLoss(), opt, backend="eager", cuda_graphs="step",
                                      micro_batches=3)
        g = torch.Generator().manual_seed(4)
        batches = [(x, y.masked_fill(torch.rand(y.shape, generator=g) < 0.34, -100)) for x, y in batches]
    losses, ref_losses = _train_both(call, _eager_step(ref, ref_opt), batches)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    _assert_same_params(model, ref)
    assert (step.graph.warmups, step.graph.captures, step.graph.replays) == (2, 1, 5) and sim.captured == 1


def test_a_batch_inside_a_dict_is_an_input_of_the_captured_step(monkeypatch):
    """A target passed as a dict of tensors is copied into the captured step's inputs at each replay, as a
    tensor argument is (a replay reading the first call's dict would train on one batch over and over), and
    split with micro_batches: the losses and parameters of eager steps on the whole batch."""
    ref, model = _net(), _net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sim = SimulatedGraphs(model, opt)
    monkeypatch.setattr(graphs, "CudaGraphs", lambda device: sim)
    g = torch.Generator().manual_seed(6)
    batches = [(x, {"y": y, "w": torch.rand(y.shape, generator=g)}) for x, y in _batches(6)]

    def loss_fn(out: torch.Tensor, t: dict) -> torch.Tensor:
        return (F.cross_entropy(out, t["y"], reduction="none") * t["w"]).mean()

    step = cc.compile_step(model, loss_fn, opt, backend="eager", cuda_graphs="step", micro_batches=2)

    def eager(x, t):
        loss = loss_fn(ref(x), t)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        return loss.detach()

    losses, ref_losses = _train_both(step, eager, batches)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    _assert_same_params(model, ref)
    assert (step.graph.warmups, step.graph.captures, step.graph.replays) == (2, 1, 4) and sim.captured == 1


def test_last_call_compiled_marks_the_calls_that_compiled(monkeypatch):
    """Per-graph compiled steps on the CPU: the first call compiles, a second row count compiles once more
    (dynamo's automatic dynamic shape), and every later call of either runs steady."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = cc.compile_step(model, nn.CrossEntropyLoss(), opt, backend="comera")
    assert step.last_call_compiled is False
    seen = []
    for x, y in _batches(6, rows=(12, 12, 7, 7, 12, 7)):
        step(x, y)
        seen.append(step.last_call_compiled)
    assert seen == [True, False, True, False, False, False]


def test_rank_reallocation_and_the_late_stage_capture_anew(monkeypatch):
    """The late stage (from step 10) changes the loss and its pruning toward the size target cuts the cores
    (new Parameters, first at step 12; it may cut again at the last step): each makes the step warm up and
    capture anew, and the run matches an eager loop cut the same way, loss for loss and rank for rank."""
    batches = _batches(16)

    def run(captured: bool):
        model = _net()
        opt = torch.optim.AdamW(param_groups(model, lr=1e-3))
        ra = cc.RankAdaptive(model, optimizer=opt, cut_every=4, realloc_at=1.0, late_stage_at=10,
                             target_ratio=0.9)
        loss_fn = lambda out, y: ra.loss(F.cross_entropy(out, y))  # noqa: E731
        if captured:
            sim = SimulatedGraphs(model, opt, ra)
            monkeypatch.setattr(graphs, "CudaGraphs", lambda device: sim)
            step = cc.compile_step(model, loss_fn, opt, backend="eager", cuda_graphs="step", rank_adaptive=ra)
        losses, captures = [], []
        for i, (x, y) in enumerate(batches):
            if captured:
                loss = step(x, y)
                captures.append(step.graph.captures)
            else:
                loss = eager_step_with(model, loss_fn, opt, ra, x, y)
            losses.append(float(loss))
            if i == 2:   # a slice nearly off in every layer: the late stage prunes it first
                with torch.no_grad():
                    for layer in ra.layers.values():
                        layer.gates[0][0] = 0.0
        return losses, ra, captures

    losses, ra, captures = run(True)
    ref_losses, ref_ra, _ = run(False)
    assert ra.cuts == ref_ra.cuts >= 1 and ra.ranks() == ref_ra.ranks() and ra.stage == ref_ra.stage == "late"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    # captured at step 3, replayed to step 10; steps 11-12 warm up for the late stage, 13-14 for the cut
    assert captures == [0, 0] + [1] * 12 + [2, 2], str(captures)


def test_changed_settings_state_and_mode_capture_anew(monkeypatch):
    """A changed weight decay (read on the host), a loaded optimizer state (new tensors) and eval() mode are
    each a new capture, never a stale replay."""
    batches = _batches(16)
    ref = _net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step, _ = _captured_step(monkeypatch, model, opt)
    eager = _eager_step(ref, ref_opt)
    losses, ref_losses = [], []
    for i, (x, y) in enumerate(batches):
        if i == 4:
            opt.param_groups[0]["weight_decay"] = ref_opt.param_groups[0]["weight_decay"] = 0.1
        if i == 8:
            saved = copy.deepcopy(ref_opt.state_dict())
            opt.load_state_dict(copy.deepcopy(saved))
            ref_opt.load_state_dict(saved)
        if i == 12:
            model.eval()
            ref.eval()
        losses.append(step(x, y))
        ref_losses.append(eager(x, y))
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-5, atol=1e-6)
    _assert_same_params(model, ref)
    assert step.graph.captures == 4


def _sgd_under_a_schedule(foreach: bool | None):
    """Batches, then (model, SGD with momentum, a per-step LambdaLR) twice: the reference (SGD at its default
    implementation) and the one to step (foreach as given: True keeps its rate a float)."""
    def built(foreach=None):
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=foreach)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.9**i)

    return _batches(8), built(), built(foreach)


@pytest.mark.parametrize("foreach", [True, None], ids=["sgd-foreach-float-lr", "sgd-default"])
def test_a_setting_changed_every_step_is_said_not_left_uncaptured(monkeypatch, foreach):
    """SGD whose rate stays a float (foreach) under a per-step schedule: the rate a graph would bake in
    changes every step, so no step can be captured -- it trains as the eager loop, and a warning names the
    changed setting and the fix.  SGD left at its default is made fused, its rate a tensor: captured once,
    no warning."""
    import warnings

    batches, (ref, ref_opt, ref_sched), (model, opt, sched) = _sgd_under_a_schedule(foreach)
    step, _ = _captured_step(monkeypatch, model, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, ref_losses = _train_both(step, _eager_step(ref, ref_opt), batches, (sched, ref_sched))
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    _assert_same_params(model, ref)
    said = [str(w.message) for w in caught if "cuda_graphs='step'" in str(w.message)]
    if foreach:
        assert step.graph.captures == 0 and len(said) == 1, said
        assert "param group 0's 'lr' changed" in said[0] and "fused=True" in said[0]
    else:
        assert step.graph.captures == 1 and said == []


def test_the_simulated_graph_catches_a_replay_that_skipped_its_checks(monkeypatch):
    """The checks are what keeps replays fresh: with them skipped, a changed setting replays stale."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step, _ = _captured_step(monkeypatch, model, opt)
    batches = _batches(5)
    for x, y in batches[:4]:
        step(x, y)
    monkeypatch.setattr(graphs.StepGraph, "_same_world", lambda self: True)
    opt.param_groups[0]["weight_decay"] = 0.5
    with pytest.raises(StaleReplay):
        step(*batches[4])


def test_whole_step_errors_say_what_to_do(monkeypatch):
    model = _net()
    opt = torch.optim.AdamW(model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    with pytest.raises(ValueError, match="CUDA device"):
        cc.compile_step(model, loss_fn, opt, backend="eager", cuda_graphs="step")
    with pytest.raises(ValueError, match="cuda_graphs='compiled'"):
        cc.compile_step(model, loss_fn, torch.optim.LBFGS(model.parameters()), backend="eager", cuda_graphs="step")
    with pytest.raises(ValueError, match="mode"):
        cc.compile_step(model, loss_fn, opt, backend="inductor", mode="reduce-overhead", cuda_graphs="step")
    with pytest.raises(ValueError, match="cuda_graphs="):
        cc.compile_step(model, loss_fn, opt, cuda_graphs="whole")
    with pytest.raises(ValueError, match="DistributedDataParallel"):
        cc.compile_step(nn.DataParallel(model), loss_fn, opt, backend="eager", cuda_graphs="step")
    assert not any(isinstance(g.get("lr"), torch.Tensor) for g in opt.param_groups), "a refused step changed nothing"


def test_a_capture_that_fails_raises_an_error_naming_the_host_read_and_the_fix(monkeypatch):
    """Where the step cannot be captured (torch raises inside the capture, as CUDA does for a host read such as
    .item()), the error says what in the step is the cause and which mode runs it instead."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step, sim = _captured_step(monkeypatch, model, opt)

    def refuse(fn):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(sim, "capture", refuse)
    (x, y), = _batches(1)
    step(x, y), step(x, y)   # the two warm-up calls run uncaptured
    with pytest.raises(RuntimeError, match=r"could not capture.*\.item\(\).*cuda_graphs='compiled'") as info:
        step(x, y)
    assert "operation not permitted when stream is capturing" in str(info.value)
    assert not graphs.capturing()


class EmbeddedNet(nn.Module):
    """A token embedding (tensorized: an eager TT lookup outside the compiled blocks) before BlockNet's blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(512, 32)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(32, 5)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(1))


def test_an_eager_tt_embedding_reads_nothing_on_the_host_inside_the_capture_and_trains_as_eager(monkeypatch):
    """The TT embedding's eager lookup reads its indices on the host (range check, distinct rows), which failed
    a real capture on an H100.  Probed and captured, it takes the static path a compiled graph takes: no host
    read in the step, one capture, and the steps equal an eager AdamW loop's."""
    torch.manual_seed(0)
    net = cc.tensorize(EmbeddedNet(), rank=4, min_features=16)
    assert type(net.embed).__name__ == "TTEmbedding"
    model, eager = copy.deepcopy(net), copy.deepcopy(net)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, eager))
    step, sim = _captured_step(monkeypatch, model, opt)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randint(0, 512, (8, 6), generator=g), torch.randint(0, 5, (8,), generator=g))] * 6
    losses, ref = _train_both(step, _eager_step(eager, ref_opt), batches)
    assert (step.graph.warmups, step.graph.captures, step.graph.replays) == (2, 1, 4) and sim.captured == 1
    torch.testing.assert_close(losses, ref, rtol=1e-5, atol=1e-6)
    _assert_same_params(model, eager)


def test_a_host_read_in_the_step_is_an_error_before_any_capture_naming_where(monkeypatch):
    """A loss that reads a device value on the host (here a check on the targets) cannot be captured, and a real
    failed capture would leave the process's CUDA state unusable: the probing warm-up finds the read and the
    error names its line and the fix, with nothing captured; the call itself ran, uncaptured."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sim = SimulatedGraphs(model, opt)
    monkeypatch.setattr(graphs, "CudaGraphs", lambda device: sim)

    def checked_loss(logits, y):
        if (y < 0).any():   # a host read: bool() of a device tensor
            raise ValueError("negative class")
        return F.cross_entropy(logits, y)

    step = cc.compile_step(model, checked_loss, opt, cuda_graphs="step", backend="eager")
    (x, y), = _batches(1)
    step(x, y)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"reads device values on the host.*test_step_graph\.py:\d+: __bool__"
                                           r".*cuda_graphs='compiled'"):
        step(x, y)
    assert sim.captured == 0 and step.graph.captures == 0
    assert any((p - q).abs().max() > 0 for p, q in zip(model.parameters(), before)), "the probed call trained"


def _simulated_cuda(monkeypatch, model, opt):
    """compile_step as on a CUDA model, its graphs simulated (the parameters stay on the CPU)."""
    sim = SimulatedGraphs(model, opt)
    monkeypatch.setattr(graphs, "CudaGraphs", lambda device: sim)
    monkeypatch.setattr(importlib.import_module("comera_compile.step"), "_on_cuda", lambda model: True)
    return sim


def _said_auto(recwarn) -> bool:
    return any("cuda_graphs='auto'" in str(w.message) for w in recwarn.list)


def test_auto_captures_the_whole_step_where_it_can_and_says_why_where_it_cannot(monkeypatch, recwarn):
    """cuda_graphs="auto" on CUDA: a capturable optimizer gets the whole-step graph (trained as the eager loop,
    no warning); an optimizer without `capturable` gets per-graph replays and a warning naming why; per-graph
    graphs or per-layer profiling asked for get them, silently.  On the CPU it is the ordinary step."""
    batches = _batches(6)
    model, ref = _net(), _net()
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    sim = _simulated_cuda(monkeypatch, model, opt)
    step = cc.compile_step(model, nn.CrossEntropyLoss(), opt, backend="eager", cuda_graphs="auto")
    assert step.cuda_graphs == "step"
    losses, ref_losses = _train_both(step, _eager_step(ref, ref_opt), batches)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    _assert_same_params(model, ref)
    assert sim.captured == 1 and step.graph.replays == 4 and not _said_auto(recwarn)

    model = _net()
    with pytest.warns(UserWarning, match=r"cuda_graphs='compiled'.*Adagrad has none"):
        step = cc.compile_step(model, nn.CrossEntropyLoss(), torch.optim.Adagrad(model.parameters()),
                               backend="eager", cuda_graphs="auto")
    assert step.cuda_graphs == "compiled" and step.graph is None
    recwarn.clear()
    for kwargs in ({"options": {"profile": True}}, {"backend": "inductor", "mode": "reduce-overhead"}):
        step = cc.compile_step(model, nn.CrossEntropyLoss(), torch.optim.AdamW(model.parameters()),
                               cuda_graphs="auto", **{"backend": "eager", **kwargs})
        assert step.cuda_graphs == "compiled", kwargs
    assert not _said_auto(recwarn)
    monkeypatch.undo()
    step = cc.compile_step(model, nn.CrossEntropyLoss(), torch.optim.AdamW(model.parameters()), backend="eager",
                           cuda_graphs="auto")
    assert step.cuda_graphs is None and step.graph is None


def test_auto_falls_back_to_per_graph_replays_where_the_probe_finds_a_host_read(monkeypatch):
    """cuda_graphs="auto" with a loss that reads a device value on the host: the probing warm-up finds it, a
    warning names its line, nothing is captured, and the blocks are compiled again with their own CUDA graphs
    on ("compiled"); every step, the probed one included, trains as the eager loop does."""
    model, ref = _net(), _net()
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    sim = _simulated_cuda(monkeypatch, model, opt)
    module = importlib.import_module("comera_compile.step")
    compiled_with = []

    def compile_blocks(model, **kwargs):
        compiled_with.append((kwargs.get("options") or {}).get("cudagraphs"))
        return module.compile_blocks.__wrapped__(model, **kwargs)

    compile_blocks.__wrapped__ = module.compile_blocks
    monkeypatch.setattr(module, "compile_blocks", compile_blocks)

    def checked_loss(logits, y):
        if (y < 0).any():   # a host read: bool() of a device tensor
            raise ValueError("negative class")
        return F.cross_entropy(logits, y)

    step = cc.compile_step(model, checked_loss, opt, backend="comera", cuda_graphs="auto")
    batches = _batches(6)
    losses, ref_losses = [step(*batches[0])], [_eager_step(ref, ref_opt)(*batches[0])]
    with pytest.warns(UserWarning, match=r"auto.*test_step_graph\.py:\d+: __bool__.*cuda_graphs='compiled' from now"):
        losses.append(step(*batches[1]))
    ref_losses.append(_eager_step(ref, ref_opt)(*batches[1]))
    assert step.cuda_graphs == "compiled" and step.graph is None and step.last_call_compiled
    losses.append(step(*batches[2]))   # the blocks compile again, with their own graphs: not a steady step
    assert step.last_call_compiled
    ref_losses.append(_eager_step(ref, ref_opt)(*batches[2]))
    more, ref_more = _train_both(step, _eager_step(ref, ref_opt), batches[3:])
    assert not step.last_call_compiled   # steady from there
    torch.testing.assert_close(torch.cat([torch.stack(losses), more]),
                               torch.cat([torch.stack(ref_losses), ref_more]), rtol=1e-5, atol=1e-6)
    _assert_same_params(model, ref)
    assert sim.captured == 0 and compiled_with == [False, None]


def test_auto_falls_back_to_per_graph_replays_where_a_setting_changes_at_every_step(monkeypatch):
    """cuda_graphs="auto" with SGD whose rate stays a float (foreach) under a per-step schedule: no call could
    ever be captured, so rather than run every step uncaptured it goes on as "compiled", once, with a warning
    naming the setting; the steps are the eager loop's throughout."""
    batches, (ref, ref_opt, ref_sched), (model, opt, sched) = _sgd_under_a_schedule(True)
    sim = _simulated_cuda(monkeypatch, model, opt)
    step = cc.compile_step(model, nn.CrossEntropyLoss(), opt, backend="eager", cuda_graphs="auto")
    with pytest.warns(UserWarning, match=r"auto.*no call could be captured.*param group 0's 'lr' changed.*"
                                         r"cuda_graphs='compiled' from now on") as caught:
        losses, ref_losses = _train_both(step, _eager_step(ref, ref_opt), batches, (sched, ref_sched))
    assert sum("cuda_graphs=" in str(w.message) for w in caught) == 1, [str(w.message) for w in caught]
    assert step.cuda_graphs == "compiled" and sim.captured == 0
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    _assert_same_params(model, ref)


def test_mode_and_options_together_reach_backend_comera_and_the_optimizer_step(monkeypatch):
    """torch.compile refuses a mode beside options; compile_step hands backend "comera" the mode's Inductor
    settings inside its options (below the options' own), also where it adds options of its own for the
    compiled optimizer step: the blocks' and the optimizer's compiles get the mode's max_autotune, and the
    steps train as eager ones."""
    from comera_compile import backend as comera_backend_module
    from comera_compile.step_modes import compile_kwargs

    kwargs = compile_kwargs("comera", "max-autotune-no-cudagraphs", {"fast_dropout": False,
                                                                     "inductor": {"coordinate_descent_tuning": False}})
    assert "mode" not in kwargs and kwargs["options"]["fast_dropout"] is False
    assert kwargs["options"]["inductor"] == {"max_autotune": True, "coordinate_descent_tuning": False}
    seen = []
    real = comera_backend_module.inductor_config
    monkeypatch.setattr(comera_backend_module, "inductor_config",
                        lambda devices, mode, options: seen.append(real(devices, mode, options)) or seen[-1])
    batches = _batches(3)
    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = cc.compile_step(model, nn.CrossEntropyLoss(), opt, backend="comera", mode="max-autotune-no-cudagraphs",
                           options={"fast_dropout": False}, compile_optimizer=True)
    losses, ref_losses = _train_both(step, _eager_step(ref, ref_opt), batches)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    _assert_same_params(model, ref)
    assert len(seen) >= 2 and all(patches.get("max_autotune") for patches in seen)
