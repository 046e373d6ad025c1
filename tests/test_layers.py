"""Tests of the TT layers (comera_compile.layers): TTLinear against nn.Linear, TTEmbedding against
nn.Embedding, gradients (gradcheck and an independent dense reconstruction), padding_idx, errors, and the
ordinary nn.Module conventions (state_dict, deepcopy, pickle, dtype conversion).  The conventions both
kinds of layer share are tested once here, parametrised over both; the embedding's lookup planning and bags
are in test_embedding.py.

Every reference is computed another way than the code under test: dense nn.Linear / nn.Embedding, float64,
torch.autograd.gradcheck, or the dense weight rebuilt from the cores by the helpers below (plain tensordot
chains written here, not the library's cores_to_dense).
"""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

from comera_compile.embedding import TTEmbedding, TTEmbeddingBag
from comera_compile.layers import TTLinear
from helpers import FULL, perturb_gates, rel_err

# A dense matrix of at most 2**18 entries: from_dense at full rank runs TT-SVDs whose largest unfolding has
# about in*out entries, and the reference gradients rebuild the dense weight; bounding the product keeps
# every hypothesis example to a fraction of a second while still letting either side reach 4096.
MAX_ENTRIES = 2**18
PRIMES = [2, 3, 5, 7, 11, 13, 31, 61, 127, 257, 509, 1021, 2039, 4093]


pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------------------------------------------------
# Independent reconstructions of the dense weight from the cores (for reference gradients)


def _chain(cores, gates):
    """Contract cores (r, *phys, r') left to right with diag(gate) on every bond; returns (*all phys)."""
    t = cores[0].reshape(cores[0].shape[1:])  # drop r_0 = 1
    for k, core in enumerate(cores[1:]):
        t = t * gates[k]  # broadcast over the trailing bond index
        t = torch.tensordot(t, core, dims=([t.dim() - 1], [0]))
    return t.reshape(t.shape[:-1])  # drop r_last = 1


def tt_linear_weight(cores, gates, in_modes, out_modes, in_f, out_f):
    """The (out_f, in_f) weight of a TT linear map whose cores carry in_modes then out_modes."""
    t = _chain(cores, gates)
    return t.reshape(math.prod(in_modes), math.prod(out_modes))[:in_f, :out_f].t()


def ttm_table(cores, gates, row_modes, col_modes, rows, cols):
    """The (rows, cols) table of a TTM whose core k is (r, row_modes[k], col_modes[k], r')."""
    t = _chain(cores, gates)  # (v1, e1, v2, e2, ..., vd, ed)
    d = len(row_modes)
    t = t.permute(list(range(0, 2 * d, 2)) + list(range(1, 2 * d, 2)))
    return t.reshape(math.prod(row_modes), math.prod(col_modes))[:rows, :cols]


def linear_weight_of(layer: TTLinear) -> torch.Tensor:
    s = layer.spec
    return tt_linear_weight(list(layer.cores), list(layer.gates), s.in_modes, s.out_modes,
                            layer.in_features, layer.out_features)


def embedding_table_of(layer: TTEmbedding) -> torch.Tensor:
    s = layer.spec
    w = ttm_table(list(layer.cores), list(layer.gates), s.in_modes, s.out_modes,
                  layer.num_embeddings, layer.embedding_dim)
    if layer.padding_idx is not None:
        mask = torch.ones(layer.num_embeddings, 1, dtype=w.dtype)
        mask[layer.padding_idx] = 0
        w = w * mask
    return w


# ---------------------------------------------------------------------------------------------------------
# Strategies

dims = st.one_of(st.integers(1, 4096), st.sampled_from(PRIMES))


@st.composite
def linear_sizes(draw):
    # Draw one side freely and the other under the entry bound (so the assume below rarely rejects), then
    # swap at random so either side can be the large one.
    a = draw(dims)
    cap = min(4096, MAX_ENTRIES // a)
    b = draw(st.one_of(st.integers(1, cap), st.sampled_from([p for p in PRIMES if p <= cap])))
    return (b, a) if draw(st.booleans()) else (a, b)


@st.composite
def embedding_sizes(draw):
    vocab = draw(dims)
    cap = min(512, MAX_ENTRIES // vocab)
    dim = draw(st.one_of(st.integers(1, cap), st.sampled_from([p for p in PRIMES if p <= cap])))
    return vocab, dim


lead_shapes = st.one_of(st.just(()), st.tuples(st.integers(1, 4)), st.tuples(st.integers(1, 3), st.integers(1, 3)))


# ---------------------------------------------------------------------------------------------------------
# TTLinear vs nn.Linear


def _check_linear_against_dense(layer: TTLinear, ref: nn.Linear, x: torch.Tensor, gy: torch.Tensor, tol: float):
    """Output and input gradient of layer vs the float64 reference ref (on x cast to float64).

    For float32 the error is measured against |x| |W|^T + |b| (the size of the terms summed), which is the
    scale floating-point rounding is proportional to; a plain relative error could blow up on an output
    that happens to cancel to nearly zero (a 1x1 layer)."""
    x = x.clone().requires_grad_(True)
    y = layer(x)
    assert y.shape == (*x.shape[:-1], ref.out_features)
    assert y.dtype == x.dtype
    (gx,) = torch.autograd.grad((y * gy.to(y.dtype)).sum(), x)

    x64 = x.detach().double().requires_grad_(True)
    y_ref = ref(x64)
    (gx_ref,) = torch.autograd.grad((y_ref * gy).sum(), x64)

    if x.dtype == torch.float64:
        y_scale, g_scale = y_ref, gx_ref
    else:
        w_abs = ref.weight.detach().abs()
        b_abs = ref.bias.detach().abs() if ref.bias is not None else 0.0
        y_scale = x64.detach().abs() @ w_abs.t() + b_abs
        g_scale = gy.abs() @ w_abs
    assert rel_err(y, y_ref, y_scale) < tol
    assert rel_err(gx, gx_ref, g_scale) < tol
    # inference (no autograd) may contract in another order: same result
    with torch.no_grad():
        assert rel_err(layer(x.detach()), y_ref, y_scale) < tol


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=linear_sizes(), lead=lead_shapes, bias=st.booleans(), d=st.sampled_from([None, 1, 2, 4]),
       seed=st.integers(0, 2**31 - 1))
@example(sizes=(4093, 61), lead=(2, 3), bias=True, d=None, seed=0)
@example(sizes=(1, 4096), lead=(), bias=True, d=None, seed=1)
@example(sizes=(4096, 1), lead=(3,), bias=False, d=None, seed=2)
@example(sizes=(1, 1), lead=(), bias=True, d=None, seed=3)
@example(sizes=(37, 53), lead=(2,), bias=True, d=3, seed=4)
def test_ttlinear_from_dense_full_rank_matches_linear(sizes, lead, bias, d, seed):
    in_f, out_f = sizes
    assume(in_f * out_f <= MAX_ENTRIES)
    g = torch.Generator().manual_seed(seed)
    ref = nn.Linear(in_f, out_f, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(out_f, in_f, generator=g, dtype=torch.float64) / math.sqrt(in_f))
        if bias:
            ref.bias.copy_(torch.randn(out_f, generator=g, dtype=torch.float64))
    x = torch.randn(*lead, in_f, generator=g, dtype=torch.float64)
    gy = torch.randn(*lead, out_f, generator=g, dtype=torch.float64)

    # float64, built from the float64 weight
    tt64 = TTLinear.from_dense(ref.weight, ref.bias, rank=FULL, d=d)
    assert tt64.to_dense().shape == (out_f, in_f)
    assert rel_err(tt64.to_dense(), ref.weight) < 1e-10
    _check_linear_against_dense(tt64, ref, x, gy, 1e-10)

    # float32 (a) the float64 TT layer cast with .float(); reference: the float64 weight
    tt_cast = copy.deepcopy(tt64).float()
    assert all(p.dtype == torch.float32 for p in tt_cast.parameters())
    _check_linear_against_dense(tt_cast, ref, x.float(), gy, 1e-4)

    # float32 (b) built from a float32 nn.Linear; reference: that layer's (rounded) weights in float64
    ref32 = copy.deepcopy(ref).float()
    tt32 = TTLinear.from_dense(ref32.weight, ref32.bias, rank=FULL, d=d)
    assert all(p.dtype == torch.float32 for p in tt32.parameters())
    _check_linear_against_dense(tt32, ref32.double(), x.float(), gy, 1e-4)

    # gradients w.r.t. the cores and gates: through the layer vs through the dense weight rebuilt here
    perturb_gates(tt64, g)
    params = list(tt64.cores) + list(tt64.gates)
    y = tt64(x)
    grads = torch.autograd.grad((y * gy).sum(), params)
    y_ref = F.linear(x, linear_weight_of(tt64), tt64.bias)
    grads_ref = torch.autograd.grad((y_ref * gy).sum(), params)
    assert rel_err(y, y_ref) < 1e-10
    for got, want in zip(grads, grads_ref):
        assert rel_err(got, want, scale=max(float(want.norm()), 1e-12)) < 1e-10


def test_ttlinear_from_dense_full_rank_bert_ffn_shape():
    # 768 -> 3072 (BERT's FFN) is above the property test's entry bound: checked once here.
    g = torch.Generator().manual_seed(0)
    ref = nn.Linear(768, 3072, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(3072, 768, generator=g, dtype=torch.float64) / math.sqrt(768))
        ref.bias.copy_(torch.randn(3072, generator=g, dtype=torch.float64))
    x = torch.randn(2, 5, 768, generator=g, dtype=torch.float64)
    gy = torch.randn(2, 5, 3072, generator=g, dtype=torch.float64)
    tt64 = TTLinear.from_dense(ref.weight, ref.bias, rank=FULL)
    _check_linear_against_dense(tt64, ref, x, gy, 1e-10)
    _check_linear_against_dense(tt64.float(), ref, x.float(), gy, 1e-4)


def test_ttlinear_from_dense_transposed_conv1d_layout():
    g = torch.Generator().manual_seed(1)
    ref = nn.Linear(37, 53, dtype=torch.float64)
    x = torch.randn(4, 37, generator=g, dtype=torch.float64)
    # transformers' Conv1D stores the weight as (in, out)
    layer = TTLinear.from_dense(ref.weight.detach().t().contiguous(), ref.bias, rank=FULL, transposed=True)
    assert (layer.in_features, layer.out_features) == (37, 53)
    assert rel_err(layer(x), ref(x)) < 1e-10


# ---------------------------------------------------------------------------------------------------------
# TTEmbedding vs nn.Embedding


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=embedding_sizes(), data=st.data(), lead=st.one_of(st.just(()), st.tuples(st.integers(1, 6)),
                                                               st.tuples(st.integers(1, 3), st.integers(1, 4))),
       use_padding=st.booleans(), int32=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_ttembedding_from_dense_full_rank_matches_embedding(sizes, data, lead, use_padding, int32, seed):
    vocab, dim = sizes
    assume(vocab * dim <= MAX_ENTRIES)
    padding_idx = data.draw(st.integers(-vocab, vocab - 1)) if use_padding else None
    g = torch.Generator().manual_seed(seed)
    ref = nn.Embedding(vocab, dim, padding_idx=padding_idx, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.normal_(generator=g)
        if ref.padding_idx is not None:
            ref.weight[ref.padding_idx] = 0  # as nn.Embedding's own init leaves it
    idx = torch.randint(0, vocab, lead, generator=g)
    if ref.padding_idx is not None and idx.numel() and data.draw(st.booleans()):
        idx.view(-1)[0] = ref.padding_idx
    if int32:
        idx = idx.int()

    tt64 = TTEmbedding.from_dense(ref.weight, padding_idx, rank=FULL)
    assert tt64.to_dense().shape == (vocab, dim)
    assert rel_err(tt64.to_dense(), ref.weight) < 1e-10
    out = tt64(idx)
    assert out.shape == (*lead, dim) and out.dtype == torch.float64
    assert rel_err(out, ref(idx)) < 1e-10

    ref32 = copy.deepcopy(ref).float()
    for tt32 in (TTEmbedding.from_dense(ref32.weight, padding_idx, rank=FULL), copy.deepcopy(tt64).float()):
        out32 = tt32(idx)
        assert out32.dtype == torch.float32
        assert rel_err(out32, ref32(idx)) < 1e-4

    # gradients w.r.t. cores and gates: through the lookup vs through the table rebuilt here
    perturb_gates(tt64, g)
    w = torch.randn(*lead, dim, generator=g, dtype=torch.float64)
    params = list(tt64.cores) + list(tt64.gates)
    grads = torch.autograd.grad((tt64(idx) * w).sum(), params, allow_unused=False)
    ref_out = F.embedding(idx, embedding_table_of(tt64))
    grads_ref = torch.autograd.grad((ref_out * w).sum(), params)
    for got, want in zip(grads, grads_ref):
        assert rel_err(got, want, scale=max(float(want.norm()), 1e-12)) < 1e-10


# ---------------------------------------------------------------------------------------------------------
# gradcheck (float64) through functional_call, so every parameter is an input gradcheck can vary


def _functional(layer):
    names = [n for n, _ in layer.named_parameters()]

    def f(inp, *params):
        return functional_call(layer, dict(zip(names, params)), (inp,))

    params = tuple(p.detach().clone().requires_grad_(True) for _, p in layer.named_parameters())
    return f, names, params


def test_gradcheck_ttlinear_input_cores_gates_bias():
    torch.manual_seed(0)
    layer = TTLinear(7, 10, rank=3, dtype=torch.float64)  # 7 -> 8 and 10 -> 12 padded
    assert layer.spec.in_padded > 7 and layer.spec.out_padded > 10
    perturb_gates(layer, torch.Generator().manual_seed(1))
    f, names, params = _functional(layer)
    assert any(n.startswith("cores.") for n in names) and any(n.startswith("gates.") for n in names)
    assert len(params) == 1 + len(layer.cores) + len(layer.gates)  # bias too
    x = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(f, (x, *params))


def test_gradcheck_ttembedding_cores_gates_with_padding_idx():
    torch.manual_seed(0)
    layer = TTEmbedding(13, 6, padding_idx=3, rank=FULL, row_modes=(2, 2, 2, 2), col_modes=(2, 2, 2, 1),
                        dtype=torch.float64)  # 13 -> 16 rows, 6 -> 8 cols
    assert layer.spec.in_padded > 13 and layer.spec.out_padded > 6
    perturb_gates(layer, torch.Generator().manual_seed(1))
    f, names, params = _functional(layer)
    assert len(params) == len(layer.cores) + len(layer.gates)
    idx = torch.tensor([[0, 3, 12, 5], [3, 7, 7, 1]])
    assert torch.autograd.gradcheck(lambda *p: f(idx, *p), params)


# ---------------------------------------------------------------------------------------------------------
# padding_idx


def test_padding_idx_reads_zero_and_gets_no_gradient():
    torch.manual_seed(0)
    layer = TTEmbedding(50, 16, padding_idx=7, rank=8, dtype=torch.float64)
    idx = torch.tensor([[7, 1, 2, 7], [3, 7, 49, 0]])
    pad = idx == 7
    out = layer(idx)
    assert torch.all(out[pad] == 0)
    assert torch.all(out[~pad].abs().sum(-1) > 0)
    params = list(layer.cores) + list(layer.gates)

    w = torch.randn(*idx.shape, 16, dtype=torch.float64)
    only_pad = torch.autograd.grad((layer(idx) * w * pad[..., None]).sum(), params)
    assert all(torch.all(gr == 0) for gr in only_pad)

    # the padding positions add nothing to the gradient of a loss over all positions
    all_pos = torch.autograd.grad((layer(idx) * w).sum(), params)
    non_pad = torch.autograd.grad((layer(idx) * w * (~pad)[..., None]).sum(), params)
    assert any(float(gr.abs().sum()) > 0 for gr in all_pos)
    for a, b in zip(all_pos, non_pad):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_negative_padding_idx_normalized_like_nn_embedding():
    layer = TTEmbedding(13, 6, padding_idx=-1)
    assert layer.padding_idx == nn.Embedding(13, 6, padding_idx=-1).padding_idx == 12
    assert torch.all(layer(torch.tensor([12])) == 0)


@pytest.mark.parametrize("padding_idx", [13, -14])
def test_padding_idx_out_of_range_rejected(padding_idx):
    with pytest.raises(ValueError, match="padding_idx"):
        TTEmbedding(13, 6, padding_idx=padding_idx)


# ---------------------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("bad", [13, 15, 16, 1000, -1, -13])
def test_embedding_index_out_of_range_raises_index_error(bad):
    # 13 rows are padded to 16 internally: 13..15 must not silently read padding rows
    layer = TTEmbedding(13, 6)
    assert layer.spec.in_padded == 16
    with pytest.raises(IndexError):
        nn.Embedding(13, 6)(torch.tensor([0, bad]))  # the behaviour being mirrored
    with pytest.raises(IndexError):
        layer(torch.tensor([0, bad]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_embedding_float_indices_raise_type_error(dtype):
    with pytest.raises(TypeError, match="integer indices"):
        TTEmbedding(13, 6)(torch.tensor([1, 2], dtype=dtype))


@pytest.mark.parametrize("shape", [(3, 8), (8,), (2, 3, 6), ()])
def test_linear_wrong_feature_size_raises_value_error(shape):
    layer = TTLinear(7, 10, rank=3)
    with pytest.raises(ValueError, match=r"\(\.\.\., 7\)"):
        layer(torch.randn(shape))


def test_non_float_dtype_and_svd_init_without_weight_rejected():
    with pytest.raises(TypeError, match="floating-point"):
        TTLinear(7, 10, dtype=torch.int64)
    with pytest.raises(ValueError, match="from_dense"):
        TTLinear(7, 10, init="svd")
    with pytest.raises(ValueError, match="from_dense"):
        TTEmbedding(13, 6, init="svd")
    with pytest.raises(ValueError, match="init must be one of"):
        TTEmbedding(13, 6, init="zeros")


# ---------------------------------------------------------------------------------------------------------
# nn.Module conventions


def _make_linear(seed=0):
    torch.manual_seed(seed)
    return TTLinear(37, 53, rank=5)


def _make_embedding(seed=0):
    torch.manual_seed(seed)
    return TTEmbedding(101, 20, padding_idx=4, rank=6)


LAYERS = {
    "linear": (_make_linear, lambda: torch.randn(3, 4, 37, generator=torch.Generator().manual_seed(9))),
    "embedding": (_make_embedding, lambda: torch.tensor([[0, 4, 100], [50, 4, 7]])),
}


def _dense_reference(layer, inp):
    """The layer's output recomputed in float64 from its own (possibly rounded) parameters, densely."""
    layer64 = copy.deepcopy(layer).double()
    if isinstance(layer64, TTLinear):
        return F.linear(inp.double(), linear_weight_of(layer64), layer64.bias)
    return F.embedding(inp, embedding_table_of(layer64))


@pytest.mark.parametrize("kind", LAYERS)
def test_state_dict_round_trip(kind):
    make, inp = LAYERS[kind]
    src, dst = make(seed=0), make(seed=1)
    x = inp()
    assert not torch.equal(src(x), dst(x))  # different random init, so the load below matters
    dst.load_state_dict(src.state_dict())
    assert torch.equal(src(x), dst(x))


@pytest.mark.parametrize("case", ["cut", "other modes", "embedding modes", "gates missing"])
def test_a_checkpoint_loads_at_its_ranks_and_one_of_other_modes_is_an_error(case):
    """A checkpoint of the layer after a rank cut loads into the layer built at full ranks, which takes its
    ranks (its outputs then equal the saved layer's); one of other modes, or one lacking some gates under
    strict=False, is an error naming the layer and what to do, its ranks and cores as they were (it used to be
    taken as a rank change and fail at the first forward, or compute with a spec its cores do not fit)."""
    torch.manual_seed(0)
    if case == "embedding modes":
        src = TTEmbedding(128, 64, rank=4, row_modes=(8, 16), col_modes=(8, 8))
        dst = TTEmbedding(128, 64, rank=4, row_modes=(16, 8), col_modes=(8, 8))
        x = torch.tensor([0, 5, 127])
    else:
        src = TTLinear(64, 64, rank=8, in_modes=(4, 16), out_modes=(8, 8))
        dst = TTLinear(64, 64, rank=8, in_modes=(16, 4) if case == "other modes" else (4, 16), out_modes=(8, 8))
        x = torch.randn(3, 64)
    if case in ("cut", "gates missing"):
        src.prune_ranks([torch.tensor([0, 2])] + [None] * (len(src.gates) - 1))
    state = src.state_dict()
    if case == "cut":
        dst.load_state_dict(state)
        assert dst.spec.ranks == src.spec.ranks and torch.equal(dst(x), src(x))
        return
    if case == "gates missing":
        state = {k: v for k, v in state.items() if not k.startswith("gates.")}
    spec, shapes = dst.spec, [c.shape for c in dst.cores]
    with pytest.raises(RuntimeError, match="tensorize the model with the shapes it was saved with"):
        dst.load_state_dict(state, strict=case != "gates missing")
    assert dst.spec == spec and [c.shape for c in dst.cores] == shapes
    dst(x)   # still a working layer


@pytest.mark.parametrize("kind", LAYERS)
def test_deepcopy_and_pickle_round_trip(kind):
    make, inp = LAYERS[kind]
    layer, x = make(), inp()
    expected = layer(x)
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert type(clone) is type(layer)
        assert torch.equal(clone(x), expected)
        assert all(a is not b for a, b in zip(clone.parameters(), layer.parameters()))
    clone = copy.deepcopy(layer)
    with torch.no_grad():
        clone.cores[0].mul_(2)
    assert torch.equal(layer(x), expected)  # the copy is independent
    assert not torch.equal(clone(x), expected)


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("convert", ["to_float64", "double"])
def test_float64_conversion(kind, convert):
    make, inp = LAYERS[kind]
    layer = make()
    layer = layer.to(torch.float64) if convert == "to_float64" else layer.double()
    assert all(p.dtype == torch.float64 for p in layer.parameters())
    x = inp()
    x = x.double() if x.is_floating_point() else x
    y = layer(x)
    assert y.dtype == torch.float64
    assert rel_err(y, _dense_reference(layer, x)) < 1e-12


def _half_supported() -> bool:
    try:
        a = torch.ones(2, 2, dtype=torch.float16)
        torch.einsum("ij,jk->ik", a, a)
        torch.bmm(a[None], a[None])
        return True
    except RuntimeError:
        return False


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_conversion(kind, dtype):
    if dtype == torch.float16 and not _half_supported():
        pytest.skip("float16 matmul not supported on this CPU build")
    make, inp = LAYERS[kind]
    layer = make().to(dtype)
    assert all(p.dtype == dtype for p in layer.parameters())
    x = inp()
    x = x.to(dtype) if x.is_floating_point() else x
    y = layer(x)
    assert y.dtype == dtype
    assert torch.isfinite(y).all()
    assert rel_err(y, _dense_reference(layer, x)) < 5e-2


# ---------------------------------------------------------------------------------------------------------
# Random init


def test_ttlinear_random_init_matches_nn_linear_scale():
    torch.manual_seed(0)
    layer = TTLinear(768, 3072, rank=30)
    with torch.no_grad():
        std = float(linear_weight_of(layer).std())
    target = 1.0 / math.sqrt(3 * 768)  # nn.Linear's U(-1/sqrt(in), 1/sqrt(in))
    assert abs(std - target) <= 0.25 * target, (std, target)
    bound = 1.0 / math.sqrt(768)
    bias = layer.bias.detach()
    assert float(bias.abs().max()) <= bound
    assert float(bias.std()) > 0.25 * bound  # spread over the range, not a constant


def test_ttembedding_random_init_matches_nn_embedding_scale():
    torch.manual_seed(0)
    layer = TTEmbedding(5000, 512)
    with torch.no_grad():
        std = float(embedding_table_of(layer).std())
    assert abs(std - 1.0) <= 0.25, std


# ---------------------------------------------------------------------------------------------------------
# Shapes: empty batches, padded sizes


@pytest.mark.parametrize("lead", [(0,), (3, 0), (0, 4)])
def test_ttlinear_empty_batch(lead):
    assert nn.Linear(37, 53)(torch.zeros(*lead, 37)).shape == (*lead, 53)  # the behaviour being mirrored
    layer = TTLinear(37, 53, rank=5)
    x = torch.zeros(*lead, 37, requires_grad=True)
    y = layer(x)
    assert y.shape == (*lead, 53)
    y.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("shape", [(0,), (3, 0)])
def test_ttembedding_empty_indices(shape):
    layer = TTEmbedding(13, 6, padding_idx=3)
    idx = torch.zeros(shape, dtype=torch.long)
    assert nn.Embedding(13, 6)(idx).shape == (*shape, 6)  # the behaviour being mirrored
    out = layer(idx)
    assert out.shape == (*shape, 6)
    out.sum().backward()
    assert all(c.grad is not None and not c.grad.any() for c in layer.cores)


def test_ttlinear_padding_is_invisible():
    torch.manual_seed(0)
    layer = TTLinear(37, 53, rank=5, dtype=torch.float64)
    assert layer.spec.in_padded > 37 and layer.spec.out_padded > 53
    w = layer.to_dense()
    assert w.shape == (53, 37)
    assert rel_err(w, linear_weight_of(layer)) < 1e-12
    for lead in [(), (4,), (2, 3)]:
        x = torch.randn(*lead, 37, dtype=torch.float64)
        y = layer(x)
        assert y.shape == (*lead, 53)
        assert rel_err(y, F.linear(x, linear_weight_of(layer), layer.bias)) < 1e-12


@given(ranks=st.lists(st.integers(1, 300), min_size=1, max_size=6))
def test_gemm_ranks_pad_little_and_only_inner_bonds(ranks):
    from comera_compile.tt import gemm_ranks

    full = (1, *ranks, 1)
    padded = gemm_ranks(full)
    assert padded[0] == padded[-1] == 1 and len(padded) == len(full)
    for r, p in zip(ranks, padded[1:-1]):
        assert p == r or (p % 16 == 0 and r < p <= r + max(4, r // 8))
    assert gemm_ranks(full, multiple=1) == full


def test_ttlinear_rank_padding_is_exact_in_forward_and_gradients():
    """Ranks 30 run as 32 (zero slices in the cores): output and every gradient equal the dense layer's,
    in float64, and the gradients keep the cores' own shapes (gradcheck on the padded path)."""
    torch.manual_seed(0)
    layer = TTLinear(96, 120, rank=30, dtype=torch.float64)
    assert layer.spec.ranks[1:-1] != layer.gemm_spec.ranks[1:-1]
    perturb_gates(layer, torch.Generator().manual_seed(1))
    x = torch.randn(5, 96, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    w = linear_weight_of(layer)
    assert rel_err(y, F.linear(x, w, layer.bias)) < 1e-12
    (y * torch.randn_like(y)).sum().backward()
    assert all(c.grad.shape == c.shape for c in layer.cores)
    f, names, params = _functional(layer)
    xs = torch.randn(2, 96, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(f, (xs, *params), fast_mode=True)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_autocast_gives_the_dtypes_of_the_layers_replaced(compiled):
    """Under CPU autocast to bfloat16 nn.Linear computes in bfloat16 and nn.Embedding(Bag) in float32: the
    TT layers built from them follow, and stay close to them."""
    torch.manual_seed(0)
    pairs = []
    for bias in (True, False):
        dense = nn.Linear(64, 48, bias=bias)
        pairs.append((dense, TTLinear.from_dense(dense.weight, dense.bias, rank=64), torch.randn(5, 64)))
    emb = nn.Embedding(300, 32)
    idx = torch.randint(0, 300, (2, 7))
    pairs.append((emb, TTEmbedding.from_dense(emb.weight, rank=64), idx))
    bag = nn.EmbeddingBag(300, 32, mode="sum")
    pairs.append((bag, TTEmbeddingBag.from_dense(bag.weight, mode="sum", rank=64), idx))
    for dense, tt, x in pairs:
        run = torch.compile(tt, backend="comera", fullgraph=True) if compiled else tt
        with torch.autocast("cpu", torch.bfloat16):
            want, got = dense(x), run(x)
        assert got.dtype == want.dtype, (type(tt).__name__, got.dtype, want.dtype)
        tol = 3e-2 if want.dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())
    torch._dynamo.reset()


def test_exporting_is_true_under_torch_export_only():
    """TT layers choose one plan for every row count only when torch.export traces them: layers.exporting()
    reads True there, and False eagerly and under torch.compile (whose dynamo on torch 2.11/2.12 folds
    torch.compiler.is_exporting() to True)."""
    from comera_compile.layers import exporting

    class Probe(nn.Module):
        def forward(self, x):
            return x + float(exporting())

    x = torch.zeros(2)
    assert Probe()(x).tolist() == [0.0, 0.0]
    assert torch.compile(Probe(), backend="eager", fullgraph=True)(x).tolist() == [0.0, 0.0]
    assert torch.export.export(Probe(), (x,)).module()(x).tolist() == [1.0, 1.0]
    torch._dynamo.reset()


def test_weight_under_autocast_is_the_cores_dtype_as_a_dense_layers_parameter():
    """Code that reads ``layer.weight`` inside a bfloat16 autocast region (a tied head, T5's dtype check) gets
    the float32 matrix a dense layer's parameter would be, equal to the float64 product of the cores to
    float32 rounding; autocast had rounded it to bfloat16 (relative error ~4e-3)."""
    torch.manual_seed(0)
    linear, table = TTLinear(48, 40, rank=6), TTEmbedding(60, 24, rank=6)
    want_w = linear_weight_of(copy.deepcopy(linear).double())
    want_t = embedding_table_of(copy.deepcopy(table).double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_w, got_t = linear.weight, table.weight
    assert got_w.dtype == got_t.dtype == torch.float32
    assert rel_err(got_w.double(), want_w) < 1e-6 and rel_err(got_t.double(), want_t) < 1e-6
