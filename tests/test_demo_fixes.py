"""The demo and the benchmarks, as the review found them: the TT-linear benchmark's timed calls each bring one
step's gradients (none added into the call before's), the dense model is freed before CoMERA trains, each model
compiles in a fresh cache after an untimed warm-up, --evals and the table's labels hold when --steps caps a
--minutes budget, and GaLore's memory counts its projection matrices."""

from __future__ import annotations

import gc
import json
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("tokenizers")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from comera_compile.benchmarks import galore, tt_linear  # noqa: E402
from comera_compile.examples import code_data, code_mlm, demo_report, demo_train  # noqa: E402
from comera_compile.layers import TTLinear  # noqa: E402
from test_demo import _check_figures, _run_cli, tiny_data  # noqa: E402,F401  (tiny_data: the fixture)


# -- 1. the TT-linear benchmark times one step's backward, not an accumulation ------------------------------
def test_every_timed_call_of_the_tt_linear_benchmark_brings_one_steps_gradients():
    """Called three times, each case leaves the gradients of one forward and backward (as after
    zero_grad(set_to_none=True)), not three calls' sum: nn.Linear's against the closed forms, the TT layer's
    (searched and fixed order) against torch.autograd.grad of one call."""
    torch.manual_seed(0)
    dense = nn.Linear(768, 3072)
    tt = TTLinear(768, 3072, rank=4, in_modes=(12, 8, 8), out_modes=(12, 16, 16))
    x = torch.randn(2, 768, requires_grad=True)
    grad = torch.randn(2, 3072)
    cases = tt_linear.cases(dense, tt, x, grad)
    assert set(cases) == {"nn.Linear", "TT searched", "TT fixed order"}
    for _ in range(3):
        cases["nn.Linear"]()
    torch.testing.assert_close(dense.weight.grad, grad.t() @ x.detach())
    torch.testing.assert_close(dense.bias.grad, grad.sum(0))
    torch.testing.assert_close(x.grad, grad @ dense.weight.detach())
    params = [p for p in tt.parameters() if p.requires_grad]
    expected = torch.autograd.grad(tt(x), [*params, x], grad)
    for name in ("TT searched", "TT fixed order"):
        for _ in range(3):
            cases[name]()
        for got, want in zip([*(p.grad for p in params), x.grad], expected):
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)   # another order: rounding


# -- 2. dense's model is gone when CoMERA trains ---------------------------------------------------------------
def test_train_one_keeps_no_reference_to_the_model_it_trained(tiny_data):
    """With the garbage collector off, the model (and with it its optimizer state) is freed as soon as the
    caller drops it: train_one's eager step leaves no reference cycle holding it."""
    cfg, data, _ = tiny_data
    dense, _ = code_mlm.build_models(cfg, data.vocab_size)
    ref = weakref.ref(dense)
    was = gc.isenabled()
    gc.disable()
    try:
        demo_train.train_one("dense", dense, replace(cfg, minutes=None, steps=2, evals=1), data, 1000)
        del dense
        assert ref() is None
    finally:
        if was:
            gc.enable()


def test_the_dense_model_is_freed_before_comera_trains(tmp_path, monkeypatch):
    """The whole demo (eager steps, the garbage collector off): when CoMERA's run starts, dense's model no
    longer exists, so CoMERA's peak RSS holds none of it."""
    real, dense_ref, alive = code_mlm.train_one, [], []

    def train_one(name, model, *a, **k):
        if name == "dense":
            dense_ref.append(weakref.ref(model))
        else:
            alive.append(dense_ref[0]() is not None)
        return real(name, model, *a, **k)

    monkeypatch.setattr(code_mlm, "train_one", train_one)
    was = gc.isenabled()
    gc.disable()
    try:
        result = _run_cli(tmp_path, "--no-compile")
    finally:
        if was:
            gc.enable()
    assert alive == [False]
    for run in result["runs"].values():
        assert 0 < run["rss_start_bytes"] <= run["peak_rss_bytes"]


# -- 3. each model compiles in its own cache, after the compiler's start-up ---------------------------------
def _tiny_function(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w).sum()


def test_each_model_compiles_in_a_fresh_cache_after_an_untimed_warm_up(tmp_path, monkeypatch):
    """The compiler's warm-up runs before either budget starts, and inside each model's run a function the
    other run (or an earlier one) compiled is compiled again: Inductor misses, no cache hit."""
    from torch._dynamo.utils import counters

    order: list = []
    monkeypatch.setattr(code_mlm, "warm_up_compiler", lambda device: order.append("warm-up") or 0.0)
    real = code_mlm.train_one
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    torch.compile(_tiny_function, backend="inductor")(x, w)   # compiled once before the demo, in this process

    def train_one(name, model, cfg, *a, **k):
        hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        torch.compile(_tiny_function, backend="inductor")(x, w)
        order.append((name, counters["inductor"]["fxgraph_cache_hit"] - hits,
                      counters["inductor"]["fxgraph_cache_miss"] - misses))
        return real(name, model, replace(cfg, compile=False), *a, **k)   # the steps themselves eager: quick

    monkeypatch.setattr(code_mlm, "train_one", train_one)
    _run_cli(tmp_path)   # CoMERA compiled (the default): the warm-up is due
    assert order == ["warm-up", ("dense", 0, 1), ("comera", 0, 1)]


# -- 4. --minutes with a --steps cap ---------------------------------------------------------------------------
def test_a_step_cap_that_ends_a_time_budget_keeps_the_evaluations_and_says_so(tmp_path):
    """--minutes 5 --steps 6 --evals 3 on a tiny model: the step cap ends both runs, each is evaluated at
    steps 2, 4 and 6 (as --steps alone is), and the table calls the final figures equal steps, not equal time."""
    result = _run_cli(tmp_path, "--no-compile", "--minutes", "5")
    assert result["config"]["minutes"] == 5 and result["config"]["steps"] == 6
    _check_figures(result)   # among them: evaluations at steps 2, 4 and 6 for both models
    assert all(run["ended_by"] == "steps" for run in result["runs"].values())
    table = (Path(result["config"]["out"]) / "table.md").read_text()
    assert "end of equal steps" in table and "equal time" not in table
    assert "Budget 5 min or 6 steps per model, whichever ends first (both stopped at the 6-step cap)" in table
    assert json.loads((Path(result["config"]["out"]) / "results.json").read_text())["runs"]["dense"]["ended_by"] == \
        "steps"


def test_the_table_names_each_runs_budget_where_they_differ():
    """dense stopped at its 20-step cap, CoMERA at 5 minutes (runs saved before "ended_by" existed: read from
    their step counts)."""
    config = {"minutes": 5, "steps": 20}
    runs = {"dense": {"steps": 20}, "comera": {"steps": 17}}
    labels = {"dense": "dense", "comera": "CoMERA"}
    assert demo_report.end_label(config, runs, labels) == \
        "held-out loss / accuracy, end of each run (dense: the 20-step cap, CoMERA: 5 min)"
    assert demo_report.budget_line(config, runs, labels) == ("Budget 5 min or 20 steps per model, whichever ends "
                                                             "first (dense stopped at the 20-step cap, CoMERA "
                                                             "stopped at 5 min)")
    assert demo_report.end_label({"minutes": 5, "steps": None}, runs, labels).endswith("end of equal time")
    assert demo_report.budget_line({"minutes": 5, "steps": None}, runs, labels) == "Budget 5 min per model"


# -- 5. GaLore's projection matrices are memory it keeps ---------------------------------------------------
def test_galore_persistent_bytes_counts_the_projection_matrices():
    """After one step on a tiny model (two encoder Linears, 16 -> 8 and 8 -> 16, projected at rank 4; a head
    kept dense): parameters, AdamW's two moments (the projected ones rank x the longer side) and each
    projector, a slice of the SVD's factor that keeps the whole factor (min side x min side), counted once."""
    pytest.importorskip("galore_torch")

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(16, 8), nn.Linear(8, 16)])
            self.head = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.layers[1](self.layers[0](x)))

    torch.manual_seed(0)
    model = Tiny()
    opt = galore.galore_optimizer(model, rank=4)
    model(torch.randn(3, 16)).square().sum().backward()
    opt.step()
    rank, floats = 4, 0
    for name, p in model.named_parameters():
        floats += p.numel()
        if name.startswith("layers.") and name.endswith("weight"):
            m, n = p.shape
            floats += 2 * rank * max(m, n) + min(m, n) ** 2
        else:
            floats += 2 * p.numel()
    assert galore.persistent_bytes(model, opt) == 4 * floats


# -- 6. a file copied under two paths is held out or trained, never both ------------------------------------
def test_a_file_copied_under_two_paths_is_held_out_or_trained_never_both(tmp_path):
    """--data with a/ and b/ holding the same 20 files (plain copies, not links; one of b's without its final
    newline): each text is read once, so no held-out text is in training, whatever the seed; the 20 texts are
    all used, and the copies skipped are counted (Corpus.copies)."""
    import random

    rng = random.Random(1)
    texts = [f"@@{i:04d}@@\n" + " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(200)) + "\n"
             for i in range(20)]
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        for i, t in enumerate(texts):
            (tmp_path / folder / f"m{i}.py").write_text(t.rstrip("\n") if (folder, i) == ("b", 7) else t)
    for seed in range(5):
        corpus = code_data.load_corpus(tmp_path, seed, 0.1, 10_000_000)
        held = {t.strip() for t in corpus.heldout_texts}
        trained = {t.strip() for t in corpus.train_texts}
        assert held and not held & trained, f"seed {seed}: held-out files also in training"
        assert held | trained == {t.strip() for t in texts} and len(corpus.train_texts) == len(trained)
        assert len(corpus.heldout_files) == 4 and corpus.copies == 20
