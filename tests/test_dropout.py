"""ops.hash_dropout and passes.fx.dropout: hash-based dropout masks have dropout's distribution, scaling and
gradient, in eager and under Inductor, and the graph pass swaps every dropout of a GraphModule."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from comera_compile.ops.hash_dropout import _C1, _C2, HashDropout, hash_dropout
from comera_compile.passes.fx import dropout as dropout_pass
from comera_compile.passes.fx.dropout import fast_dropout
from comera_compile.passes.joint.recompute import recompute_hash_masks
from helpers import second_compile_from_aot_cache


@pytest.fixture(params=["int32", "int64"])
def index_width(request, monkeypatch):
    """Both hash paths: int32 (tensors under 2^31 elements) and int64 (larger ones), forced on small data."""
    if request.param == "int64":
        monkeypatch.setattr("comera_compile.ops.hash_dropout._INT32_INDICES", 0)
    return request.param


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction_and_scale(p, index_width):
    torch.manual_seed(0)
    x = torch.rand(400_000, dtype=torch.float64) + 0.5   # never zero, so a zero output means dropped
    y = hash_dropout(x, p)
    kept = y != 0
    n = x.numel()
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(kept.sum().item() - n * (1 - p)) < 5 * sigma
    torch.testing.assert_close(y[kept], x[kept] * (1.0 / (1.0 - p)), rtol=1e-15, atol=0)


def test_mask_has_no_structure(index_width):
    """Neighbouring elements, rows and columns are kept independently of each other."""
    torch.manual_seed(1)
    keep = (hash_dropout(torch.ones(1024, 1024), 0.5) != 0).double()
    flat = keep.flatten()
    a, b = flat[:-1] - flat.mean(), flat[1:] - flat.mean()
    corr = (a * b).mean() / (a.std() * b.std())
    assert abs(corr.item()) < 5 / math.sqrt(flat.numel())
    for per in (keep.mean(0), keep.mean(1)):   # 1024 per column/row: sd 1/64
        assert (per - 0.5).abs().max().item() < 5 / 64


def test_seeded_and_fresh_per_call(index_width):
    x = torch.ones(10_000)
    torch.manual_seed(3)
    a, b = hash_dropout(x, 0.3), hash_dropout(x, 0.3)
    torch.manual_seed(3)
    assert torch.equal(hash_dropout(x, 0.3), a)
    assert not torch.equal(a, b)


def _python_keep(n: int, p: float, words: list[int]) -> torch.Tensor:
    """The documented mask in Python integers: element i kept when the low 31 bits of the 32-bit mix of
    (i * a + b) mod 2^32 are at least p * 2^31, a = 2 w0 + 1, b = w1 (unsigned arithmetic mod 2^32)."""
    a, b = 2 * words[0] + 1, words[1]
    keep = []
    for i in range(n):
        h = (i * a + b) % 2**32
        h ^= h >> 16
        h = h * _C1 % 2**32
        h ^= h >> 15
        h = h * _C2 % 2**32
        h ^= h >> 16
        keep.append((h & 0x7FFFFFFF) >= round(p * 2**31))
    return torch.tensor(keep)


@pytest.mark.parametrize("compiled", [False, True])
def test_int32_path_masks_are_the_documented_hash(compiled):
    """Eager and in Inductor's kernel (fallback_random: the random words from torch's generator), the masks
    of the int32 path are the unsigned 32-bit hash computed in Python integers."""
    import comera_compile  # noqa: F401  (registers the backend)

    n, p = 3000, 0.4
    f = lambda x: hash_dropout(x, p)
    if compiled:
        torch._dynamo.reset()
        f = torch.compile(f, backend="comera", fullgraph=True)
    with torch._inductor.config.patch(fallback_random=True):
        torch.manual_seed(11)
        y = f(torch.ones(n))
    torch.manual_seed(11)
    words = torch.randint(0, 2**30, (2,), dtype=torch.int32).tolist()
    assert torch.equal(y != 0, _python_keep(n, p, words))


def test_identity_cases_and_errors():
    x = torch.randn(5, 7)
    assert hash_dropout(x, 0.5, training=False) is x
    assert hash_dropout(x, 0.0) is x
    assert torch.equal(hash_dropout(x, 1.0), torch.zeros_like(x))
    with pytest.raises(ValueError, match="between 0 and 1"):
        hash_dropout(x, 1.5)


def test_inplace_modifies_input():
    torch.manual_seed(0)
    x = torch.rand(1000) + 1
    y = hash_dropout(x, 0.5, inplace=True)
    assert y.data_ptr() == x.data_ptr() and (x == 0).any()


@settings(max_examples=20, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=0, max_size=4),
       p=st.floats(0.05, 0.95), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_gradient_is_mask_times_scale(shape, p, dtype):
    x = (torch.rand(shape, dtype=dtype) + 1).requires_grad_()
    w = torch.randn(shape, dtype=dtype)
    y = hash_dropout(x, p)
    (y * w).sum().backward()
    assert y.shape == x.shape and y.dtype == dtype
    expected = (y.detach() != 0).to(dtype) * w * (1.0 / (1.0 - p))
    torch.testing.assert_close(x.grad, expected)


@pytest.mark.parametrize("backend", ["inductor", "comera"])
def test_compiled_masks_agree_between_forward_and_backward(backend):
    """Under Inductor the backward may recompute the mask (under "comera" it always does): it must be
    the forward's mask.  The mask is read off the forward output (inputs are never zero, so an output is
    zero exactly where dropped), and the input gradient checked against upstream * mask / (1 - p)."""
    import comera_compile  # noqa: F401  (registers the backend)

    p = 0.25

    def f(x, w):
        return hash_dropout(x * w, p) + 1.0

    torch._dynamo.reset()
    cf = torch.compile(f, backend=backend, fullgraph=True)
    torch.manual_seed(0)
    x = (torch.rand(64, 33, dtype=torch.float64) + 1).requires_grad_()
    w = torch.rand(64, 33, dtype=torch.float64) + 0.5        # x * w never zero
    y = cf(x, w)
    kept = (y.detach() - 1.0) != 0                            # the forward's mask
    upstream = torch.randn(64, 33, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y.backward(upstream)
    torch.testing.assert_close(x.grad, upstream * kept * w / (1 - p), rtol=1e-14, atol=0)
    assert abs(kept.double().mean().item() - (1 - p)) < 0.05
    assert not torch.equal(kept, cf(x, w).detach() != 1.0)   # the next call draws another mask


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return F.dropout(self.drop(self.lin(x)), 0.2, training=self.training)


class _DropNet(nn.Module):
    """Two linears with dropout between them: an nn.Dropout module, or F.dropout(training=self.training)."""

    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.functional = functional
        self.up = nn.Linear(16, 48)
        self.drop = nn.Dropout(0.3)
        self.down = nn.Linear(48, 5)

    def forward(self, x):
        h = torch.tanh(self.up(x))
        h = F.dropout(h, 0.3, training=self.training) if self.functional else self.drop(h)
        return self.down(F.gelu(h))


@pytest.mark.parametrize("functional", [False, True])
def test_compiled_model_with_dropout_matches_eager_hash_dropout(functional):
    """torch.compile(model, backend="comera") (fast_dropout on by default) against the same model run
    eagerly with hash dropout: outputs and every parameter's gradient agree, step after step.  Inductor's
    fallback_random draws the two random words with torch's own generator, as eager does, so one seed gives
    both the same masks; the mask arithmetic and its recomputation in the backward stay compiled."""
    import comera_compile  # noqa: F401  (registers the backend)

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _DropNet(functional).double()
    ref = copy.deepcopy(model)
    ref.drop = HashDropout(0.3)

    def eager(x):   # the reference forward, with hash_dropout in place of F.dropout
        h = torch.tanh(ref.up(x))
        h = hash_dropout(h, 0.3, training=ref.training) if functional else ref.drop(h)
        return ref.down(F.gelu(h))

    compiled = torch.compile(model, backend="comera")
    x = torch.randn(12, 16, dtype=torch.float64)
    upstream = torch.randn(12, 5, dtype=torch.float64)
    with torch._inductor.config.patch(fallback_random=True):
        for seed in (1, 2):
            torch.manual_seed(seed)
            got = compiled(x)
            got.backward(upstream)
            torch.manual_seed(seed)
            want = eager(x)
            want.backward(upstream)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            with torch.no_grad():   # dropout did drop something
                assert not torch.allclose(got, ref.down(F.gelu(torch.tanh(ref.up(x)))))
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)
            model.zero_grad()
            ref.zero_grad()
        model.eval()
        ref.eval()
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-12, atol=1e-12)   # eval: no dropout


class _ThreeDrops(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 24)
        self.down = nn.Linear(24, 5)

    def forward(self, x):
        h = F.dropout(torch.tanh(self.up(x)), 0.3, training=self.training)
        h = F.dropout(h * 2.0, 0.5, training=self.training) + F.dropout(h, 0.1, training=self.training)
        return self.down(h)


def test_dropouts_of_a_graph_share_one_draw_and_mask_as_eager_calls_do():
    """The pass gives a graph's dropout calls one draw of random words (one kernel, not one per call); with
    the generator's own bits (fallback_random) each call still masks as an eager hash_dropout call drawing
    its own words in turn: outputs and gradients equal, in float64."""
    import comera_compile  # noqa: F401  (registers the backend)
    from comera_compile.ops.hash_dropout import draw_words

    draws = []

    def counting(gm, example_inputs):
        fast_dropout(gm, example_inputs)
        draws.append(sum(n.target is draw_words for n in gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _ThreeDrops().double()
    x = torch.randn(12, 16, dtype=torch.float64)
    torch.compile(model, backend=counting)(x)
    assert draws == [1]
    model.eval()   # an eval graph draws no words: the generator's state is left as eager leaves it
    state = torch.get_rng_state()
    torch.compile(model, backend=counting)(x)
    assert draws == [1, 0] and torch.equal(torch.get_rng_state(), state)
    model.train()

    def eager(x):
        h = hash_dropout(torch.tanh(model.up(x)), 0.3)
        h = hash_dropout(h * 2.0, 0.5) + hash_dropout(h, 0.1)
        return model.down(h)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="comera")
    upstream = torch.randn(12, 5, dtype=torch.float64)
    with torch._inductor.config.patch(fallback_random=True):
        torch.manual_seed(3)
        got = compiled(x)
        got.backward(upstream)
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        torch.manual_seed(3)
        want = eager(x)
        want.backward(upstream)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-12, atol=1e-12)
    torch._dynamo.reset()


def test_a_second_compile_is_served_by_aotautograd_s_cache_and_masks_as_eager_calls_do():
    """The hash_dropout and draw_words calls the pass puts into dynamo's graph are marked cacheable, so a
    second compile of the same model (a new run, another process, or after torch._dynamo.reset) finds its
    graph in AOTAutograd's cache instead of tracing the joint graph again; what the cache serves computes
    what eager hash_dropout calls do (float64, the generator's own bits)."""
    import comera_compile  # noqa: F401  (registers the backend)

    torch.manual_seed(0)
    model = _ThreeDrops().double()
    x = torch.randn(12, 16, dtype=torch.float64)

    def eager(x):
        h = hash_dropout(torch.tanh(model.up(x)), 0.3)
        h = hash_dropout(h * 2.0, 0.5) + hash_dropout(h, 0.1)
        return model.down(h)

    def step(forward):
        torch.manual_seed(3)
        out = forward(x)
        out.sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        return out.detach(), grads

    with torch._inductor.config.patch(fallback_random=True):
        torch._dynamo.reset()
        got, got_grads = second_compile_from_aot_cache(lambda: torch.compile(model, backend="comera"), step)
        want, want_grads = step(eager)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    torch._dynamo.reset()


def test_graph_pass_swaps_modules_and_calls():
    gm = torch.fx.symbolic_trace(_Net())
    assert fast_dropout(gm).count == 2
    assert isinstance(gm.drop, HashDropout) and gm.drop.p == 0.5
    assert any(n.target is hash_dropout for n in gm.graph.nodes)
    gm.eval()
    x = torch.randn(3, 8)
    torch.testing.assert_close(gm.drop(x), x)


class _TwiceDropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x) + self.drop(x * 2)


def test_graph_pass_counts_each_call_of_a_module_called_twice():
    """The count is the sites rewritten: one nn.Dropout called twice is two, as the backend's log says."""
    gm = torch.fx.symbolic_trace(_TwiceDropped())
    assert fast_dropout(gm).count == 2 and isinstance(gm.drop, HashDropout)


def test_backend_runs_the_pass_by_default(monkeypatch):
    import comera_compile  # noqa: F401  (registers the backend)

    calls = []
    real = dropout_pass.fast_dropout
    monkeypatch.setattr(dropout_pass, "fast_dropout", lambda gm, *rest: calls.append(1) or real(gm, *rest))
    torch._dynamo.reset()
    f = torch.compile(lambda x: F.dropout(x, 0.5, training=True), backend="comera")
    y = f(torch.ones(20_000))
    assert calls and abs((y == 0).double().mean().item() - 0.5) < 0.02
    torch._dynamo.reset()
    calls.clear()
    g = torch.compile(lambda x: F.dropout(x, 0.5, training=True) + 1, backend="comera",
                      options={"fast_dropout": False})
    g(torch.ones(10))
    assert not calls


def _saved_tensors(fn, *args):
    """(dtype, numel) of every tensor autograd saves while fn runs."""
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, saved


def test_backend_recomputes_the_masks_instead_of_saving_them():
    """Under backend "comera" the backward of a small encoder recomputes its hash masks from the random
    words of its dropouts, two each, drawn once for the graph (Inductor's default partitioning saves
    several bool masks here)."""
    import comera_compile  # noqa: F401  (registers the backend)
    from comera_compile.examples import six_encoder

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = six_encoder.build(layers=2, d_model=64, heads=4, ffn=256, vocab_size=100, max_positions=32)
    ids, seg, mask = six_encoder.example_inputs(model, 2, 16)
    f = torch.compile(lambda *a: model(*a).square().sum(), backend="comera")
    loss, saved = _saved_tensors(f, ids, seg, mask)
    assert not [s for s in saved if s[0] == torch.bool], saved
    words = [numel for dtype, numel in saved if dtype == torch.int32]
    assert words == [2 * (1 + 3 * 2)], saved   # embedding dropout, three per layer: one draw
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_recompute_pass_tags_the_mask_and_the_forward_dropout_output_only():
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import must_recompute

    tagged = {}

    def partition(joint, joint_inputs, **kwargs):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        recompute_hash_masks(joint.graph)
        tangents = [n for n in joint.graph.nodes if n.name.startswith("tangents")]
        tagged.update({n.name: (n.meta["val"].dtype, any(t in n.all_input_nodes for t in tangents))
                       for n in joint.graph.nodes if must_recompute(n)})
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    torch._dynamo.reset()
    f = torch.compile(lambda x: F.gelu(hash_dropout(x * 2.0, 0.5)),
                      backend=aot_autograd(fw_compiler=lambda g, _: g, partition_fn=partition))
    f(torch.randn(100, requires_grad=True)).sum().backward()
    dtypes = [d for d, _ in tagged.values()]
    assert torch.bool in dtypes
    assert dtypes.count(torch.float32) == 2, tagged      # input x mask, then x scale; not x * 2.0, not the GELU
    assert not any(uses_tangent for _, uses_tangent in tagged.values()), tagged


def test_attention_dropout_output_is_recomputed_not_saved_and_gradients_match_eager():
    """Attention's dropped probabilities feed the values' gradient.  Under backend "comera" output and
    gradients equal eager hash_dropout's in float64 (fallback_random: the same words), and in an encoder
    the backward recomputes the dropped probabilities from the scores it keeps anyway: one
    probabilities-sized tensor saved per layer, not two."""
    import comera_compile  # noqa: F401  (registers the backend)

    def attend(q, k, v):
        return hash_dropout(torch.softmax(q @ k.transpose(1, 2), -1), 0.1) @ v

    torch._dynamo.reset()
    q, k, v = (torch.randn(4, 32, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    upstream = torch.randn(4, 32, 8, dtype=torch.float64)
    compiled = torch.compile(attend, backend="comera")
    with torch._inductor.config.patch(fallback_random=True):
        torch.manual_seed(3)
        got, saved = _saved_tensors(compiled, q, k, v)
        got.backward(upstream)
        grads = [t.grad.clone() for t in (q, k, v)]
        torch.manual_seed(3)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        want = attend(*leaves)
        want.backward(upstream)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, leaf in zip(grads, leaves):
        torch.testing.assert_close(g, leaf.grad, rtol=1e-12, atol=1e-12)

    from comera_compile.examples import six_encoder

    torch._dynamo.reset()
    torch.manual_seed(0)   # 2 x 4 heads x 16^2 probabilities per layer; no other tensor has 2,048 elements
    model = six_encoder.build(layers=2, d_model=48, heads=4, ffn=256, vocab_size=100, max_positions=32)
    f = torch.compile(lambda *a: model(*a).square().sum(), backend="comera")
    _, saved = _saved_tensors(f, *six_encoder.example_inputs(model, 2, 16))
    assert [n for d, n in saved if n == 2 * 4 * 16 * 16] == [2048, 2048], saved   # the scores, per layer
