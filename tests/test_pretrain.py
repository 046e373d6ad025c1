"""`comera-compile pretrain`: the learning-rate schedule (by steps and by time), perplexity, GaLore's groups,
bad options, the equal-token evaluation point, and the command end to end at a micro size."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from comera_compile.cli import main  # noqa: E402
from comera_compile.examples import lm_pretrain as lp  # noqa: E402
from comera_compile.examples import lm_report  # noqa: E402

MICRO_SHAPE = lp.LlamaShape(hidden=64, intermediate=128, heads=2, layers=2, max_positions=64)
MICRO_PRESET = {"minutes": None, "steps": 4, "batch": 2, "rank": 4, "galore_rank": 4, "warmup_steps": 1,
                "eval_blocks": 4, "evals": 2, "threads": 1}
MICRO_ARGS = ["--seq-len", "32", "--vocab-size", "300", "--max-bytes", "30000", "--no-progress"]


@pytest.fixture
def micro(monkeypatch):
    """The "micro" preset: a 2-layer, 64-wide Llama, a few steps."""
    monkeypatch.setitem(lp.SHAPES, "micro", MICRO_SHAPE)
    monkeypatch.setitem(lp.PRESETS, "micro", dict(MICRO_PRESET))


@pytest.fixture
def shared_compile_cache(monkeypatch):
    """Each method's graphs traced again (dynamo reset around it) but Inductor's compiled code taken from the
    on-disk cache the suite shares, instead of a fresh cache per method: the command's fair first-call timing
    costs about a minute of compiling here and has tests of its own (test_demo_fixes, test_pretrain_fixes)."""
    import contextlib

    @contextlib.contextmanager
    def traced_again():
        torch._dynamo.reset()
        try:
            yield
        finally:
            torch._dynamo.reset()

    monkeypatch.setattr(lp, "own_compile_cache", traced_again)
    monkeypatch.setattr(lp, "warm_up_compiler", lambda device: 0.0)


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# -- schedule ----------------------------------------------------------------------------------------------
def _lrs(sched: lp.Schedule, step: int, elapsed: float) -> list[float]:
    sched.before(step, elapsed)
    return [g["lr"] for g in sched.optimizer.param_groups]


def test_step_schedule_is_transformers_cosine_with_warmup_to_a_tenth():
    """On a step budget, the lr of 1-based step k is transformers' cosine-with-min-lr schedule at k (warm-up
    k / W, then the cosine to 10% at the last step), in every param group alike."""
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    total, warmup = 50, 7
    p = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))]
    opt = torch.optim.AdamW([{"params": [p[0]], "lr": 1e-3}, {"params": [p[1]], "lr": 2e-2}])
    reference = get_cosine_with_min_lr_schedule_with_warmup(
        torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0), warmup, total, min_lr_rate=0.1).lr_lambdas[0]
    sched = lp.Schedule(opt, warmup, 0.1, budget_s=None, steps=total)
    for k in range(1, total + 1):
        lrs = _lrs(sched, k, elapsed=123.0)   # the clock plays no part on a step budget
        assert lrs[0] == pytest.approx(1e-3 * reference(k), rel=1e-12)
        assert lrs[1] == pytest.approx(2e-2 * reference(k), rel=1e-12)
    assert lrs[0] == pytest.approx(1e-4)  # the last step at the floor
    assert sched.warmup_end == warmup / total


def test_time_schedule_runs_the_cosine_on_the_fraction_of_the_clock():
    """On a time budget: warm-up by steps, then the cosine from the clock at the warm-up's end to the budget's
    end, whatever the steps take (here uneven, with a long first step as a compile makes)."""
    budget, warmup, peak = 60.0, 3, 5e-4
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(3))], lr=peak)
    sched = lp.Schedule(opt, warmup, 0.1, budget_s=budget, steps=None)
    durations = [9.0, 0.5, 0.7] + [0.4 + 0.3 * (i % 5) for i in range(200)]
    elapsed, t_end_warmup = 0.0, None
    for k, d in enumerate(durations, 1):
        if elapsed >= budget:
            break
        lr = _lrs(sched, k, elapsed)[0]
        if k <= warmup:
            expected = peak * k / warmup
        else:
            if t_end_warmup is None:
                t_end_warmup = elapsed
            u = (elapsed - t_end_warmup) / (budget - t_end_warmup)
            expected = peak * (0.1 + 0.45 * (1 + math.cos(math.pi * u)))
        assert lr == pytest.approx(expected, rel=1e-12), k
        elapsed += d
    assert t_end_warmup == pytest.approx(10.2)
    assert lr < peak * 0.11 and lr > peak * 0.1  # the last step started just short of the budget's end


def test_lr_factor_edges():
    assert lp.lr_factor(1, 0.0, 0, 0.0) == pytest.approx(1.0)   # no warm-up: the cosine's top
    assert lp.lr_factor(5, 1.0, 0, 0.0, floor=0.1) == pytest.approx(0.1)
    assert lp.lr_factor(5, 2.0, 0, 0.0, floor=0.1) == pytest.approx(0.1)  # past the budget: held at the floor
    assert lp.lr_factor(9, 0.5, 10, 0.9) == pytest.approx(0.9)  # still warming up, whatever the progress
    assert lp.lr_factor(11, 1.0, 10, 1.0, floor=0.2) == pytest.approx(0.2)  # warm-up outlasted the budget


# -- model, loss, perplexity -------------------------------------------------------------------------------
def test_perplexity_is_exp_of_transformers_own_shifted_loss():
    """evaluate's loss is the mean next-token cross-entropy over every predicted token: equal to the mean of
    LlamaForCausalLM's own labels= loss over equal-size batches; its perplexity is exp of that."""
    model = lp.build_model(MICRO_SHAPE, 300, seed=0)
    val = torch.randint(0, 300, (6, 16), generator=torch.Generator().manual_seed(1))
    got = lp.evaluate(model, val, batch=2)
    with torch.no_grad():
        model.eval()
        hf = torch.stack([model(input_ids=val[i: i + 2], labels=val[i: i + 2], use_cache=False).loss
                          for i in range(0, 6, 2)]).mean()
    assert got["predicted_tokens"] == 6 * 15
    assert got["loss"] == pytest.approx(float(hf), rel=1e-5)
    assert got["ppl"] == pytest.approx(math.exp(float(hf)), rel=1e-5)
    assert model.training is False  # evaluate puts the model back as it found it
    model.train()
    lp.evaluate(model, val[:2])
    assert model.training


def test_causal_lm_loss_predicts_the_next_token():
    ids = torch.tensor([[1, 2, 3]])
    logits = torch.full((1, 3, 4), -30.0)
    logits[0, 0, 2] = logits[0, 1, 3] = 30.0  # position t predicts token t + 1: a perfect model
    assert float(lp.causal_lm_loss(logits, ids)) < 1e-6
    logits[0, 1, 3], logits[0, 1, 0] = -30.0, 30.0
    assert float(lp.causal_lm_loss(logits, ids)) == pytest.approx(60.0 / 2, rel=1e-4)


def test_batches_are_one_seeded_order_for_every_method():
    train = torch.arange(40).reshape(10, 4)
    a, b = lp.batches(train, 3, seed=5), lp.batches(train, 3, seed=5)
    first = [next(a) for _ in range(7)]
    assert all(torch.equal(x, next(b)) for x in first)
    epoch = torch.cat(first[:3])[:, 0] // 4   # three batches of 3 from 10 blocks: 9 distinct blocks
    assert len(set(epoch.tolist())) == 9
    c = lp.batches(train, 3, seed=6)
    assert not all(torch.equal(x, next(c)) for x in first)


def test_galore_projects_exactly_the_decoder_linears():
    pytest.importorskip("galore_torch")
    model = lp.build_model(MICRO_SHAPE, 300, seed=0)
    cfg = lp.preset("tiny", galore_rank=8)
    opt = lp.galore_optimizer(model, cfg)
    low = [g for g in opt.param_groups if "rank" in g]
    assert len(low) == 1 and low[0]["rank"] == 8 and low[0]["update_proj_gap"] == 200
    names = {id(p): n for n, p in model.named_parameters()}
    projected = sorted(names[id(p)] for p in low[0]["params"])
    assert len(projected) == 7 * MICRO_SHAPE.layers
    assert all(n.startswith("model.layers.") and n.endswith("_proj.weight") for n in projected)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def test_presets_have_the_papers_llama_shapes():
    assert lp.SHAPES["60m"] == lp.LlamaShape(512, 1376, 8, 8)
    assert lp.SHAPES["130m"] == lp.LlamaShape(768, 2048, 12, 12)
    assert lp.SHAPES["350m"] == lp.LlamaShape(1024, 2736, 16, 24)
    with torch.device("meta"):
        m = lp.build_model(lp.SHAPES["60m"], 32000, seed=0)
    assert 57e6 < lp.total_params(m) < 60e6  # "60M" with the papers' 32k vocabulary
    assert all(lp.preset(name).seq_len == 256 for name in lp.PRESETS)


# -- bad options -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--seq-len", "2048"], "above the model's 1024 positions"),
    (["--methods", "dense,lora"], "--methods takes a comma-separated subset of dense,comera,galore"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--minutes", "-1"], "--minutes must be a positive number"),
    (["--minutes", "inf"], "--minutes must be a positive number (for no time budget, give --steps alone), got inf"),
    (["--steps", "10"], None),   # a step budget alone warms up for a tenth of it: no error
    (["--steps", "5", "--warmup-steps", "5"], "leaves no step of the 5-step budget"),
    (["--lr", "0"], "learning rates must be positive"),
    (["--rank", "0"], "--rank must be a positive integer"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--vocab-size", "100"], "--vocab-size must be at least 257"),
    (["--nproc", "3", "--batch", "4"], "does not split evenly over 3 processes"),
    # checked before torchrun starts, not once in every process
    (["--nproc", "2", "--data", "/nonexistent/comera-docs"], "--data '/nonexistent/comera-docs' does not exist"),
    (["--nproc", "2", "--tokenizer", "/nonexistent/tok.json"], "--tokenizer '/nonexistent/tok.json' does not exist"),
    (["--batch", "4", "--micro-batches", "3"], "leaves micro-batches of unequal size; give a --batch that is a "
                                                "multiple of 3"),
    (["--micro-batches", "0"], "--micro-batches must be at least 1"),
    (["--clip", "-1"], "--clip must be positive"),
    (["--precision", "tf32"], "--precision tf32 is a mode of CUDA's matrix products"),
    pytest.param(["--device", "cuda"], "no CUDA device is visible",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")),
])
def test_bad_options_say_what_to_change(args, message, capsys, monkeypatch, keep_threads):
    if message is None:   # accepted: stop before anything is read or trained
        monkeypatch.setattr(lp, "run_in_world", lambda *a: {})
        assert main(["pretrain", *args]) == 0
        return
    with pytest.raises(SystemExit) as e:
        main(["pretrain", *args])
    assert str(e.value).startswith("comera-compile pretrain: ")
    assert message in str(e.value)


def test_unknown_preset_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["pretrain", "--preset", "7b"])
    assert "invalid choice" in capsys.readouterr().err


def test_a_file_as_out_dir_is_an_error(tmp_path, micro, keep_threads):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(SystemExit, match="is a file"):
        main(["pretrain", "--preset", "micro", "--out", str(f), *MICRO_ARGS])


# -- the equal-token point ---------------------------------------------------------------------------------
def test_equal_token_point_is_evaluated_on_a_time_budget(keep_threads):
    """On a time budget, a method is also evaluated when its token count reaches the first method's final
    one, off the time marks; the summary reads its perplexity there."""
    torch.set_num_threads(1)
    cfg = lp.PretrainConfig(preset="tiny", minutes=30.0, steps=5, batch=2, seq_len=16, evals=1, warmup_steps=1,
                            progress=False)
    model = lp.build_model(MICRO_SHAPE, 300, seed=0)
    data = torch.randint(0, 300, (12, 16), generator=torch.Generator().manual_seed(0))
    r = lp.train_one("dense", model, cfg, data[:10], data[10:], eval_tokens=(3 * 2 * 16,))
    assert r["steps"] == 5 and r["tokens"] == 5 * 2 * 16
    assert [e["step"] for e in r["evals"]] == [3, 5]   # the token mark, then the end (no time mark passed)
    assert r["evals"][0]["tokens"] == 96
    assert r["evals"][0]["ppl"] == pytest.approx(math.exp(r["evals"][0]["loss"]))
    base = {**r, "tokens": 96, "val_loss": r["evals"][0]["loss"] + 1.0, "val_ppl": 1.0, "time_s": 2 * r["time_s"]}
    s = lm_report.summarize({"runs": {"dense": base, "comera": r}, "dense_params": {"decoder": 1}})
    m = s["methods"]["comera"]
    assert m["equal_tokens"] is r["evals"][0]
    assert m["ppl_ratio_equal_tokens"] == pytest.approx(r["evals"][0]["ppl"])
    assert m["reach_s"] == pytest.approx(r["evals"][0]["time_s"])   # below the target at its first evaluation
    assert m["reach_fraction"] == pytest.approx(0.5 * r["evals"][0]["time_s"] / r["time_s"])



def test_a_second_pass_over_the_training_text_is_said_and_counted(keep_threads):
    """Ten training blocks in batches of 2 are 5 steps a pass: the first 5 batches hold each block once and the
    6th repeats one; train_one says so at step 6 (once), counts 7 steps as 1.4 passes, and the table carries
    the passes and a line saying the batches repeated."""
    torch.set_num_threads(1)
    data = torch.randint(0, 300, (12, 16), generator=torch.Generator().manual_seed(0))
    train = data[:10]
    stream = lp.batches(train, 2, seed=0)
    seen = [tuple(map(tuple, next(stream).tolist())) for _ in range(6)]
    first_pass = [row for b in seen[:5] for row in b]
    assert sorted(first_pass) == sorted(map(tuple, train.tolist()))   # every block once
    assert set(seen[5]) <= set(first_pass)                            # then they repeat
    cfg = lp.PretrainConfig(preset="tiny", minutes=None, steps=7, batch=2, seq_len=16, evals=1, warmup_steps=1,
                            progress=False)
    said: list[str] = []
    r = lp.train_one("dense", lp.build_model(MICRO_SHAPE, 300, seed=0), cfg, train, data[10:], log=said.append)
    assert len(said) == 1 and "step 6 starts a second pass" in said[0] and "--data" in said[0]
    assert r["passes"] == pytest.approx(7 / 5)
    result = {"runs": {"dense": r}, "dense_params": {"total": 1, "decoder": 1}, "wall_time_s": 1.0,
              "threads": 1, "config": {**vars(cfg), "out": None},
              "model": {**vars(MICRO_SHAPE), "vocab_size": 300, "seq_len": 16},
              "data": {"val_blocks": 2, "val_tokens": 30, "source": "test"}}
    result["summary"] = lm_report.summarize(result)
    table = lm_report.format_table(result)
    assert "| passes over the training text" in table and "1.40" in table
    assert "Batches repeated (passes over the training text: dense 1.4)" in table
    # A method whose every step compiled has no step time: n/a, and no speed ratio read off compile times.
    result["runs"]["comera"] = {**r, "median_step_s": None, "tokens_per_s": None}
    result["summary"] = lm_report.summarize(result)
    assert result["summary"]["methods"]["comera"]["step_speedup"] is None
    row = next(line for line in lm_report.format_table(result).splitlines() if line.startswith("| median step"))
    assert row.count("n/a (every step compiled; raise --minutes)") == 1 and "speed" not in row
    del result["runs"]["comera"]
    short = lp.train_one("dense", lp.build_model(MICRO_SHAPE, 300, seed=0),
                         lp.PretrainConfig(**{**vars(cfg), "steps": 5}), train, data[10:], log=said.append)
    assert len(said) == 1 and short["passes"] == pytest.approx(1.0)   # one whole pass: nothing repeated



@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_the_step_runs_in_the_precision_asked_for(precision, keep_threads, monkeypatch):
    """--precision bf16 (fp16) runs forward and loss under bf16 (fp16) autocast (the logits the loss reads are
    bf16 (fp16), the first loss is eager autocast's, the weights and their optimizer state stay fp32; fp16's
    loss scaled by the step's GradScaler); fp32 runs in fp32 (the first loss is the fp32 model's).  The CPU's
    float32 matmul setting is left as it was."""
    from comera_compile.examples import lm_train
    from comera_compile.examples.demo_dist import arithmetic

    torch.set_num_threads(1)
    seen: list[torch.dtype] = []
    loss_of_output = lm_train._loss_of_output
    monkeypatch.setattr(lm_train, "_loss_of_output",
                        lambda out, ids: seen.append(out.logits.dtype) or loss_of_output(out, ids))
    data = torch.randint(0, 300, (12, 16), generator=torch.Generator().manual_seed(0))
    cfg = lp.PretrainConfig(preset="tiny", minutes=None, steps=2, batch=2, seq_len=16, evals=1, warmup_steps=1,
                            progress=False, precision=precision)
    model = lp.build_model(MICRO_SHAPE, 300, seed=0)
    first = next(lp.batches(data[:10], 2, seed=0))
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    with torch.no_grad(), torch.autocast("cpu", dtype=half or torch.bfloat16, enabled=half is not None):
        expected = float(lp.causal_lm_loss(model(input_ids=first, use_cache=False).logits, first))
    before = torch.get_float32_matmul_precision()
    with arithmetic(cfg.arithmetic(), torch.device("cpu")) as dtype:
        assert torch.get_float32_matmul_precision() == before
        r = lp.train_one("dense", model, cfg, data[:10], data[10:], log=lambda _: None)
    assert dtype == half and r["precision"] == precision
    assert seen and set(seen) == {half or torch.float32}
    assert r["history"]["loss"][0] == pytest.approx(expected, rel=1e-2 if half is not None else 1e-5)
    assert r["skipped_steps"] == 0
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert lp.PretrainConfig(device="cpu").arithmetic() == "fp32"
    assert lp.PretrainConfig(device="cuda").arithmetic() == "bf16"



def test_comera_in_bf16_compiles_one_graph_for_a_12_layer_decoder(keep_threads, monkeypatch):
    """pretrain's CoMERA run as the command builds it (tensorize of model.layers.*, RankAdaptive, compile_step
    with backend "comera"), --precision bf16, on a 12-layer Llama: one compiled graph serves every layer, no
    layer runs eagerly, and the first step's loss is an eager bf16-autocast forward's of the same model."""
    import copy

    import comera_compile as cc
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    monkeypatch.setitem(lp.SHAPES, "deep", lp.LlamaShape(hidden=64, intermediate=128, heads=2, layers=12,
                                                         max_positions=64))
    cfg = lp.PretrainConfig(preset="deep", minutes=None, steps=2, batch=2, seq_len=16, evals=1, warmup_steps=1,
                            rank=4, progress=False, precision="bf16")
    model = lp._model_for("comera", cfg, 300, torch.device("cpu"))
    data = torch.randint(0, 300, (12, 16), generator=torch.Generator().manual_seed(0))
    first = next(lp.batches(data[:10], 2, seed=0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = float(lp.causal_lm_loss(copy.deepcopy(model)(input_ids=first, use_cache=False).logits, first))
    torch._dynamo.reset()
    counters.clear()
    r = lp.train_one("comera", model, cfg, data[:10], data[10:], log=lambda _: None)
    assert counters["stats"]["unique_graphs"] == 1 and not cc.regional.eager_blocks(model)
    assert r["history"]["loss"][0] == pytest.approx(expected, rel=1e-2)
    assert r["precision"] == "bf16" and all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.slow   # test_demo's and test_regional's whole-step tests run compile_step's capture
def test_the_step_trains_the_same_with_the_whole_step_captured(micro, keep_threads, monkeypatch, recwarn):
    """On one GPU pretrain replays the whole step as one CUDA graph ("auto").  Simulated here
    (helpers.SimulatedGraphs: a stale replay fails): the schedule fills the learning rates the captured step
    reads in place, so one capture serves every rate of the warm-up and cosine; the losses and rates are the
    per-layer compiled step's, step for step, and the three steps before the first replay count as compiling."""
    from helpers import capture_every_compiled_step

    torch.set_num_threads(1)
    data = torch.randint(0, 300, (16, 16), generator=torch.Generator().manual_seed(0))
    cfg = lp.PretrainConfig(preset="micro", minutes=None, steps=7, batch=2, seq_len=16, evals=1, warmup_steps=3,
                            rank=4, progress=False)
    plain = lp.train_one("comera", lp._model_for("comera", cfg, 300, torch.device("cpu")), cfg, data[:12], data[12:],
                         log=lambda _: None)
    sims = capture_every_compiled_step(monkeypatch)
    captured = lp.train_one("comera", lp._model_for("comera", cfg, 300, torch.device("cpu")), cfg, data[:12],
                            data[12:], log=lambda _: None)
    assert len(sims) == 1 and sims[0].captured == 1, "one capture for every learning rate"
    assert not [w for w in recwarn.list if "cuda_graphs" in str(w.message)]
    assert captured["execution"].endswith("the whole step one CUDA graph")
    assert len(set(captured["history"]["lr"])) >= 5 and captured["history"]["lr"] == plain["history"]["lr"]
    torch.testing.assert_close(torch.tensor(captured["history"]["loss"]), torch.tensor(plain["history"]["loss"]),
                               rtol=1e-5, atol=1e-6)
    assert captured["compile_steps"] == [1, 2, 3]


@pytest.mark.slow
def test_micro_batches_train_as_the_whole_batch(micro, keep_threads):
    """--micro-batches 2 (batch 4: two forward and backward passes of 2 rows, one AdamW step) follows the run
    of the whole batch at once, CoMERA with RankAdaptive: every step's loss, the learning rates and the
    validation loss, to float32 rounding.  (Slow: its two compiles take 35 s; compile_step's micro-batches are
    tests/test_micro_batches.py's, and the option's check and resume fingerprint run in the default tier.)"""
    torch.set_num_threads(1)
    data = torch.randint(0, 300, (16, 16), generator=torch.Generator().manual_seed(0))
    runs = []
    for parts in (1, 2):
        cfg = lp.PretrainConfig(preset="micro", minutes=None, steps=5, batch=4, micro_batches=parts, seq_len=16,
                                evals=1, warmup_steps=2, rank=4, progress=False)
        runs.append(lp.train_one("comera", lp._model_for("comera", cfg, 300, torch.device("cpu")), cfg, data[:12],
                                 data[12:], log=lambda _: None))
    whole, parts = runs
    assert parts["history"]["lr"] == whole["history"]["lr"]
    torch.testing.assert_close(torch.tensor(parts["history"]["loss"]), torch.tensor(whole["history"]["loss"]),
                               rtol=1e-5, atol=1e-6)
    assert parts["val_loss"] == pytest.approx(whole["val_loss"], rel=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("precision, setting", [("fp32", "highest"), ("tf32", "high"), ("bf16", "high")])
def test_cuda_matmuls_run_in_the_precision_asked_for(precision, setting, device):
    from comera_compile.examples.demo_dist import arithmetic

    before = torch.get_float32_matmul_precision()
    with arithmetic(precision, device):
        assert torch.get_float32_matmul_precision() == (setting if device.type == "cuda" else before)
    assert torch.get_float32_matmul_precision() == before


def test_reach_time_interpolates_between_evaluations():
    base = {"val_loss": 5.0, "val_ppl": math.exp(5.0), "tokens": 400, "time_s": 100.0, "median_step_s": 1.0,
            "params_decoder": 1, "evals": [{"tokens": 400, "time_s": 100.0, "loss": 5.0, "ppl": math.exp(5.0)}]}
    other = {"val_loss": 4.0, "val_ppl": math.exp(4.0), "tokens": 1000, "time_s": 100.0, "median_step_s": 0.25,
             "params_decoder": 1,
             "evals": [{"tokens": 200, "time_s": 20.0, "loss": 6.0, "ppl": math.exp(6.0)},
                       {"tokens": 400, "time_s": 40.0, "loss": 5.5, "ppl": math.exp(5.5)},
                       {"tokens": 600, "time_s": 60.0, "loss": 4.5, "ppl": math.exp(4.5)}]}
    s = lm_report.summarize({"runs": {"dense": base, "comera": other}, "dense_params": {"decoder": 1}})
    m = s["methods"]["comera"]
    assert m["reach_s"] == pytest.approx(50.0) and m["reach_fraction"] == pytest.approx(0.5)
    assert m["reach_tokens"] == pytest.approx(500.0)
    assert m["step_speedup"] == pytest.approx(4.0)
    assert m["ppl_ratio_equal_tokens"] == pytest.approx(math.exp(0.5))
    assert m["ppl_ratio_equal_time"] == pytest.approx(math.exp(-1.0))


# -- end to end --------------------------------------------------------------------------------------------
def test_pretrain_end_to_end_writes_table_plot_and_json(tmp_path, micro, keep_threads, shared_compile_cache,
                                                        monkeypatch, capsys):
    """dense, CoMERA and GaLore at the micro size, a few steps each: the files and every figure in them.  The
    run is stopped in GaLore first: the finished methods' runs are kept, and --resume trains GaLore alone
    (evaluated at dense's kept token count).  A saved run trained with other options is refused, naming them."""
    pytest.importorskip("galore_torch")
    out = tmp_path / "run"
    args = ["pretrain", "--preset", "micro", "--out", str(out), *MICRO_ARGS]
    real, trained, stop_in = lp.train_one, [], {"galore"}

    def train_one(method, *a, eval_tokens=(), **k):
        trained.append((method, eval_tokens))
        if method in stop_in:
            raise RuntimeError("out of time")
        return real(method, *a, eval_tokens=eval_tokens, **k)

    monkeypatch.setattr(lp, "train_one", train_one)
    with pytest.raises(RuntimeError, match="out of time"):
        main(args)
    assert f"stopped: dense, comera finished and kept in {out / 'runs'}" in capsys.readouterr().out
    assert not (out / "runs" / "galore.json").exists() and not (out / "results.json").exists()
    kept = {m: json.loads((out / "runs" / f"{m}.json").read_text())["run"] for m in ("dense", "comera")}
    trained.clear()
    stop_in.clear()
    assert main([*args, "--resume"]) == 0
    assert trained == [("galore", (kept["dense"]["tokens"],))]
    printed = capsys.readouterr().out
    assert "resume: dense, comera kept from" in printed
    table = (out / "table.md").read_text()
    assert "for this command, which kept dense, CoMERA from an earlier one (--resume)" in table
    assert table.strip() in printed
    assert (out / "curves.png").stat().st_size > 10_000
    result = json.loads((out / "results.json").read_text())
    assert list(result["runs"]) == ["dense", "comera", "galore"]
    tokens = 4 * 2 * 32
    for name, r in result["runs"].items():
        assert r["steps"] == 4 and r["tokens"] == tokens
        assert [e["step"] for e in r["evals"]] == [2, 4]
        assert math.isfinite(r["val_loss"]) and r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]))
        assert r["tokens_per_s"] > 0 and r["median_step_s"] > 0 and r["compile_s"] >= 0
        assert r["peak_rss_bytes"] > 0 and r["state_bytes"] > 0
        assert len(r["history"]["lr"]) == 4
    d, c, g = (result["runs"][k] for k in ("dense", "comera", "galore"))
    assert d["params_total"] == g["params_total"] == result["dense_params"]["total"]
    assert d["params_decoder"] == result["dense_params"]["decoder"] == lp.decoder_params(
        lp.build_model(MICRO_SHAPE, result["model"]["vocab_size"], 0))
    assert c["params_decoder"] < d["params_decoder"] and c["tt_params_end"] <= c["tt_params_start"]
    assert d["history"]["lr"] == pytest.approx([1e-3 * lp.lr_factor(k, k / 4, 1, 0.25) for k in range(1, 5)])
    s = result["summary"]["methods"]
    assert s["comera"]["equal_tokens"]["tokens"] == tokens  # equal steps: the equal-token point is the end
    assert "at equal time" not in table  # a step budget: the ends are at equal steps, not equal time
    for label in ("val perplexity (loss) at equal steps", "at dense's 256 tokens", "time to reach dense's final",
                  "active TT parameters", "median step time", "tokens/s", "parameters + optimizer"):
        assert label in table
    assert [c.strip() for c in table.splitlines()[0].split("|")[2:-1]] == ["dense", "CoMERA", "GaLore"]
    assert f"{c['val_ppl']:.2f}" in table and f"{g['val_ppl']:.2f}" in table
    assert d["passes"] == pytest.approx(4 / (result["data"]["train_blocks"] // 2)) and d["passes"] < 1
    assert "passes over the training text" in table and "Batches repeated" not in table
    assert "in fp32;" in table and all(r["precision"] == "fp32" for r in result["runs"].values())
    assert d == kept["dense"] and c == kept["comera"] and (out / "runs" / "galore.json").is_file()
    trained.clear()
    with pytest.raises(SystemExit, match=r"dense's run in .* was trained differently \(batch 2 there, 4 here\)"):
        main([*args, "--resume", "--batch", "4"])
    with pytest.raises(SystemExit, match=r"differently \(micro_batches 1 there, 2 here\)"):
        main([*args, "--resume", "--micro-batches", "2"])
    assert trained == []
    with pytest.raises(SystemExit, match="--resume needs --out"):
        main(["pretrain", "--preset", "micro", "--resume", *MICRO_ARGS])


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_two_processes_train_as_one_on_the_whole_batch(tmp_path, precision):
    """--nproc 2 (torchrun, DDP over gloo, each process on its half of every global batch) follows the
    one-process run of the same global batch: every step's loss and the validation figures, all three methods,
    in fp32 and under bf16 autocast (there to bf16's rounding: 2e-3 relative)."""
    rel = 1e-4 if precision == "fp32" else 2e-3
    pytest.importorskip("galore_torch")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(   # the micro preset, in every process torchrun starts
        "from comera_compile.examples import lm_pretrain as lp\n"
        f"lp.SHAPES['micro'] = lp.{MICRO_SHAPE!r}\n"
        f"lp.PRESETS['micro'] = {dict(MICRO_PRESET, batch=4, steps=6)!r}\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    runs = {}
    for n in (1, 2):
        out = tmp_path / f"p{n}"
        cmd = [sys.executable, "-m", "comera_compile", "pretrain", "--preset", "micro", "--out", str(out),
               "--precision", precision, *MICRO_ARGS, *(["--nproc", "2"] if n == 2 else [])]
        subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=600)
        runs[n] = json.loads((out / "results.json").read_text())
    assert runs[2]["processes"] == 2 and runs[1]["processes"] == 1
    for name in ("dense", "comera", "galore"):
        one, two = runs[1]["runs"][name], runs[2]["runs"][name]
        assert two["precision"] == one["precision"] == precision
        assert two["history"]["loss"] == pytest.approx(one["history"]["loss"], rel=rel)
        assert two["val_loss"] == pytest.approx(one["val_loss"], rel=rel)
        assert "DDP x 2 processes" in two["execution"]


@pytest.mark.slow   # about 2 min; the resume tests below run in the default tier
def test_a_run_stopped_by_ctrl_c_after_replacing_another_resumes_and_evaluates_beside_the_same_method(
        tmp_path, micro, keep_threads, monkeypatch, capsys):
    """A run over a folder of finished runs replaces them at once, so the --resume its Ctrl-C hint names keeps
    only its own; Ctrl-C leaves the hint and exit status 130, no traceback; a kept run evaluated beside
    another first method (dense's tokens, where --methods comera alone has none) is refused, naming it."""
    out = tmp_path / "run"
    args = ["pretrain", "--preset", "micro", "--out", str(out), "--methods", "dense,comera", *MICRO_ARGS]
    assert main(args) == 0
    table = (out / "table.md").read_text()   # the footer names what ran, and no GaLore settings
    assert "CoMERA from TT rank 4." in table and "GaLore" not in table and "which kept" not in table
    real, trained, stop_in = lp.train_one, [], {"comera"}

    def train_one(method, *a, **k):
        trained.append(method)
        if method in stop_in:
            raise KeyboardInterrupt
        return real(method, *a, **k)

    monkeypatch.setattr(lp, "train_one", train_one)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main([*args, "--lr", "2e-3"])
    assert stop.value.code == 130
    assert "stopped: dense finished and kept" in capsys.readouterr().out
    assert not (out / "runs" / "comera.json").exists()   # the earlier run's, at lr 1e-3, is gone
    trained.clear()
    stop_in.clear()
    assert main([*args, "--lr", "2e-3", "--resume"]) == 0 and trained == ["comera"]
    with pytest.raises(SystemExit, match=r"comera's run .* differently \(evaluated_beside 'dense' there, 'comera'"):
        main(["pretrain", "--preset", "micro", "--out", str(out), "--methods", "comera", *MICRO_ARGS,
              "--lr", "2e-3", "--resume"])


def test_resume_keeps_runs_of_the_same_command_and_data_however_its_path_is_written(tmp_path, monkeypatch):
    """--resume compares `--data ./text`, `text` and its absolute path as one folder; a run another command
    saved in the folder is refused in one line naming that command; a run saved before the command was
    recorded is still kept."""
    from dataclasses import dataclass

    from comera_compile.examples.code_data import DemoError
    from comera_compile.examples.run_store import RunStore, fingerprint, run_path

    @dataclass
    class Cfg:
        data: str
        batch: int = 2

    (tmp_path / "text").mkdir()
    monkeypatch.chdir(tmp_path)
    env = {"device": "cpu", "processes": 1, "threads": 1, "torch": torch.__version__}
    out = tmp_path / "out"

    def store(data, command="pretrain", batch=2):
        return RunStore(out, ["dense"], fingerprint(Cfg(data, batch), (), env, paths=("data",)), command=command,
                        resume=True, main=True, log=lambda line: None)

    RunStore(out, ["dense"], fingerprint(Cfg("./text"), (), env, paths=("data",)), command="pretrain",
             resume=False, main=True, log=lambda line: None).save("dense", {"loss": 1.5})
    for written in ("text", str(tmp_path / "text"), "./text/"):
        kept = store(written)
        assert kept.runs == {"dense": {"loss": 1.5}} and kept.kept == ["dense"]
    with pytest.raises(DemoError, match=r"differently \(batch 2 there, 4 here\)"):
        store("text", batch=4)
    with pytest.raises(DemoError, match=r"saved by `comera-compile pretrain`, not `comera-compile demo`; give this "
                                        r"command a new --out$"):
        store("text", command="demo")
    saved = json.loads(run_path(out, "dense").read_text())
    del saved["fingerprint"]["command"]   # as an earlier release wrote it
    run_path(out, "dense").write_text(json.dumps(saved))
    assert store("text", command="demo").kept == ["dense"]


def test_a_one_step_budget_warms_up_for_none_and_a_rerun_drops_the_old_report(tmp_path):
    """--steps 1 alone leaves its one step to the decay (the automatic tenth made it 1 warm-up step, then an
    error about --warmup-steps, which was not given); a run over a folder of finished runs, without --resume,
    removes their table, JSON and plot with them (they described runs no longer there)."""
    from comera_compile.examples.run_store import RunStore, run_path

    assert lp.preset("tiny", steps=1, minutes=None, warmup_steps=None).warmup() == 0
    assert lp.preset("tiny", steps=30, minutes=None, warmup_steps=None).warmup() == 3
    (tmp_path / "runs").mkdir()
    run_path(tmp_path, "dense").write_text("{}")
    for report in ("table.md", "results.json", "curves.png"):
        (tmp_path / report).write_text("old")
    RunStore(tmp_path, ["dense"], {}, command="pretrain", resume=False, main=True, log=lambda _: None)
    assert not [p.name for p in tmp_path.iterdir() if p.is_file()]
    (tmp_path / "results.json").write_text("the user's own")   # no finished run of ours beside it: kept
    RunStore(tmp_path, ["dense"], {}, command="pretrain", resume=False, main=True, log=lambda _: None)
    assert (tmp_path / "results.json").read_text() == "the user's own"
