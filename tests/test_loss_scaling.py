"""float16 autocast in a compiled step: ``compile_step(..., autocast=torch.float16)`` scales the loss with a
GradScaler of its own, so gradients too small for float16 still train (against the float64 step without
autocast, over loss magnitudes from 1e-7 to 1e2), skips a step whose gradients overflowed (RankAdaptive
included), hands optimizer pre-hooks such as gradient clipping the unscaled gradients, and refuses the modes
a scaler cannot run in.  bfloat16 autocast needs no scaler and gets none.  A loop of one's own (README) and
two processes under FSDP2 (tests/test_fsdp.py) skip alike; the CUDA tier runs it against torch's eager
GradScaler loop (tests/test_device.py)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import comera_compile as cc
from comera_compile.step_modes import choose_cuda_graphs
from helpers import BlockNet

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = 1e-6   # the task loss's factor: its gradients at the head's float16 outputs (~1e-8) underflow to zero


def _net(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return cc.tensorize(BlockNet(), rank=4, min_features=16).to(dtype)


def _tiny_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float(), target) * TINY


def _update(model: nn.Module, run) -> torch.Tensor:
    """The parameters' change (flattened, float64) from one call of run()."""
    before = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    run()
    return torch.cat([p.detach().double().flatten() for p in model.parameters()]) - before


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1 / TINY)   # the update: the unscaled loss's gradient


@pytest.mark.parametrize("case", ["default", "micro-batches", "no scaling"])
def test_float16_autocast_trains_gradients_float16_cannot_hold(case):
    """A loss whose gradients are ~1e-8 at the float16 logits: compile_step at autocast=torch.float16 (backend
    "comera", the blocks compiled one by one) makes the SGD update of the float64 step without autocast, to
    float16's precision, whole or in micro-batches; with the scaler switched off the same step underflows."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 16, generator=g), torch.randint(0, 5, (16,), generator=g)
    ref = _net(torch.float64)
    ref_opt = _sgd(ref)

    def ref_step() -> None:
        _tiny_loss(ref(x.double()), y).backward()
        ref_opt.step()

    expected = _update(ref, ref_step)
    model = _net()
    extra = {"micro_batches": 2} if case == "micro-batches" else {}
    if case == "no scaling":
        extra["scaler"] = torch.amp.GradScaler("cpu", enabled=False)
    step = cc.compile_step(model, _tiny_loss, _sgd(model), autocast=torch.float16, **extra)
    assert isinstance(step.scaler, torch.amp.GradScaler)
    got = _update(model, lambda: step(x, y))
    error = ((got - expected).norm() / expected.norm()).item()
    if case == "no scaling":
        assert error > 0.5, f"float16 gradients did not underflow without scaling (error {error:.3g})"
    else:
        assert error < 2e-2, f"the scaled float16 step is {error:.3g} off the float64 one"


def test_an_overflowing_step_is_skipped_with_rank_adaptive():
    """A batch that overflows float16 (the first layer's output scaled by 1e6): the step leaves every parameter
    and the optimizer's state (moments and step counts, in the fused AdamW that takes the scaler's overflow
    flag itself) as they were, RankAdaptive does not count it, the scale halves and step.skipped says so; the
    next batch trains and is counted."""
    model = _net()
    opt = torch.optim.AdamW(cc.param_groups(model, lr=1e-3))
    ra = cc.RankAdaptive(model, optimizer=opt)
    step = cc.compile_step(model, nn.CrossEntropyLoss(), opt, autocast=torch.float16, rank_adaptive=ra,
                           backend="eager")
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    step(x, y)
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    scale, counted = step.scaler.get_scale(), ra.steps
    loss = step(x, y, scale=1e6)
    assert not torch.isfinite(loss), "the batch was meant to overflow float16"
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params)), "a skipped step changed a parameter"
    assert all(torch.equal(opt.state[p][k], v) for p, kept in zip(model.parameters(), state)
               for k, v in kept.items()), "a skipped step changed the optimizer's state"
    assert getattr(opt, "_step_supports_amp_scaling", False), "the fused AdamW should take the scale itself"
    assert step.scaler.get_scale() == scale / 2 and step.skipped
    assert ra.steps == counted
    assert torch.isfinite(step(x, y)) and not step.skipped
    assert ra.steps == counted + 1
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), params))


def test_loss_scaling_refuses_the_modes_it_cannot_run_in():
    """A whole-step CUDA graph and a compiled optimizer step cannot hold a scaler's host read and its own
    optimizer step: errors that say what to do; "auto" on CUDA keeps per-graph replays, with a warning;
    bfloat16 autocast gets no scaler."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="bfloat16"):
        cc.compile_step(model, nn.CrossEntropyLoss(), opt, autocast=torch.float16, cuda_graphs="step")
    with pytest.raises(ValueError, match="compile_optimizer"):
        cc.compile_step(model, nn.CrossEntropyLoss(), opt, autocast=torch.float16, compile_optimizer=True)
    with pytest.warns(UserWarning, match="loss scaler"):
        chosen = choose_cuda_graphs("auto", True, opt, model, "comera", {}, scaling=True)
    assert chosen == "compiled"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step = cc.compile_step(model, nn.CrossEntropyLoss(), opt, autocast=torch.bfloat16, backend="eager")
    assert step.scaler is None


@pytest.mark.parametrize("autocast", ["bf16", True, torch.int8])
def test_an_autocast_that_is_not_a_floating_dtype_is_refused_when_the_step_is_built(autocast):
    """autocast="bf16" (the CLI's spelling) failed inside dynamo at the first call, and torch.int8 ran with
    autocast silently off: both are refused before anything compiles, naming the dtypes to give."""
    model = _net()
    with pytest.raises(ValueError, match=r"torch\.bfloat16 or torch\.float16"):
        cc.compile_step(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1),
                        autocast=autocast)


def test_the_readme_s_own_loop_skips_rank_adaptive_with_the_scaler():
    """The README's loop of one's own: ra.step only where the scale did not drop.  Over an overflowing batch
    between two good ones, RankAdaptive counts the two steps that changed the parameters, not the third."""
    model = _net()
    opt = torch.optim.AdamW(cc.param_groups(model, lr=1e-3))
    ra = cc.RankAdaptive(model, optimizer=opt)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    moved = []
    for factor in (1.0, 1e6, 1.0):
        before = [p.detach().clone() for p in model.parameters()]
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x, scale=factor).float(), y)
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if scaler.get_scale() >= scale:
            ra.step(loss)
        moved.append(any(not torch.equal(p, q) for p, q in zip(model.parameters(), before)))
    assert moved == [True, False, True]
    assert ra.steps == 2


@pytest.mark.parametrize("wrapper", ["torch", "accelerate"])
def test_rank_adaptive_skips_a_step_a_fused_optimizer_skipped_in_its_kernel(wrapper):
    """A GradScaler steps an optimizer built with fused=True (transformers' default AdamW) even where the
    gradients overflowed, the kernel leaving the parameters alone, so accelerate's test (step() not called)
    misses the skip and the Trainer's callback used to run ra.step on it.  ``ra.step()`` right after the step,
    with no check of one's own (the Trainer's callback; a plain loop; accelerate's wrapper, which holds the
    scaler): over an overflowing batch between two good ones, RankAdaptive and the parameters end as the run
    that never saw the bad batch."""
    if wrapper == "accelerate":
        accelerate = pytest.importorskip("accelerate")
        from accelerate.optimizer import AcceleratedOptimizer
        accelerate.Accelerator(cpu=True)   # the state its wrapper reads; CPU gets no scaler of its own
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))

    def run(factors: tuple[float, ...]) -> tuple[nn.Module, cc.RankAdaptive, list[bool]]:
        model = _net()
        opt = torch.optim.AdamW(cc.param_groups(model, lr=1e-3), fused=True)
        scaler = torch.amp.GradScaler("cpu")
        stepper = AcceleratedOptimizer(opt, device_placement=False, scaler=scaler) if wrapper == "accelerate" \
            else opt
        ra = cc.RankAdaptive(model, optimizer=stepper)
        moved = []
        for factor in factors:
            before = [p.detach().clone() for p in model.parameters()]
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x, scale=factor).float(), y)
            scaler.scale(loss).backward()
            if wrapper == "accelerate":
                stepper.step()   # scaler.step and scaler.update inside
            else:
                scaler.step(opt)
                scaler.update()
            stepper.zero_grad()
            ra.step(loss)
            moved.append(any(not torch.equal(p, q) for p, q in zip(model.parameters(), before)))
        return model, ra, moved

    model, ra, moved = run((1.0, 1e6, 1.0))
    ref, ref_ra, _ = run((1.0, 1.0))
    assert moved == [True, False, True]
    assert ra.steps == ref_ra.steps == 2
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("autocast", [torch.float16, None], ids=["float16", "autocast-elsewhere"])
def test_an_accelerate_fp16_optimizer_steps_with_its_own_scaler(autocast):
    """accelerate under mixed_precision="fp16" hands out an optimizer that steps through its own GradScaler
    (here put on a CPU Accelerator as a GPU one has it).  compile_step given that optimizer scales the loss with
    that scaler (it used to scale with a second one, and the wrapper's step failed: "_scale is None"), with its
    own autocast or none (accelerate autocasts the model's forward itself).  Over an overflowing batch between
    two good ones it trains as compile_step with a scaler of its own (to the bit) and as torch's eager
    GradScaler recipe (within 5% of the update), and accelerate's scheduler skips the skipped step."""
    accelerate = pytest.importorskip("accelerate")
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    factors = (1.0, 1e6 if autocast else float("inf"), 1.0)

    def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.float(), target)

    ref = _net()
    start = [p.detach().clone() for p in ref.parameters()]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda k: 1.0 / (1 + k))
    ref_scaler = torch.amp.GradScaler("cpu")
    for factor in factors:
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast is not None):
            loss = loss_of(ref(x, scale=factor), y)
        ref_scaler.scale(loss).backward()
        scale = ref_scaler.get_scale()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        if ref_scaler.get_scale() >= scale:
            ref_sched.step()

    def run(wrapped: bool) -> tuple[nn.Module, list[bool], Any, Any]:
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))
        if wrapped:
            accelerator = accelerate.Accelerator(cpu=True)
            accelerator.scaler = torch.amp.GradScaler("cpu")   # what mixed_precision="fp16" makes on a GPU
            model, opt, sched = accelerator.prepare(model, opt, sched)
        step = cc.compile_step(model, loss_of, opt, backend="eager", autocast=autocast,
                               scaler=None if wrapped else torch.amp.GradScaler("cpu"))
        assert not wrapped or step.scaler is opt.scaler
        skipped = []
        for factor in factors:
            step(x, y, scale=factor)
            skipped.append(step.skipped)
            if wrapped or not step.skipped:
                sched.step()   # accelerate's wrapper steps only after an optimizer step that was not skipped
        return model, skipped, getattr(sched, "scheduler", sched), opt

    model, skipped, sched, opt = run(wrapped=True)
    own, own_skipped, _, _ = run(wrapped=False)
    assert skipped == own_skipped == [False, True, False]
    assert sched.last_epoch == ref_sched.last_epoch == 2
    for (name, p), q, r, r0 in zip(model.named_parameters(), own.parameters(), ref.parameters(), start):
        assert torch.equal(p, q), name
        assert (p - r).norm() <= 0.05 * (r - r0).norm() + 1e-6, name
    with pytest.raises(ValueError, match="GradScaler of its own"):
        cc.compile_step(model, loss_of, opt, backend="eager", scaler=torch.amp.GradScaler("cpu"))


@settings(max_examples=8, deadline=None)
@given(exponent=st.integers(-7, 2), micro_batches=st.sampled_from([1, 2]), rows=st.sampled_from([8, 12]))
def test_the_scaler_finds_a_scale_for_loss_magnitudes_from_1e_7_to_1e2(exponent, micro_batches, rows):
    """A task loss scaled by 10^exponent (gradients from underflowing to overflowing float16 at the first
    scale): the first call that is not skipped makes the float64 step's SGD update (lr 10^-exponent) to
    float16's precision; every call before it was skipped and left the parameters as they were.  Below 1e-7
    the scaler's first scale (65536) leaves the gradients among float16's subnormals (at 1e-9: 9% off), and
    it grows only after 2000 steps without an overflow: GradScaler's own limit."""
    factor = 10.0 ** exponent
    g = torch.Generator().manual_seed(rows)
    x, y = torch.randn(rows, 16, generator=g), torch.randint(0, 5, (rows,), generator=g)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.float(), target) * factor

    ref = _net(torch.float64)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1 / factor)
    expected = _update(ref, lambda: (loss_fn(ref(x.double()), y).backward(), ref_opt.step()))
    model = _net()
    step = cc.compile_step(model, loss_fn, torch.optim.SGD(model.parameters(), lr=1 / factor),
                           autocast=torch.float16, micro_batches=micro_batches, backend="eager")
    for _ in range(40):
        got = _update(model, lambda: step(x, y))
        if not step.skipped:
            break
        assert not got.any(), "a skipped step changed a parameter"
    assert not step.skipped, "the scaler found no scale in 40 halvings"
    error = ((got - expected).norm() / expected.norm()).item()
    assert error < 2e-2, f"{error:.3g} off the float64 step at a loss scaled by 1e{exponent}"


def test_an_optimizer_pre_hook_clips_the_unscaled_gradients():
    """Gradient clipping in an optimizer step pre-hook (as pretrain clips), at float16 autocast: the hook sees
    the true gradients, not the scaled ones, also where the fused SGD takes the scale in its kernel.  One SGD
    step clipped to norm 0.01 moves the parameters as the float64 step clipped alike (clipping the scaled
    gradients would have moved them 65536 times less)."""
    def clip(optimizer, args, kwargs):
        torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 0.01)

    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)
    ref = _net(torch.float64)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1.0)
    ref_opt.register_step_pre_hook(clip)
    expected = _update(ref, lambda: (F.cross_entropy(ref(x.double()), y).backward(), ref_opt.step()))
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    opt.register_step_pre_hook(clip)
    step = cc.compile_step(model, nn.CrossEntropyLoss(), opt, autocast=torch.float16, backend="eager")
    got = _update(model, lambda: step(x, y))
    assert getattr(opt, "_step_supports_amp_scaling", False), "the fused SGD should take the scale itself"
    assert expected.norm().item() == pytest.approx(0.01, rel=1e-6)
    error = ((got - expected).norm() / expected.norm()).item()
    assert error < 2e-2, f"the clipped float16 step is {error:.3g} off the float64 one"
