"""Tests of the TT format helpers in comera_compile.tt: mode choice, specs (ranks, parameter counts,
errors) and TT-SVD.

References are computed independently in the tests (explicit products, einsum, SVDs of unfoldings),
never taken from the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from comera_compile import tt
from helpers import rel_err


pytestmark = pytest.mark.usefixtures("single_thread")


def max_ranks_of(sizes) -> list[int]:
    """Largest meaningful rank of each bond, boundary 1s included: min of the products on either side."""
    out = [1]
    for k in range(1, len(sizes)):
        out.append(min(math.prod(sizes[:k]), math.prod(sizes[k:])))
    out.append(1)
    return out


def unfolding_tail_errors(tensor: torch.Tensor, ranks) -> list[float]:
    """eps_k: the error of the best rank-r_k approximation of the k-th unfolding (n_1..n_k) x (rest)."""
    sizes = tensor.shape
    eps = []
    for k in range(1, tensor.dim()):
        s = torch.linalg.svdvals(tensor.reshape(math.prod(sizes[:k]), -1))
        eps.append(float(s[ranks[k]:].square().sum().sqrt()))
    return eps


# ---------------------------------------------------------------------------------------------------------
# choose_modes / balanced_factors


@pytest.mark.parametrize("n, d, expected", [(768, 3, (12, 8, 8)), (3072, 3, (16, 16, 12))])
def test_choose_modes_known_sizes(n, d, expected):
    assert tt.choose_modes(n, d) == expected


@pytest.mark.parametrize("n", [30522, 4093, 65537])
@pytest.mark.parametrize("d", [3, 4])
def test_choose_modes_pads_awkward_sizes(n, d):
    # 30522 = 2 * 3 * 5087 and the primes have no balanced factorization: the size must be padded up to one
    # whose factors are all close to the d-th root.
    modes = tt.choose_modes(n, d)
    prod = math.prod(modes)
    assert len(modes) == d
    assert prod > n
    assert max(modes) <= 1.5 * prod ** (1.0 / d)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 100_000), d=st.integers(1, 4))
def test_choose_modes_property(n, d):
    modes = tt.choose_modes(n, d)
    assert len(modes) == d
    assert all(isinstance(m, int) and m >= 1 for m in modes)
    assert list(modes) == sorted(modes, reverse=True)
    prod = math.prod(modes)
    assert n <= prod <= 2 * n + 8


def test_choose_modes_rejects_nonpositive():
    with pytest.raises(ValueError, match="size 0"):
        tt.choose_modes(0, 3)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 5000), d=st.integers(1, 4))
def test_balanced_factors_is_an_exact_and_most_balanced_split(n, d):
    factors = tt.balanced_factors(n, d)
    assert len(factors) == d and math.prod(factors) == n
    # independent check of "smallest largest factor": no factor f < max(factors) of n can be the largest
    # factor of a d-way split, i.e. n / f must not split into d-1 factors all <= f.
    def splits(m, parts, cap):
        if parts == 0:
            return m == 1
        return any(m % f == 0 and splits(m // f, parts - 1, f) for f in range(min(m, cap), 0, -1))
    best = min(f for f in range(1, n + 1) if n % f == 0 and splits(n // f, d - 1, f))
    assert max(factors) == best


def _smallest_largest_factor(n: int, d: int) -> int:
    """Brute force: the smallest f that is the largest factor of some split of n into d factors."""
    def splits(m, parts, cap):
        if parts == 0:
            return m == 1
        return any(m % f == 0 and splits(m // f, parts - 1, f) for f in range(min(m, cap), 0, -1))
    return min(f for f in range(1, n + 1) if n % f == 0 and splits(n // f, d - 1, f))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 3000), d=st.integers(2, 4))
def test_choose_modes_splits_a_balanced_enough_size_as_it_is_and_pads_the_rest(n, d):
    """A size whose best split's largest factor is at most twice its d-th root is split without padding
    (padding costs more time than that imbalance); any other is padded to the first size whose best split
    is within 1.5x of its root."""
    modes = tt.choose_modes(n, d)
    if _smallest_largest_factor(n, d) <= 2.0 * n ** (1.0 / d):
        assert math.prod(modes) == n and max(modes) == _smallest_largest_factor(n, d)
        return
    first = next((m for m in range(n + 1, 2 * n + 9)
                  if _smallest_largest_factor(m, d) <= math.floor(1.5 * m ** (1.0 / d))), None)
    if first is not None:
        assert math.prod(modes) == first and max(modes) == _smallest_largest_factor(first, d)


@pytest.mark.parametrize("d", [2, 3, 4])
def test_choose_modes_never_pads_a_power_of_two(d):
    for k in range(1, 25):
        assert math.prod(tt.choose_modes(2 ** k, d)) == 2 ** k


@pytest.mark.parametrize("n", [10_000_019, 39_884_406])
def test_choose_modes_of_a_large_awkward_table(n):
    """Embedding tables of tens of millions of rows that do not factor well (a prime; Criteo's largest):
    padded to a balanced size (this took minutes when every integer below n was tried as a factor)."""
    modes = tt.choose_modes(n, 4)
    prod = math.prod(modes)
    assert n < prod <= n + 1000 and max(modes) <= 1.5 * prod ** 0.25


# ---------------------------------------------------------------------------------------------------------
# make_spec


def test_make_spec_caps_ranks_square():
    spec = tt.make_spec("tt", 768, 768, 30, in_modes=(12, 8, 8), out_modes=(8, 8, 12))
    assert spec.ranks == (1, 12, 30, 30, 30, 12, 1)


def test_make_spec_caps_ranks_rectangular():
    spec = tt.make_spec("tt", 768, 3072, 30, in_modes=(12, 8, 8), out_modes=(12, 16, 16))
    assert spec.ranks == (1, 12, 30, 30, 30, 16, 1)


modes_st = st.lists(st.integers(1, 6), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(in_modes=modes_st, out_modes=modes_st, rank=st.one_of(st.integers(1, 40), st.just(10**9)))
def test_make_spec_tt_ranks_and_params(in_modes, out_modes, rank):
    in_f, out_f = math.prod(in_modes), math.prod(out_modes)
    spec = tt.make_spec("tt", in_f, out_f, rank, in_modes=in_modes, out_modes=out_modes)
    sizes = list(in_modes) + list(out_modes)
    cap = max_ranks_of(sizes)
    expected = [1] + [min(rank, m) for m in cap[1:-1]] + [1]
    assert list(spec.ranks) == expected
    core_params = sum(expected[k] * sizes[k] * expected[k + 1] for k in range(len(sizes)))
    assert spec.core_params() == core_params
    assert spec.num_params() == core_params + sum(expected[1:-1])


@settings(max_examples=60, deadline=None)
@given(data=st.data(), d=st.integers(1, 4), rank=st.one_of(st.integers(1, 40), st.just(10**9)))
def test_make_spec_ttm_ranks_and_params(data, d, rank):
    row_modes = data.draw(st.lists(st.integers(1, 6), min_size=d, max_size=d))
    col_modes = data.draw(st.lists(st.integers(1, 6), min_size=d, max_size=d))
    spec = tt.make_spec("ttm", math.prod(row_modes), math.prod(col_modes), rank,
                        in_modes=row_modes, out_modes=col_modes)
    sizes = [v * e for v, e in zip(row_modes, col_modes)]
    cap = max_ranks_of(sizes)
    expected = [1] + [min(rank, m) for m in cap[1:-1]] + [1]
    assert list(spec.ranks) == expected
    assert spec.core_params() == sum(expected[k] * sizes[k] * expected[k + 1] for k in range(d))


def test_make_spec_explicit_rank_list():
    internal = [5, 7, 9, 7, 5]
    spec = tt.make_spec("tt", 768, 768, internal, in_modes=(12, 8, 8), out_modes=(8, 8, 12))
    assert spec.ranks == (1, *internal, 1)
    spec2 = tt.make_spec("tt", 768, 768, [1, *internal, 1], in_modes=(12, 8, 8), out_modes=(8, 8, 12))
    assert spec2.ranks == spec.ranks


def test_make_spec_default_modes_cover_features():
    spec = tt.make_spec("tt", 37, 53, 4)
    assert math.prod(spec.in_modes) >= 37 and math.prod(spec.out_modes) >= 53
    assert len(spec.in_modes) == len(spec.out_modes) == 3


def test_make_spec_refuses_a_d_that_contradicts_the_given_modes():
    with pytest.raises(ValueError, match=r"d=3 modes a side, but in_modes \(8, 8\) has 2"):
        tt.make_spec("tt", 64, 64, 4, in_modes=(8, 8), d=3)
    with pytest.raises(ValueError, match=r"d=3 modes a side, but row_modes \(8, 8\) has 2"):
        tt.make_spec("ttm", 64, 64, 4, in_modes=(8, 8), d=3)
    spec = tt.make_spec("tt", 64, 64, 4, in_modes=(8, 8))   # the given side sets the other's count
    assert spec.out_modes == (8, 8)


@pytest.mark.parametrize("rank", [0, -1, -30])
def test_make_spec_rejects_nonpositive_int_rank(rank):
    with pytest.raises(ValueError, match="positive"):
        tt.make_spec("tt", 768, 768, rank)


@pytest.mark.parametrize("ranks", [[4, 0, 4, 4, 4], [4, 4, -2, 4, 4]])
def test_make_spec_rejects_nonpositive_rank_in_list(ranks):
    with pytest.raises(ValueError, match="must be positive"):
        tt.make_spec("tt", 768, 768, ranks, in_modes=(12, 8, 8), out_modes=(8, 8, 12))


@pytest.mark.parametrize("ranks", [[4, 4], [4] * 4, [4] * 6, [4] * 8])
def test_make_spec_rejects_rank_list_of_wrong_length(ranks):
    # 6 cores -> 5 internal ranks (or 7 with the boundary 1s)
    with pytest.raises(ValueError, match="expected 5 internal ranks"):
        tt.make_spec("tt", 768, 768, ranks, in_modes=(12, 8, 8), out_modes=(8, 8, 12))


def test_make_spec_rejects_rank_above_max():
    # the first bond's largest meaningful rank is 12
    with pytest.raises(ValueError, match=r"rank 13 of bond 1 .*largest meaningful value 12"):
        tt.make_spec("tt", 768, 768, [13, 30, 30, 30, 12], in_modes=(12, 8, 8), out_modes=(8, 8, 12))


@pytest.mark.parametrize("kind, in_modes, out_modes, label, prod", [
    ("tt", (8, 8, 8), None, "in_modes", 512),  # 512 < 768
    ("tt", None, (8, 8, 8), "out_modes", 512),
    ("ttm", (4, 4, 4, 4), None, "in_modes", 256),  # 256 < 768 rows
])
def test_make_spec_rejects_modes_too_small(kind, in_modes, out_modes, label, prod):
    with pytest.raises(ValueError, match=rf"{label} .* multiply to {prod}, fewer than the layer's 768"):
        tt.make_spec(kind, 768, 768, 4, in_modes=in_modes, out_modes=out_modes)


def test_make_spec_rejects_bad_kind_and_features():
    with pytest.raises(ValueError, match="kind"):
        tt.make_spec("cp", 8, 8, 2)
    with pytest.raises(ValueError, match="in_features must be a positive integer"):
        tt.make_spec("tt", 0, 8, 2)
    for bad in (8.0, True, "8", torch.tensor(8.0)):
        with pytest.raises((ValueError, TypeError), match="in_features must be"):
            tt.make_spec("tt", bad, 8, 2)


def test_make_spec_takes_numpy_and_0_d_tensor_sizes_as_nn_linear_does():
    np = pytest.importorskip("numpy")
    want = tt.make_spec("tt", 64, 96, 4)
    for a, b in ((np.int64(64), np.int32(96)), (torch.tensor(64), torch.tensor(96))):
        got = tt.make_spec("tt", a, b, 4)
        assert got == want and type(got.in_features) is int and type(got.out_features) is int
        torch.nn.Linear(a, b)   # the sizes nn.Linear takes


# ---------------------------------------------------------------------------------------------------------
# full_tensor / tt_svd


def test_full_tensor_matches_einsum():
    g = torch.Generator().manual_seed(0)
    c0 = torch.randn(1, 3, 4, dtype=torch.float64, generator=g)
    c1 = torch.randn(4, 5, 2, dtype=torch.float64, generator=g)
    c2 = torch.randn(2, 6, 1, dtype=torch.float64, generator=g)
    g0 = torch.randn(4, dtype=torch.float64, generator=g)
    g1 = torch.randn(2, dtype=torch.float64, generator=g)
    ref = torch.einsum("xia,a,ajb,b,bky->ijk", c0, g0, c1, g1, c2)
    assert rel_err(tt.full_tensor([c0, c1, c2], [g0, g1]), ref) < 1e-14
    ref_no_gates = torch.einsum("xia,ajb,bky->ijk", c0, c1, c2)
    assert rel_err(tt.full_tensor([c0, c1, c2]), ref_no_gates) < 1e-14


@pytest.mark.parametrize("shape", [(3, 4, 5, 2), (2, 2, 2, 2, 2, 2), (7, 1, 6), (5,), (4, 9)])
@pytest.mark.parametrize("extra", [0, 3])
def test_tt_svd_exact_at_full_ranks(shape, extra):
    g = torch.Generator().manual_seed(1)
    tensor = torch.randn(shape, dtype=torch.float64, generator=g)
    ranks = max_ranks_of(shape)
    # ranks above the bond's maximum are allowed (zero padded) and still exact
    ranks = [1] + [r + extra for r in ranks[1:-1]] + [1]
    cores = tt.tt_svd(tensor, ranks)
    assert [tuple(c.shape) for c in cores] == [(ranks[k], shape[k], ranks[k + 1]) for k in range(len(shape))]
    assert rel_err(tt.full_tensor(cores), tensor) < 1e-12


def test_tt_svd_left_cores_are_orthonormal():
    g = torch.Generator().manual_seed(2)
    tensor = torch.randn(4, 5, 6, 3, dtype=torch.float64, generator=g)
    cores = tt.tt_svd(tensor, [1, 3, 7, 2, 1])
    for c in cores[:-1]:
        q = c.reshape(-1, c.shape[-1])
        assert torch.allclose(q.T @ q, torch.eye(q.shape[1], dtype=torch.float64), atol=1e-12)


def test_tt_svd_error_decreases_with_rank():
    g = torch.Generator().manual_seed(3)
    shape = (4, 5, 6, 5, 4)
    tensor = torch.randn(shape, dtype=torch.float64, generator=g)
    cap = max_ranks_of(shape)
    errors = []
    for r in range(1, max(cap) + 1):
        ranks = [min(r, m) for m in cap]
        errors.append(rel_err(tt.full_tensor(tt.tt_svd(tensor, ranks)), tensor))
    assert errors[0] > 0.5  # rank 1 of a random tensor is a poor approximation
    assert all(b <= a + 1e-12 for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-12


@settings(max_examples=30, deadline=None)
@given(data=st.data(), shape=st.lists(st.integers(1, 6), min_size=2, max_size=5), seed=st.integers(0, 2**31 - 1))
def test_tt_svd_quasi_optimal(data, shape, seed):
    cap = max_ranks_of(shape)
    ranks = [1] + [data.draw(st.integers(1, m)) for m in cap[1:-1]] + [1]
    g = torch.Generator().manual_seed(seed)
    tensor = torch.randn(shape, dtype=torch.float64, generator=g)
    err = float((tt.full_tensor(tt.tt_svd(tensor, ranks)) - tensor).norm())
    eps = unfolding_tail_errors(tensor, ranks)
    # upper bound (Oseledets 2011, Thm 2.2): ||A - TT-SVD(A)|| <= sqrt(sum_k eps_k^2)
    assert err <= math.sqrt(sum(e * e for e in eps)) * (1 + 1e-10) + 1e-12
    # lower bound: the result has unfolding ranks <= r_k, so it cannot beat any single eps_k
    assert err >= max(eps) * (1 - 1e-10) - 1e-12


def test_tt_svd_rejects_wrong_number_of_ranks():
    with pytest.raises(ValueError, match="need 4 ranks"):
        tt.tt_svd(torch.zeros(2, 3, 4), [1, 2, 1])


def test_cores_to_dense_round_trips_svd_cores_with_padding():
    # 37 -> 53 pads both sides; svd_cores at full rank then cores_to_dense must give the matrix back
    g = torch.Generator().manual_seed(4)
    w_t = torch.randn(37, 53, dtype=torch.float64, generator=g)
    spec = tt.make_spec("tt", 37, 53, 10**9)
    assert spec.in_padded > 37 and spec.out_padded > 53
    cores = tt.svd_cores(w_t, spec)
    assert [tuple(c.shape) for c in cores] == spec.core_shapes
    gates = [torch.ones(r, dtype=torch.float64) for r in spec.gate_sizes]
    assert rel_err(tt.cores_to_dense(cores, gates, spec), w_t) < 1e-12


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(["tt", "ttm"]), n_in=st.integers(8, 3000), n_out=st.integers(8, 3000),
       rank=st.integers(1, 40), cut=st.integers(0, 5))
def test_spec_token_names_the_same_spec(kind, n_in, n_out, rank, cut):
    """The text key the layers hand the planner under torch.compile gives back the spec it came from, cut
    ranks and caps included, and equal specs give equal tokens."""
    spec = tt.make_spec(kind, n_in, n_out, rank)
    spec = spec.with_ranks([1, *(max(1, r - cut) for r in spec.ranks[1:-1]), 1])
    back = tt.TTSpec.of(spec.token)
    assert back == spec and back.max_ranks == spec.max_ranks and back.token == spec.token
    assert tt.TTSpec.of(spec.key()) == spec
    assert tt.gemm_core_padding(spec.token) == tt.gemm_core_padding(spec)
    assert tt.make_spec(kind, n_in, n_out, rank).token == tt.make_spec(kind, n_in, n_out, rank).token
