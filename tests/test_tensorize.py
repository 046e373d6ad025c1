"""tensorize on own models (FX path) and on transformers models (module-by-module path)."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera_compile as cc
from comera_compile.examples import six_encoder
from comera_compile.embedding import TTEmbedding
from comera_compile.layers import TTLinear
from helpers import FULL, LargestAllocation, cli_error

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


def test_d_sets_the_chosen_modes_and_a_shapes_entry_sets_its_own():
    """d is the modes per side of the layers shaped automatically; a layer given modes keeps their count, and
    the product stays the dense layer's (full-rank SVD reproduces it)."""
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)).double()
    tt = cc.tensorize(dense, rank=10 ** 6, init="svd", d=4, shapes={"2": cc.LayerShape(in_modes=(16, 8))})
    assert len(tt[0].spec.in_modes) == len(tt[0].spec.out_modes) == 4
    assert tt[2].spec.in_modes == (16, 8) and len(tt[2].spec.out_modes) == 2
    x = torch.randn(5, 64, dtype=torch.float64)
    torch.testing.assert_close(tt(x), dense(x), rtol=1e-9, atol=1e-10)


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
    (dict(rank="30"), "rank must be a positive int or a list of ints, got '30'"),
    (dict(rank="11111"), "got '11111'"),                      # a string is not a list of ranks
    (dict(rank=[2.0] * 5, include="layers.0.ffn_up"), "must be an integer, got 2.0"),
    (dict(min_features="64"), "min_features must be an integer"),
    (dict(d="3"), r"d \(the number of cores per layer\) must be an integer"),
    (dict(d=0), "must be an integer of at least 1"),
    (dict(shapes={"layers.*.ffn_upp": ((4, 4, 3), (4, 4, 6))}),
     r"shapes key\(s\) \['layers.\*.ffn_upp'\] match no layer"),
    (dict(shapes={(96, 40): ((4, 4, 6), (4, 2, 5))}), r"match no layer.*layers.0.ffn_up \(48, 96\)"),
    (dict(shapes={"fc1": (4, 4)}), "must be a LayerShape"),
])
def test_bad_input_gives_clear_error_and_leaves_model_untouched(kwargs, match, inplace):
    model = _small_encoder()
    snap = _snapshot(model)
    with pytest.raises((ValueError, TypeError), match=match):
        cc.tensorize(model, inplace=inplace, **{"min_features": 1, **kwargs})
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


@pytest.mark.parametrize("how", ["tensorize(trace=True)", "tempo"])
def test_a_part_in_eval_inside_a_model_in_train_keeps_its_mode_through_a_trace(how):
    """A frozen backbone (BatchNorm's running statistics, no dropout) in eval inside a model in train: the
    trace leaves every module's mode as the user set it, in the user's model and in the result."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Dropout(0.5)),
                          nn.Linear(64, 64), nn.GELU(), nn.LayerNorm(64), nn.Dropout(0.0))
    model.train()
    model[0].eval()
    modes = [m.training for m in model.modules()]
    x = torch.randn(16, 64)
    with torch.no_grad():
        want = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = cc.tempo(model) if how == "tempo" else cc.tensorize(model, rank=4, min_features=1, trace=True)
    assert [m.training for m in model.modules()] == modes
    frozen = [out.get_submodule(name) for name in ("0", "0.1", "0.2")]   # (a GraphModule: no indexing)
    assert out.training and not any(m.training for m in frozen)
    stats = frozen[1].running_mean.clone()
    with torch.no_grad():
        got = out(x)
        torch.testing.assert_close(out(x), got)   # no dropout in the frozen part
    torch.testing.assert_close(frozen[1].running_mean, stats)   # BatchNorm's statistics read, not updated
    if how == "tempo":
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("rows", [1, 8, 64, 1024])
def test_explain_s_flops_are_those_a_training_forward_runs(rows):
    """explain's FLOPs per row, times the rows, are what torch's flop counter counts in a training forward of
    the layer (the order explain lists beside them), not another plan's."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = cc.tensorize(nn.Sequential(nn.Linear(64, 128, bias=False)), rank=8, min_features=1)
    (row,) = cc.explain(model, rows=rows).rows
    x = torch.randn(rows, 64, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        model(x)
    assert round(row.flops_per_row * rows) == counter.get_total_flops()


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


class _Mlp(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.emb(ids))))


@pytest.mark.parametrize("inplace", [False, True])
def test_hooks_on_a_rewritten_layer_run_on_its_tt_layer(inplace):
    """Forward pre-hooks, forward hooks (with kwargs too) and backward hooks the user put on a dense layer run
    on the TT layer that replaces it: at full rank the output and gradients are the dense model's (float64).
    With inplace=True the user's handles still remove them."""
    torch.manual_seed(0)
    model = _Mlp().double()
    seen = []
    handles = [model.up.register_forward_pre_hook(lambda m, args: (args[0].clamp(-0.5, 0.5),)),
               model.down.register_forward_hook(lambda m, args, kwargs, out: 2 * out, with_kwargs=True),
               model.up.register_full_backward_hook(lambda m, gin, gout: seen.append(gout[0].shape))]
    ids = torch.randint(0, 100, (3, 7))
    want = model(ids)
    want.sum().backward()
    want_grad = model.emb.weight.grad.clone()
    model.zero_grad()
    tt = cc.tensorize(model, rank=FULL, init="svd", inplace=inplace, min_features=1, exclude="emb")
    got = tt(ids)
    got.sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(tt.emb.weight.grad, want_grad, rtol=1e-10, atol=1e-10)
    assert seen == [torch.Size([3, 7, 128])] * 2
    torch.testing.assert_close(cc.densify(tt)(ids), want, rtol=1e-10, atol=1e-10)   # densify keeps them too
    for h in handles:
        h.remove()
    plain = _Mlp().double()
    plain.load_state_dict(cc.densify(tt).state_dict())
    if inplace:   # the handles removed the TT layers' hooks: the model computes the plain map again
        torch.testing.assert_close(tt(ids), plain(ids), rtol=1e-10, atol=1e-10)
    else:         # the copy keeps its own hooks, as deepcopy's copies of the other modules do
        torch.testing.assert_close(tt(ids), want, rtol=1e-10, atol=1e-10)


def test_each_layer_keeps_its_train_eval_mode_through_tensorize_and_densify():
    model = _Mlp().double()
    model.eval()
    model.up.train()
    modes = {n: m.training for n, m in model.named_modules()}
    tt = cc.tensorize(model, rank=8, min_features=1)
    assert isinstance(tt.up, TTLinear)
    assert {n: tt.get_submodule(n).training for n in modes} == modes
    assert {n: m.training for n, m in cc.densify(tt).named_modules()} == modes
    assert all(not m.training for m in tt.down.modules())   # its ParameterLists too


class _MaxNormEmbedding(nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids)


def test_layers_kept_dense_are_never_run_on_the_user_s_weights():
    """A subclass of nn.Embedding with max_norm (which renormalizes the rows a lookup reads, in place) is kept
    dense without a probe lookup through it: the user's table is as it was."""
    torch.manual_seed(0)
    model = nn.Sequential(_MaxNormEmbedding(100, 64, max_norm=1.0), nn.Linear(64, 64))
    table = model[0].weight.detach().clone()
    assert table.norm(dim=1).max() > 1.0
    with pytest.warns(UserWarning, match="max_norm"):
        tt = cc.tensorize(model, rank=4, min_features=1)
    assert torch.equal(model[0].weight, table)
    assert tt.comera_summary.kept_dense["0"].startswith("uses max_norm")


def test_a_layer_also_held_in_a_plain_container_stays_dense_with_a_warning():
    """A forward that calls a layer from a plain dict would run the dense layer whatever tensorize swapped in,
    and (in a copy) the user's own: such a layer stays dense, said; registered in a ModuleDict, it is
    rewritten; named in include, it is an error."""

    class Routed(nn.Module):
        def __init__(self, registered: bool) -> None:
            super().__init__()
            self.emb, self.fc = nn.Embedding(100, 64), nn.Linear(64, 64)
            self.route = nn.ModuleDict({"tok": self.emb}) if registered else {"tok": self.emb}

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.fc(self.route["tok"](ids))

    torch.manual_seed(0)
    model = Routed(registered=False)
    with pytest.warns(UserWarning, match=r"emb \(at route\['tok'\]\)"):
        tt = cc.tensorize(model, rank=4, min_features=1)
    assert type(tt.emb) is nn.Embedding and tt.route["tok"] is tt.emb and tt.emb is not model.emb
    tt(torch.randint(0, 100, (8,))).sum().backward()
    assert tt.emb.weight.grad is not None and model.emb.weight.grad is None   # the copy trains its own
    with pytest.raises(cc.TensorizeError, match="route"):
        cc.tensorize(model, rank=4, min_features=1, include="emb")
    registered = cc.tensorize(Routed(registered=True), rank=4, min_features=1)
    assert isinstance(registered.route["tok"], TTEmbedding) and registered.route["tok"] is registered.emb


def test_tensorize_errors_name_the_fix_and_leave_the_model_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    with torch.no_grad():
        model[1].weight[3, 5] = float("nan")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(cc.TensorizeError, match=r"'1' \(Linear\) with init='svd': its weight holds NaN"):
        cc.tensorize(model, rank=4, init="svd", min_features=1)
    model.lock = threading.Lock()   # no copy of it can be made
    with pytest.raises(cc.TensorizeError, match="inplace=True"):
        cc.tensorize(model, rank=4, min_features=1)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, equal_nan=True)
    assert type(model[0]) is nn.Linear
    assert isinstance(cc.tensorize(model, rank=4, min_features=1, inplace=True)[0], TTLinear)


def test_layers_whose_weight_is_computed_stay_dense_and_say_so():
    """A parametrized weight (orthogonal, spectral_norm) or one weight_norm's hooks compute is kept dense with
    a warning: a TT layer holds a weight of its own, so the constraint would be dropped.  Naming one in include
    is an error that leaves the model untouched."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)).double()
    torch.nn.utils.parametrizations.orthogonal(model[0])
    torch.nn.utils.parametrizations.spectral_norm(model[1])
    x = torch.randn(5, 64, dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"kept 2 layer\(s\) dense .*0 \(ParametrizedLinear: its weight is "
                                         r"parametrized"):
        tt = cc.tensorize(model, rank=FULL, init="svd", min_features=1)
    assert list(tt.comera_summary.rewritten) == ["2"]
    assert torch.nn.utils.parametrize.is_parametrized(tt[0]) and isinstance(tt[2], TTLinear)
    torch.testing.assert_close(tt.eval()(x), model.eval()(x), rtol=1e-10, atol=1e-10)
    snap = _snapshot(model)
    with pytest.raises(cc.TensorizeError, match=r"'0': its weight is parametrized"):
        cc.tensorize(model, rank=4, include=["0", "2"], inplace=True)
    _assert_untouched(model, snap)
    # torch.nn.utils.weight_norm's module cannot be deep-copied (torch's rule): inplace
    old_style = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).double()
    with pytest.warns(FutureWarning):
        torch.nn.utils.weight_norm(old_style[0])
    want = old_style(x)
    with pytest.warns(UserWarning, match=r"0 \(Linear: its weight is computed by a hook"):
        cc.tensorize(old_style, rank=FULL, init="svd", min_features=1, inplace=True)
    assert type(old_style[0]) is nn.Linear and isinstance(old_style[1], TTLinear)
    torch.testing.assert_close(old_style(x), want, rtol=1e-10, atol=1e-10)


def test_frozen_layers_stay_frozen_and_rank_adaptive_leaves_them_alone():
    """A layer frozen before tensorize (requires_grad=False) comes back frozen, its bias too; RankAdaptive
    says it leaves it and never changes it, while it shrinks and cuts the trainable layers."""
    torch.manual_seed(0)
    model = _Mlp()
    model.emb.requires_grad_(False)
    model.up.requires_grad_(False)
    tt = cc.tensorize(model, rank=8, min_features=1, init="svd")   # init="random" keeps frozen layers dense
    frozen = {n for n, p in tt.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in tt.named_parameters() if n.startswith(("emb.", "up."))}
    opt = torch.optim.AdamW([p for p in tt.parameters() if p.requires_grad], lr=1e-2)
    with pytest.warns(UserWarning, match=r"leaves 2 frozen TT layer\(s\) at their ranks \(emb, up\)"):
        ra = cc.RankAdaptive(tt, optimizer=opt, cut_every=2, realloc_at=None)
    before = {n: p.clone() for n, p in tt.named_parameters() if n in frozen}
    ids = torch.randint(0, 100, (4, 6))
    for _ in range(6):
        loss = ra.loss(tt(ids).square().mean())
        loss.backward()
        opt.step()
        opt.zero_grad()
        ra.step(loss)
    for n, p in tt.named_parameters():
        if n in frozen:
            assert torch.equal(p, before[n]), n
    with torch.no_grad():   # switched-off slices in a frozen layer and a trainable one
        tt.up.gates[1][:3] = 0.0
        tt.down.gates[1][:3] = 0.0
    ranks = tt.up.ranks
    ra.step(), ra.step()    # a check: the zero gates of the layers it adapts switch off
    assert ra.cut() > 0 and set(ra.layers) == {"down"}
    assert tt.down.ranks[2] == 8 - 3 and tt.up.ranks == ranks
    with pytest.raises(ValueError, match="every TT layer of _Mlp is frozen"):
        cc.RankAdaptive(cc.tensorize(model.requires_grad_(False), rank=8, min_features=1, init="svd"))


def test_a_frozen_weight_beside_a_trainable_bias_is_kept_by_rank_adaptive_and_densify():
    """Bias-only fine-tuning: the weight frozen, the bias training.  RankAdaptive leaves the layer's weight
    exactly as it is (it used to adapt the layer, its gauge steps moving the frozen weight by ~10%), the bias
    trains, and densify gives each dense parameter its own flag back (it used to copy the cores' to the bias)."""
    torch.manual_seed(0)
    model = _Mlp()
    model.up.weight.requires_grad_(False)
    model.down.bias.requires_grad_(False)
    tt = cc.tensorize(model, rank=8, min_features=1, init="svd")
    weight = tt.up.to_dense().detach().clone()
    bias = tt.up.bias.detach().clone()
    opt = torch.optim.AdamW([p for p in tt.parameters() if p.requires_grad], lr=1e-2)
    with pytest.warns(UserWarning, match=r"leaves 1 frozen TT layer\(s\) at their ranks \(up\)"):
        ra = cc.RankAdaptive(tt, optimizer=opt, cut_every=2, realloc_at=None)
    ids = torch.randint(0, 100, (4, 6))
    for _ in range(30):   # three gauge balances (every 10 steps) and checks every 2
        loss = ra.loss(tt(ids).square().mean())
        loss.backward()
        opt.step()
        opt.zero_grad()
        ra.step(loss)
    assert torch.equal(tt.up.to_dense(), weight) and not torch.equal(tt.up.bias, bias)
    dense = cc.densify(tt)
    assert {n: p.requires_grad for n, p in dense.named_parameters()} == {
        n: p.requires_grad for n, p in model.named_parameters()}


def test_a_frozen_layer_keeps_its_values_under_init_random_and_is_factored_under_svd():
    """A frozen table (Whisper's sinusoidal encoder positions: an nn.Embedding with requires_grad=False) stays
    dense at init="random", its rows as they were, with a warning: random cores would replace them for good.
    Named in include it is an error; init="svd" factors it (exact at full rank) and keeps it frozen."""
    torch.manual_seed(0)
    model = _Mlp()
    model.emb.requires_grad_(False)
    table = model.emb.weight.detach().clone()
    with pytest.warns(UserWarning, match=r"kept 1 frozen layer\(s\) dense \(emb\).*init='svd'"):
        tt = cc.tensorize(model, rank=8, min_features=1)
    assert type(tt.emb) is nn.Embedding and torch.equal(tt.emb.weight, table) and isinstance(tt.up, TTLinear)
    assert "frozen" in tt.comera_summary.kept_dense["emb"]
    with pytest.raises(cc.TensorizeError, match=r"'emb' with init='random': its weight is frozen"):
        cc.tensorize(model, rank=8, min_features=1, include="emb")
    svd = cc.tensorize(model, rank=10**6, min_features=1, init="svd")
    ids = torch.randint(0, 100, (4, 6))
    assert isinstance(svd.emb, TTEmbedding) and not any(p.requires_grad for p in svd.emb.parameters())
    torch.testing.assert_close(svd.emb(ids), F.embedding(ids, table), rtol=1e-5, atol=1e-5)


class _Experts(nn.Module):
    """Mixture-of-experts weights as transformers 5 stores them: one 3-D Parameter per projection."""

    def __init__(self, experts: int = 8, width: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, hidden, width) / width ** 0.5)
        self.down = nn.Parameter(torch.randn(experts, width, hidden) / hidden ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.router(x).softmax(-1)
        h = torch.einsum("bw,ehw->beh", x, self.up).relu()
        return torch.einsum("beh,ewh,be->bw", h, self.down, gate)


def test_weights_held_as_plain_parameters_are_named_as_kept_dense_and_warned_when_they_are_most_of_the_model():
    """tensorize rewrites layers: MoE experts held as 3-D Parameters stay dense, and the summary, cc.explain
    and a warning (they are most of the model) say so, instead of a result that looks compressed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), _Experts(), nn.Linear(64, 64))
    with pytest.warns(UserWarning, match=r"kept 2 weight\(s\) dense .*1\.up \(8x256x64\).*9\d% of the model"):
        tt = cc.tensorize(model, rank=8)
    kept = tt.comera_summary.kept_dense
    assert set(kept) >= {"1.up", "1.down"} and "Parameter of _Experts" in kept["1.up"]
    assert "1.up" in str(cc.explain(tt)) and isinstance(tt[0], TTLinear)
    torch.testing.assert_close(tt[1].up, model[1].up)
    small = nn.Sequential(*(nn.Linear(512, 512) for _ in range(3)), _Experts(experts=1, width=512, hidden=64))
    with warnings.catch_warnings():   # 8% of the model: listed, not warned about
        warnings.simplefilter("error")
        assert "3.down" in cc.tensorize(small, rank=8).comera_summary.kept_dense


class _LoRALinear(nn.Linear):
    """A LoRA adapter in the shape loralib gives it: a low-rank update whose B starts at zero."""

    def __init__(self, n_in: int, n_out: int, r: int = 4) -> None:
        super().__init__(n_in, n_out)
        self.lora_A = nn.Parameter(torch.randn(r, n_in) * 0.01)
        self.lora_B = nn.Parameter(torch.zeros(n_out, r))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + x @ self.lora_A.t() @ self.lora_B.t()


def test_a_subclass_holding_state_of_its_own_stays_dense_whatever_its_values():
    """A subclass that replaces the forward and holds parameters or submodules besides weight and bias (a LoRA
    adapter, a QAT layer with its fake-quantizers) stays dense, even where its forward happens to compute the
    plain map (LoRA's B at zero); tensorize runs nothing of it, so its observers are not fed a probe."""
    torch.manual_seed(0)
    from torch.ao.nn.qat import Linear as QATLinear
    from torch.ao.quantization import get_default_qat_qconfig

    model = nn.Sequential(_LoRALinear(64, 64), QATLinear(64, 64, qconfig=get_default_qat_qconfig("fbgemm")),
                          nn.Linear(64, 64))
    snap = _snapshot(model)
    with pytest.warns(UserWarning, match=r"kept 2 layer\(s\) dense whose class has its own forward"):
        tt = cc.tensorize(model, rank=8, min_features=1)
    _assert_untouched(model, snap)    # the fake-quantizers' observers saw nothing
    assert type(tt[0]) is _LoRALinear and type(tt[1]) is QATLinear and isinstance(tt[2], TTLinear)
    assert "holds lora_A, lora_B" in tt.comera_summary.kept_dense["0"]
    assert "holds weight_fake_quant" in tt.comera_summary.kept_dense["1"]


def test_tensorize_twice_keeps_what_the_first_call_rewrote():
    """A second tensorize call over a tensorized model adds its layers to the summary, so densify still knows
    every layer's dense form (Conv1D where the first call replaced one) and the model's own loader reads it."""
    from transformers.pytorch_utils import Conv1D

    class Gpt2Like(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn, self.mlp = Conv1D(192, 64), nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp(self.attn(x)[..., :64])

    torch.manual_seed(0)
    model = Gpt2Like().double()
    once = cc.tensorize(model, rank=FULL, init="svd", include="attn", min_features=1)
    twice = cc.tensorize(once, rank=FULL, init="svd", include="mlp", min_features=1)
    assert set(twice.comera_summary.rewritten) == {"attn", "mlp"}
    dense = cc.densify(twice)
    assert type(dense.attn) is Conv1D and type(dense.mlp) is nn.Linear
    x = torch.randn(2, 64, dtype=torch.float64)
    torch.testing.assert_close(dense(x), model(x), rtol=1e-10, atol=1e-10)
    assert model.state_dict().keys() == dense.state_dict().keys()
    for k, v in dense.state_dict().items():
        assert v.shape == model.state_dict()[k].shape, k


def test_inspect_cli_errors_are_one_line_messages(capsys):
    for args, message in ((["--rank", "0"], "comera-compile inspect: rank must be a positive integer, got 0"),
                          (["--rows", "0"], "argument --rows: expected a positive integer, got '0'"),
                          (["--rows", "-4"], "argument --rows: expected a positive integer, got '-4'")):
        assert message in cli_error(["inspect", "--example", "six-encoder", "--layers", "1", *args], capsys)


def test_torchscript_is_refused_or_kept_dense_and_a_call_that_rewrites_nothing_says_so():
    """A scripted or traced model's layers cannot be swapped: tensorize refuses the whole model, keeps a
    scripted submodule dense with a warning, and a call that rewrites no layer says why instead of handing the
    dense model back in silence."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    x = torch.randn(2, 64)
    for scripted in (torch.jit.script(eager), torch.jit.trace(eager, x)):
        with pytest.raises(cc.TensorizeError, match="before scripting it"):
            cc.tensorize(scripted, rank=4, min_features=1)
    model = nn.Sequential(nn.Linear(64, 64), torch.jit.script(nn.Linear(64, 64)))
    with pytest.warns(UserWarning, match=r"kept 1 layer\(s\) dense inside TorchScript submodules \(1\)"):
        tt = cc.tensorize(model, rank=4, min_features=1)
    assert isinstance(tt[0], TTLinear) and "TorchScript" in tt.comera_summary.kept_dense["1"]
    torch.testing.assert_close(tt[1](x), model[1](x))
    with pytest.warns(UserWarning, match=r"rewrote no layer; the model stays dense \(2 kept dense: 0: smaller"):
        small = cc.tensorize(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32)))
    assert not small.comera_summary.rewritten and type(small[0]) is nn.Linear
    with pytest.warns(UserWarning, match=r"its 1 TT layer\(s\) are tensorized already"):
        cc.tensorize(nn.Sequential(tt[0]))


def test_densify_of_a_graph_whose_contractions_were_expanded_is_refused_and_leaves_it_working():
    """densify swaps modules; a graph expand_contractions rewrote reads the TT cores itself, so a swapped-in
    nn.Linear would leave those reads without their tensors (an AttributeError at the next call): refused,
    naming the pass, and the graph still computes the model."""
    from comera_compile.passes.fx.contraction import expand_contractions

    torch.manual_seed(0)
    gm = cc.tensorize(nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)), rank=8, min_features=32,
                      trace=True).double()
    x = torch.randn(3, 64, dtype=torch.float64)
    want = gm(x)
    torch.testing.assert_close(cc.densify(gm)(x), want, rtol=1e-10, atol=1e-12)
    assert expand_contractions(gm, (x,)).count == 2
    with pytest.raises(ValueError, match=r"reads the cores of 2 TT layer\(s\).*expand_contractions"):
        cc.densify(gm)
    torch.testing.assert_close(gm(x), want, rtol=1e-10, atol=1e-12)
