"""Tempo's dropout at 16 bits and its attention under autocast: the values and gradients of torch's own ops
(the same masks, replayed with dropout_mask), fewer bytes kept for backward, and no fallback warning."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from comera_compile.memory import saved_bytes
from comera_compile.ops import buffers
from comera_compile.ops.attention import softmax_dropout_matmul
from comera_compile.ops.bit_dropout import dropout, dropout_mask
from comera_compile.ops.tempo_modules import TempoDropout
from tempo_helpers import same_mask_dropout


def _no_fallback(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("error", buffers.TempoDtypeWarning)
        return fn()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_dropout_keeps_its_mask_as_bits(dtype):
    torch.manual_seed(0)
    x = torch.randn(64, 96, dtype=dtype, requires_grad=True)
    g = torch.randn(64, 96, dtype=dtype)
    want = same_mask_dropout(0.3, seed=5)(x)
    got = _no_fallback(lambda: dropout(x, 0.3, generator=torch.Generator().manual_seed(5)))
    assert got.dtype == dtype
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got, x, g)[0], torch.autograd.grad(want, x, g)[0])
    _no_fallback(lambda: TempoDropout(0.3)(x))
    # torch keeps a mask of a byte (CUDA) or an element (CPU) per element; this one bit
    assert saved_bytes(lambda: dropout(x, 0.3)) * 8 <= saved_bytes(lambda: F.dropout(x, 0.3)) + 8


def _attention_inputs(scores_dtype, v_dtype, device="cpu"):
    torch.manual_seed(1)
    scores = torch.randn(2, 3, 10, 12, dtype=scores_dtype, device=device, requires_grad=True)
    v = torch.randn(2, 3, 12, 4, dtype=v_dtype, device=device, requires_grad=True)
    return scores, v, torch.randn(2, 3, 10, 4, device=device).bfloat16()


@pytest.mark.parametrize("scores_dtype,v_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                                  (torch.bfloat16, torch.float32)])
def test_attention_under_autocast_gives_torchs_values_and_gradients_keeping_less(scores_dtype, v_dtype):
    scores, v, go = _attention_inputs(scores_dtype, v_dtype)
    ref_drop = same_mask_dropout(0.2, seed=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref_drop(torch.softmax(scores, -1)) @ v
        got = _no_fallback(lambda: softmax_dropout_matmul(scores, v, 0.2, generator=torch.Generator().manual_seed(4)))
        eager_bytes = saved_bytes(lambda: F.dropout(torch.softmax(scores, -1), 0.2) @ v)
        tempo_bytes = saved_bytes(softmax_dropout_matmul, scores, v, 0.2)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, (scores, v), go), torch.autograd.grad(want, (scores, v), go)):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b)
    assert tempo_bytes < 0.6 * eager_bytes   # no mask, no dropped copy: the softmax output and bits


def test_attention_under_an_autocast_that_runs_softmax_at_float32(monkeypatch):
    """CUDA's rule (softmax at float32, the matmul at bfloat16), set on the CPU's autocast: the reference is
    written out with the casts autocast would make."""
    monkeypatch.setitem(buffers._AUTOCAST_DTYPES, ("softmax", "cpu", torch.bfloat16, torch.bfloat16), torch.float32)
    scores, v, go = _attention_inputs(torch.bfloat16, torch.bfloat16)
    dropped = same_mask_dropout(0.2, seed=4)(torch.softmax(scores.float(), -1))
    want = dropped.bfloat16() @ v
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = softmax_dropout_matmul(scores, v, 0.2, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, (scores, v), go), torch.autograd.grad(want, (scores, v), go)):
        torch.testing.assert_close(a, b)


@pytest.mark.cuda
def test_attention_under_the_devices_autocast_matches_torchs_ops(device):
    scores, v, go = _attention_inputs(torch.bfloat16, torch.float32, device)
    gen = torch.Generator(device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        got = softmax_dropout_matmul(scores, v, 0.2, generator=gen.manual_seed(4))
        probs = torch.softmax(scores, -1)   # at the dtype this device's autocast gives it
        keep = dropout_mask(probs.shape, 0.2, generator=gen.manual_seed(4), device=device)
        want = (probs * (keep.to(probs.dtype) * 1.25)) @ v
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, (scores, v), go), torch.autograd.grad(want, (scores, v), go)):
        torch.testing.assert_close(a, b)
