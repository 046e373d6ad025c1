"""TrainingPathOptimizer against opt_einsum's conventions for path optimizers, and its contractions against
numpy.einsum / torch.einsum in float64."""

from __future__ import annotations

import importlib
import itertools
import math
import pickle

import numpy as np
import opt_einsum
import pytest
import torch
from hypothesis import given, settings, strategies as st

from comera_compile import networks as nw

order = importlib.import_module("comera_compile.networks.order")
TrainingPathOptimizer = nw.TrainingPathOptimizer


def _arrays(eq: str, sizes: dict[str, int], seed: int = 0, dtype=np.float64) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    terms = eq.split("->")[0].split(",")
    return [np.asarray(rng.standard_normal([sizes[c] for c in term]), dtype=dtype) for term in terms]


def _assert_linear_path(path, n: int) -> None:
    """A path in opt_einsum's linear form: tuples of Python ints in ascending order, each naming distinct
    operands among those left (all removed, the result appended), ending with one operand."""
    assert isinstance(path, list)
    left = n
    for step in path:
        assert isinstance(step, tuple) and len(step) >= 1
        assert all(type(k) is int for k in step)
        assert list(step) == sorted(set(step)) and all(0 <= k < left for k in step)
        left -= len(step) - 1
    assert left == 1


def _contract_and_check(eq: str, arrays, opt: TrainingPathOptimizer, reference=None, rtol=1e-10, atol=1e-10):
    """Contract with opt, compare with numpy.einsum (or `reference`), check contract_path's path; the path."""
    want = np.einsum(eq, *[np.asarray(a, dtype=np.float64) for a in arrays]) if reference is None else reference
    got = opt_einsum.contract(eq, *arrays, optimize=opt)
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), want, rtol=rtol, atol=atol)
    path, info = opt_einsum.contract_path(eq, *arrays, optimize=opt)
    _assert_linear_path(path, len(arrays))
    assert info.path is path
    return path


def _tree(path, n: int):
    """The contraction tree (nested pairs of input positions) of a pairwise path."""
    ops: list = list(range(n))
    for step in path:
        picked = [ops[k] for k in step]
        for k in sorted(step, reverse=True):
            ops.pop(k)
        ops.append(tuple(picked))
    return ops[0]


def _all_paths(n: int):
    """Every pairwise path of n operands."""
    if n == 1:
        yield []
        return
    for pair in itertools.combinations(range(n), 2):
        for rest in _all_paths(n - 1):
            yield [pair] + rest


class _CountingSearch:
    """Stands in for order.optimal_tree and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.search = order.optimal_tree

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.search(*args, **kwargs)


@pytest.fixture
def counted(monkeypatch) -> _CountingSearch:
    counter = _CountingSearch()
    monkeypatch.setattr(order, "optimal_tree", counter)
    return counter


# ---------------------------------------------------------------------------------------------- path form


def test_one_and_two_inputs_give_opt_einsum_paths():
    opt = TrainingPathOptimizer()
    sizes = {"a": 2, "b": 3, "c": 4}
    assert opt([frozenset("ab")], frozenset("a"), sizes) == [(0,)] == opt_einsum.paths.greedy(["ab"], "a", sizes)
    two = opt([frozenset("ab"), frozenset("bc")], frozenset("ac"), sizes)
    assert two == [(0, 1)] == opt_einsum.paths.optimal([set("ab"), set("bc")], set("ac"), sizes)
    # contract_path asks no optimizer about one or two operands; the result is still the einsum.
    for eq in ("ab->a", "abb->ba", "ab,bc->ac"):
        arrays = _arrays(eq, {"a": 2, "b": 3, "c": 4})
        path = _contract_and_check(eq, arrays, opt)
        assert path == [tuple(range(len(arrays)))]


def test_three_or_more_inputs_give_a_list_of_int_tuples_the_search_chose(counted):
    eq = "abh,bcq,cdh,dea,ehs,fg->afg"
    sizes = {"a": 5, "b": 7, "c": 3, "d": 6, "e": 4, "h": 2, "q": 3, "s": 5, "f": 4, "g": 3}
    arrays = _arrays(eq, sizes)
    opt = TrainingPathOptimizer()
    path = _contract_and_check(eq, arrays, opt)
    assert len(path) == len(arrays) - 1 and all(len(step) == 2 for step in path)
    assert counted.calls == 1
    # The path contracts the tree the search chose, and that tree costs the exhaustive minimum.
    inputs, output = eq.split("->")
    net = nw.einsum_network(inputs.split(","), output, sizes)
    assert nw.tree_cost(net, _tree(path, len(arrays))) == nw.optimal_tree(net)[1]
    assert nw.optimal_tree(net)[1] == min(nw.tree_cost(net, _tree(p, len(arrays))) for p in _all_paths(6))


def test_steps_are_in_opt_einsum_linear_form():
    """opt_einsum's optimizers write each step's positions in ascending order (ssa_to_linear sorts them):
    a path is its own round trip through static single assignment form."""
    sizes = {"a": 5, "b": 7, "c": 3, "d": 6, "e": 4, "h": 2, "q": 3, "s": 5, "f": 4, "g": 3}
    inputs = [set(t) for t in ("abh", "bcq", "cdh", "dea", "ehs", "fg")]
    for training in (True, False):
        path = TrainingPathOptimizer(training)(inputs, set("afg"), sizes)
        assert opt_einsum.paths.ssa_to_linear(opt_einsum.paths.linear_to_ssa(path)) == path
        assert all(i < j for i, j in path)
    # A left-deep tree, whose merged operand sits after the next input: (4, 0) in plan order.
    chain = [set("ab"), set("bc"), set("cd"), set("de"), set("ef")]
    path = TrainingPathOptimizer()(chain, set("af"), {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5, "f": 6})
    assert all(i < j for i, j in path)
    _assert_linear_path(path, 5)


def test_returned_paths_are_fresh_lists():
    opt = TrainingPathOptimizer()
    inputs, sizes = [set("ab"), set("bc"), set("cd")], {"a": 2, "b": 3, "c": 4, "d": 5}
    first = opt(inputs, set("ad"), sizes)
    expected = list(first)
    first.append((9, 9))
    assert opt(inputs, set("ad"), sizes) == expected


# --------------------------------------------------------------------------------------------- input forms


def test_sets_frozensets_strings_and_repeated_labels_give_one_path(counted):
    sizes = {"a": 6, "b": 2, "c": 7, "d": 3, "e": 5}
    forms = [
        (["ab", "bc", "cd", "de"], "ae"),
        ([set("ab"), set("bc"), set("cd"), set("de")], set("ae")),
        ([frozenset("ab"), frozenset("bc"), frozenset("cd"), frozenset("de")], frozenset("ae")),
        ([list("ba"), ("c", "b"), "dcc", "eed"], ["a", "e"]),  # repeated labels: traces, counted once
    ]
    paths = [TrainingPathOptimizer()(inputs, output, sizes) for inputs, output in forms]
    assert all(p == paths[0] for p in paths)
    arrays = _arrays("ab,bc,cd,de->ae", sizes)
    assert opt_einsum.contract_path("ab,bc,cd,de->ae", *arrays, optimize=TrainingPathOptimizer())[0] == paths[0]


def test_labels_of_any_hashable_type_give_the_letters_path():
    sizes = {"a": 6, "b": 2, "c": 7, "d": 3, "e": 5}
    letters = TrainingPathOptimizer()([set("ab"), set("bc"), set("cd"), set("de")], set("ae"), sizes)
    for rename in ({"a": 0, "b": 1, "c": 2, "d": 3, "e": 4},
                   {"a": "i0", "b": "i1", "c": "i2", "d": "i3", "e": "i4"},
                   {"a": 0, "b": "x", "c": (1, 2), "d": 2.5, "e": None},
                   {"a": opt_einsum.get_symbol(300), "b": opt_einsum.get_symbol(60), "c": "c", "d": "Z",
                    "e": opt_einsum.get_symbol(1000)}):
        inputs = [{rename[c] for c in term} for term in ("ab", "bc", "cd", "de")]
        path = TrainingPathOptimizer()(inputs, {rename["a"], rename["e"]}, {rename[c]: v for c, v in sizes.items()})
        assert path == letters, rename


def test_interleaved_input_with_non_letter_indices():
    """opt_einsum's interleaved form: any sortable hashables as indices, mapped by get_symbol (beyond the 52
    letters: unicode characters)."""
    rng = np.random.default_rng(1)
    a, b, c = rng.standard_normal((4, 3)), rng.standard_normal((3, 5)), rng.standard_normal((5, 2))
    opt = TrainingPathOptimizer()
    got = opt_einsum.contract(a, [1000, 7], b, [7, 60], c, [60, 99], [1000, 99], optimize=opt)
    np.testing.assert_allclose(got, a @ b @ c, rtol=1e-12)
    _assert_linear_path(opt_einsum.contract_path(a, [1000, 7], b, [7, 60], c, [60, 99], [1000, 99],
                                                 optimize=opt)[0], 3)
    # Beyond 52 distinct indices opt_einsum's symbols leave ASCII: 60 size-1 axes on the first operand push
    # the indices the three operands share past the letters.
    ones = list(range(60))
    big = a[0].reshape((1,) * 60 + (3,))
    args = (big, ones + [1000], b, [1000, 2000], c, [2000, 3000], ones + [3000])
    got = opt_einsum.contract(*args, optimize=opt)
    np.testing.assert_allclose(got.reshape(-1), a[0] @ b @ c, rtol=1e-12)
    path, info = opt_einsum.contract_path(*args, optimize=opt)
    _assert_linear_path(path, 3)
    shared = set(info.input_subscripts.split(",")[1])
    assert all(ord(ch) > 127 for ch in shared)  # the optimizer saw non-ASCII indices


# -------------------------------------------------------------------------- shapes opt_einsum accepts


def test_broadcast_size_one_dimensions():
    rng = np.random.default_rng(2)
    x, y, z = rng.standard_normal((4, 1)), rng.standard_normal((3, 5)), rng.standard_normal((1, 5, 2))
    eq = "ab,bc,acd->ad"
    want = np.einsum(eq, np.broadcast_to(x, (4, 3)), y, np.broadcast_to(z, (4, 5, 2)))
    _contract_and_check(eq, [x, y, z], TrainingPathOptimizer(), reference=want)


@pytest.mark.parametrize("eq", ["aab,bc,cd->d", "abb,bc,cc->a", "aab,bcc,cdd,dee->ae", "abz,bcy,cd->ad",
                                "abb,bc,ccd->abd"])
def test_traces_diagonals_and_indices_summed_in_one_input(eq):
    sizes = {"a": 3, "b": 4, "c": 2, "d": 5, "e": 3, "y": 2, "z": 3}
    _contract_and_check(eq, _arrays(eq, sizes), TrainingPathOptimizer())


@pytest.mark.parametrize("eq", ["ab,cd,ef->abcdef", "ab,bc,de,ef->acdf", "ab,cd,ef,gh->", "a,b,c,d->dcba",
                                "ab,bc,xy,yz,pq->acxzpq"])
def test_outer_products_and_disconnected_components(eq):
    sizes = {c: 2 + k % 3 for k, c in enumerate("abcdefghpqxyz")}
    path = _contract_and_check(eq, _arrays(eq, sizes), TrainingPathOptimizer())
    assert all(len(step) == 2 for step in path)


def test_scalar_inputs():
    rng = np.random.default_rng(3)
    m, n = rng.standard_normal((2, 3)), rng.standard_normal((3, 4))
    arrays = [np.float64(2.0), m, np.array(-1.5), n]
    _contract_and_check(",ab,,bc->ac", arrays, TrainingPathOptimizer(), reference=-3.0 * m @ n)
    _contract_and_check(",,->", [np.array(2.0), np.array(3.0), np.array(0.5)], TrainingPathOptimizer(),
                        reference=np.array(3.0))
    _assert_linear_path(TrainingPathOptimizer()([set(), set(), set()], set(), {}), 3)


# ------------------------------------------------------------------------------------------- memory_limit


@pytest.mark.parametrize("unlimited", [None, -1, float("inf")])
def test_no_limit_values_run_the_search(counted, unlimited):
    """None, -1 and infinity mean no limit in opt_einsum.paths: the search answers, as without a limit."""
    opt = TrainingPathOptimizer(fallback="greedy")
    inputs, sizes = [set("ab"), set("bc"), set("cd"), set("de")], {"a": 9, "b": 2, "c": 8, "d": 2, "e": 9}
    assert opt(inputs, set("ae"), sizes, unlimited) == TrainingPathOptimizer()(inputs, set("ae"), sizes)
    assert counted.calls == 2
    arrays = _arrays("ab,bc,cd,de->ae", sizes)
    got = opt_einsum.contract("ab,bc,cd,de->ae", *arrays, optimize=opt, memory_limit=-1)
    np.testing.assert_allclose(got, np.linalg.multi_dot(arrays), rtol=1e-12)


@pytest.mark.parametrize("limit", [1, 20, "max_input"])
def test_a_memory_limit_is_kept_by_the_fallback(counted, limit):
    eq = "ab,bc,cd,de->ae"
    sizes = {"a": 9, "b": 2, "c": 8, "d": 2, "e": 9}
    arrays = _arrays(eq, sizes)
    opt = TrainingPathOptimizer()
    want = np.linalg.multi_dot(arrays)
    got = opt_einsum.contract(eq, *arrays, optimize=opt, memory_limit=limit)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    path, info = opt_einsum.contract_path(eq, *arrays, optimize=opt, memory_limit=limit)
    _assert_linear_path(path, 4)
    assert path == opt_einsum.contract_path(eq, *arrays, optimize="auto", memory_limit=limit)[0]
    bound = max(math.prod(a.shape) for a in arrays + [want]) if limit == "max_input" else limit
    assert all(size <= bound for size in info.size_list[:-1])  # every intermediate but the result
    assert counted.calls == 0


def test_no_pairwise_path_within_the_limit_contracts_several_operands_at_once():
    sizes = {"a": 9, "b": 2, "c": 8, "d": 2, "e": 9}
    path = TrainingPathOptimizer()([set("ab"), set("bc"), set("cd"), set("de")], set("ae"), sizes, 1)
    assert path == [(0, 1, 2, 3)] == opt_einsum.paths.optimal([set("ab"), set("bc"), set("cd"), set("de")],
                                                              set("ae"), sizes, 1)


# ------------------------------------------------------------------------------------------ large expressions


def _chain(n: int) -> tuple[str, list[np.ndarray]]:
    eq = ",".join(opt_einsum.get_symbol(k) + opt_einsum.get_symbol(k + 1) for k in range(n))
    eq += "->" + opt_einsum.get_symbol(0) + opt_einsum.get_symbol(n)
    rng = np.random.default_rng(n)
    return eq, [rng.standard_normal((2, 2)) / 2 for _ in range(n)]


def test_large_expressions_go_to_the_fallback(counted):
    eq, arrays = _chain(nw.EXACT_CONNECTED + 3)
    opt = TrainingPathOptimizer(fallback="greedy")
    path = _contract_and_check(eq, arrays, opt, reference=np.linalg.multi_dot(arrays))
    assert path == opt_einsum.contract_path(eq, *arrays, optimize="greedy")[0]
    assert counted.calls == 0
    eq, arrays = _chain(nw.EXACT_CONNECTED)
    _contract_and_check(eq, arrays, opt, reference=np.linalg.multi_dot(arrays))
    assert counted.calls == 1  # up to EXACT_CONNECTED inputs, the search


def test_fallback_may_be_a_path_optimizer_whose_answers_are_not_stored():
    class Counting(opt_einsum.paths.PathOptimizer):
        calls = 0

        def __call__(self, inputs, output, size_dict, memory_limit=None):
            Counting.calls += 1
            assert all(isinstance(i, frozenset) for i in inputs) and isinstance(output, frozenset)
            return opt_einsum.paths.greedy(inputs, output, size_dict, memory_limit)

    eq, arrays = _chain(nw.EXACT_CONNECTED + 1)
    opt = TrainingPathOptimizer(fallback=Counting())
    for _ in range(2):
        _contract_and_check(eq, arrays, opt, reference=np.linalg.multi_dot(arrays))
    assert Counting.calls == 4  # contract and contract_path, twice each


def test_fallback_names_are_checked_when_the_optimizer_is_made():
    with pytest.raises(KeyError, match="not found"):
        TrainingPathOptimizer(fallback="no-such-optimizer")
    with pytest.raises(TypeError):
        TrainingPathOptimizer(fallback=3)


def test_bad_calls_raise_clear_errors():
    with pytest.raises(ValueError, match="at least one input"):
        TrainingPathOptimizer()([], set(), {})
    with pytest.raises(ValueError, match="requires_grad has 2 entries for 3 inputs"):
        TrainingPathOptimizer(requires_grad=[True, False])([set("ab"), set("bc"), set("cd")], set("ad"),
                                                           {"a": 2, "b": 2, "c": 2, "d": 2})


# ---------------------------------------------------------------------------------------- repeated searches


def test_a_second_call_of_one_expression_does_not_search(counted):
    eq = "ab,bc,cd,de->ae"
    sizes = {"a": 9, "b": 2, "c": 8, "d": 2, "e": 9}
    arrays = _arrays(eq, sizes)
    opt = TrainingPathOptimizer()
    first = opt_einsum.contract_path(eq, *arrays, optimize=opt)[0]
    assert counted.calls == 1
    for _ in range(3):
        assert opt_einsum.contract_path(eq, *arrays, optimize=opt)[0] == first
        np.testing.assert_allclose(opt_einsum.contract(eq, *arrays, optimize=opt), np.linalg.multi_dot(arrays))
    # The same expression called directly, in another form (strings here, frozensets from contract_path).
    assert opt([set("ab"), set("bc"), set("cd"), set("de")], "ae", sizes) == first
    assert counted.calls == 1
    # Other sizes, another search; a fresh optimizer searches again; clear_cache forgets.
    opt_einsum.contract_path(eq, *_arrays(eq, {**sizes, "c": 3}), optimize=opt)
    assert counted.calls == 2
    TrainingPathOptimizer()([set("ab"), set("bc"), set("cd"), set("de")], "ae", sizes)
    assert counted.calls == 3
    opt.clear_cache()
    opt_einsum.contract_path(eq, *arrays, optimize=opt)
    assert counted.calls == 4


def test_settings_are_part_of_the_key_and_the_cache_is_bounded(counted):
    sizes = {"a": 9, "b": 2, "c": 8, "d": 2, "e": 9}
    inputs = [set("ab"), set("bc"), set("cd"), set("de")]
    opt = TrainingPathOptimizer(cache_size=2)
    opt(inputs, "ae", sizes)
    opt.training = False
    opt(inputs, "ae", sizes)
    assert counted.calls == 2
    opt(inputs, "ae", {**sizes, "a": 3})  # a third expression drops the least recently used (training=True)
    opt.training = True
    opt(inputs, "ae", sizes)
    assert counted.calls == 4
    uncached = TrainingPathOptimizer(cache_size=0)
    uncached(inputs, "ae", sizes)
    uncached(inputs, "ae", sizes)
    assert counted.calls == 6


def test_string_fallback_answers_are_stored(monkeypatch):
    calls = []

    def counting_greedy(inputs, output, size_dict, memory_limit=None):
        calls.append(1)
        return opt_einsum.paths.greedy(inputs, output, size_dict, memory_limit)

    monkeypatch.setattr(opt_einsum.paths, "_PATH_OPTIONS", dict(opt_einsum.paths._PATH_OPTIONS))
    opt_einsum.paths.register_path_fn("counting-greedy", counting_greedy)
    eq, arrays = _chain(nw.EXACT_CONNECTED + 1)
    opt = TrainingPathOptimizer(fallback="counting-greedy")
    for _ in range(3):
        _contract_and_check(eq, arrays, opt, reference=np.linalg.multi_dot(arrays))
    assert len(calls) == 1


def test_contract_expression_searches_once_and_evaluates_like_einsum(counted):
    eq = "ab,bc,cd,de->ae"
    sizes = {"a": 5, "b": 2, "c": 7, "d": 3, "e": 4}
    shapes = [(5, 2), (2, 7), (7, 3), (3, 4)]
    expr = opt_einsum.contract_expression(eq, *shapes, optimize=TrainingPathOptimizer())
    assert counted.calls == 1
    for seed in range(3):
        arrays = _arrays(eq, sizes, seed)
        np.testing.assert_allclose(expr(*arrays), np.linalg.multi_dot(arrays), rtol=1e-12)
        tensors = [torch.from_numpy(a) for a in arrays]
        torch.testing.assert_close(expr(*tensors), torch.einsum(eq, *tensors), rtol=1e-12, atol=1e-12)
    assert counted.calls == 1
    with_constant = opt_einsum.contract_expression(eq, shapes[0], arrays[1], *shapes[2:], constants=[1],
                                                   optimize=TrainingPathOptimizer())
    np.testing.assert_allclose(with_constant(arrays[0], *arrays[2:]), np.linalg.multi_dot(arrays), rtol=1e-12)


# ----------------------------------------------------------------------------- repr, pickle, registration


def test_repr_names_the_settings():
    opt = TrainingPathOptimizer(False, requires_grad=[True, False, True], fallback="greedy")
    assert repr(opt) == "TrainingPathOptimizer(training=False, requires_grad=(True, False, True), fallback='greedy')"
    again = eval(repr(opt), {"TrainingPathOptimizer": TrainingPathOptimizer})
    assert (again.training, again.requires_grad, again.fallback) == (False, (True, False, True), "greedy")


def test_pickles_with_its_settings_and_paths(counted):
    opt = TrainingPathOptimizer(False, requires_grad=[False, True, True, False], fallback="greedy")
    inputs, sizes = [set("ab"), set("bc"), set("cd"), set("de")], {"a": 9, "b": 2, "c": 8, "d": 2, "e": 9}
    path = opt(inputs, "ae", sizes)
    copy = pickle.loads(pickle.dumps(opt))
    assert repr(copy) == repr(opt)
    assert copy(inputs, "ae", sizes) == path
    assert counted.calls == 1  # the stored path came along
    copy.clear_cache()
    assert copy(inputs, "ae", sizes) == path


def test_registered_under_a_name(monkeypatch):
    monkeypatch.setattr(opt_einsum.paths, "_PATH_OPTIONS", dict(opt_einsum.paths._PATH_OPTIONS))
    opt = TrainingPathOptimizer()
    opt_einsum.paths.register_path_fn("comera-training", opt)
    eq = "abh,bcq,cdh,dea,ehs,fg->afg"
    sizes = {"a": 5, "b": 7, "c": 3, "d": 6, "e": 4, "h": 2, "q": 3, "s": 5, "f": 4, "g": 3}
    arrays = _arrays(eq, sizes)
    got = opt_einsum.contract(eq, *arrays, optimize="comera-training")
    np.testing.assert_allclose(got, np.einsum(eq, *arrays), rtol=1e-10)
    assert opt_einsum.contract_path(eq, *arrays, optimize="comera-training")[0] == \
        opt_einsum.contract_path(eq, *arrays, optimize=opt)[0]


# -------------------------------------------------------------------------------------------- property test

_LABELS = "abcdefg"


@st.composite
def _expressions(draw):
    n = draw(st.integers(2, 6))
    terms = [draw(st.lists(st.sampled_from(_LABELS), min_size=0, max_size=3)) for _ in range(n)]
    used = sorted(set().union(*terms))
    output = draw(st.permutations(used).flatmap(lambda p: st.integers(0, len(p)).map(lambda k: p[:k])))
    sizes = {c: draw(st.integers(1, 3)) for c in used}
    # Broadcasting: some inputs hold an index at size 1.
    shapes = [[1 if draw(st.integers(0, 5)) == 0 else sizes[c] for c in term] for term in terms]
    for term, shape in zip(terms, shapes):
        for k, c in enumerate(term):  # a repeated index takes one size within its input
            shape[k] = shape[term.index(c)]
    eq = ",".join("".join(t) for t in terms) + "->" + "".join(output)
    return eq, shapes


@settings(max_examples=60, deadline=None)
@given(_expressions(), st.sampled_from([np.float32, np.float64]), st.booleans(), st.data())
def test_random_expressions_contract_like_numpy_einsum(expression, dtype, training, data):
    eq, shapes = expression
    n = len(shapes)
    grads = data.draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=n, max_size=n)))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    arrays = [np.asarray(rng.standard_normal(s), dtype=dtype) for s in shapes]
    opt = TrainingPathOptimizer(training, requires_grad=grads)
    broadcast = _broadcast(eq, arrays)
    want = np.einsum(eq, *broadcast)
    tol = 1e-4 if dtype == np.float32 else 1e-10
    path = _contract_and_check(eq, arrays, opt, reference=want, rtol=tol, atol=tol)
    assert opt_einsum.contract_path(eq, *arrays, optimize=opt)[0] == path


def _broadcast(eq: str, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """The float64 arrays with every size-1 dimension broadcast to its index's size (numpy.einsum's reading
    of broadcasting, done by hand)."""
    terms = eq.split("->")[0].split(",")
    size: dict[str, int] = {}
    for term, a in zip(terms, arrays):
        for c, d in zip(term, a.shape):
            size[c] = max(size.get(c, 1), d)
    out = []
    for term, a in zip(terms, arrays):
        a = np.asarray(a, dtype=np.float64)
        target = [size[c] for c in term]
        # Broadcast each axis on its own, so a repeated index stays square.
        b = a
        for k, c in enumerate(term):
            if b.shape[k] == 1 and target[k] != 1:
                b = np.repeat(b, target[k], axis=k)
        out.append(b)
    return out
