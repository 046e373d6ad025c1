"""The contraction-order search: exact against brute force, never worse than fixed orders."""

from __future__ import annotations

import itertools
import math
import random

import opt_einsum
import pytest
import torch
from hypothesis import given, settings, strategies as st

from comera_compile import network as nw
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
    (transitively) holds a tensor needing a gradient."""
    sizes = net.size_of
    ops = [(t.indices, t.requires_grad) for t in net.tensors]
    total = 0
    for i, j in path:
        (a, ga), (b, gb) = ops[i], ops[j]
        for k in sorted((i, j), reverse=True):
            ops.pop(k)
        rest = set(net.output).union(*(o[0] for o in ops))
        out = "".join(c for c in dict.fromkeys(a + b) if c in rest) if ops else net.output
        inv = set(a) | set(b)
        f = math.prod(sizes[c] for c in inv) * (2 if inv - set(out) else 1)
        f += traffic_weight * sum(math.prod(sizes[c] for c in t) for t in (a, b, out))
        total += f * (1 + (ga + gb if training else 0))
        ops.append((out, ga or gb))
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


@pytest.mark.parametrize("n_tensors,trials", [(5, 12), (6, 6), (7, 2)])
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
        # opt_einsum's forward-optimal path, costed forward + backward by the independent evaluator
        assert plan.training_flops <= _path_cost(net, _opt_einsum_tree(net))
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
    monkeypatch.setattr(nw, "search", lambda *a, **k: searches.append(a) or real_search(*a, **k))
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


def test_network_graph_has_tensors_as_nodes_and_bonds_as_edges():
    spec = make_spec("tt", 768, 768, 30, (12, 8, 8), (8, 8, 12))
    g = nw.tt_linear_network(spec, 8).graph()
    assert g.number_of_nodes() == 7
    # x shares 3 input modes with the input cores; the 6 cores form a chain of 5 bonds
    assert g.number_of_edges() == 3 + 5
    emb = nw.ttm_embedding_network(make_spec("ttm", 1000, 64, 8, (10, 10, 10), (4, 4, 4)), 16)
    assert len(emb.tensors) == 3 and all(t.indices[0] == emb.output[0] for t in emb.tensors)
