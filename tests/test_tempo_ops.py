"""The Tempo runtime ops (comera_compile.ops): GELU, LayerNorm, dropout with bit masks, attention, bit packing
and gradient-buffer reuse.

Every reference is computed another way than the code under test: the original torch ops (F.gelu,
F.layer_norm, softmax / matmul) under ordinary autograd, in float64 where it matters, with the same dropout
mask re-drawn by dropout_mask and applied by plain multiplication; torch.autograd.gradcheck; bit packing
checked against a Python loop.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from comera_compile.memory import SavedTensors
from comera_compile.ops.attention import softmax_dropout_matmul
from comera_compile.ops.bit_dropout import dropout, dropout_mask
from comera_compile.ops.bits import pack_bits, unpack_bits
from comera_compile.ops.buffers import _REFCOUNTS, boxing_supported
from comera_compile.ops.gelu import gelu, gelu_dropout
from comera_compile.ops.layer_norm import layer_norm
from tempo_helpers import SETTINGS, close, grads_of, same_mask_dropout

X0 = {"none": -0.7517915246935645, "tanh": -0.7522}   # GELU's minimum (tanh form: roughly)
pytestmark = pytest.mark.usefixtures("single_thread")   # small tensors (see conftest.single_thread)


# ---------------------------------------------------------------------------------------------------------
# Bits and masks


@given(st.lists(st.booleans(), min_size=0, max_size=70))
@settings(**SETTINGS)
def test_pack_bits_matches_a_python_loop(flags):
    mask = torch.tensor(flags, dtype=torch.bool)
    packed = pack_bits(mask)
    expected = [sum(1 << k for k in range(8) if 8 * j + k < len(flags) and flags[8 * j + k])
                for j in range((len(flags) + 7) // 8)]
    assert packed.tolist() == expected
    assert torch.equal(unpack_bits(packed, mask.shape), mask)


def test_unpack_bits_checks_its_input():
    with pytest.raises(ValueError, match="pack_bits made from 9 elements"):
        unpack_bits(torch.zeros(1, dtype=torch.uint8), (9,))


def test_dropout_masks_keep_the_right_fraction_and_are_reproducible():
    n = 600_000   # more than one slice of the elementwise loops
    for p in (0.1, 0.5, 0.9):
        mask = dropout_mask((n,), p, generator=torch.Generator().manual_seed(3))
        rate = mask.double().mean().item()
        assert abs(rate - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    a = dropout_mask((4, 1000), 0.3, generator=torch.Generator().manual_seed(5))
    b = dropout_mask((4, 1000), 0.3, generator=torch.Generator().manual_seed(5))
    c = dropout_mask((4, 1000), 0.3, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.manual_seed(0)
    d1 = dropout_mask((1000,), 0.5)
    d2 = dropout_mask((1000,), 0.5)   # the default generator moved on
    assert not torch.equal(d1, d2)
    # Neighbouring elements are not correlated (two per random word, consecutive words).
    m = dropout_mask((n,), 0.5, generator=torch.Generator().manual_seed(1)).double() - 0.5
    assert abs((m[1:] * m[:-1]).mean().item()) < 5 * 0.25 / math.sqrt(n)
    with pytest.raises(ValueError, match="between 0 and 1"):
        dropout_mask((3,), 1.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dropout_matches_the_same_mask_applied_by_hand(dtype):
    x = torch.randn(37, 301, dtype=dtype)
    g = torch.randn_like(x)
    got = grads_of(lambda t: dropout(t, 0.3, generator=torch.Generator().manual_seed(4)), [x], g)
    ref = grads_of(same_mask_dropout(0.3, 4), [x], g)
    for a, b in zip(got, ref):
        close(a, b, dtype)
    # eval mode, p = 0 and p = 1 are the ordinary op
    assert torch.equal(dropout(x, 0.3, training=False), x)
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))


# ---------------------------------------------------------------------------------------------------------
# GELU

values = st.floats(-12.0, 12.0, allow_nan=False, width=32)
near_minimum = st.floats(-1.0, -0.5, allow_nan=False, width=32)
tail = st.floats(-40.0, -2.5, allow_nan=False, width=32)


@given(st.lists(st.one_of(values, near_minimum, tail), min_size=1, max_size=300),
       st.sampled_from(["none", "tanh"]), st.sampled_from([torch.float32, torch.float64]), st.integers(0, 99))
@settings(**SETTINGS)
def test_gelu_outputs_and_gradients_match_torch(xs, form, dtype, seed):
    x = torch.tensor(xs, dtype=dtype)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    got = grads_of(lambda t: gelu(t, form), [x], g)
    ref = grads_of(lambda t: F.gelu(t, approximate=form), [x], g)
    assert torch.equal(got[0], ref[0])   # the forward is F.gelu itself
    close(got[1], ref[1], dtype)


@pytest.mark.parametrize("form", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gelu_gradient_on_a_dense_grid_across_both_branches(form, dtype):
    # A fine grid (steps of 4.5e-6) around the minimum, where inverting GELU is hardest, and a wide range
    # beyond, in a tensor of several slices; upstream gradients up to 4 in size.
    x = torch.cat([torch.linspace(-1.2, -0.3, 200_001), torch.linspace(-30, 60, 200_001)]).to(dtype)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(0), dtype=dtype).clamp_(-4, 4)
    got = grads_of(lambda t: gelu(t, form), [x], g)[1]
    ref = grads_of(lambda t: F.gelu(t, approximate=form), [x], g)[1]
    close(got, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gelu_dropout_matches_gelu_then_the_same_mask(dtype):
    torch.manual_seed(1)
    x = torch.randn(3, 70_000, dtype=dtype) * 2
    g = torch.randn_like(x)
    for form in ("none", "tanh"):
        got = grads_of(lambda t: gelu_dropout(t, 0.1, True, form, generator=torch.Generator().manual_seed(9)),
                       [x], g)
        ref = grads_of(lambda t: same_mask_dropout(0.1, 9)(F.gelu(t, approximate=form)), [x], g)
        for a, b in zip(got, ref):
            close(a, b, dtype)


def test_gelu_keeps_less_and_falls_back_to_keeping_the_input():
    x = torch.randn(4096, requires_grad=True)
    with SavedTensors() as eager:
        ye = F.gelu(x)
        eager_bytes = eager.bytes
    with SavedTensors() as tempo:
        yt = gelu(x)
        breakdown = tempo.breakdown()
    assert eager_bytes == 4096 * 4
    # output (the next layer keeps it anyway), branch bits, and a few exact inputs (index + value)
    assert breakdown[0] == ("(4096,) torch.float32", 4096 * 4)
    assert sum(n for _, n in breakdown[1:]) < 0.25 * 4096 * 4
    del ye, yt
    # All inputs where inverting is ill-conditioned: the input itself is kept; gradients still exact.
    x = (torch.full((1000,), X0["none"]) + torch.linspace(-0.05, 0.05, 1000)).requires_grad_()
    with SavedTensors() as fallback:
        y = gelu(x)
        assert [n for _, n in fallback.breakdown() if n] == [4000]   # the input alone, as torch keeps
    del y
    g = torch.randn(1000)
    close(grads_of(gelu, [x], g)[1], grads_of(F.gelu, [x], g)[1], torch.float32)


def test_gelu_non_finite_inputs_give_torch_s_gradients():
    # Among many ordinary values (so the exact inputs are kept sparsely, not as a whole tensor).
    x = torch.cat([torch.tensor([float("nan"), float("inf"), -float("inf"), -5.0, -0.75]),
                   torch.linspace(0.0, 3.0, 1000)])
    g = torch.ones_like(x)
    got = grads_of(gelu, [x], g)
    ref = grads_of(F.gelu, [x], g)
    assert ref[1][:3].isnan().all()
    close(got[1], ref[1], torch.float32)


def test_gelu_other_dtypes_and_no_grad_run_the_original_op():
    x = torch.randn(64, dtype=torch.bfloat16, requires_grad=True)
    assert gelu(x).grad_fn.name() == "GeluBackward0"
    y = torch.randn(8, requires_grad=True)
    with torch.no_grad():
        out = gelu(y)
    assert out.grad_fn is None and torch.equal(out, F.gelu(y.detach()))
    assert gelu(y).grad_fn.name().startswith("_Gelu")
    with pytest.raises(ValueError, match="'none' or 'tanh'"):
        gelu(y, "sigmoid")


# ---------------------------------------------------------------------------------------------------------
# LayerNorm


@given(st.integers(1, 6), st.sampled_from([(8,), (33,), (4, 5)]), st.sampled_from(["affine", "weight", "none"]),
       st.sampled_from([torch.float32, torch.float64]), st.integers(0, 99))
@settings(**SETTINGS)
def test_layer_norm_matches_torch(rows, shape, affine, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 3, *shape, generator=gen, dtype=dtype) * 3 + 1
    g = torch.randn(x.shape, generator=gen, dtype=dtype)
    w = torch.randn(shape, generator=gen, dtype=dtype)
    b = torch.randn(shape, generator=gen, dtype=dtype)
    w.view(-1)[0] = 0.0          # a zero weight: the normalised input cannot be rebuilt there
    w.view(-1)[-1] = 1e-3        # tiny next to its bias: rebuilding it would lose digits
    inputs = [x]
    if affine == "affine":
        inputs += [w, b]
    elif affine == "weight":
        inputs += [w]

    def call(f):
        def run(x, *wb):
            wb = list(wb) + [None] * (2 - len(wb))
            return f(x, shape, wb[0], wb[1], 1e-5)
        return run

    got = grads_of(call(layer_norm), inputs, g)
    ref = grads_of(call(F.layer_norm), inputs, g)
    for a, r in zip(got, ref):
        close(a, r, dtype)


def test_layer_norm_keeps_its_output_not_its_input():
    ln = nn.LayerNorm(64)
    x = torch.randn(32, 64, requires_grad=True)
    with SavedTensors(exclude=ln) as saved:
        y = layer_norm(x, (64,), ln.weight, ln.bias)
        kept = saved.breakdown()
    assert kept[0] == ("(32, 64) torch.float32", 32 * 64 * 4)     # the output
    assert sum(n for _, n in kept[1:]) <= 32 * 4 + 16              # 1/std per row (and empty extras)
    assert y.grad_fn.name().startswith("_LayerNorm")


# ---------------------------------------------------------------------------------------------------------
# Attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("v_shape", [(2, 3, 17, 8), (17, 8), (1, 3, 17, 8)])
def test_softmax_dropout_matmul_matches_the_unfused_ops(dtype, v_shape):
    torch.manual_seed(0)
    s = torch.randn(2, 3, 17, 17, dtype=dtype)
    v = torch.randn(v_shape, dtype=dtype)
    g = torch.randn(2, 3, 17, 8, dtype=dtype)
    got = grads_of(lambda a, b: softmax_dropout_matmul(a, b, 0.2, generator=torch.Generator().manual_seed(2)),
                   [s, v], g)
    ref = grads_of(lambda a, b: same_mask_dropout(0.2, 2)(torch.softmax(a, -1)) @ b, [s, v], g)
    for a, b in zip(got, ref):
        close(a, b, dtype)
    # eval mode is exactly softmax then matmul
    assert torch.equal(softmax_dropout_matmul(s, v, 0.2, training=False), torch.softmax(s, -1) @ v)


def test_attention_keeps_the_softmax_output_once_and_the_mask_as_bits():
    s = torch.randn(2, 4, 32, 32, requires_grad=True)
    v = torch.randn(2, 4, 32, 16, requires_grad=True)
    probs_bytes = s.numel() * 4
    with SavedTensors() as eager:
        out_e = F.dropout(torch.softmax(s, -1), 0.1) @ v
        eager_bytes = eager.bytes
    with SavedTensors() as tempo:
        out_t = softmax_dropout_matmul(s, v, 0.1)
        tempo_bytes = tempo.bytes
    assert tempo_bytes == probs_bytes + probs_bytes // 32 + v.numel() * 4
    assert eager_bytes >= 3 * probs_bytes   # softmax output, float mask and dropped-out copy
    del out_e, out_t


def test_gradcheck_float64():
    def seeded(fn, seed=3):
        return lambda *a: fn(*a, generator=torch.Generator().manual_seed(seed))

    x = torch.randn(6, 7, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        x[0, :3] = torch.tensor([-0.76, -3.5, 20.0], dtype=torch.float64)  # window, tail, flat right side
    assert torch.autograd.gradcheck(gelu, (x,))
    assert torch.autograd.gradcheck(lambda t: gelu(t, "tanh"), (x,))
    assert torch.autograd.gradcheck(seeded(lambda t, generator: gelu_dropout(t, 0.3, generator=generator)), (x,))
    assert torch.autograd.gradcheck(seeded(lambda t, generator: dropout(t, 0.3, generator=generator)), (x,))
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: layer_norm(a[0], (7,), a[1], a[2]), (x, w, b))
    assert torch.autograd.gradcheck(lambda t: layer_norm(t, (7,)), (x,))
    s = torch.randn(2, 5, 5, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        seeded(lambda a, c, generator: softmax_dropout_matmul(a, c, 0.25, generator=generator)), (s, v))


def test_gradient_buffer_is_reused_only_when_nobody_else_holds_it():
    torch.manual_seed(0)
    x = torch.randn(5, 300, requires_grad=True)
    w = torch.randn(300, 7)
    ref = grads_of(lambda t: F.gelu(t) @ w, [x], torch.ones(5, 7))[1]
    # Upstream gradient from a matmul (owned by autograd alone): reused in place; still correct.
    x.grad = None
    (gelu(x) @ w).sum().backward()
    close(x.grad, ref, torch.float32)
    # A hook keeps the upstream gradient: it must come out unchanged.
    kept = []
    x.grad = None
    y = gelu(x)
    y.register_hook(lambda gr: kept.append(gr))
    (y @ w).sum().backward()
    close(x.grad, ref, torch.float32)
    close(kept[0], torch.ones(5, 7) @ w.t(), torch.float32)
    # A gradient the caller passes in is not overwritten.
    g = torch.randn(5, 300)
    g_copy = g.clone()
    gelu(x).backward(g)
    assert torch.equal(g, g_copy)


class _GradSource(torch.autograd.Function):
    """Identity whose backward hands on a fresh copy of its gradient, records the copy's data_ptr, and, with
    keep, also holds the copy (in `kept`) as a second owner."""

    @staticmethod
    def forward(ctx, t, log, kept):
        ctx.log, ctx.kept = log, kept
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        out = g.clone()
        ctx.log["given"] = out.data_ptr()
        if ctx.kept is not None:
            ctx.kept.append(out)
        return out, None, None


class _GradSink(torch.autograd.Function):
    """Identity whose backward records the data_ptr of the gradient it receives."""

    @staticmethod
    def forward(ctx, t, log):
        ctx.log = log
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        ctx.log["received"] = g.data_ptr()
        return g, None


TEMPO_BOXED = {   # the Tempo ops whose backward takes its gradient boxed (may reuse it), with references
    "gelu": (lambda t: gelu(t), lambda t: F.gelu(t)),
    "gelu_dropout": (lambda t: gelu_dropout(t, 0.3, generator=torch.Generator().manual_seed(2)),
                     lambda t: same_mask_dropout(0.3, 2)(F.gelu(t))),
    "dropout": (lambda t: dropout(t, 0.3, generator=torch.Generator().manual_seed(2)),
                same_mask_dropout(0.3, 2)),
}


@pytest.mark.parametrize("op", sorted(TEMPO_BOXED))
@pytest.mark.parametrize("shared", [False, True])
def test_input_gradient_takes_the_incoming_gradient_s_buffer_only_when_unshared(op, shared):
    """Sink <- Tempo op <- Source: the input gradient the op produces sits in the buffer of the gradient it
    was given when nothing else holds that gradient; when something does, the op writes elsewhere and
    leaves the held gradient as it was.  Either way the gradient is the plain torch op's (float64)."""
    tempo_fn, ref_fn = TEMPO_BOXED[op]
    x = torch.randn(6, 301, dtype=torch.float64)
    upstream = torch.randn(6, 301, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    log, kept = {}, ([] if shared else None)
    leaf = x.clone().requires_grad_()
    _GradSource.apply(tempo_fn(_GradSink.apply(leaf, log)), log, kept).backward(upstream)
    ref = grads_of(ref_fn, [x], upstream)[1]
    close(leaf.grad, ref, torch.float64)
    if shared:
        assert log["received"] != log["given"]
        assert torch.equal(kept[0], upstream)   # the held gradient is untouched
    elif _REFCOUNTS and boxing_supported():
        assert log["received"] == log["given"]
    else:   # without boxed gradients (torch < 2.13) or the private refcount APIs: always a new buffer
        assert log["received"] != log["given"]


def test_one_upstream_gradient_shared_by_several_tempo_ops():
    """Autograd hands one gradient tensor to every input of an addition: each Tempo op (and the plain op
    beside them) must see it unchanged, whichever runs first, and the sum of gradients at a tensor feeding
    several Tempo ops must be the plain ops' (F.gelu, F.layer_norm, dropout with the same mask; float64)."""
    g = torch.Generator().manual_seed(0)
    a, b, c, d = (torch.randn(4, 64, dtype=torch.float64, generator=g) for _ in range(4))
    w, bias = torch.rand(64, dtype=torch.float64, generator=g) + 0.5, torch.randn(64, dtype=torch.float64, generator=g)
    proj = torch.randn(64, 5, dtype=torch.float64, generator=g)   # its backward makes the shared gradient
    upstream = torch.randn(4, 5, dtype=torch.float64, generator=g)

    def model(gelu, layer_norm, drop, gelu_drop):
        def f(a, b, c, d, w, bias):
            s = gelu(a) + layer_norm(b, (64,), w, bias) + drop(c) + gelu_drop(c) + torch.sin(d)
            s = s + gelu(d) + layer_norm(d, (64,), w, bias)     # d feeds two Tempo ops and sin
            return s @ proj
        return f

    got = grads_of(model(gelu, layer_norm,
                         lambda t: dropout(t, 0.3, generator=torch.Generator().manual_seed(5)),
                         lambda t: gelu_dropout(t, 0.2, generator=torch.Generator().manual_seed(6))),
                   [a, b, c, d, w, bias], upstream)
    ref = grads_of(model(F.gelu, F.layer_norm, same_mask_dropout(0.3, 5),
                         lambda t: same_mask_dropout(0.2, 6)(F.gelu(t))),
                   [a, b, c, d, w, bias], upstream)
    for x, y in zip(got, ref):
        close(x, y, torch.float64)


@pytest.mark.parametrize("op", sorted(TEMPO_BOXED))
def test_unboxed_fallback_gives_the_boxed_path_s_gradients_bit_for_bit(op, monkeypatch):
    """Where torch cannot hand gradients boxed (2.11, 2.12: boxing_supported() is False) the Tempo ops take
    them as plain arguments: the same input gradient, bit for bit, as the boxed path computes."""
    import comera_compile.ops.buffers as buffers

    if not buffers.boxing_supported():
        pytest.skip(f"torch {torch.__version__} cannot hand gradients boxed: no boxed path to compare with")
    tempo_fn, _ = TEMPO_BOXED[op]
    x = torch.randn(6, 301, dtype=torch.float32)
    upstream = torch.randn(6, 301, generator=torch.Generator().manual_seed(1))
    grads = {}
    for boxed in (True, False):
        monkeypatch.setattr(buffers, "boxing_supported", lambda boxed=boxed: boxed)
        leaf = x.clone().requires_grad_()
        tempo_fn(leaf).backward(upstream.clone())
        grads[boxed] = leaf.grad
    assert torch.equal(grads[True], grads[False])


@pytest.mark.parametrize("op", ["gelu", "gelu_dropout", "dropout", "layer_norm", "attention"])
@pytest.mark.parametrize("boxed", [True, False])
def test_a_double_backward_through_a_tempo_op_is_an_error_not_a_wrong_gradient(op, boxed, monkeypatch):
    """The Tempo ops compute first derivatives only.  A gradient penalty (create_graph=True) through one is an
    error, boxed or not, with autograd.grad's inputs= or without, where torch's once_differentiable let the
    boxed backward and autograd.grad(inputs=w) return wrong second derivatives (2.8e2 off for GELU)."""
    import comera_compile.ops.buffers as buffers

    monkeypatch.setattr(buffers, "boxing_supported", lambda: boxed and boxing_supported())
    fns = {**{k: f for k, (f, _) in TEMPO_BOXED.items()}, "layer_norm": lambda t: layer_norm(t, (8,)),
           "attention": lambda t: softmax_dropout_matmul(t.view(2, 4, 4), t.view(2, 4, 4), 0.3,
                                                        generator=torch.Generator().manual_seed(2))}
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    for inputs in ([x], [x, w]):
        (gx, *_) = torch.autograd.grad(fns[op](x @ w).square().sum(), [x, w], create_graph=False)
        assert gx.shape == x.shape   # first derivatives: as before
        with pytest.raises(RuntimeError, match="double backward .* first derivatives only"):
            grads = torch.autograd.grad(fns[op](x @ w).square().sum(), inputs, create_graph=True)
            (grads[0].norm() - 1).square().backward()


def test_attention_with_scores_broadcast_against_v_and_under_autocast_matches_the_unfused_ops():
    """Scores shared across the batch (a learned or positional attention, (1, H, S, S) against v's (B, H, S, D))
    give the unfused ops' gradients with the same mask; under autocast the op runs the unfused ops, whose
    dtypes autocast chooses (float32 scores and v with a bfloat16 matmul crashed the fused backward)."""
    torch.manual_seed(0)
    s = torch.randn(1, 3, 9, 9, dtype=torch.float64)
    v = torch.randn(2, 3, 9, 5, dtype=torch.float64)
    g = torch.randn(2, 3, 9, 5, dtype=torch.float64)
    got = grads_of(lambda a, b: softmax_dropout_matmul(a, b, 0.2, generator=torch.Generator().manual_seed(2)),
                   [s, v], g)
    ref = grads_of(lambda a, b: same_mask_dropout(0.2, 2)(torch.softmax(a, -1)) @ b, [s, v], g)
    for a, b in zip(got, ref):
        close(a, b, torch.float64)
    s32, v32 = s.float().requires_grad_(), v.float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = softmax_dropout_matmul(s32, v32, 0.2, generator=torch.Generator().manual_seed(2))
        want = same_mask_dropout(0.2, 2)(torch.softmax(s32, -1)) @ v32
    assert out.dtype == want.dtype == torch.bfloat16 and torch.equal(out, want)
    out.float().sum().backward()
    assert s32.grad is not None and v32.grad is not None
