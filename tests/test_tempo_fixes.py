"""Tempo on torch's own transformer modules, at 16-bit dtypes, in eval mode and under torch.export.

References are computed another way than the code under test: the untouched model under ordinary autograd
(dropout masks replayed with dropout_mask, in float64), torch's own ops at bf16 / fp16 tolerances, and the
eager model against the exported program.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera_compile.ops.buffers as buffers
import comera_compile.ops.gelu as gelu_module
from comera_compile.memory import saved_bytes
from comera_compile.ops.attention import softmax_dropout_matmul
from comera_compile.ops.gelu import gelu, gelu_dropout
from comera_compile.ops.layer_norm import layer_norm
from comera_compile.ops.tempo_modules import TempoDropout, TempoGELU, TempoLayerNorm
from comera_compile.passes.module.tempo import tempo
from tempo_helpers import MaskReplayDropout, close, same_mask_dropout

pytestmark = pytest.mark.usefixtures("single_thread")   # small tensors (see conftest.single_thread)


def _replay_dropouts(model: nn.Module) -> nn.Module:
    for name, mod in list(model.named_modules()):
        if type(mod) is nn.Dropout:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, MaskReplayDropout(mod.p))
    return model


class Encoder(nn.Module):
    def __init__(self, norm_first: bool, attn_dropout: float = 0.0) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.2, activation="gelu", batch_first=True,
                                           norm_first=norm_first)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        for m in self.modules():
            if isinstance(m, nn.MultiheadAttention):
                m.dropout = attn_dropout   # torch's own attention dropout would draw from the generator too
        self.head = nn.Linear(16, 3)

    def forward(self, x, mask, padding):
        return self.head(self.enc(x, mask=mask, src_key_padding_mask=padding))


def _inputs():
    torch.manual_seed(5)
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    causal = nn.Transformer.generate_square_subsequent_mask(7, dtype=torch.float64)
    padding = torch.zeros(3, 7, dtype=torch.bool)
    padding[1, 5:] = True
    return x, causal, padding


def _run(model, x, causal, padding, seed=3):
    """Output and the gradients of the input and of every parameter, for a fixed upstream gradient."""
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)
    out = model(x, causal, padding)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
    return [out.detach(), x.grad] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("norm_first", [False, True])
def test_tempo_reaches_inside_torch_s_transformer_layers_with_the_same_numbers(norm_first):
    torch.manual_seed(0)
    base = Encoder(norm_first).double()
    ref = _replay_dropouts(copy.deepcopy(base))
    given = copy.deepcopy(base)
    model = tempo(given)
    assert model.tempo_summary.counts() == {"gelu+dropout": 2, "dropout": 4, "layer_norm": 4}
    # the model given keeps its own modules; the result shares its parameters
    assert type(given.enc.layers[0].norm1) is nn.LayerNorm and type(given.enc.layers[1].dropout1) is nn.Dropout
    assert model.enc.layers[0].norm1.weight is given.enc.layers[0].norm1.weight
    assert type(model.enc.layers[0].norm1) is TempoLayerNorm and type(model.enc.layers[1].dropout1) is TempoDropout
    x, causal, padding = _inputs()
    for a, b in zip(_run(model, x, causal, padding), _run(ref, x, causal, padding)):
        close(a, b, torch.float64)
    for m in (base, model):
        m.eval()
    for grad in (True, False):   # eval, with grad (torch's slow path) and without (its fused fast path)
        with torch.set_grad_enabled(grad):
            close(model(x, causal, padding), base(x, causal, padding), torch.float64)
    model.train()
    assert saved_bytes(model, x.requires_grad_(), causal, padding, exclude=model) < \
        0.8 * saved_bytes(ref, x, causal, padding, exclude=ref)


def test_what_tempo_cannot_reach_inside_torch_s_modules_is_listed_and_warned():
    torch.manual_seed(0)
    base = Encoder(False, attn_dropout=0.1)
    with pytest.warns(UserWarning, match="no Tempo op can reach"):
        model = tempo(copy.deepcopy(base))
    kept = model.tempo_summary.kept
    attention = {w for w, why in kept.items() if "MultiheadAttention" in why}
    assert attention == {f"enc.layers.{i}.self_attn" for i in (0, 1)}
    x, causal, padding = _inputs()
    x = x.float()
    close(model.eval()(x, causal.float(), padding), base.eval()(x, causal.float(), padding), torch.float32)

    torch.manual_seed(0)
    full = nn.Transformer(16, 2, 1, 1, 32, dropout=0.1, activation="gelu", batch_first=True)
    want = copy.deepcopy(full).eval()
    with pytest.warns(UserWarning, match="no Tempo op can reach"):
        got = tempo(full)
    assert got.tempo_summary.counts()["layer_norm"] == 7 and got.tempo_summary.counts()["gelu+dropout"] == 2
    assert sum("MultiheadAttention" in why for why in got.tempo_summary.kept.values()) == 3
    src, tgt = torch.randn(2, 5, 16), torch.randn(2, 4, 16)
    close(got.eval()(src, tgt), want(src, tgt), torch.float32)


# ---------------------------------------------------------------------------------------------------------
# 16-bit dtypes


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget which (op, dtype) fallbacks have warned in this process."""
    monkeypatch.setattr(buffers, "_WARNED", set())


def _warned(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in seen if issubclass(w.category, buffers.TempoDtypeWarning)]


def test_a_dtype_fallback_warns_once_naming_the_op_and_the_dtype(fresh_warnings):
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(8, requires_grad=True)
    first = _warned(lambda: gelu(x))
    assert len(first) == 1 and "gelu" in first[0] and "bfloat16" in first[0]
    assert _warned(lambda: gelu(x)) == []                         # once
    assert "float16" in _warned(lambda: gelu(x.detach().half().requires_grad_()))[0]
    assert "layer_norm" in _warned(lambda: layer_norm(x, 8, w))[0]   # autocast's mix: bf16 input, fp32 weight
    with torch.no_grad():                                          # nothing to save: no warning
        assert _warned(lambda: gelu(x.float().bfloat16())) == [] and _warned(lambda: layer_norm(x, 8, w)) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_gelu_dropout_and_attention_match_torch_and_keep_less(dtype):
    torch.manual_seed(0)
    x = torch.randn(64, 96, dtype=dtype, requires_grad=True)
    g = torch.randn(64, 96, dtype=dtype)
    lin = nn.Linear(96, 8).to(dtype)
    ref_drop = same_mask_dropout(0.2, seed=4)
    want = ref_drop(F.gelu(x))
    got = gelu_dropout(x, 0.2, generator=torch.Generator().manual_seed(4))
    # with the next layer, which keeps the dropout output: torch keeps GELU's input and a byte mask
    eager_bytes = saved_bytes(lambda: lin(F.dropout(F.gelu(x), 0.2)), exclude=lin)
    tempo_bytes = saved_bytes(lambda: lin(gelu_dropout(x, 0.2)), exclude=lin)
    torch.testing.assert_close(got, want)
    (want_grad,) = torch.autograd.grad(want, x, g)
    (got_grad,) = torch.autograd.grad(got, x, g)
    torch.testing.assert_close(got_grad, want_grad)
    assert tempo_bytes < eager_bytes   # the mask as bits, not bytes

    scores = torch.randn(2, 3, 10, 10, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 3, 10, 4, dtype=dtype, requires_grad=True)
    go = torch.randn(2, 3, 10, 4, dtype=dtype)
    want = ref_drop(torch.softmax(scores, -1)) @ v
    got = softmax_dropout_matmul(scores, v, 0.2, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, (scores, v), go), torch.autograd.grad(want, (scores, v), go)):
        torch.testing.assert_close(a, b)
    assert saved_bytes(softmax_dropout_matmul, scores, v, 0.2) < \
        saved_bytes(lambda: F.dropout(torch.softmax(scores, -1), 0.2) @ v)


# ---------------------------------------------------------------------------------------------------------
# Eval mode, no_grad, torch.export


def _autograd_nodes(t: torch.Tensor) -> set[str]:
    seen, stack, names = set(), [t.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        stack += [nxt for nxt, _ in fn.next_functions]
    return names


class Block(nn.Module):
    """Attention and a GELU MLP from modules the FX pass rewrites (softmax -> dropout -> matmul included)."""

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(16, 48), nn.Linear(16, 16)
        self.ln1, self.ln2 = nn.LayerNorm(16), nn.LayerNorm(16)
        self.ff1, self.ff2, self.act = nn.Linear(16, 32), nn.Linear(32, 16), nn.GELU()
        self.drop, self.adrop = nn.Dropout(p), nn.Dropout(p)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).split(16, -1)
        a = self.adrop(torch.softmax(q @ k.transpose(-1, -2) / 4.0 + mask, dim=-1)) @ v
        x = self.ln1(x + self.drop(self.o(a)))
        return self.ln2(x + self.ff2(self.drop(self.act(self.ff1(x)))))


def test_eval_mode_runs_torch_s_ops_even_with_grad_enabled():
    torch.manual_seed(0)
    base = Block().eval()
    model = tempo(copy.deepcopy(base)).eval()
    assert set(model.tempo_summary.counts()) == {"attention", "gelu+dropout", "dropout", "layer_norm"}
    x, mask = torch.randn(2, 5, 16, requires_grad=True), torch.zeros(5, 5)
    got, want = model(x, mask), base(x, mask)
    assert not any(n.startswith("_") for n in _autograd_nodes(got))   # no Tempo autograd Function
    assert torch.equal(got, want)
    assert torch.equal(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0])
    for mod, plain in ((TempoGELU(), F.gelu), (TempoLayerNorm(16), lambda t: F.layer_norm(t, (16,)))):
        out = mod.eval()(x)
        assert not type(out.grad_fn).__name__.startswith("_") and torch.equal(out, plain(x))


def test_gelu_checks_its_form_without_building_tables(monkeypatch):
    monkeypatch.setattr(gelu_module, "_INVERSES", {})
    x = torch.randn(8)
    assert torch.equal(gelu(x, "tanh"), F.gelu(x, approximate="tanh"))
    assert torch.equal(gelu_dropout(x.requires_grad_(), 0.5, False), F.gelu(x))
    assert gelu_module._INVERSES == {}
    with pytest.raises(ValueError, match="'none' or 'tanh'"):
        gelu(x, "sigmoid")
    with pytest.raises(ValueError, match="'none' or 'tanh'"):
        gelu_dropout(x, 0.5, True, "sigmoid")


@pytest.mark.parametrize("grad", [True, False])
def test_torch_export_of_a_tempo_model_matches_the_eager_model(grad, monkeypatch):
    monkeypatch.setattr(gelu_module, "_INVERSES", {})   # as in a fresh process: no table built yet
    torch.manual_seed(1)
    x, mask = torch.randn(2, 5, 16), torch.zeros(5, 5)
    mask[:, 4] = -math.inf
    base = Block().eval()
    model = tempo(copy.deepcopy(base)).eval()
    with torch.set_grad_enabled(grad):
        program = torch.export.export(model, (x, mask))
    close(program.module()(x, mask), base(x, mask), torch.float32)
    train_base = Block(p=0.0)   # training mode: deterministic with p = 0
    with torch.set_grad_enabled(grad):
        program = torch.export.export(tempo(copy.deepcopy(train_base)), (x, mask))
    close(program.module()(x, mask), train_base(x, mask), torch.float32)


def _graph_sizes(fn, *args) -> list[int]:
    """The node counts of the graphs torch.compile captures for fn(*args)."""
    sizes: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        sizes.append(len(gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*args)
    return sizes


def test_gelu_tables_are_built_before_a_compiled_forward_and_never_traced(monkeypatch):
    """A Tempo GELU's tables (180 steps of float64 loops) are built when a pass swaps it in, never in a trace:
    under torch.compile the op runs torch's GELU (buffers.traced), so a direct call of it builds no table and
    its graph is torch's.  Traced, their loops became graphs of thousands of nodes that took Inductor more than
    nine minutes."""
    monkeypatch.setattr(gelu_module, "_INVERSES", {})
    model = tempo(nn.Sequential(nn.Linear(8, 16), nn.GELU(approximate="tanh"), nn.Linear(16, 2)).double())
    assert set(gelu_module._INVERSES) == {"tanh"}   # built by the swap, before any forward
    monkeypatch.setattr(gelu_module, "_INVERSES", {})
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    sizes = _graph_sizes(lambda t: gelu(t @ t.T).sum(), x)
    assert gelu_module._INVERSES == {} and max(sizes) < 20, sizes
    torch._dynamo.reset()
    want = model(x)
    torch.testing.assert_close(torch.compile(model, backend="eager")(x), want)

class _Encoderish(nn.Module):
    """An encoder block of one's own: LayerNorm, GELU then dropout, softmax -> dropout -> matmul."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.qkv, self.up, self.down = nn.Linear(16, 48), nn.Linear(16, 32), nn.Linear(32, 16)
        self.norm, self.act, self.drop, self.attn_drop = nn.LayerNorm(16), nn.GELU(), nn.Dropout(p), nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        h = x + self.attn_drop((q @ k.transpose(-1, -2)).softmax(-1)) @ v
        return h + self.down(self.drop(self.act(self.up(self.norm(h)))))


@pytest.mark.parametrize("p", [0.1, 0.0])
def test_a_tempo_model_compiles_to_one_graph_as_torch_s_ops(p, fresh_dynamo):
    """cc.tempo, then torch.compile with backend "comera": one graph, no graph break, the gradients of the model
    before tempo.  The ops run torch's ops under torch.compile (buffers.traced); traced, their data-dependent
    shapes and bit-mask draws broke the graph at every op and made Inductor fail on a BERT-base layer."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    ref = _Encoderish(p)
    model = tempo(copy.deepcopy(ref))
    assert model.tempo_summary.counts() == {"attention": 1, "gelu+dropout": 1, "layer_norm": 1}
    compiled = torch.compile(model, backend="comera")
    x = torch.randn(2, 8, 16)
    compiled(x).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])
    if p == 0.0:   # no draws: the same numbers
        ref(x).sum().backward()
        got = dict(model.named_parameters())
        for name, b in ref.named_parameters():
            torch.testing.assert_close(got[name].grad, b.grad, rtol=1e-5, atol=1e-6)
