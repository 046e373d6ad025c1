"""cc.breakdown, cc.count_flops and cc.matmul_peak: the figures a user reads to see where a step's time goes.

References are computed another way: FLOPs against the textbook count of a linear layer's products and
against the contraction planner's own cost of each TT product; busy time against a brute-force count of the
covered time; operator counts against the operators the step is known to call.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import comera_compile as cc
from comera_compile.step_time import busy_time, kernel_category, summarize
from comera_compile.layers import TTLinear


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 20)), max_size=12))
def test_busy_time_is_the_length_of_the_union(spans):
    intervals = [(s, s + n) for s, n in spans]
    covered = {t for s, e in intervals for t in range(s, e)}   # unit cells [t, t+1) some interval covers
    assert busy_time(intervals) == len(covered)


@pytest.mark.parametrize("name, category", [
    ("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_off", "matmul"),
    ("nvjet_tst_128x64_64x8_1x2_h_bz_coopA_NTN", "matmul"),
    ("ampere_sgemm_64x32_sliced1x4_tn", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_64x64_16x6_tn_align4>(Params)", "matmul"),
    ("triton_tem_fused_mm_4", "matmul"),
    ("aten::addmm", "matmul"),
    ("aten::bmm", "matmul"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>(Flash_fwd_params)", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("aten::copy_", "copy"),
    ("triton_poi_fused_add_mul_0", "other"),
    ("triton_per_fused_native_layer_norm_3", "other"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other"),
    ("aten::mm_fake_name_suffix", "other"),
])
def test_kernel_categories(name, category):
    assert kernel_category(name) == category


def _mlp(bias: bool = False) -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64, bias=bias), nn.ReLU(), nn.Linear(64, 48, bias=bias), nn.ReLU(),
                         nn.Linear(48, 16, bias=bias))


@pytest.mark.parametrize("input_grad", [False, True])
def test_count_flops_of_a_dense_training_step_is_the_textbook_count(input_grad):
    """2mnk per product: forward y = xW^T, backward dW = g^T x for every layer, dx = g W for every layer but
    the first unless the input needs a gradient.  The optimizer adds no matrix product."""
    torch.manual_seed(0)
    model, rows = _mlp(bias=True), 10
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(rows, 32, requires_grad=input_grad)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    shapes = [(32, 64), (64, 48), (48, 16)]
    expected = sum(2 * rows * i * o * (2 if k == 0 and not input_grad else 3) for k, (i, o) in enumerate(shapes))
    counted = cc.count_flops(step, model=model)
    assert counted.total == expected
    assert counted.tt_layers == 0


def test_count_flops_of_tt_layers_matches_the_planners_costs():
    """Forward only: each TT layer's counted FLOPs are its plan's cost; a model of TT layers alone has them
    all in its TT share.  Training: the TT share is the whole count there too, the same under bf16
    autocast, and counting leaves the parameters' gradients as they were."""
    torch.manual_seed(0)
    model = cc.tensorize(_mlp(bias=True), rank=4, min_features=16)
    layers = [m for m in model.modules() if isinstance(m, TTLinear)]
    assert len(layers) == 3
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        counted = cc.count_flops(lambda: model(x), model=model)
    assert counted.total == counted.tt_layers == sum(layer.flops(10) for layer in layers)
    trained = cc.count_flops(lambda: model(x).sum().backward(), model=model)
    assert trained.tt_layers == trained.total > 2 * counted.total
    with torch.autocast("cpu", dtype=torch.bfloat16):   # layers replayed under the autocast they ran in
        assert cc.count_flops(lambda: model(x).float().sum().backward(), model=model) == trained
    grads = [p.grad.clone() for p in model.parameters()]
    cc.count_flops(lambda: model(x).sum(), model=model)   # forward with grad on, no backward: replays only
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))


@settings(max_examples=25, deadline=None)
@given(n_in=st.integers(16, 300), n_out=st.integers(16, 300), rank=st.integers(2, 12), rows=st.integers(1, 64),
       input_grad=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_count_flops_of_a_tt_layer_is_its_plans_forward_and_training_flops(n_in, n_out, rank, rows, input_grad,
                                                                           dtype):
    """torch's flop counter on the products a TT layer runs equals the contraction planner's own count, forward
    and forward + backward (with or without the input's gradient), for any shape, rank and dtype.  (At rank 1
    the two differ by convention: a product over a bond of size 1 is an outer product, mn multiplications to
    the planner and 2mn to torch's counter.)"""
    torch.manual_seed(0)
    layer = TTLinear(n_in, n_out, rank=rank).to(dtype)
    x = torch.randn(rows, n_in, dtype=dtype, requires_grad=input_grad)
    with torch.no_grad():
        forward = cc.count_flops(lambda: layer(x), model=layer)
    training = cc.count_flops(lambda: layer(x).sum().backward(), model=layer)
    assert forward.total == forward.tt_layers == layer.plan(rows, training=False).flops
    assert training.total == training.tt_layers == layer.plan(rows, True, input_grad).training_flops


def test_breakdown_counts_the_operators_a_cpu_step_calls():
    """Forward of three bias-free linear layers and two ReLUs under no_grad: three matrix products and two
    other operators per step (the outermost aten operator of each call), busy time within the profiled steps,
    and the FLOP rate from the count and the step time."""
    torch.manual_seed(0)
    model = _mlp()
    x = torch.randn(64, 32)

    def step():
        with torch.no_grad():
            return model(x)

    flops = cc.count_flops(step)
    b = cc.breakdown(step, device="cpu", steps=4, repeat=5, flops=flops, peak_flops=cc.matmul_peak("cpu", size=256))
    assert b.categories["matmul"]["count"] == 3
    assert b.categories["other"]["count"] == 2
    assert b.kernels == 5 and b.launches == 0 and b.graphs == 0
    assert 0 < b.busy_ms
    assert b.flops_per_s == pytest.approx(flops.total / (b.step_ms / 1e3))
    assert b.peak_share == pytest.approx(b.flops_per_s / b.peak_flops)
    text = str(b)
    assert "3 operators" in text and "TFLOP/s" in text
    assert set(b.to_dict()) >= {"step_ms", "busy_ms", "idle_ms", "kernels", "categories", "flops_per_s"}


def test_breakdown_of_a_compiled_step_runs_and_takes_a_given_step_time():
    model = cc.tensorize(_mlp(bias=True), rank=4, min_features=16)
    opt = torch.optim.AdamW(model.parameters())
    step = cc.compile_step(model, lambda out, t: (out - t).square().mean(), opt)
    x, t = torch.randn(8, 32), torch.randn(8, 16)
    b = cc.breakdown(lambda: step(x, t), device="cpu", steps=2, step_ms=123.0)
    assert b.step_ms == 123.0 and b.idle_ms == pytest.approx(123.0 - b.busy_ms)
    assert b.flops is None and b.flops_per_s is None and "GFLOP" not in str(b)


def test_summarize_counts_device_kernels_and_host_launches():
    """On CUDA the units are the kernels the device ran (inside graphs too) and the launches are the host's
    runtime calls: built from stand-in events, as torch's profiler reports them."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name, device_type, start=0.0, end=0.0):
        return SimpleNamespace(name=name, device_type=device_type, cpu_parent=None,
                               time_range=SimpleNamespace(start=start, end=end))

    events = [e for t in (0, 5000) for e in (
        event("cudaGraphLaunch", DeviceType.CPU), event("cudaLaunchKernel", DeviceType.CPU),
        event("nvjet_tst_64x8", DeviceType.CUDA, t, t + 300),
        event("triton_poi_fused_0", DeviceType.CUDA, t + 200, t + 500),
        event("Memcpy HtoD (Pageable -> Device)", DeviceType.CUDA, t + 1000, t + 1100))]
    s = summarize(events, "cuda", steps=2)
    assert s["launches"] == 1 and s["graphs"] == 1 and s["kernels"] == 3
    assert s["busy_ms"] == pytest.approx((500 + 100) / 1e3)   # the two kernels overlap by 100 us
    assert s["categories"]["matmul"] == {"ms": pytest.approx(0.3), "count": 1}
    assert s["categories"]["copy"]["count"] == 1


def test_breakdown_refuses_bad_arguments():
    with pytest.raises(ValueError, match="steps and repeat"):
        cc.breakdown(lambda: None, device="cpu", steps=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            cc.breakdown(lambda: None, device="cuda")


def test_readme_breakdown_lines_run_as_written(capsys):
    from helpers import readme_marked_block

    torch.manual_seed(0)
    model = cc.tensorize(_mlp(bias=True), rank=4, min_features=16)
    names = {"cc": cc, "model": model, "loss_fn": nn.MSELoss(), "opt": torch.optim.AdamW(model.parameters()),
             "x": torch.randn(8, 32), "y": torch.randn(8, 16)}
    exec(compile(readme_marked_block("<!-- breakdown-lines -->"), "README.md", "exec"), names)
    out = capsys.readouterr().out
    assert "busy" in out and "GFLOP per step" in out and "of the measured matmul peak" in out
