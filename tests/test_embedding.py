"""Tests of the fast TT embedding lookup (distinct rows, planned core merging), TTEmbeddingBag, the
EmbeddingBag rewrite of tensorize, the no-dense-table guarantee and the DLRM example (the lookup planner's
choices are each checked against the dense table).

References are computed another way than the code under test: the dense table from to_dense() (itself
checked against an independent reconstruction in test_layers.py) through F.embedding / F.embedding_bag, in
float64; nn.Embedding / nn.EmbeddingBag for errors; torch.autograd.gradcheck.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import comera_compile as cc
from comera_compile import networks as nw
from comera_compile.embedding import TTEmbedding, TTEmbeddingBag
from helpers import FULL, LargestAllocation, perturb_gates, rel_err

pytestmark = pytest.mark.usefixtures("single_thread")

def grads_vs_dense(layer: TTEmbedding, out: torch.Tensor, ref_fn) -> float:
    """Largest relative error of the core and gate gradients of sum(out * w) against the same loss on the
    dense table rebuilt by to_dense() (ref_fn maps the table to the reference output)."""
    w = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(7))
    params = list(layer.cores) + list(layer.gates)
    got = torch.autograd.grad((out * w).sum(), params, allow_unused=True)
    want = torch.autograd.grad((ref_fn(layer.to_dense()) * w).sum(), params, allow_unused=True)
    errs = []
    for g, r in zip(got, want):
        g = torch.zeros_like(params[0]) if g is None and r is None else g
        if r is None or float(r.norm()) == 0:
            errs.append(0.0 if g is None else float(g.abs().max()))
        else:
            errs.append(rel_err(g, r))
    return max(errs)


def layer64(vocab, dim, d, rank, padding_idx=None, cls=TTEmbedding, **kw) -> TTEmbedding:
    torch.manual_seed(vocab * 31 + dim)
    layer = cls(vocab, dim, padding_idx=padding_idx, rank=rank, d=d, dtype=torch.float64, **kw)
    perturb_gates(layer)
    return layer


# ---------------------------------------------------------------------------------------------------------
# Lookups and gradients against the dense table


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(vocab=st.integers(1, 3000), dim=st.integers(1, 40), d=st.integers(1, 4), rank=st.integers(1, 6),
       n=st.integers(0, 300), distinct=st.integers(1, 50), lead=st.sampled_from(["flat", "2d"]),
       use_padding=st.booleans(), int32=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_lookup_and_gradients_match_dense_table(vocab, dim, d, rank, n, distinct, lead, use_padding, int32, seed):
    g = torch.Generator().manual_seed(seed)
    padding_idx = int(torch.randint(0, vocab, (1,), generator=g)) if use_padding else None
    layer = layer64(vocab, dim, d, rank, padding_idx)
    pool = torch.randint(0, vocab, (distinct,), generator=g)  # few distinct ids: many repeats
    idx = pool[torch.randint(0, distinct, (n,), generator=g)]
    if padding_idx is not None and n:
        idx[0] = padding_idx
    if lead == "2d" and n % 2 == 0:
        idx = idx.reshape(2, n // 2)
    if int32:
        idx = idx.int()
    out = layer(idx)
    assert out.shape == (*idx.shape, dim) and out.dtype == torch.float64
    ref = F.embedding(idx, layer.to_dense())
    assert rel_err(out, ref) < 1e-10 or float(ref.norm()) == float(out.norm()) == 0
    if padding_idx is not None:
        assert torch.all(out[idx == padding_idx] == 0)
    assert grads_vs_dense(layer, layer(idx), lambda w: F.embedding(idx, w)) < 1e-10


SPECS = [
    dict(vocab=30522, dim=48, row_modes=(16, 20, 10, 10), col_modes=(2, 2, 4, 3), rank=5),
    dict(vocab=997, dim=30, row_modes=(10, 10, 10), col_modes=(2, 3, 5), rank=4),
    dict(vocab=50, dim=8, row_modes=(5, 10), col_modes=(2, 4), rank=3),
    dict(vocab=4096, dim=16, row_modes=(4, 4, 4, 4, 4, 4), col_modes=(2, 2, 2, 2, 1, 1), rank=3),
]


@pytest.mark.parametrize("cfg", SPECS, ids=lambda c: f"{c['vocab']}x{c['dim']}")
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_every_candidate_plan_matches_dense_table(cfg, rows):
    # Whatever the planner picks, every grouping and every way of running a pair must be exact.
    torch.manual_seed(0)
    layer = TTEmbedding(cfg["vocab"], cfg["dim"], rank=cfg["rank"], row_modes=cfg["row_modes"],
                        col_modes=cfg["col_modes"], dtype=torch.float64)
    perturb_gates(layer)
    idx = torch.randint(0, cfg["vocab"], (rows,))
    candidates = nw.lookup._lookup_candidates(layer.spec, rows, True, True)
    hows = {how for c in candidates for _, _, how in c.groups}
    # a two-core table would be the dense table itself: only offered when it merges part of the cores
    assert hows == ({"rows", "table", "dedupe"} if len(cfg["row_modes"]) > 2 else {"rows", "dedupe"})
    for plan in candidates:
        out = layer._rows(idx, plan.groups, plan.program)
        assert rel_err(out, layer.to_dense().index_select(0, idx).detach()) < 1e-10, plan.describe()
        err = grads_vs_dense(layer, out, lambda w: w.index_select(0, idx))
        assert err < 1e-10, plan.describe()


def test_pair_products_in_chunks_gradcheck(monkeypatch):
    from comera_compile.embedding import _PairRows

    monkeypatch.setattr(_PairRows, "CHUNK_ELEMENTS", 7)  # one row per chunk: every chunk boundary exercised
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(6, 4, 2, dtype=torch.float64, generator=g, requires_grad=True)
    ia, ib = torch.tensor([0, 4, 4, 1, 0]), torch.tensor([5, 5, 0, 2, 5])
    ref = torch.bmm(a.detach()[ia], b.detach()[ib])
    assert torch.allclose(_PairRows.apply(a, b, ia, ib), ref, rtol=0, atol=1e-14)
    assert torch.autograd.gradcheck(lambda x, y: _PairRows.apply(x, y, ia, ib), (a, b))



def test_pair_products_backward_inside_autocast_matches_float64(monkeypatch):
    """A backward called inside a bf16 autocast region (``with autocast: loss.backward()``) adds the
    cores' gradients in their own dtype, as the forward computed them: it used to fail in index_add_."""
    from comera_compile.embedding import _PairRows

    monkeypatch.setattr(_PairRows, "CHUNK_ELEMENTS", 20)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(5, 3, 4, generator=g, requires_grad=True)
    b = torch.randn(6, 4, 2, generator=g, requires_grad=True)
    ia, ib = torch.tensor([0, 4, 4, 1, 0, 3]), torch.tensor([5, 5, 0, 2, 5, 1])
    w = torch.randn(6, 3, 2, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (_PairRows.apply(a, b, ia, ib) * w).sum().backward()
    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    (torch.bmm(a64[ia], b64[ib]) * w.double()).sum().backward()
    assert a.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    assert rel_err(a.grad, a64.grad) < 1e-6 and rel_err(b.grad, b64.grad) < 1e-6

def test_gradcheck_lookup_with_repeats_and_padding():
    layer = layer64(40, 6, 3, 3, padding_idx=5)
    names = [n for n, _ in layer.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_(True) for p in layer.parameters())
    idx = torch.tensor([[5, 1, 1, 39], [7, 7, 7, 0]])

    def f(*p):
        return torch.func.functional_call(layer, dict(zip(names, p)), (idx,))

    assert torch.autograd.gradcheck(f, params)


@pytest.mark.parametrize("shape", [(0,), (3, 0)])
def test_empty_batch_matches_nn_embedding(shape):
    layer = layer64(100, 5, 2, 3, padding_idx=2)
    idx = torch.zeros(shape, dtype=torch.long)
    out = layer(idx)
    assert out.shape == nn.Embedding(100, 5)(idx).shape
    out.sum().backward()
    assert all(c.grad is not None and not c.grad.any() for c in layer.cores)


@pytest.mark.parametrize("bad", [100, 127, 128, 10**6, -1, -100])
def test_out_of_range_gives_nn_embedding_error(bad):
    layer = TTEmbedding(100, 5, rank=3, row_modes=(8, 16), col_modes=(5, 1))  # 128 rows internally
    idx = torch.tensor([[0, 5], [bad, 1]])
    with pytest.raises(IndexError) as want:
        nn.Embedding(100, 5)(idx)
    with pytest.raises(IndexError) as got:
        layer(idx)
    assert str(got.value) == str(want.value)


def test_float_indices_rejected():
    with pytest.raises(TypeError, match="integer indices"):
        TTEmbeddingBag(10, 4, rank=2)(torch.tensor([1.0]))


# ---------------------------------------------------------------------------------------------------------
# TTEmbeddingBag against F.embedding_bag on the dense table


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(["sum", "mean", "max"]), vocab=st.integers(2, 2000), dim=st.integers(1, 24),
       d=st.integers(1, 3), bags=st.integers(0, 12), use_padding=st.booleans(), weights=st.booleans(),
       last=st.booleans(), form=st.sampled_from(["offsets", "2d"]), seed=st.integers(0, 2**31 - 1))
def test_embedding_bag_matches_dense(mode, vocab, dim, d, bags, use_padding, weights, last, form, seed):
    g = torch.Generator().manual_seed(seed)
    padding_idx = int(torch.randint(0, vocab, (1,), generator=g)) if use_padding else None
    layer = layer64(vocab, dim, d, 3, padding_idx, cls=TTEmbeddingBag, mode=mode,
                    include_last_offset=last and form == "offsets")
    pool = torch.randint(0, vocab, (5,), generator=g)
    if form == "offsets":
        sizes = torch.randint(0, 5, (bags,), generator=g)  # empty bags included
        n = int(sizes.sum())
        inp = pool[torch.randint(0, 5, (n,), generator=g)]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
        if not layer.include_last_offset:
            offsets = offsets[:-1]
    else:
        inp = pool[torch.randint(0, 5, (bags, 3), generator=g)]
        offsets = None
    if padding_idx is not None and inp.numel():
        inp.view(-1)[0] = padding_idx
    psw = torch.rand(inp.shape, generator=g, dtype=torch.float64) if weights and mode == "sum" else None

    def ref(w):
        return F.embedding_bag(inp, w, offsets, mode=mode, per_sample_weights=psw,
                               include_last_offset=layer.include_last_offset, padding_idx=padding_idx)

    out = layer(inp, offsets, psw)
    want = ref(layer.to_dense())
    assert out.shape == want.shape
    assert rel_err(out, want) < 1e-10 or float(want.norm()) == float(out.norm()) == 0
    assert grads_vs_dense(layer, layer(inp, offsets, psw), ref) < 1e-10


def test_embedding_bag_gradcheck_per_sample_weights():
    layer = layer64(30, 4, 2, 2, padding_idx=3, cls=TTEmbeddingBag, mode="sum")
    names = [n for n, _ in layer.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_(True) for p in layer.parameters())
    inp, off = torch.tensor([3, 1, 1, 29, 7, 7]), torch.tensor([0, 2, 2])
    psw = torch.rand(6, dtype=torch.float64, requires_grad=True)

    def f(w, *p):
        return torch.func.functional_call(layer, dict(zip(names, p)), (inp, off, w))

    assert torch.autograd.gradcheck(f, (psw, *params))


def test_embedding_bag_errors_mirror_nn_embedding_bag():
    ref, tt = nn.EmbeddingBag(100, 4, mode="sum"), TTEmbeddingBag(100, 4, mode="sum", rank=3)
    for inp, off in [(torch.tensor([1, 100]), torch.tensor([0])), (torch.tensor([-1, 2]), torch.tensor([0]))]:
        with pytest.raises(RuntimeError) as want:
            ref(inp, off)
        with pytest.raises(RuntimeError) as got:  # also an IndexError, as TTEmbedding raises
            tt(inp, off)
        assert isinstance(got.value, IndexError) and str(got.value) == str(want.value)
    for inp, off, psw in [(torch.tensor([1, 2]), torch.tensor([1]), None),      # offsets must start at 0
                          (torch.tensor([[1, 2]]), torch.tensor([0]), None),     # 2-D input takes no offsets
                          (torch.tensor([1, 2]), None, None)]:                   # 1-D input needs offsets
        with pytest.raises((RuntimeError, ValueError)) as want:
            ref(inp, off, psw)
        with pytest.raises(type(want.value)):
            tt(inp, off, psw)
    with pytest.raises(NotImplementedError):
        TTEmbeddingBag(10, 4, mode="mean", rank=2)(torch.tensor([1]), torch.tensor([0]), torch.ones(1))
    with pytest.raises(ValueError, match="mode must be one of"):
        TTEmbeddingBag(10, 4, mode="median")


# ---------------------------------------------------------------------------------------------------------
# tensorize rewrites nn.EmbeddingBag


class _Recommender(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.users = nn.EmbeddingBag(1000, 64, mode="sum", padding_idx=0)
        self.items = nn.EmbeddingBag(500, 64, mode="mean")
        self.tags = nn.EmbeddingBag(300, 64, mode="max", include_last_offset=True)
        self.lookup = nn.Embedding(200, 64)

    def forward(self, u, uo, w, i, t, to, e):
        return self.users(u, uo, per_sample_weights=w) + self.items(i) + self.tags(t, to) + self.lookup(e)


def _recommender_inputs():
    g = torch.Generator().manual_seed(0)
    u, uo = torch.randint(0, 1000, (9,), generator=g), torch.tensor([0, 4, 4])
    w = torch.rand(9, generator=g, dtype=torch.float64)
    i = torch.randint(0, 500, (3, 2), generator=g)
    t, to = torch.randint(0, 300, (7,), generator=g), torch.tensor([0, 1, 5, 7])
    e = torch.randint(0, 200, (3,), generator=g)
    return u, uo, w, i, t, to, e


@pytest.mark.parametrize("trace", [True, False])
def test_tensorize_rewrites_embedding_bags_exactly_at_full_rank(trace):
    torch.manual_seed(0)
    model = _Recommender().double()
    tt = cc.tensorize(model, rank=FULL, init="svd", trace=trace)
    for name, mode in (("users", "sum"), ("items", "mean"), ("tags", "max")):
        layer = tt.get_submodule(name)
        assert isinstance(layer, TTEmbeddingBag) and layer.mode == mode
        assert "TTEmbeddingBag" in tt.comera_summary.rewritten[name]
    assert tt.tags.include_last_offset and tt.users.padding_idx == 0
    args = _recommender_inputs()
    assert rel_err(tt(*args), model(*args)) < 1e-10


def test_tensorize_keeps_unsupported_bags_dense_and_says_why():
    model = nn.Sequential()
    model.add_module("sparse", nn.EmbeddingBag(1000, 64, sparse=True))
    before = copy.deepcopy(model.state_dict())
    with pytest.warns(UserWarning, match=r"kept 1 embedding\(s\) dense whose nn.Embedding options .*"
                                         r"\(sparse \(sparse\)\)"):
        tt = cc.tensorize(model)
    assert "sparse" in tt.comera_summary.kept_dense["sparse"]
    with pytest.raises(cc.TensorizeError, match="EmbeddingBag options"):
        cc.tensorize(model, include="sparse")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ---------------------------------------------------------------------------------------------------------
# Never a dense table


@pytest.mark.parametrize("cls", [TTEmbedding, TTEmbeddingBag])
def test_no_table_sized_tensor_is_ever_allocated(cls):
    vocab, dim = 10**6, 128
    torch.manual_seed(0)
    layer = cls(vocab, dim, rank=16, row_modes=(100, 100, 100), col_modes=(8, 4, 4))
    opt = torch.optim.AdamW(layer.parameters())
    g = torch.Generator().manual_seed(0)
    table_bytes = vocab * dim * 4
    for n in (1, 64, 4096, 20000):  # the plan changes with the batch: rows, dedupe, merged tables
        idx = torch.randint(0, vocab, (n,), generator=g)
        with LargestAllocation() as mode:
            out = layer(idx) if cls is TTEmbedding else layer(idx.reshape(n, 1))
            out.square().mean().backward()
            opt.step()
            opt.zero_grad()
        # The largest tensor of a step is of the batch's size (a few times its output) or a merged-pair
        # table, never of the table's (512 MB).
        assert mode.largest <= max(4 * n * dim * 4, 16 * 2**20), (n, mode.what)
        assert mode.largest < table_bytes / 10, (n, mode.what)


# ---------------------------------------------------------------------------------------------------------
# The planner


def test_planner_merges_pairs_for_big_batches_and_gathers_rows_for_small_ones():
    spec = cc.make_spec("ttm", 30522, 768, 32, (16, 20, 10, 10), (4, 4, 8, 6))
    small, big = nw.plan_ttm_lookup(spec, 1), nw.plan_ttm_lookup(spec, 4096)
    assert {how for _, _, how in big.groups} == {"table"}  # 320- and 100-row merged tables
    assert "table" not in {how for _, _, how in small.groups}
    # forward FLOPs of the merged-table plan, counted by hand: two table GEMMs and one batched product
    tables = 2 * (16 * 20) * (1 * 4 * 32) * (4 * 32) + 2 * (10 * 10) * (32 * 8 * 32) * (6 * 1)
    assert big.flops == tables + 2 * 4096 * 16 * 32 * 48


def test_planner_never_merges_all_cores_into_one_table():
    spec = cc.make_spec("ttm", 100, 8, 50, (10, 10), (2, 4))
    for rows in (1, 100, 10**6):
        for plan in nw.lookup._lookup_candidates(spec, rows, True, True):
            assert plan.groups != ((0, 2, "table"),)


def test_compile_path_needs_no_unique_and_matches_eager():
    layer = layer64(500, 12, 3, 3, padding_idx=4, cls=TTEmbeddingBag, mode="mean")
    inp, off = torch.tensor([4, 1, 1, 499, 7, 7, 7]), torch.tensor([0, 3, 3])
    eager = layer(inp, off)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert rel_err(compiled(inp, off), eager) < 1e-12
    emb = layer64(500, 12, 3, 3, padding_idx=4)
    assert rel_err(torch.compile(emb, backend="aot_eager", fullgraph=True)(inp), emb(inp)) < 1e-12


def test_plans_are_cached_per_bucket():
    spec = cc.make_spec("ttm", 5000, 32, 4, (50, 100), (4, 8))
    assert nw.lookup_bucket(1000) == nw.lookup_bucket(1010) >= 1010
    assert nw.lookup_bucket(5) == 5
    assert all(nw.lookup_bucket(n) >= n for n in range(1, 5000, 37))
    assert nw.lookup_bucket(4000) < 1.5 * 4000
    assert nw.plan_ttm_lookup(spec, 1024) is nw.plan_ttm_lookup(spec, 1024)
    assert math.isfinite(nw.plan_ttm_lookup(spec, 1024).cost)


# ---------------------------------------------------------------------------------------------------------
# The DLRM example


def test_auc_matches_pair_counting():
    from comera_compile.examples.dlrm import auc

    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (200,), generator=g).double()  # many ties
    labels = torch.rand(200, generator=g) < 0.3
    pos, neg = scores[labels], scores[~labels]
    wins = (pos[:, None] > neg[None, :]).double() + 0.5 * (pos[:, None] == neg[None, :]).double()
    assert abs(auc(scores, labels.float()) - float(wins.mean())) < 1e-12


def test_dlrm_example_smoke():
    from comera_compile.examples import dlrm

    r = dlrm.run(steps=6, batch=64, tables=3, smallest=100, largest=30_000, dim=8, rank=4, eval_samples=2000,
                 progress=False)
    sizes = dlrm.table_sizes(3, 100, 30_000)
    assert r["tt_tables"] == [k for k, n in enumerate(sizes) if n >= dlrm.TT_MIN_ROWS] == [2]
    assert r["embedding_params_dense"] == sum(sizes) * 8
    assert r["compression"] > 1 and r["peak_memory_ratio"] > 1
    for key in ("dense_auc", "tt_auc", "teacher_auc", "dense_logloss", "tt_logloss", "dense_step_ms", "tt_step_ms"):
        assert math.isfinite(r[key]), key
    assert 0.5 < r["teacher_auc"] <= 1


class _Lookup(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, idx):
        return self.layer(idx)


@pytest.mark.parametrize("bag", [False, True], ids=["embedding", "bag"])
def test_out_of_range_indices_raise_eager_compiled_and_exported(bag):
    """Eager raises nn.Embedding's IndexError; compiled and exported programs raise at run time as a compiled
    nn.Embedding does (RuntimeError), never a wrapped-around row."""
    torch.manual_seed(0)
    layer = TTEmbeddingBag(256, 16, mode="sum", rank=4) if bag else TTEmbedding(256, 16, rank=4)
    good = torch.tensor([[0, 5, 255]])
    compiled = torch.compile(_Lookup(layer), backend="comera", fullgraph=True)
    exported = torch.export.export(_Lookup(layer), (good,)).module()
    for run in (compiled, exported):
        torch.testing.assert_close(run(good), layer(good))
    for bad in (256, -1, 300):
        idx = torch.tensor([[0, bad, 7]])
        with pytest.raises(IndexError):
            layer(idx)
        for run in (compiled, exported):
            with pytest.raises(RuntimeError, match="index out of range"):
                run(idx)
    torch._dynamo.reset()


@pytest.mark.parametrize("cls", [TTEmbedding, TTEmbeddingBag], ids=["embedding", "bag"])
def test_compiled_fullgraph_serves_every_batch_size(cls):
    torch.manual_seed(0)
    layer = cls(1000, 32, rank=8)
    run = torch.compile(layer, backend="comera", fullgraph=True)
    for n in (5, 9, 17, 33):  # the second size makes dynamo recompile with a symbolic batch
        idx = torch.randint(0, 1000, (2, n))
        torch.testing.assert_close(run(idx), layer(idx))
    torch._dynamo.reset()


class _Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(500, 64)
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64)

    def forward(self, ids):
        return self.down(torch.relu(self.up(self.emb(ids).mean(1))))


@pytest.mark.parametrize("strict", [False, True])
def test_tensorized_model_exports_with_a_dynamic_batch_from_1_to_4096(strict):
    """torch.export, non-strict (the default) and strict (dynamo traces the model: it failed on the TT
    linear's contraction planner, whose caches dynamo cannot enter)."""
    torch.manual_seed(0)
    model = cc.tensorize(_Tower(), rank=8, min_features=1).eval()
    batch = torch.export.Dim("batch", min=1, max=4096)
    program = torch.export.export(model, (torch.randint(0, 500, (8, 7)),), dynamic_shapes={"ids": {0: batch}},
                                  strict=strict)
    exported = program.module()
    for n in (1, 3, 64, 4096):
        ids = torch.randint(0, 500, (n, 7))
        torch.testing.assert_close(exported(ids), model(ids), rtol=1e-5, atol=1e-6)


def test_a_padding_row_that_is_not_zero_reads_as_the_dense_table_s_in_every_mode():
    """nn.Embedding returns the stored padding row (only its gradient is zero), and a pretrained table's is
    often not zero: at full rank the TT embedding gives the dense model's rows and gradients (float64) eager,
    compiled by "comera" and exported; densify and .weight give the table back."""
    torch.manual_seed(0)
    dense = nn.Embedding(96, 16, padding_idx=3).double()
    with torch.no_grad():
        dense.weight[3] = torch.randn(16, dtype=torch.float64)
    tt = TTEmbedding.from_dense(dense.weight, 3, rank=FULL)
    ids = torch.tensor([[3, 0, 5, 3, 95]])
    compiled = torch.compile(_Lookup(tt), backend="comera", fullgraph=True)
    exported = torch.export.export(_Lookup(tt), (ids,)).module()
    for run in (tt, compiled, exported):
        torch.testing.assert_close(run(ids), dense(ids), rtol=1e-10, atol=1e-10)
    # the cores' gradients: the dense table's (F.embedding gives its padding row none)
    assert grads_vs_dense(tt, tt(ids), lambda table: F.embedding(ids, table, 3)) < 1e-10
    torch.testing.assert_close(tt.weight, dense.weight, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(cc.densify(tt).weight, dense.weight, rtol=1e-10, atol=1e-10)
    torch._dynamo.reset()


@pytest.mark.parametrize("saved", ["layer without padding_idx", "no version"])
def test_a_state_dict_without_the_padding_row_keeps_the_row_the_saved_layer_read(saved):
    """Loaded into a layer with padding_idx, a state_dict saved without padding_row (by a layer without
    padding_idx) reads that row as the saved layer did, from its cores, as nn.Embedding keeps a loaded
    table's row (it was zeroed); where the state_dict carries no version (an older checkpoint, or a format
    that drops torch's metadata) it may come from a padding layer that read zeros, which a warning says."""
    torch.manual_seed(0)
    dense = torch.randn(96, 16, dtype=torch.float64)
    state = nn.ModuleDict({"emb": TTEmbedding.from_dense(dense, rank=FULL)}).state_dict()
    if saved == "no version":
        state = dict(state)   # torch's metadata is the OrderedDict's attribute
    loaded = nn.ModuleDict({"emb": TTEmbedding(96, 16, 3, rank=FULL, dtype=torch.float64)})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loaded.load_state_dict(state)   # strict
    said = [str(w.message) for w in seen if "padding_row" in str(w.message)]
    assert len(said) == (1 if saved == "no version" else 0)
    ids = torch.tensor([3, 0, 95])
    torch.testing.assert_close(loaded["emb"](ids), dense[ids], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("cls", [TTEmbedding, TTEmbeddingBag], ids=["embedding", "bag"])
def test_lookups_on_the_meta_device_give_nn_embedding_s_shapes(cls):
    with torch.device("meta"):
        layer, ref = cls(100, 16, padding_idx=1, rank=4), (nn.EmbeddingBag if cls is TTEmbeddingBag else
                                                            nn.Embedding)(100, 16, padding_idx=1)
        ids = torch.zeros(3, 4, dtype=torch.long)
        out = layer(ids)
        assert out.is_meta and out.shape == ref(ids).shape


def test_code_that_reads_an_embedding_s_weight_reads_the_table():
    """``emb.weight`` (a tied head written as h @ emb.weight.t(), a check of its device): the dense table the
    cores represent, differentiable into the cores."""
    torch.manual_seed(0)
    dense = nn.Embedding(64, 16).double()
    tt = cc.tensorize(nn.Sequential(dense), rank=FULL, init="svd", min_features=1)[0]
    h = torch.randn(5, 16, dtype=torch.float64)
    torch.testing.assert_close(h @ tt.weight.t(), h @ dense.weight.t(), rtol=1e-10, atol=1e-10)
    (h @ tt.weight.t()).sum().backward()
    assert all(c.grad is not None and c.grad.abs().sum() > 0 for c in tt.cores)


@pytest.mark.parametrize("ids", [3, 400], ids=["rows", "dedupe"])
def test_second_order_gradients_through_the_row_products_match_the_dense_tables(ids):
    """A gradient penalty (create_graph=True) through a lookup whose plan multiplies cores per row, as for a
    large vocabulary and few ids: the cores' gradients of the penalty match those of the same penalty computed
    on the dense table the cores make (float64), as nn.Embedding supports."""
    torch.manual_seed(0)
    emb = TTEmbedding(10**6, 8, rank=3, d=3, dtype=torch.float64)
    idx = torch.randint(0, 10**6, (ids,))
    assert {g.how for g in emb.plan(torch.unique(idx).numel()).groups} & {"rows", "dedupe"}
    cores = list(emb.cores)

    def penalty(lookup):
        grads = torch.autograd.grad(lookup().square().sum(), cores, create_graph=True)
        return torch.autograd.grad(sum(g.square().sum() for g in grads), cores)

    got = penalty(lambda: emb(idx))
    want = penalty(lambda: F.embedding(idx, emb.to_dense()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("vocab, ids", [(256, 200), (10**6, 3)], ids=["table", "rows"])
def test_core_gradients_have_the_cores_own_strides(vocab, ids):
    """DDP's gradient layout contract: each core's .grad has the core's strides (a first core of rank 1 got
    another stride on its size-1 dimension, which DDP warns of at every build and copies at every step)."""
    torch.manual_seed(0)
    for layer in (TTEmbedding(vocab, 64, rank=8, d=3), TTEmbeddingBag(vocab, 64, rank=8, d=3)):
        layer(torch.randint(0, vocab, (ids,)).view(1, -1) if isinstance(layer, TTEmbeddingBag)
              else torch.randint(0, vocab, (ids,))).sum().backward()
        assert [p.grad.stride() for p in layer.parameters()] == [p.stride() for p in layer.parameters()]
