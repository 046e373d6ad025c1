"""The benchmark suite's plumbing: `comera-compile bench` runs the chosen benchmarks and writes their
figures; the GaLore comparison's memory accounting counts what a training step keeps."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from comera_compile import cli
from comera_compile.benchmarks import galore, suite


def test_bench_cli_writes_every_figure(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert cli.main(["bench", "--quick", "--only", "tt_linear", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["quick"] is True and set(report["results"]) == {"tt_linear"}
    rows = [r for r in report["results"]["tt_linear"]["rows"] if "rows" in r]
    assert rows, "tt_linear reported no per-row-count figures"
    for r in rows:
        assert r["dense_ms"] > 0 and r["tt_ms"] > 0
        assert r["speedup_vs_dense"] == pytest.approx(r["dense_ms"] / r["tt_ms"])
    printed = capsys.readouterr().out
    assert "nn.Linear" in printed and str(path) in printed


def test_bench_cli_rejects_unknown_benchmark():
    with pytest.raises(SystemExit, match="unknown benchmark"):
        cli.main(["bench", "--only", "no_such_benchmark"])


def test_suite_lists_installed_benchmarks():
    assert {"tt_linear", "six_encoder_step", "galore"} <= set(suite.available())
    assert "ra_control" not in suite.available() and "ra_control" in suite.available(opt_in=True)


def test_ra_control_trains_three_models_and_builds_the_control_at_adapts_ranks():
    """The control is the adapted model's architecture from a fresh start: a model built at given ranks has
    exactly those ranks, the TT parameter count they imply, and runs; the benchmark's three runs report
    their sizes (no adaptation keeps its size) and held-out figures."""
    from comera_compile.benchmarks import ra_control
    from comera_compile.examples import code_mlm
    from comera_compile.optim import tt_layers

    cfg = code_mlm.DemoConfig(size="tiny", minutes=None, steps=4, max_bytes=40_000, vocab_size=300,
                              eval_blocks=8, compile=False, progress=False)
    _, model = code_mlm.build_models(cfg, 300)
    layers = tt_layers(model)
    ranks = {name: (1, *(max(1, r // (2 + k % 2)) for k, r in enumerate(m.spec.ranks[1:-1])), 1)
             for name, m in layers.items()}
    ra_control._build_at_ranks(model, ranks, seed=0)
    for name, m in tt_layers(model).items():
        assert m.spec.ranks == ranks[name]
        sizes = (*m.spec.in_modes, *m.spec.out_modes)
        r = ranks[name]
        assert m.tt_params() == sum(r[k] * n * r[k + 1] for k, n in enumerate(sizes)) + sum(r[1:-1])
    def ranks_size(r, m):
        sizes = (*m.spec.in_modes, *m.spec.out_modes)
        return sum(r[k] * n * r[k + 1] for k, n in enumerate(sizes)) + sum(r[1:-1])

    ids = torch.randint(0, 300, (2, cfg.seq_len))
    assert model(ids, torch.arange(cfg.seq_len).expand(2, -1)).shape == (2, cfg.seq_len, 300)

    rows = ra_control.run(steps=4, size="tiny", max_bytes=40_000, vocab_size=300, eval_blocks=8, compile=False,
                          frontier=(2,))
    by = {r["run"]: r for r in rows}
    assert set(by) == {"adapt", "fixed", "final", "uniform"}
    # the frontier's model is the tiny size at rank 2 throughout: its TT count is what those ranks imply
    uniform = by["uniform"]
    assert uniform["rank"] == 2 and uniform["tt_end"] == uniform["tt_start"]
    assert all(max(r) <= 2 for r in uniform["ranks"].values())
    assert uniform["tt_end"] == sum(ranks_size(r, layers[name]) for name, r in uniform["ranks"].items())
    assert set(by["adapt"]["vs_uniform"]) == {2}
    assert by["fixed"]["tt_end"] == by["fixed"]["tt_start"]
    assert by["final"]["tt_end"] == by["adapt"]["tt_end"] and by["final"]["ranks"] == by["adapt"]["ranks"]
    for r in rows:
        assert 0 <= r["accuracy"] <= 1 and r["loss"] > 0 and r["masked_tokens"] > 0
        assert "tokens" not in r  # the per-token scores stay out of the JSON report
    # paired on the same tokens, the mean difference is the difference of the runs' own means
    for key, other in (("vs_fixed", by["fixed"]), ("vs_control", by["final"])):
        d = by["adapt"][key]
        assert d["accuracy"] == pytest.approx(by["adapt"]["accuracy"] - other["accuracy"], abs=1e-12)
        assert d["loss"] == pytest.approx(by["adapt"]["loss"] - other["loss"], abs=1e-9)
        assert d["loss_se"] > 0 and d["accuracy_se"] >= 0
    text = ra_control.format_rows(rows)
    assert "built at adapt's final ranks" in text and "adapt - control" in text


def test_ra_control_saves_each_run_and_resumes_only_under_the_same_settings(tmp_path, monkeypatch):
    """A long comparison cut short loses nothing: every finished run is saved, a second call with the same
    settings trains nothing and reports the same figures, and changed settings train again."""
    from comera_compile.benchmarks import ra_control

    settings = dict(steps=2, size="tiny", max_bytes=40_000, vocab_size=300, eval_blocks=8, compile=False,
                    frontier=(2,), save_dir=tmp_path)
    first = ra_control.run(**settings)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapt.pt", "final.pt", "fixed.pt", "frontier.png",
                                                          "uniform2.pt"]
    assert (tmp_path / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ra_control.plot([r for r in first if r["run"] != "uniform"], tmp_path / "plain.png")  # no frontier run
    assert (tmp_path / "plain.png").stat().st_size > 0
    trained = []
    real_train = ra_control.train
    monkeypatch.setattr(ra_control, "train", lambda *a, **k: trained.append(a[0]) or real_train(*a, **k))
    again = ra_control.run(**settings)
    assert trained == [] and again == first
    ra_control.run(**{**settings, "steps": 3})
    assert trained == ["adapt", "fixed", "final", "fixed"]


def test_compare_reads_adaptation_against_a_frontier_that_ends_at_the_unadapted_model():
    """The model without adaptation is the uniform-rank model at the starting rank: a size between the
    largest uniform run and the start lies on the frontier, interpolated toward that run (not 'outside')."""
    from comera_compile.benchmarks.ra_control import compare, format_rows

    tokens = {"loss": torch.tensor([1.0, 2.0]), "correct": torch.tensor([1.0, 0.0]), "block": torch.tensor([0, 1])}

    def row(run, rank, size, loss):
        return {"run": run, "rank": rank, "tt_start": 400, "tt_end": size, "loss": loss, "accuracy": 0.5,
                "accuracy_se": 0.1, "masked_tokens": 2, "tokens": tokens, "trajectory": [(100, size)]}

    rows = compare([row("adapt", None, 200, 5.40), row("fixed", 32, 400, 5.46), row("uniform", 8, 100, 5.50)], 100)
    f = rows[0]["frontier"]
    assert f["between"] == (8, 32) and f["loss"] == pytest.approx(5.50 - 0.04 * 0.5)
    assert "on or below it" in format_rows(rows)
    alone = compare([row("adapt", None, 200, 5.40), row("fixed", 32, 400, 5.46)], 100)
    assert alone[0]["frontier"] is None  # no uniform run asked for: no frontier


def test_frontier_at_interpolates_the_uniform_runs_in_log_size():
    """The frontier between two uniform runs is linear in log(size), as np.interp on log sizes computes it;
    outside the trained sizes there is no frontier to compare with."""
    from comera_compile.benchmarks.ra_control import frontier_at

    runs = [{"tt_end": n, "loss": loss, "rank": r} for n, loss, r in ((400, 1.0, 4), (100, 2.0, 2), (1600, 0.8, 8))]
    for size in (100, 150, 200, 399, 400, 1000, 1600):
        expected = np.interp(np.log(size), np.log([100, 400, 1600]), [2.0, 1.0, 0.8])
        got = frontier_at(size, runs)
        assert got["loss"] == pytest.approx(expected, abs=1e-12)
        assert got["between"] == ((2, 4) if size <= 400 else (4, 8))
    assert frontier_at(200, runs)["loss"] == pytest.approx(1.5)  # halfway in log size between 100 and 400
    assert frontier_at(99, runs) is None and frontier_at(1601, runs) is None


def test_last_quarter_change_reads_the_size_at_three_quarters_and_at_the_end():
    from comera_compile.benchmarks.ra_control import last_quarter_change

    trajectory = [(100 * i, 1000 - 10 * i) for i in range(1, 41)]   # 4,000 steps, one rounding per 100
    assert last_quarter_change(trajectory, 4000) == pytest.approx((700 - 600) / 700)  # step 3,000 -> 4,000
    assert last_quarter_change([(100, 50), (200, 50)], 200) == 0.0
    assert last_quarter_change([(300, 50)], 200) is None  # no rounding by three quarters of the run


@given(st.lists(st.floats(-10, 10), min_size=4, max_size=40), st.integers(1, 4))
def test_paired_difference_matches_the_textbook_standard_errors(values, size):
    """One observation per cluster: the standard error of a mean (unbiased std / sqrt(n)); equal clusters of
    `size`: the standard error over the cluster means."""
    from comera_compile.benchmarks.ra_control import paired_difference

    d = torch.tensor(values, dtype=torch.float64)
    d = d[: len(d) // size * size]
    if len(d) < 2 * size:
        return
    b = torch.zeros_like(d)
    mean, se = paired_difference(d, b, torch.arange(len(d)) // size)
    means = np.asarray(values[: len(d)]).reshape(-1, size).mean(axis=1)
    assert mean == pytest.approx(float(np.mean(values[: len(d)])), abs=1e-9)
    assert se == pytest.approx(float(np.std(means, ddof=1) / np.sqrt(len(means))), rel=1e-9, abs=1e-12)


def test_persistent_bytes_counts_parameters_and_adam_state():
    model = nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 10)).sum().backward()
    opt.step()
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    # parameters + exp_avg + exp_avg_sq (float32 each) + one float32 step counter per parameter
    assert galore.persistent_bytes(model, opt) == 3 * 4 * n + 4 * len(params)


def test_galore_projects_only_encoder_matrices():
    pytest.importorskip("galore_torch")
    from comera_compile.examples import six_encoder

    model = six_encoder.build(layers=1, vocab_size=100, max_positions=16)
    opt = galore.galore_optimizer(model, rank=8)
    low_rank = opt.param_groups[1]["params"]
    expected = [m.weight for name, m in model.named_modules()
                if isinstance(m, nn.Linear) and name.startswith("layers.")]
    assert len(low_rank) == len(expected) == 6
    assert all(a is b for a, b in zip(low_rank, expected))
    assert opt.param_groups[1]["rank"] == 8
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def test_flat_rows_print_floats_ints_and_labels():
    from comera_compile.benchmarks.common import format_flat_rows

    row = {"benchmark": "b", "ms": 1.5, "params": 1234567, "execution": "eager (--quick)"}
    assert format_flat_rows([row]) == "b: ms 1.5, params 1,234,567, execution eager (--quick)"


def test_fixed_order_baseline_runs_the_reference_order_and_computes_the_same_product():
    """The six-encoder benchmark's baseline: inside fixed_order() a TT layer contracts in the reference
    tree's order (eager and compiled), gives the dense product, and the planner's order is back after."""
    from comera_compile import networks
    from comera_compile.benchmarks import six_encoder_step as bench
    from comera_compile.layers import TTLinear
    from comera_compile.networks import codegen

    torch.manual_seed(0)
    tt = TTLinear(768, 3072, rank=30, in_modes=(12, 8, 8), out_modes=(12, 16, 16))
    x = torch.randn(128, 768, dtype=torch.float64, requires_grad=True)
    tt = tt.double()
    dense = x @ tt.to_dense().t() + tt.bias
    fixed = networks.plan_from_tree(networks.tt_linear_network(tt.gemm_spec, 128),
                                    networks.reference_tree(tt.gemm_spec))
    assert fixed.training_flops > tt.plan(128).training_flops   # a different, costlier order
    from torch.utils.flop_counter import FlopCounterMode

    def gemm_flops(fn) -> int:
        with FlopCounterMode(display=False) as counter:
            fn()
        return counter.get_total_flops()

    def fixed_run():   # the fixed plan, run by the planner's interpreter on the layer's operands
        return networks.execute(fixed, [x.reshape(128, *tt.spec.in_modes), *tt._operands()])

    saved = networks.tt_linear_program
    searched_flops = gemm_flops(lambda: tt(x))
    with bench.fixed_order():
        assert networks.tt_linear_program(tt.spec, 128) == fixed.program
        eager = tt(x)
        # the layer runs that order: the GEMMs' FLOPs are the fixed plan's, not the searched one's
        assert gemm_flops(lambda: tt(x)) == gemm_flops(fixed_run) != searched_flops
        _, names = codegen.tt_linear_runner_names(tt.spec.token, True, True, True)
        assert set(names) == {codegen._runner(tt.spec, fixed.program, True)[0]}
        compiled = torch.compile(tt, backend=bench._comera_fixed_order)(x)
    assert networks.tt_linear_program is saved
    assert gemm_flops(lambda: tt(x)) == searched_flops
    torch.testing.assert_close(eager, dense)
    torch.testing.assert_close(compiled, dense)
    torch._dynamo.reset()


def test_gemm_calls_counts_every_matrix_product_one_call_runs_and_the_six_encoder_row_shows_them():
    from comera_compile.benchmarks.common import gemm_calls
    from comera_compile.benchmarks.six_encoder_step import format_rows

    a, b, c = torch.randn(4, 8), torch.randn(8, 8), torch.randn(2, 4, 8)

    def products():   # a @ b, a 3-D @ 2-D matmul (one folded GEMM), addmm, bmm, baddbmm: five; the rest none
        return (a @ b, c @ b, torch.addmm(b[0], a, b), torch.bmm(c, b.expand(2, 8, 8)),
                torch.baddbmm(c, c, b.expand(2, 8, 8)), a.sum(), a * 2, b @ b[0])

    assert gemm_calls(products) == 5
    assert gemm_calls(lambda: None) == 0
    row = {"benchmark": "six_encoder_step_b8x128_l6", "dense eager ms": 100.0, "tensorized comera ms": 25.0,
           "comera, siblings shared ms": 24.0, "comera vs dense eager": 4.0, "comera vs tensorized eager": 2.0,
           "comera vs fixed order": 1.5, "siblings shared vs apart": 25.0 / 24.0, "tensorized comera GEMMs": 678,
           "comera, siblings shared GEMMs": 390, "dense params": 85_000_000, "tensorized params": 2_000_000,
           "threads": 2}
    assert format_rows([row]).endswith("; GEMM calls per step 678 -> 390 with siblings shared (1.04x the step time)")


# -- the device suite (comera-compile bench --device, make gpu-check) -----------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where no GPU is present")
def test_bench_on_cuda_without_a_gpu_says_what_to_do():
    with pytest.raises(SystemExit, match="no CUDA device.*--device cpu"):
        cli.main(["bench", "--device", "cuda"])
    from comera_compile.benchmarks import gpu_check

    assert gpu_check.main(["--device", "cuda"]) == 2


def test_bench_device_names_the_cpu_only_benchmarks():
    with pytest.raises(SystemExit, match=r"\['memory_passes'\] run on the CPU only"):
        cli.main(["bench", "--device", "cpu", "--only", "memory_passes"])


def test_device_compare_interleaves_the_cases_and_reports_each_median():
    from comera_compile.benchmarks.device_step import device_compare

    calls = []
    cases = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    ms = device_compare(cases, torch.device("cpu"), warmup=1, repeat=3)
    assert calls == ["a", "b"] + ["a", "b", "b", "a", "a", "b"]   # warm-up, then one of each per round
    assert set(ms) == {"a", "b"} and all(v >= 0 for v in ms.values())


def test_compare_starts_each_round_one_case_further_on():
    """Every case runs once a round; each round starts at the next case, so none always follows the same
    other case (whose freed memory it would inherit)."""
    from comera_compile.benchmarks.common import compare

    calls = []
    cases = {k: (lambda k=k: calls.append(k)) for k in "abc"}
    ms = compare(cases, warmup=1, repeat=4)
    assert calls == list("abc") + list("abc") + list("bca") + list("cab") + list("abc")
    assert all(len(ms[k].samples) == 4 for k in "abc")


def test_compile_step_under_bf16_autocast_matches_eager_autocast_steps():
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 5))
    import copy

    import comera_compile as cc

    model = cc.tensorize(dense, rank=8, min_features=32)
    eager = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(16, 64, generator=g), torch.randint(0, 5, (16,), generator=g)
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    ref = []
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = eager(x)
            loss = loss_fn(out, target)
        assert out.dtype == torch.bfloat16
        ref.append(float(loss.detach()))
        loss.backward()
        opt.step()
        opt.zero_grad()
    step = cc.compile_step(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1), autocast=torch.bfloat16)
    got = [float(step(x, target)) for _ in range(3)]
    torch._dynamo.reset()
    assert got == pytest.approx(ref, rel=2e-2)
    for p, q in zip(model.parameters(), eager.parameters()):
        assert p.dtype == torch.float32
        assert (p - q).norm() <= 2e-2 * q.norm() + 1e-4


def test_gpu_check_report_shows_every_variant_and_ratio():
    from comera_compile.benchmarks import gpu_check

    row = {"benchmark": "device_step_cuda_bf16_b1x128_l6", "device": "NVIDIA H100", "precision": "bf16",
           "dense eager first s": 1.0, "dense eager MiB": 900.0, "CoMERA first s": 30.0, "CoMERA MiB": 100.0,
           "dense eager ms": 12.0, "CoMERA ms": 4.0, "CoMERA launches": 212.0, "dense eager launches": 640.0,
           "CoMERA vs dense eager": 3.0, "best CoMERA": "CoMERA", "matmul peak TFLOP/s": 400.0,
           "CoMERA, compiled autograd error": "RuntimeError: boom",
           "CoMERA breakdown": {"step_ms": 4.0, "busy_ms": 3.0, "idle_ms": 1.0, "kernels": 300.0,
                                "categories": {"matmul": {"ms": 1.5, "count": 90.0}}, "flops": {"total": 4e9},
                                "flops_per_s": 1e12, "peak_share": 1e12 / 400e12}}
    report = {"date": "2026-11-24", "command": "x", "bench": {"device_step": {"rows": [row]}},
              "machine": {"device": "NVIDIA H100", "torch": "2.11.0", "cuda": "13.0", "python": "3.12",
                          "platform": "Linux"},
              "tests": {"command": "pytest -m cuda", "returncode": 1, "seconds": 5.0, "passed": 3, "failed": 1,
                        "errors": 0, "skipped": 0,
                        "cases": [{"test": "test_x", "status": "failed", "message": "boom"}]}}
    md = gpu_check.report_markdown(report)
    assert "| CoMERA | 4.00 | 212 | 300 | 25% | 50% | 1.00 | 0.2% | 100.0 | 30.0 |" in md
    assert "| dense eager | 12.00 | 640 | - | - | - | - | - | 900.0 | 1.0 |" in md
    assert "400.0 TFLOP/s (bf16" in md and "CoMERA 4.00 GFLOP" in md
    assert "| CoMERA, compiled autograd | failed: RuntimeError: boom |" in md
    assert "CoMERA vs dense eager **3.00x** (best CoMERA: CoMERA)" in md
    assert "3 passed, 1 failed" in md and "`test_x` boom" in md and "NVIDIA H100" in md


@pytest.mark.slow
def test_device_suite_runs_on_the_cpu(tmp_path):
    """gpu_check's whole path on the CPU: the tier's tests, then the device suite at reduced sizes."""
    from comera_compile.benchmarks import gpu_check

    assert gpu_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["tests"]["failed"] == 0 and report["tests"]["passed"] > 0
    assert set(report["bench"]) == {"tt_linear", "embeddings", "device_step"}
    assert all("error" not in v for v in report["bench"].values())
    rows = report["bench"]["device_step"]["rows"]
    assert {r["precision"] for r in rows} == {"fp32", "bf16"}
    assert all(r["CoMERA ms"] > 0 and r["dense compiled ms"] > 0 for r in rows)
    assert "CoMERA vs dense compiled" in (tmp_path / "report.md").read_text()


def test_ra_teachers_cases_have_the_teachers_ranks_and_a_frontier():
    """The teachers hold the ranks their case names (a dense teacher's found from its unfoldings, checked
    against the matrix rank computed by torch.linalg); a short run reports ranks, sizes and a frontier."""
    from comera_compile.benchmarks import ra_teachers as T

    for case in T.CASES:
        teacher = T.teacher_data(case)[0]
        for (n_in, n_out, rank), layer in zip(case.layers, teacher.layers):
            if rank is not None:
                assert max(layer.ranks) == rank and layer.in_features == n_in and layer.out_features == n_out
    dense = next(c for c in T.CASES if any(r is None for _, _, r in c.layers))
    weight = T.teacher_data(dense)[0].layers[0].weight
    student = T.Net(dense, rank=16).layers[0]
    ranks = T.exact_ranks(weight, student)
    # the bond between the input and output halves of the train is the matrix's own rank
    assert ranks[len(student.spec.in_modes)] == int(torch.linalg.matrix_rank(weight.double(), rtol=1e-5)) == 5
    row = T.run_case(T.CASES[0], steps=5, uniform=(2, 16))
    assert [f["rank"] for f in row["frontier"]] == [2, 16]
    assert row["frontier"][0]["size"] < row["size"] <= row["frontier"][1]["size"]
    assert row["best_uniform"]["rank"] == 16
    assert "found (1, " in T.format_rows([row])


def test_row_plan_runs_the_headline_row_first_and_each_extra_where_it_answers_its_question():
    """The device table's rows for a lent GPU's minutes: every (precision, batch) once, bf16 at batch 8 first,
    GaLore at batch 1 only (its claim), the siblings apart in every bf16 row (batch_siblings' CUDA default),
    combo kernels and the fixed order in the headline row alone; the variants built are the row's."""
    from comera_compile.benchmarks.common import EXTRAS, row_plan
    from comera_compile.benchmarks.device_step import _variants

    plan = row_plan((1, 8, 32))
    assert [(p, b) for p, b, _ in plan] == [("bf16", 8), ("bf16", 1), ("bf16", 32), ("fp32", 8), ("fp32", 1),
                                            ("fp32", 32)]
    extras = {(p, b): e for p, b, e in plan}
    assert {k for k, e in extras.items() if "GaLore" in e} == {("bf16", 1), ("fp32", 1)}
    assert {k for k, e in extras.items() if "CoMERA, compiled autograd" in e} == {("bf16", 1)}
    assert {k for k, e in extras.items() if "CoMERA, whole-step graph, siblings apart" in e} == {
        ("bf16", 1), ("bf16", 8), ("bf16", 32)}
    assert {k for k, e in extras.items() if "CoMERA, fixed order" in e} == {("bf16", 8)} == {
        k for k, e in extras.items() if "CoMERA, whole-step graph, combo kernels" in e}
    assert set().union(*extras.values()) == set(EXTRAS)
    assert [(p, b) for p, b, _ in row_plan((1, 2), ("fp32",))] == [("fp32", 2), ("fp32", 1)]
    cpu = torch.device("cpu")
    assert "CoMERA, fixed order" not in _variants(1, cpu, None, frozenset())
    assert "CoMERA, fixed order" in _variants(1, cpu, None, {"CoMERA, fixed order"})


def test_compiled_autograd_step_trains_as_eager_adamw():
    """The device bench's third whole-step mechanism (the step compiled as one function, its backward traced
    by compiled autograd) computes the eager AdamW steps."""
    import copy

    import comera_compile as cc
    from comera_compile.benchmarks.common import compiled_autograd_step

    torch.manual_seed(0)
    model = cc.tensorize(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 5)), rank=4, min_features=16)
    eager = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(8, 32, generator=g), torch.randint(0, 5, (8,), generator=g)
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    ref = []
    for _ in range(3):
        loss = loss_fn(eager(x), target)
        ref.append(float(loss))
        loss.backward()
        opt.step()
        opt.zero_grad()
    step = compiled_autograd_step(model, loss_fn, torch.optim.AdamW(model.parameters(), lr=1e-2), None)
    got = [float(step(x, target)) for _ in range(3)]
    torch._dynamo.reset()
    assert got == pytest.approx(ref, rel=1e-4)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_gpu_check_keeps_finished_parts_and_says_what_a_budget_left_out(tmp_path, capsys):
    """make gpu-check in parts, as a lent GPU's time limit needs: --resume keeps the tests and rows an earlier
    run left under --out and measures nothing twice; a --budget too small for another row starts none, and
    the report and the exit status (3) say which rows are missing and how to finish them."""
    from comera_compile.benchmarks import gpu_check

    (tmp_path / "rows").mkdir()
    earlier = {"benchmark": "six_encoder_step_b1x32_l1 fp32", "precision": "fp32", "device": "cpu",
               "CoMERA ms": 2.0, "CoMERA first s": 1.0, "dense compiled ms": 3.0, "dense compiled first s": 1.0,
               "CoMERA vs dense compiled": 1.5, "best CoMERA": "CoMERA"}
    (tmp_path / "rows" / "fp32_b1.json").write_text(json.dumps(earlier))
    (tmp_path / "bench_tt_linear.json").write_text(json.dumps({"rows": [{"benchmark": "tt_linear", "ms": 1.0}]}))
    tests = {"command": "pytest -m cuda", "returncode": 0, "seconds": 1.0, "passed": 3, "failed": 0, "errors": 0,
             "skipped": 0, "cases": []}
    (tmp_path / "tests.json").write_text(json.dumps(tests))
    args = ["--device", "cpu", "--quick", "--out", str(tmp_path), "--budget", "0"]
    assert gpu_check.main([*args, "--resume"]) == 3
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["tests"] == tests and report["bench"]["device_step"]["rows"] == [earlier]
    # headline row first (bf16 at the larger batch), fp32 after; the per-layer benches after the whole table
    assert report["bench"]["device_step"]["missing"] == ["bf16 b2", "bf16 b1", "fp32 b2"]
    assert "embeddings" not in report["bench"] and report["bench"]["tt_linear"]["rows"][0]["ms"] == 1.0
    md = (tmp_path / "report.md").read_text()
    assert "Incomplete" in md and "bf16 b2, bf16 b1, fp32 b2, embeddings" in md and "--resume" in md
    assert "CoMERA vs dense compiled **1.50x**" in md
    assert gpu_check.main([*args, "--skip-tests", "--skip-bench"]) == 0   # without --resume nothing is kept
    assert not (tmp_path / "rows" / "fp32_b1.json").exists() and not (tmp_path / "tests.json").exists()
