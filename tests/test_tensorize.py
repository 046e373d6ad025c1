"""tensorize on own models (FX path) and on transformers models (module-by-module path)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera_compile as cc
from comera_compile.examples import six_encoder
from comera_compile.embedding import TTEmbedding
from comera_compile.layers import TTLinear
from helpers import FULL, LargestAllocation

def _small_encoder(**kw) -> six_encoder.SixEncoder:
    cfg = dict(vocab_size=97, d_model=48, heads=4, ffn=96, layers=2, max_positions=32, num_classes=3)
    cfg.update(kw)
    return six_encoder.build(**cfg)


def _snapshot(model: nn.Module) -> tuple[dict, list]:
    return ({k: v.clone() for k, v in model.state_dict().items()},
            [(n, type(m)) for n, m in model.named_modules()])


def _assert_untouched(model: nn.Module, snap) -> None:
    state, structure = snap
    assert [(n, type(m)) for n, m in model.named_modules()] == structure
    now = model.state_dict()
    assert now.keys() == state.keys()
    for k in state:
        assert torch.equal(now[k], state[k]), k


def test_six_encoder_preset_parameter_count_matches_formula():
    dense = six_encoder.build()
    dense_params = sum(p.numel() for p in dense.parameters())
    assert round(dense_params / 1e6, 1) == 67.0
    tt = cc.tensorize(dense, preset="comera-six-encoder", inplace=True)

    def tt_count(sizes, ranks):  # PAPERS.md: sum_k r_{k-1} * size_k * r_k, plus one gate per internal rank
        return sum(ranks[k] * s * ranks[k + 1] for k, s in enumerate(sizes)) + sum(ranks[1:-1])

    r = 30
    attn = tt_count([12, 8, 8, 8, 8, 12], [1, 12, r, r, r, 12, 1])
    up = tt_count([12, 8, 8, 12, 16, 16], [1, 12, r, r, r, 16, 1])
    down = tt_count([16, 16, 12, 8, 8, 12], [1, 16, r, r, r, 12, 1])
    word = tt_count([16 * 4, 20 * 4, 10 * 8, 10 * 6], [1, 32, 32, 32, 1])
    d, ffn = 768, 3072
    per_layer = 4 * (attn + d) + (up + ffn) + (down + d) + 2 * 2 * d
    expected = (word + 512 * d + 2 * d + 2 * d      # TT word embedding, dense positions, segments, norm
                + 6 * per_layer
                + attn + d + d * 3 + 3)           # classifier: TT fc1, dense fc2
    total = sum(p.numel() for p in tt.parameters())
    assert total == expected
    assert dense_params / total >= 40
    assert type(tt) is type(dense)  # the user's model, its layers swapped
    traced = cc.tensorize(six_encoder.build(layers=1), preset="comera-six-encoder", trace=True)
    assert isinstance(traced, torch.fx.GraphModule) and "tt_layers_0_ffn_up" in traced.code
    ranks = {n: m.ranks for n, m in tt.named_modules() if isinstance(m, TTLinear)}
    assert ranks["layers.3.attention.v"] == (1, 12, 30, 30, 30, 12, 1)
    assert ranks["layers.3.ffn_up"] == (1, 12, 30, 30, 30, 16, 1)
    assert tt.word.spec.in_modes == (16, 20, 10, 10) and tt.word.spec.out_modes == (4, 4, 8, 6)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_full_rank_svd_reproduces_dense_model(dtype, tol):
    torch.manual_seed(0)
    dense = _small_encoder().to(dtype).eval()
    snap = _snapshot(dense)
    tt = cc.tensorize(dense, rank=FULL, init="svd", min_features=1).eval()
    _assert_untouched(dense, snap)  # inplace=False: the user's model is not modified
    assert type(tt) is type(dense)
    n_tt = sum(isinstance(m, (TTLinear, TTEmbedding)) for m in tt.modules())
    assert n_tt == len(tt.comera_summary.rewritten) > 10
    ids, seg, mask = six_encoder.example_inputs(dense, batch=3, seq=11)
    mask[0, 7:] = 0
    for args in [(ids,), (ids, seg), (ids, seg, mask)]:
        ref, out = dense(*args), tt(*args)
        assert (out - ref).norm() / ref.norm() < tol


def test_tensorized_model_trains_and_does_not_share_parameters_with_original():
    torch.manual_seed(0)
    dense = _small_encoder()
    before = _snapshot(dense)
    tt = cc.tensorize(dense, rank=4, min_features=16).eval()  # eval: no dropout noise in this check
    assert not {id(p) for p in tt.parameters()} & {id(p) for p in dense.parameters()}
    opt = torch.optim.AdamW(tt.parameters(), lr=3e-3)
    ids, seg, mask = six_encoder.example_inputs(dense, batch=4, seq=8)
    y = torch.tensor([0, 1, 2, 1])
    losses = []
    for _ in range(20):
        loss = nn.functional.cross_entropy(tt(ids, seg, mask), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    _assert_untouched(dense, before)


def test_min_features_exclude_include_and_summary():
    model = _small_encoder()
    tt = cc.tensorize(model, rank=4, min_features=40, exclude=["layers.1.*"])
    s = tt.comera_summary
    for name in ["word", "layers.0.attention.q", "layers.0.ffn_up", "fc1"]:
        assert name in s.rewritten and isinstance(tt.get_submodule(name), (TTLinear, TTEmbedding))
    assert "min_features" in s.kept_dense["position"]      # 32 x 48: smaller side below 40
    assert "min_features" in s.kept_dense["fc2"]           # 48 -> 3
    assert s.kept_dense["layers.1.ffn_up"] == "excluded"
    assert type(tt.get_submodule("layers.1.ffn_up")) is nn.Linear
    only = cc.tensorize(model, rank=4, min_features=1, include="layers.*.ffn_*")
    assert set(only.comera_summary.rewritten) == {f"layers.{i}.ffn_{w}" for i in (0, 1) for w in ("up", "down")}
    assert "ffn_up" in str(cc.explain(only))


def test_inplace_swaps_layers_in_the_given_model():
    model = _small_encoder()
    out = cc.tensorize(model, rank=4, min_features=1, inplace=True)
    assert isinstance(model.layers[0].ffn_up, TTLinear)
    assert out.layers[0].ffn_up is model.layers[0].ffn_up
    assert out.state_dict().keys() == model.state_dict().keys()


def test_module_used_twice_is_replaced_everywhere_with_one_tt_layer():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = nn.Linear(64, 64)
            self.alias = self.shared

        def forward(self, x):
            return self.alias(self.shared(x))

    m = Twice()
    tt = cc.tensorize(m, rank=8, min_features=1)
    assert tt.shared is tt.alias and isinstance(tt.shared, TTLinear)


def test_untraceable_model_falls_back_module_by_module_with_warning():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(64, 64)
            self.b = nn.Linear(64, 64)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: torch.fx cannot trace this
                return self.a(x)
            return self.b(x)

    torch.manual_seed(0)
    m = Branchy().double()
    with pytest.warns(UserWarning, match="module by module"):
        tt = cc.tensorize(m, rank=FULL, init="svd", trace=True)
    assert type(tt) is Branchy and not tt.comera_summary.traced
    x = torch.randn(5, 64, dtype=torch.float64)
    for sign in (1, -1):
        torch.testing.assert_close(tt(sign * x.abs()), m(sign * x.abs()), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("kwargs,match", [
    (dict(rank=0), "positive"),
    (dict(rank=-3), "positive"),
    (dict(rank=[4, 4], include="layers.0.ffn_up"), "expected 5 internal ranks"),
    (dict(shapes={"layers.0.ffn_up": ((4, 4, 2), (4, 4, 6))}, rank=4), r"multiply to 32, fewer than .* 48"),
    (dict(include="layers.*.no_such_layer"), "matches no module"),
    (dict(include="layers.0.attn_norm"), "LayerNorm"),
    (dict(preset="no-such-preset"), "unknown preset"),
    (dict(init="zeros"), "init must be"),
])
def test_bad_input_gives_clear_error_and_leaves_model_untouched(kwargs, match, inplace):
    model = _small_encoder()
    snap = _snapshot(model)
    with pytest.raises((ValueError, TypeError), match=match):
        cc.tensorize(model, min_features=1, inplace=inplace, **kwargs)
    _assert_untouched(model, snap)


def test_failure_in_a_late_layer_leaves_earlier_layers_dense():
    model = _small_encoder()
    snap = _snapshot(model)
    with pytest.raises(ValueError, match="fc1"):
        cc.tensorize(model, min_features=1, inplace=True, shapes={"fc1": ((2, 2), (2, 2))})
    _assert_untouched(model, snap)


def test_inspect_cli_prints_graph_and_table():
    out = subprocess.run([sys.executable, "-m", "comera_compile.cli", "inspect", "--example", "six-encoder"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "def forward(self, input_ids" in out.stdout
    assert "tt_layers_5_ffn_down" in out.stdout
    # The table: a row for layers.5.ffn_down, a TTLinear of the dense layer's shape and weight size.
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("layers.5.ffn_down ")]
    assert len(rows) == 1 and rows[0][1:3] == ["TTLinear", "3072x768"], rows
    assert f"{3072 * 768:,}" in rows[0], rows   # dense weight entries
    # The summary: parameter counts and their ratio, against the same model tensorized here and counted.
    model = six_encoder.build(layers=6)
    dense = sum(p.numel() for p in model.parameters())
    tt = cc.tensorize(model, inplace=True, preset="comera-six-encoder")
    now = sum(p.numel() for p in tt.parameters())
    assert f"model: {dense:,} parameters dense -> {now:,} ({dense / now:.1f}x smaller)" in out.stdout


class _Mixed(nn.Module):
    """An embedding (with padding), a bag and two linears, the first without bias."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(200, 64, padding_idx=3)
        self.bag = nn.EmbeddingBag(200, 64, mode="mean")
        self.up = nn.Linear(64, 96, bias=False)
        self.down = nn.Linear(96, 64)

    def forward(self, ids, offsets):
        h = self.emb(ids).mean(1) + self.bag(ids.flatten(), offsets)
        return self.down(torch.tanh(self.up(h)))


def test_densify_matches_the_tt_model_after_rank_adaptation():
    torch.manual_seed(0)
    tt = cc.tensorize(_Mixed(), rank=6, min_features=1)
    opt = torch.optim.AdamW(cc.param_groups(tt, lr=1e-2))
    ra = cc.RankAdaptive(tt, optimizer=opt, cut_every=2, realloc_at=None)
    ids, offsets = torch.randint(0, 200, (4, 5)), torch.arange(0, 20, 5)
    for step in range(4):  # gates away from 1, some slices switched off but still allocated
        tt(ids, offsets).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 1:
            with torch.no_grad():
                tt.up.gates[1][:2] = 0.0
        ra.step()
    assert ra.ranks()["up"] != ra.allocated_ranks()["up"]
    dense = cc.densify(tt)
    kinds = {name: type(m) for name, m in dense.named_modules() if name}
    assert kinds == {"emb": nn.Embedding, "bag": nn.EmbeddingBag, "up": nn.Linear, "down": nn.Linear}
    assert dense.emb.padding_idx == 3 and dense.bag.mode == "mean" and dense.up.bias is None
    with torch.no_grad():
        want, got = tt(ids, offsets), dense(ids, offsets)
    assert (got - want).norm() <= 1e-5 * want.norm()
    assert cc.densify(tt.up).__class__ is nn.Linear  # a TT layer on its own


def test_default_rank_never_makes_a_layer_bigger():
    """64 x 64 at the default rank 30 would have more TT parameters than its 4,096 dense ones: it stays dense,
    with the reason in the summary and a warning; a rank the user picks is honoured, with a warning."""
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(1024, 1024))
    with pytest.warns(UserWarning, match="kept 1 layer"):
        tt = cc.tensorize(model, min_features=1)
    assert isinstance(tt.get_submodule("0"), nn.Linear) and "default rank" in tt.comera_summary.kept_dense["0"]
    big = tt.get_submodule("2")
    assert isinstance(big, TTLinear) and big.tt_params() < 1024 * 1024
    with pytest.warns(UserWarning, match="no smaller as TT at the rank"):
        chosen = cc.tensorize(nn.Sequential(nn.Linear(64, 64)), rank=30, min_features=1)
    assert isinstance(chosen.get_submodule("0"), TTLinear)


class _TrainEval(nn.Module):
    """User code that reads self.training: functional dropout and a train-only branch."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64)

    def forward(self, x):
        h = F.dropout(torch.relu(self.up(x)), 0.5, training=self.training)
        if self.training:
            h = h + 0.0 * h.sum()
        return self.down(h)

    def double_it(self, x):
        return 2 * self(x)


@pytest.mark.parametrize("start", ["train", "eval"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_train_eval_switching_is_honoured_after_tensorize(start, compiled):
    torch.manual_seed(0)
    model = _TrainEval().train(start == "train")
    tt = cc.tensorize(model, rank=8, min_features=1)
    assert type(tt) is _TrainEval and tt.double_it(torch.zeros(1, 64)).shape == (1, 64)
    run = torch.compile(tt, backend="comera") if compiled else tt
    x = torch.randn(32, 64)
    for mode in (("eval", "train") if start == "train" else ("train", "eval")):
        tt.train(mode == "train")
        a, b = run(x), run(x)
        if mode == "eval":
            torch.testing.assert_close(a, b)  # no dropout in eval mode
        else:
            assert not torch.allclose(a, b)  # dropout in train mode
    torch._dynamo.reset()


def test_trace_of_a_mode_dependent_model_falls_back_to_the_users_module():
    with pytest.warns(UserWarning, match="train/eval"):
        tt = cc.tensorize(_TrainEval(), rank=8, min_features=1, trace=True)
    assert type(tt) is _TrainEval and not tt.comera_summary.traced


def test_containers_stay_containers():
    seq = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    tt = cc.tensorize(seq, rank=4)
    assert type(tt) is nn.Sequential and len(tt) == 3 and isinstance(tt[0], TTLinear)
    assert [type(m) for m in tt] == [TTLinear, nn.ReLU, TTLinear]
    tt.append(nn.Tanh())
    assert tt(torch.randn(2, 256)).shape == (2, 256)


def test_a_model_built_on_the_meta_device_trains_without_any_dense_weight():
    """Built under torch.device("meta") (no memory), tensorized, materialized with to_empty and each
    module's reset_parameters (torch's convention): it trains, no tensor anywhere near a dense weight's size
    is ever allocated, and the TT layers start at nn.Linear's / nn.Embedding's init statistics."""
    torch.manual_seed(0)
    with LargestAllocation() as seen:
        with torch.device("meta"):
            model = nn.Sequential(nn.Embedding(100_000, 512), nn.Linear(512, 4096), nn.GELU(),
                                  nn.Linear(4096, 512), nn.LayerNorm(512))
        tt = cc.tensorize(model, rank=8)
        tt.to_empty(device="cpu")
        for m in tt.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        opt = torch.optim.AdamW(cc.param_groups(tt, lr=1e-3))
        ids = torch.randint(0, 100_000, (2, 8))  # activations of 16 rows: far below a weight's size
        for _ in range(2):
            tt(ids).square().mean().backward()
            opt.step()
            opt.zero_grad()
    smallest_dense = 512 * 4096 * 4
    assert seen.largest <= smallest_dense / 16, seen.largest
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in tt.parameters())
    emb, up = tt[0], tt[1]
    assert isinstance(emb, cc.TTEmbedding) and isinstance(up, cc.TTLinear)
    rows = emb(torch.randint(0, 100_000, (4096,)))  # rows of a fresh TT table: entries ~ N(0, 1)
    fresh = cc.tensorize(nn.Linear(512, 4096), rank=8)
    fresh.reset_parameters()
    w = fresh.to_dense()
    assert abs(w.std().item() * math.sqrt(3 * 512) - 1) < 0.2
    assert abs(rows.std().item() - 1) < 0.35 and fresh.bias.abs().max() <= 1 / math.sqrt(512)


class _ScaledEmbedding(nn.Embedding):
    """transformers' scaled word embedding (Gemma, Bart): the lookup times a constant."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embedding_dim ** 0.5


class _Positions(nn.Embedding):
    """A learned position embedding whose forward takes the token ids' shape, not indices (OPT's kind)."""

    def forward(self, ids: torch.Tensor, offset: int = 2) -> torch.Tensor:
        return super().forward(torch.arange(ids.shape[-1], device=ids.device) + offset)


class _PlainMath(nn.Linear):
    """Falcon's Linear: its own forward, computing exactly nn.Linear's map."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias


class _Router(nn.Linear):
    """An MoE router: a Linear whose forward returns routing weights, not the linear map."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).softmax(-1)


class _WithSubclasses(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.word, self.pos = _ScaledEmbedding(300, 64), _Positions(70, 64)
        self.plain, self.router, self.out = _PlainMath(64, 96), _Router(96, 64), nn.Linear(64, 80)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.router(self.plain(self.word(ids) + self.pos(ids))))


def test_layers_whose_class_computes_something_else_stay_dense_and_say_so():
    """Subclasses of nn.Embedding / nn.Linear with a forward of their own (scaled word embeddings, position
    embeddings, routers) are kept dense with a warning naming them, so the full-rank TT model computes what
    the user's model computes (float64, against the dense model); a subclass whose forward is the plain map
    (Falcon's Linear) is rewritten; naming a kept one in include is an error that leaves the model as it was."""
    torch.manual_seed(0)
    model = _WithSubclasses().double()
    snap = _snapshot(model)
    with pytest.warns(UserWarning, match=r"kept 3 layer\(s\) dense whose class has its own forward") as rec:
        tt = cc.tensorize(model, rank=FULL, init="svd", min_features=1)
    message = next(str(w.message) for w in rec if "own forward" in str(w.message))
    assert all(n in message for n in ("word (_ScaledEmbedding)", "pos (_Positions)", "router (_Router)"))
    summary = tt.comera_summary
    assert set(summary.rewritten) == {"plain", "out"}
    assert "_ScaledEmbedding has its own forward" in summary.kept_dense["word"]
    assert isinstance(tt.plain, TTLinear) and type(tt.router) is _Router
    ids = torch.randint(0, 300, (3, 9))
    torch.testing.assert_close(tt(ids), model(ids), rtol=1e-9, atol=1e-9)
    _assert_untouched(model, snap)
    with pytest.raises(cc.TensorizeError, match=r"'word'.*_ScaledEmbedding replaces nn.Embedding.forward"):
        cc.tensorize(model, rank=4, include=["word", "out"], inplace=True)
    _assert_untouched(model, snap)
