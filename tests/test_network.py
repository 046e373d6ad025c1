"""The contraction-order search: exact against brute force, never worse than fixed orders."""

from __future__ import annotations

import itertools
import math
import random
import re

import opt_einsum
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from comera_compile import networks as nw
from comera_compile.tt import make_spec

SIX_ENCODER = {
    "attention": ((768, 768), (12, 8, 8), (8, 8, 12)),
    "ffn_up": ((768, 3072), (12, 8, 8), (12, 16, 16)),
    "ffn_down": ((3072, 768), (16, 16, 12), (8, 8, 12)),
}
ROWS = [1, 8, 32, 128, 1024, 4096, 16384]


def _path_cost(net: nw.Network, path, training: bool = True, traffic_weight: float = 0) -> int:
    """Training cost of an opt_einsum-style path, computed directly from the definition: every pairwise
    contraction costs 2 * prod(sizes of all its indices) (1x without a summed index) plus traffic_weight
    per element of its two operands and result, and all that once more for each operand that
    (transitively) holds a tensor needing a gradient.  Contracting the input (the one tensor holding the row
    index) whose kept and summed indices are not one block each costs a copy: 2 * traffic_weight per
    element, twice when training an input needing a gradient."""
    sizes = net.size_of
    holders = [k for k, t in enumerate(net.tensors) if net.rows_index and net.rows_index in t.indices]
    ops = [(t.indices, t.requires_grad, len(holders) == 1 and k == holders[0]) for k, t in enumerate(net.tensors)]
    total = 0
    for i, j in path:
        (a, ga, xa), (b, gb, xb) = ops[i], ops[j]
        for k in sorted((i, j), reverse=True):
            ops.pop(k)
        rest = set(net.output).union(*(o[0] for o in ops))
        out = "".join(c for c in dict.fromkeys(a + b) if c in rest) if ops else net.output
        inv = set(a) | set(b)
        f = math.prod(sizes[c] for c in inv) * (2 if inv - set(out) else 1)
        f += traffic_weight * sum(math.prod(sizes[c] for c in t) for t in (a, b, out))
        total += f * (1 + (ga + gb if training else 0))
        for x, gx, is_input in ((a, ga, xa), (b, gb, xb)):
            labels = "".join("k" if c in out else "s" for c in x)
            if is_input and not re.fullmatch("k*s*|s*k*", labels):
                total += 2 * traffic_weight * math.prod(sizes[c] for c in x) * (1 + (gx if training else 0))
        ops.append((out, ga or gb, False))
    return total


def _all_paths(n: int):
    """Every sequence of pairwise contractions of n operands (opt_einsum's path convention)."""
    if n == 1:
        yield []
        return
    for i, j in itertools.combinations(range(n), 2):
        for rest in _all_paths(n - 1):
            yield [(i, j)] + rest


def _random_tt_network(rng: random.Random, n_tensors: int) -> nw.Network:
    """A TT linear network with n_tensors tensors in all (input + cores), random modes, ranks and rows."""
    n_cores = n_tensors - 1
    d_in = rng.randint(1, n_cores - 1)
    in_modes = tuple(rng.randint(2, 6) for _ in range(d_in))
    out_modes = tuple(rng.randint(2, 6) for _ in range(n_cores - d_in))
    spec = make_spec("tt", math.prod(in_modes), math.prod(out_modes), rng.randint(1, 9), in_modes, out_modes)
    return nw.tt_linear_network(spec, rng.choice([1, 3, 17, 256, 5000]), input_requires_grad=rng.random() < 0.7)


# 7 tensors (six cores, the paper's shapes) take half a minute of brute force: slow; 5 and 6 run the same search
@pytest.mark.parametrize("n_tensors,trials", [(5, 12), (6, 6), pytest.param(7, 2, marks=pytest.mark.slow)])
def test_search_is_exact_against_brute_force(n_tensors, trials):
    rng = random.Random(n_tensors)
    paths = list(_all_paths(n_tensors))
    for _ in range(trials):
        net = _random_tt_network(rng, n_tensors)
        for training in (True, False):
            w = nw.TRAFFIC_WEIGHT
            brute = min(_path_cost(net, p, training, w) for p in paths)
            plan = nw.search(net, training)
            assert _path_cost(net, plan.path, training, w) == brute
            cost = plan.training_flops if training else plan.flops
            assert cost == _path_cost(net, plan.path, training)


def _opt_einsum_tree(net: nw.Network):
    eq = ",".join(t.indices for t in net.tensors) + "->" + net.output
    shapes = [tuple(net.size_of[c] for c in t.indices) for t in net.tensors]
    path, _ = opt_einsum.contract_path(eq, *shapes, shapes=True, optimize="optimal")
    return path


@pytest.mark.parametrize("layer", sorted(SIX_ENCODER))
def test_six_encoder_plans_beat_reference_order_and_opt_einsum(layer):
    (n_in, n_out), in_modes, out_modes = SIX_ENCODER[layer]
    spec = make_spec("tt", n_in, n_out, 30, in_modes, out_modes)
    for rows in ROWS:
        net = nw.tt_linear_network(spec, rows)
        plan = nw.plan_tt_linear(spec, rows)
        ref = nw.plan_from_tree(net, nw.reference_tree(spec))
        assert plan.training_flops <= ref.training_flops
        if rows <= 32:
            assert plan.training_flops < ref.training_flops
        # opt_einsum's forward-optimal path, costed forward + backward (traffic and the input's copy too) by
        # the independent evaluator
        assert plan.cost() <= _path_cost(net, _opt_einsum_tree(net), True, nw.TRAFFIC_WEIGHT)
        assert _path_cost(net, plan.path) == plan.training_flops


def test_reference_tree_is_merge_merge_two_gemms():
    spec = make_spec("tt", 768, 3072, 30, (12, 8, 8), (12, 16, 16))
    plan = nw.plan_from_tree(nw.tt_linear_network(spec, 64), nw.reference_tree(spec))
    per_row = [s for s in plan.steps if s.per_row]
    assert len(per_row) == 2  # X A, then (X A) B
    assert len(plan.steps) - len(per_row) == 4  # two merges on each side


def test_small_batches_chain_through_the_activation():
    spec = make_spec("tt", 768, 3072, 30, (12, 8, 8), (12, 16, 16))
    small, large = nw.plan_tt_linear(spec, 1), nw.plan_tt_linear(spec, 16384)
    assert sum(s.per_row for s in small.steps) > sum(s.per_row for s in large.steps)


def test_plans_are_cached_per_shape(monkeypatch):
    """Two layers of the same shapes share one plan, searched once; another row count is searched anew; and
    the cached plan is the one an uncached search finds."""
    searches = []
    real_search = nw.search
    monkeypatch.setattr(nw.order, "search", lambda *a, **k: searches.append(a) or real_search(*a, **k))
    # Shapes (rank 27, 1000 / 1001 rows) that no other test plans, so nothing is cached for them yet.
    spec_a = make_spec("tt", 768, 768, 27, (12, 8, 8), (8, 8, 12))
    spec_b = make_spec("tt", 768, 768, 27, (12, 8, 8), (8, 8, 12))  # another layer, same shapes
    assert spec_a is not spec_b
    p1 = nw.plan_tt_linear(spec_a, 1000)
    assert len(searches) == 1
    p2 = nw.plan_tt_linear(spec_b, 1000)
    assert p1 is p2 and len(searches) == 1
    p3 = nw.plan_tt_linear(spec_a, 1001)
    assert len(searches) == 2 and p3 is not p1
    fresh = real_search(nw.tt_linear_network(spec_a, 1000), True)
    assert (p1.path, p1.steps, p1.tree) == (fresh.path, fresh.steps, fresh.tree)


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 5), st.integers(2, 5), st.integers(1, 6), st.integers(1, 40), st.data())
def test_executed_plan_equals_dense_product(n_in_cores, n_out_cores, rank, rows, data):
    in_modes = tuple(data.draw(st.integers(1, 4)) for _ in range(n_in_cores))
    out_modes = tuple(data.draw(st.integers(1, 4)) for _ in range(n_out_cores))
    spec = make_spec("tt", math.prod(in_modes), math.prod(out_modes), rank, in_modes, out_modes)
    g = torch.Generator().manual_seed(rows)
    cores = [torch.randn(s, generator=g, dtype=torch.float64) for s in spec.core_shapes]
    x = torch.randn(rows, spec.in_padded, generator=g, dtype=torch.float64)
    # reference: the dense matrix, built by a plain left-to-right product of the cores
    w = cores[0].reshape(-1, cores[0].shape[-1])
    for c in cores[1:]:
        w = (w @ c.reshape(c.shape[0], -1)).reshape(-1, c.shape[-1])
    w = w.reshape(spec.in_padded, spec.out_padded)
    ops = [c for c in cores]
    ops[0] = ops[0].reshape(ops[0].shape[1], ops[0].shape[2])
    ops[-1] = ops[-1].reshape(ops[-1].shape[0], ops[-1].shape[1])
    for training in (True, False):
        plan = nw.plan_tt_linear(spec, rows, training)
        y = nw.execute(plan, [x.reshape(rows, *in_modes), *ops]).reshape(rows, -1)
        torch.testing.assert_close(y, x @ w, rtol=1e-10, atol=1e-10)


def test_network_has_tensors_as_nodes_and_bonds_as_edges():
    spec = make_spec("tt", 768, 768, 30, (12, 8, 8), (8, 8, 12))
    net = nw.tt_linear_network(spec, 8)
    assert len(net.tensors) == 7
    # one edge per index two tensors share: x shares 3 input modes with the input cores; the 6 cores form a
    # chain of 5 bonds
    edges = [(i, j, c) for (i, a), (j, b) in itertools.combinations(enumerate(net.tensors), 2)
             for c in set(a.indices) & set(b.indices)]
    assert len(edges) == 3 + 5
    assert sorted(net.size_of[c] for _, _, c in edges) == sorted([*spec.in_modes, *spec.ranks[1:-1]])
    emb = nw.ttm_embedding_network(make_spec("ttm", 1000, 64, 8, (10, 10, 10), (4, 4, 4)), 16)
    assert len(emb.tensors) == 3 and all(t.indices[0] == emb.output[0] for t in emb.tensors)


# ---------------------------------------------------------------------------------------------------------
# One cost model: the exact search, plans, the greedy fallback and the lookup planner agree on it


def _tt_networks():
    """TT linear networks over a spread of shapes, ranks, row counts and input gradients."""
    rng = random.Random(7)
    nets = [nw.tt_linear_network(make_spec("tt", 768, 3072, r, (12, 8, 8), (12, 16, 16)), rows, ig)
            for r, rows, ig in [(30, 1, True), (30, 4096, True), (8, 64, False), (2, 16384, True)]]
    return nets + [_random_tt_network(rng, n) for n in (3, 5, 6, 8)]


@pytest.mark.parametrize("training", [True, False])
def test_search_cost_is_the_cost_function_of_its_tree(training):
    for net in _tt_networks():
        tree, cost = nw.optimal_tree(net, training)
        plan = nw.search(net, training)
        assert plan.tree == tree
        assert cost == nw.tree_cost(net, tree, training) == plan.cost(training)
        # and the definition, evaluated independently along the plan's path
        assert cost == _path_cost(net, plan.path, training, nw.TRAFFIC_WEIGHT)


@pytest.mark.parametrize("training", [True, False])
def test_greedy_tree_costs_at_least_the_optimum(training):
    for net in _tt_networks():
        greedy = nw.greedy_tree(net, training)
        assert sorted(_tree_leaves(greedy)) == list(range(len(net.tensors)))
        assert nw.tree_cost(net, greedy, training) >= nw.optimal_tree(net, training)[1]
        assert nw.tree_cost(net, greedy, training) == nw.plan_from_tree(net, greedy).cost(training)


def test_beyond_the_exact_limit_search_is_greedy_by_the_same_cost():
    in_modes, out_modes = (2,) * 8, (2,) * 8  # 17 tensors
    net = nw.tt_linear_network(make_spec("tt", 256, 256, 3, in_modes, out_modes), 32)
    assert len(net.tensors) > nw.EXACT_CONNECTED
    tree, cost = nw.optimal_tree(net)
    assert tree == nw.greedy_tree(net)
    assert cost == nw.tree_cost(net, tree) == nw.search(net).cost()


def test_greedy_picks_the_cheapest_pair_first():
    """The greedy's first contraction is, among pairs sharing an index, one of least contraction_cost."""
    rng = random.Random(3)
    for _ in range(6):
        net = _random_tt_network(rng, 6)
        tree = nw.greedy_tree(net)

        def pair_cost(x: int, y: int) -> int:  # an intermediate's indices do not depend on when it is made
            return _path_cost(net, [(x, y)], True, nw.TRAFFIC_WEIGHT)

        connected = [(x, y) for x, y in itertools.combinations(range(len(net.tensors)), 2)
                     if set(net.tensors[x].indices) & set(net.tensors[y].indices)]
        cheapest = min(pair_cost(x, y) for x, y in connected)
        assert cheapest in {pair_cost(*sorted(pair)) for pair in _innermost_pairs(tree)}


def _tree_leaves(tree) -> list[int]:
    return [tree] if isinstance(tree, int) else _tree_leaves(tree[0]) + _tree_leaves(tree[1])


def _innermost_pairs(tree) -> list[tuple[int, int]]:
    """The subtrees contracting two input tensors: the greedy's first step is one of them."""
    if isinstance(tree, int):
        return []
    if isinstance(tree[0], int) and isinstance(tree[1], int):
        return [tree]
    return _innermost_pairs(tree[0]) + _innermost_pairs(tree[1])


@pytest.mark.parametrize("rows", [1, 300, 4096])
def test_lookup_chain_cost_is_the_cost_function_of_its_tree(rows):
    from comera_compile.networks.lookup import _chain, _groupings

    spec = make_spec("ttm", 500 * 16, 128, 16, (20, 25, 16), (4, 8, 4))
    for training in (True, False):
        for groups in _groupings(len(spec.in_modes)):
            if len(groups) < 2:
                continue
            chain = _chain(spec, groups, rows, training)
            tree, cost = nw.optimal_tree(chain.network, training)
            assert chain.cost(training) == nw.tree_cost(chain.network, chain.tree, training) == cost
            assert cost == _path_cost(chain.network, chain.path, training, nw.TRAFFIC_WEIGHT)
        plan = nw.plan_ttm_lookup(spec, rows, training)
        if len(plan.groups) > 1:
            assert plan.program == _chain(spec, [(g.first, g.stop) for g in plan.groups], rows, training).program


# ---------------------------------------------------------------------------------------------------------
# The search as an opt_einsum path optimizer


def _equation(net: nw.Network) -> str:
    return ",".join(t.indices for t in net.tensors) + "->" + net.output


def _canonical(tree):
    """A tree up to the order of each pair's children."""
    return tree if isinstance(tree, int) else frozenset((_canonical(tree[0]), _canonical(tree[1])))


def _tree_of_path(n: int, path) -> object:
    ops: list = list(range(n))
    for step in path:
        picked = [ops[k] for k in step]
        for k in sorted(step, reverse=True):
            ops.pop(k)
        ops.append(tuple(picked) if len(picked) > 1 else picked[0])
    return ops[0]


def _arrays(net: nw.Network, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn([net.size_of[c] for c in t.indices], generator=g, dtype=torch.float64) for t in net.tensors]


@pytest.mark.parametrize("rows,rank,input_grad,training", [(1, 30, True, True), (2048, 30, True, True),
                                                           (64, 4, False, True), (512, 8, True, False)])
def test_optimizer_contracts_tt_linear_like_torch_einsum(rows, rank, input_grad, training):
    spec = make_spec("tt", 96, 120, rank, (4, 4, 6), (4, 5, 6))
    net = nw.tt_linear_network(spec, rows, input_grad)
    eq, arrays = _equation(net), _arrays(net, rows)
    opt = nw.TrainingPathOptimizer(training, requires_grad=[t.requires_grad for t in net.tensors])
    y = opt_einsum.contract(eq, *arrays, optimize=opt)
    torch.testing.assert_close(y, torch.einsum(eq, *arrays), rtol=1e-10, atol=1e-10)
    path, _ = opt_einsum.contract_path(eq, *arrays, optimize=opt)
    plan = nw.search(_as_einsum(net), training)
    assert _canonical(_tree_of_path(len(arrays), path)) == _canonical(plan.tree)
    assert _path_cost(_as_einsum(net), path, training, nw.TRAFFIC_WEIGHT) == plan.cost(training)


def _as_einsum(net: nw.Network) -> nw.Network:
    """The network as TrainingPathOptimizer sees it, from an einsum expression: no input marked by a row
    index, so no copy charged for its layout."""
    return nw.einsum_network([t.indices for t in net.tensors], net.output, net.size_of,
                             [t.requires_grad for t in net.tensors])


def test_optimizer_is_exact_on_a_generic_network():
    """A ring with a hyperedge, a dangling summed index and an outer-product factor: the optimizer's path is
    the brute-force optimum of the training cost, and contracting along it matches torch.einsum."""
    eq = "abh,bcq,cdh,dea,ehs,fg->afg"
    sizes = {"a": 5, "b": 7, "c": 3, "d": 6, "e": 4, "h": 2, "q": 3, "s": 5, "f": 4, "g": 3}
    inputs, output = eq.split("->")
    net = nw.einsum_network(inputs.split(","), output, sizes)
    arrays = [torch.randn([sizes[c] for c in term], dtype=torch.float64) for term in inputs.split(",")]
    opt = nw.TrainingPathOptimizer()
    torch.testing.assert_close(opt_einsum.contract(eq, *arrays, optimize=opt), torch.einsum(eq, *arrays),
                               rtol=1e-10, atol=1e-10)
    path, _ = opt_einsum.contract_path(eq, *arrays, optimize=opt)
    brute = min(_path_cost(net, p, True, nw.TRAFFIC_WEIGHT) for p in _all_paths(len(arrays)))
    assert _path_cost(net, path, True, nw.TRAFFIC_WEIGHT) == brute
    assert list(path) == [tuple(sorted(step)) for step in nw.search(net).path]


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 5), st.integers(1, 20), st.booleans(), st.data())
def test_optimizer_on_random_tt_shapes(n_in, n_out, rank, rows, training, data):
    in_modes = tuple(data.draw(st.integers(1, 4)) for _ in range(n_in))
    out_modes = tuple(data.draw(st.integers(1, 4)) for _ in range(n_out))
    spec = make_spec("tt", math.prod(in_modes), math.prod(out_modes), rank, in_modes, out_modes)
    net = nw.tt_linear_network(spec, rows)
    eq, arrays = _equation(net), _arrays(net, rows)
    opt = nw.TrainingPathOptimizer(training)
    torch.testing.assert_close(opt_einsum.contract(eq, *arrays, optimize=opt), torch.einsum(eq, *arrays),
                               rtol=1e-9, atol=1e-9)
    if len(arrays) > 2:  # opt_einsum asks no optimizer about two operands
        path, _ = opt_einsum.contract_path(eq, *arrays, optimize=opt)
        net = _as_einsum(net)
        cost = _path_cost(net, path, training, nw.TRAFFIC_WEIGHT)
        if len(arrays) <= 5:
            assert cost == min(_path_cost(net, p, training, nw.TRAFFIC_WEIGHT) for p in _all_paths(len(arrays)))
        assert cost == nw.search(net, training).cost(training)


def test_optimizer_defers_large_expressions_and_memory_limits_to_opt_einsum():
    n = nw.EXACT_CONNECTED + 2
    letters = "abcdefghijklmnopqrstuvwxyz"
    eq = ",".join(letters[k:k + 2] for k in range(n)) + "->" + letters[0] + letters[n]
    g = torch.Generator().manual_seed(0)
    arrays = [torch.randn(3, 3, generator=g, dtype=torch.float64) for _ in range(n)]
    opt = nw.TrainingPathOptimizer(fallback="greedy")
    torch.testing.assert_close(opt_einsum.contract(eq, *arrays, optimize=opt), torch.einsum(eq, *arrays))
    assert opt_einsum.contract_path(eq, *arrays, optimize=opt)[0] == \
        opt_einsum.contract_path(eq, *arrays, optimize="greedy")[0]
    small = eq.split(",")[:4]
    eq4 = ",".join(small) + "->" + small[0][0] + small[-1][1]
    limited = opt_einsum.contract_path(eq4, *arrays[:4], optimize=opt, memory_limit=50)[0]
    assert limited == opt_einsum.contract_path(eq4, *arrays[:4], optimize="greedy", memory_limit=50)[0]


def test_ffn_down_at_128_rows_trades_flops_for_no_copy_of_its_input():
    """The six-encoder's FFN down-projection at 128 rows: the FLOP-optimal order sums the input over its two
    outer modes, which interleave with the kept ones, so the input (128 x 3072) is permuted first.  The
    search takes the order that reads it as it lies, for a few more FLOPs."""
    (n_in, n_out), in_modes, out_modes = SIX_ENCODER["ffn_down"]
    spec = make_spec("tt", n_in, n_out, 30, in_modes, out_modes)
    net = nw.tt_linear_network(spec, 128)
    plan = nw.plan_tt_linear(spec, 128)
    assert not any(s.copied for s in plan.steps)
    first = next(s for s in plan.steps if s.per_row)
    assert first.recipe.a.perm is None and first.recipe.b.perm is None
    flop_optimal = nw.plan_from_tree(net, _tree_of_path(len(net.tensors), _opt_einsum_tree(net)))
    assert [s.copied for s in flop_optimal.steps if s.copied] == [128 * 3072]
    assert flop_optimal.training_flops < plan.training_flops and flop_optimal.cost() > plan.cost()


def _segment_plan_cost_ratio(spec, rows: int) -> float:
    """The cost of the plan tt_linear_segments gives `rows` (what a compiled layer runs) over the best plan's."""
    from comera_compile.networks.cost import tree_cost
    from comera_compile.tt import gemm_spec

    spec = gemm_spec(spec)
    thresholds, programs = nw.tt_linear_segments(spec, True, True)
    k = sum(rows >= t for t in thresholds)
    # a segment runs the plan of its first row count; the first segment, of one of its counts from 8 up
    first = range(8, thresholds[0]) if thresholds and thresholds[0] > 8 else [thresholds[0] - 1 if thresholds else 8]
    at = next(r for r in first if nw.plan_tt_linear(spec, r, True, True).program == programs[0]) if k == 0 else \
        thresholds[k - 1]
    plan = nw.plan_tt_linear(spec, at, True, True)
    assert plan.program == programs[k]
    net = nw.tt_linear_network(spec, rows, True)
    return tree_cost(net, plan.tree) / nw.plan_tt_linear(spec, rows, True, True).cost()


@pytest.mark.parametrize("args", [(100, 10, 4, {"d": 2}), (3, 256, 12, {"in_modes": [3], "out_modes": [4, 8, 8]})])
def test_a_segment_whose_plan_changes_below_eight_rows_still_serves_the_rows_above(args):
    """Row counts below MIN_SEGMENT_START share one program; the best plan from 8 rows up is not dropped with
    them (it was: these layers ran the 1-row plan at every batch under torch.compile, up to 2.3x the time)."""
    i, o, r, kw = args
    spec = make_spec("tt", i, o, r, **kw)
    for rows in (8, 64, 512, 4096, 65536):
        assert _segment_plan_cost_ratio(spec, rows) == pytest.approx(1.0), rows


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(2, 12), min_size=2, max_size=3), st.lists(st.integers(2, 12), min_size=1, max_size=3),
       st.integers(1, 16))
@example([5, 5], [12], 12)   # 10.1% at 8 rows while the first segment ran its last row count's plan
def test_the_compiled_plan_of_any_row_count_from_eight_up_costs_what_the_best_plan_does(ins, outs, rank):
    """Only segments narrower than MIN_SEGMENT_WIDTH join their neighbour, and the first segment runs the plan
    with the least worst cost over its counts from 8 up: at any sampled row count from 8 up, the program a
    compiled layer picks costs within 10% of the best plan for that count (the most seen: 6.7%)."""
    spec = make_spec("tt", math.prod(ins), math.prod(outs), rank, in_modes=ins, out_modes=outs)
    for rows in (8, 9, 13, 31, 100, 1000, 4096, 50000):
        assert _segment_plan_cost_ratio(spec, rows) <= 1.10, rows
