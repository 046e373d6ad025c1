"""`comera-compile demo`: corpus split, masking, evaluation, the unigram baseline, sizes and presets, errors,
the time budget and its evaluation marks, reading the curves, and a smoke run's outputs."""

from __future__ import annotations

import copy
import json
import math
import random
from dataclasses import replace
from itertools import accumulate
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("tokenizers")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

import comera_compile as cc  # noqa: E402
from comera_compile.cli import main  # noqa: E402
from comera_compile.examples import code_data, code_mlm, demo_report, demo_train  # noqa: E402
from comera_compile.examples.code_mlm import DemoConfig, DemoError  # noqa: E402
from helpers import cli_error  # noqa: E402

WORDS = ["def", "return", "self", "value", "import", "class", "for", "in", "if", "else", "None", "items",
         "data", "result", "name", "path", "len", "range", "print", "key"]


def _write_corpus(root, files: int = 8, lines: int = 150, seed: int = 0) -> None:
    """Python-looking text files, deterministic."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        body = []
        for j in range(lines):
            indent = "    " * rng.randint(0, 2)
            body.append(indent + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8))) + f"  # {i}.{j}")
        (root / f"mod_{i}.py").write_text("\n".join(body) + "\n")


# -- corpus ------------------------------------------------------------------------------------------------
def test_split_is_by_file_disjoint_and_seeded(tmp_path):
    _write_corpus(tmp_path, files=20, lines=5)
    a = code_data.load_corpus(tmp_path, seed=1, heldout_fraction=0.2, max_bytes=10**9)
    b = code_data.load_corpus(tmp_path, seed=1, heldout_fraction=0.2, max_bytes=10**9)
    c = code_data.load_corpus(tmp_path, seed=2, heldout_fraction=0.2, max_bytes=10**9)
    assert len(a.heldout_files) == 4 and len(a.train_files) == 16
    assert not set(a.heldout_files) & set(a.train_files)
    assert a.heldout_files == b.heldout_files and a.train_files == b.train_files
    assert set(a.heldout_files) != set(c.heldout_files)
    assert a.train_texts[0] == a.train_files[0].read_text()


def test_max_bytes_caps_the_text_read_even_within_one_file(tmp_path):
    """--max-bytes is a cap: the file that crosses it is cut at the budget, on a line boundary (whole files
    were read: 4.5 MB for --max-bytes 1000); what is kept is the files' own text, in order."""
    _write_corpus(tmp_path, files=6, lines=400)
    corpus = code_data.load_corpus(tmp_path, seed=1, heldout_fraction=0.2, max_bytes=3000)
    sizes = [len(t.encode("utf-8")) for t in corpus.train_texts]
    assert sum(sizes) <= 3000 and sum(sizes) > 2000
    assert corpus.train_texts[-1].endswith("\n")
    assert corpus.train_files[-1].read_text().startswith(corpus.train_texts[-1])
    assert sum(len(t.encode("utf-8")) for t in corpus.heldout_texts) <= 1000


def test_corpus_skips_binary_hidden_and_package_folders(tmp_path):
    _write_corpus(tmp_path, files=3, lines=5)
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1") * 10)
    for folder in (".git", "site-packages", "__pycache__"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "x.py").write_text("print('not corpus')\n")
    files = code_data.list_files(tmp_path)
    assert [f.name for f in files] == ["mod_0.py", "mod_1.py", "mod_2.py"]


def test_default_corpus_is_the_standard_library():
    corpus = code_data.load_corpus(None, seed=0, heldout_fraction=0.1, max_bytes=20_000)
    assert corpus.root == code_data.stdlib_dir()
    assert (corpus.root / "os.py").is_file()
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in corpus.train_files)
    assert 19_000 < corpus.train_bytes <= 20_000   # a cap: the last file cut at a line boundary


# -- masking -----------------------------------------------------------------------------------------------
def test_mask_batch_follows_bert_masking():
    vocab, mask_id = 500, 1
    blocks = torch.randint(3, vocab, (400, 100), generator=torch.Generator().manual_seed(0))
    inputs, positions, labels = code_data.mask_batch(blocks, torch.Generator().manual_seed(3), mask_id, vocab)
    assert positions.shape == labels.shape == (400, 15)  # exactly 15% of every block
    assert all(len(set(row.tolist())) == 15 for row in positions)
    assert torch.equal(labels, blocks.gather(1, positions))
    picked = torch.zeros_like(blocks, dtype=torch.bool).scatter_(1, positions, True)
    assert torch.equal(inputs[~picked], blocks[~picked])  # only the chosen positions change
    new = inputs.gather(1, positions)
    n = new.numel()
    masked = (new == mask_id).sum().item() / n
    kept = (new == labels).sum().item() / n
    assert abs(masked - 0.8) < 0.02 and abs(kept - 0.1) < 0.015  # kept includes ~0.2% random hits
    assert int(new.min()) >= 1 and int(new[new != mask_id].min()) >= 3  # random tokens avoid specials
    again = code_data.mask_batch(blocks, torch.Generator().manual_seed(3), mask_id, vocab)
    assert all(torch.equal(x, y) for x, y in zip((inputs, positions, labels), again))


# -- evaluation --------------------------------------------------------------------------------------------
class _FixedLogits(nn.Module):
    """Predicts token (position % vocab) everywhere, with known logits."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, input_ids, positions):
        return self.scale * F.one_hot(positions % self.vocab, self.vocab).float()


def test_evaluate_matches_a_direct_computation():
    vocab = 7
    g = torch.Generator().manual_seed(0)
    labels = [torch.randint(0, vocab, (4, 5), generator=g) for _ in range(3)]
    positions = [torch.randint(0, 40, (4, 5), generator=g) for _ in range(3)]
    data = demo_train.Data(torch.zeros(1, 8, dtype=torch.long),
                         [(torch.zeros(4, 8, dtype=torch.long), p, lab) for p, lab in zip(positions, labels)],
                         vocab, 1)
    got = demo_train.evaluate(_FixedLogits(vocab), data)
    pos, lab = torch.cat(positions).flatten(), torch.cat(labels).flatten()
    hit = (pos % vocab == lab).float()
    # logit 2 on the predicted token, 0 elsewhere: log-softmax of the label is 2 - log(e^2 + 6) on a hit
    per_token = torch.log(torch.tensor(math.e ** 2 + vocab - 1)) - 2.0 * hit
    assert got["masked_tokens"] == 60
    assert got["accuracy"] == pytest.approx(hit.mean().item())
    assert got["loss"] == pytest.approx(per_token.mean().item(), rel=1e-6)


def test_unigram_baseline_matches_a_direct_count():
    train = torch.tensor([[3, 3, 3, 4], [4, 5, 3, 3]])  # counts: 3 x5, 4 x2, 5 x1 (vocab 6)
    labels = torch.tensor([[3, 4], [5, 0]])
    got = code_data.unigram_baseline(train, labels, vocab_size=6)
    p = torch.tensor([1, 1, 1, 6, 3, 2], dtype=torch.float64) / 14  # add-one smoothed
    assert got["accuracy"] == pytest.approx(0.25)  # guesses 3 everywhere
    assert got["loss"] == pytest.approx(float(-p[labels.flatten()].log().mean()))


# -- models ------------------------------------------------------------------------------------------------
def _encoder_layer_params(d: int, ffn: int) -> int:
    attention = 4 * (d * d + d)
    return attention + (d * ffn + ffn) + (ffn * d + d) + 2 * 2 * d  # two LayerNorms


def test_default_size_is_bert_wide_and_compresses_the_encoder_at_least_10x_before_any_cut():
    cfg = DemoConfig()
    size = cfg.model_size()
    assert size.d_model >= 512
    dense, tt = code_mlm.build_models(cfg, vocab_size=cfg.vocab_size)
    assert demo_train.encoder_params(dense) == size.layers * _encoder_layer_params(size.d_model, size.ffn)
    assert demo_train.encoder_params(dense) / demo_train.encoder_params(tt) >= 10
    # Only the encoder is tensorized; embeddings, norms and the head start from identical weights.
    dense_sd, tt_sd = dense.state_dict(), tt.state_dict()
    shared = [k for k in dense_sd if not k.startswith("layers.")]
    assert shared and all(torch.equal(dense_sd[k], tt_sd[k]) for k in shared)
    ids = torch.randint(3, cfg.vocab_size, (2, cfg.seq_len))
    pos = torch.tensor([[0, 5, 9], [1, 2, 3]])
    assert tt(ids, pos).shape == dense(ids, pos).shape == (2, 3, cfg.vocab_size)


def test_presets_and_overrides():
    assert code_mlm.preset("demo") == DemoConfig()
    long = code_mlm.preset("long")
    assert long.minutes is None and long.steps >= 1000  # equal steps, not equal time
    assert code_mlm.preset("long", steps=10, size="tiny").steps == 10
    with pytest.raises(DemoError, match="unknown preset 'huge'; choose one of demo, long"):
        code_mlm.preset("huge")


# -- errors ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setup, message", [
    (lambda p: None, "does not exist"),
    (lambda p: p.mkdir(), "needs at least 2"),
    (lambda p: (p.mkdir(), (p / "a.py").write_text("\n"), (p / "b.py").write_text("  \n")), "empty"),
    (lambda p: p.write_text("x = 1\n"), "is a file"),
])
def test_bad_data_dirs_say_what_to_do(tmp_path, setup, message):
    data = tmp_path / "data"
    setup(data)
    with pytest.raises(DemoError, match=message) as err:
        code_data.load_corpus(data, seed=0, heldout_fraction=0.1, max_bytes=10_000)
    assert "--data" in str(err.value)


@pytest.mark.parametrize("override, message", [
    ({"steps": 0}, "--steps"), ({"batch": 0}, "--batch"), ({"seq_len": 4}, "--seq-len"),
    ({"vocab_size": 100}, "--vocab-size"), ({"rank": 0}, "--rank"), ({"size": "huge"}, "tiny, small"),
    ({"target_ratio": 1.5}, "--target-ratio"), ({"minutes": 0}, "--minutes"),
    ({"minutes": None, "steps": None}, "--minutes.*or --steps"), ({"dense_lr": -1.0}, "--dense-lr"),
    ({"evals": 0}, "--evals"), ({"precision": "tf32"}, "--precision tf32 is a mode of CUDA"),
    ({"micro_batches": 0}, "--micro-batches must be at least 1"),
    ({"batch": 6, "micro_batches": 4}, "--batch 6 .* 4 micro-batch.*a multiple of 4"),
    ({"precision": "fp8"}, "--precision must be one of fp32, tf32, bf16, fp16"),
])
def test_bad_sizes_are_rejected_with_the_option_named(override, message):
    with pytest.raises(DemoError, match=message):
        DemoConfig(**override).check()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where no GPU is present")
def test_demo_on_cuda_without_a_gpu_says_what_to_do(tmp_path):
    with pytest.raises(DemoError, match="no CUDA device.*leave --device out"):
        DemoConfig(device="cuda").check()
    with pytest.raises(SystemExit, match="no CUDA device"):
        main(["demo", "--device", "cuda", "--out", str(tmp_path / "out"), "--no-progress"])


def test_cli_reports_errors_without_a_traceback(tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        main(["demo", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "out"), "--no-progress"])
    assert "comera-compile demo:" in str(err.value) and "does not exist" in str(err.value)


def test_inspect_and_bench_errors_are_one_line_and_a_model_of_the_folder_imports(tmp_path, monkeypatch, capsys):
    """The installed script imports MODULE:FACTORY from the folder it runs in (as python -m does); inputs that
    do not fit the model, and bench --profile with the suite's --json, are one-line errors."""
    import subprocess
    import sys

    (tmp_path / "mymodels.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "class M(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.emb, self.fc = nn.Embedding(100, 64), nn.Linear(64, 64)\n\n"
        "    def forward(self, ids):\n        return self.fc(self.emb(ids))\n\n\n"
        "def build():\n    return M()\n")
    script = Path(sys.executable).parent / "comera-compile"
    run = subprocess.run([str(script), "inspect", "mymodels:build", "--rank", "4"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "TTLinear" in run.stdout + run.stderr, run.stderr[-2000:]
    # the errors in this process (a SystemExit each, no other exception), as the script would run them
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for argv in (["inspect", "mymodels:build", "--rank", "4", "--graph", "dynamo", "--input", "2x16:float"],
                 ["bench", "--profile", "1", "--json", "x.json"],
                 ["inspect", "--example", "six-encoder", "--layers", "1", "--input", "abc"]):
        assert len(cli_error(argv, capsys).strip().splitlines()) == 1, argv
    sys.modules.pop("mymodels", None)


def test_too_little_text_for_one_batch(tmp_path):
    _write_corpus(tmp_path / "data", files=3, lines=2)
    cfg = DemoConfig(data=tmp_path / "data", out=tmp_path / "out", size="tiny", steps=1, batch=64, progress=False)
    with pytest.raises(DemoError, match="fewer than one batch"):
        code_mlm.run(cfg, log=lambda s: None)
    assert not (tmp_path / "out").exists()  # nothing written for a run that could not start


# -- reading the curves ------------------------------------------------------------------------------------
def test_reach_time_interpolates_between_evaluations():
    evals = [{"time_s": 10.0, "step": 5, "loss": 7.0}, {"time_s": 20.0, "step": 10, "loss": 6.0},
             {"time_s": 30.0, "step": 15, "loss": 5.0}]
    assert demo_report.reach_time(evals, 5.5) == pytest.approx(25.0)
    assert demo_report.reach_time(evals, 5.5, key="step") == pytest.approx(12.5)
    assert demo_report.reach_time(evals, 7.5) == 10.0  # already there at the first evaluation
    assert demo_report.reach_time(evals, 6.0) == 20.0
    assert demo_report.reach_time(evals, 4.9) is None


# -- the budget --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    _write_corpus(root)
    cfg = DemoConfig(data=root, size="tiny", batch=4, seq_len=32, vocab_size=300, eval_blocks=8, progress=False)
    data, _, info = code_mlm.prepare_data(cfg, log=lambda s: None)
    return cfg, data, info


def test_time_budget_evaluates_at_its_marks_with_the_clock_stopped(tiny_data):
    cfg, data, _ = tiny_data
    dense, _ = code_mlm.build_models(cfg, data.vocab_size)
    # A budget of at least 1.2 s and of ten steps as fast as this machine runs them now (a loaded machine
    # must still fit several steps, or the marks below have nothing to fall between).
    probe = demo_train.train_one("dense", copy.deepcopy(dense), replace(cfg, minutes=None, steps=3, evals=1), data,
                                 demo_train.encoder_params(dense))
    cfg = replace(cfg, minutes=max(0.02, 10 * max(probe["history"]["step_time_s"]) / 60), evals=3)
    r = demo_train.train_one("dense", dense, cfg, data, demo_train.encoder_params(dense), eval_steps=(2,))
    h = r["history"]
    budget = 60 * cfg.minutes
    # The clock is the sum of the steps' own times (evaluations are not in it), and stops at the budget.
    assert h["time_s"] == pytest.approx(list(accumulate(h["step_time_s"])))
    assert h["time_s"][-2] < budget <= h["time_s"][-1] == r["time_s"]
    assert r["steps"] == len(h["step"]) == h["step"][-1]
    # One evaluation at the first step past each third of the budget, and one at the step asked for.
    marks = [budget * (i + 1) / 3 for i in range(3)]
    expected = sorted({2} | {next(s for s, t in zip(h["step"], h["time_s"]) if t >= m) for m in marks})
    assert [e["step"] for e in r["evals"]] == expected
    assert r["evals"][-1]["step"] == r["steps"] and r["heldout_loss"] == r["evals"][-1]["loss"]
    assert all(e["time_s"] == h["time_s"][e["step"] - 1] for e in r["evals"])


def test_step_budget_runs_exactly_its_steps(tiny_data):
    cfg, data, _ = tiny_data
    cfg = replace(cfg, minutes=None, steps=5, evals=2)
    _, tt = code_mlm.build_models(cfg, data.vocab_size)
    r = demo_train.train_one("comera", tt, replace(cfg, compile=False), data, 10_000)
    assert r["steps"] == 5 and [e["step"] for e in r["evals"]] == [2, 5]  # round(5 / 2) and the end
    assert r["active_tt_params_start"] >= r["active_tt_params_end"] > 0



@pytest.mark.parametrize("name", ["dense", "comera"])
def test_micro_batches_train_as_the_whole_batch(tiny_data, name):
    """--micro-batches 2: each step's batch in two forward and backward passes, each weighed by its share of
    the rows (every block predicts as many masked tokens, so that is its share of the loss's tokens): the
    losses and the trained parameters are those of the whole batch at once (eager steps; the compiled
    step's accumulation is tests/test_micro_batches.py's)."""
    cfg, data, _ = tiny_data
    cfg = replace(cfg, minutes=None, steps=3, evals=1, compile=False)
    models = code_mlm.build_models(cfg, data.vocab_size)
    model = models[0] if name == "dense" else models[1]
    whole = demo_train.train_one(name, copy.deepcopy(model), cfg, data, 10_000)
    parts = demo_train.train_one(name, model, replace(cfg, micro_batches=2), data, 10_000)
    torch.testing.assert_close(torch.tensor(parts["history"]["loss"]), torch.tensor(whole["history"]["loss"]),
                               rtol=1e-5, atol=1e-6)
    assert parts["heldout_loss"] == pytest.approx(whole["heldout_loss"], rel=1e-4)


def test_the_compiled_step_trains_the_same_with_the_whole_step_captured(tiny_data, monkeypatch):
    """The demo's CoMERA step is cc.compile_step's; on one GPU it replays the whole step as one CUDA graph
    ("auto").  Here the capture is simulated (helpers.SimulatedGraphs: a stale replay or a host read fails):
    through RankAdaptive's late stage (a new capture), the losses are the per-layer compiled step's, step for
    step; the steps that compiled, probed or captured count as compiling; the run says how it executed."""
    from helpers import capture_every_compiled_step

    cfg, data, _ = tiny_data
    cfg = replace(cfg, minutes=None, steps=9, evals=1, cut_every=3, target_ratio=0.3)
    _, tt = code_mlm.build_models(cfg, data.vocab_size)
    plain = demo_train.train_one("comera", copy.deepcopy(tt), cfg, data, 10_000)
    sims = capture_every_compiled_step(monkeypatch)
    captured = demo_train.train_one("comera", tt, cfg, data, 10_000)
    assert len(sims) == 1 and sims[0].captured == 2 and captured["stage"] == plain["stage"] == "late"
    assert captured["execution"].endswith("the whole step one CUDA graph") and "one CUDA graph" not in plain["execution"]
    torch.testing.assert_close(torch.tensor(captured["history"]["loss"]), torch.tensor(plain["history"]["loss"]),
                               rtol=1e-5, atol=1e-6)
    assert captured["compile_steps"][:3] == [1, 2, 3] and len(captured["compile_steps"]) == 3 * sims[0].captured


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_the_step_runs_in_the_precision_asked_for(tiny_data, precision, monkeypatch):
    """--precision bf16 (fp16) runs the forward and loss under bf16 (fp16) autocast (the first loss is eager
    autocast's on the same batch), and so does the step that measures peak memory; the weights stay fp32.
    fp32 runs without autocast."""
    cfg, data, _ = tiny_data
    cfg = replace(cfg, minutes=None, steps=2, evals=1, precision=precision)
    dense, _ = code_mlm.build_models(cfg, data.vocab_size)
    inputs, positions, labels = next(demo_train.batches(data, cfg))
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    with torch.no_grad(), torch.autocast("cpu", dtype=half or torch.bfloat16, enabled=half is not None):
        expected = float(torch.nn.functional.cross_entropy(
            dense(inputs, positions).float().reshape(-1, data.vocab_size), labels.reshape(-1)))
    seen: list[tuple[bool, torch.dtype]] = []
    mlm_loss = demo_train._mlm_loss

    def recording(*args):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return mlm_loss(*args)

    monkeypatch.setattr(demo_train, "_mlm_loss", recording)
    r = demo_train.train_one("dense", dense, cfg, data, demo_train.encoder_params(dense))
    steps = seen   # the two training steps, then the eager step that measures memory (_peak_step_bytes)
    assert len(steps) == 3 and all(on == (half is not None) for on, _ in steps)
    assert half is None or {dtype for _, dtype in steps} == {half}
    assert r["precision"] == precision and cfg.arithmetic() == precision
    assert r["history"]["loss"][0] == pytest.approx(expected, rel=1e-2 if half is not None else 1e-5)
    assert all(p.dtype == torch.float32 for p in dense.parameters())
    assert DemoConfig(device="cuda").arithmetic() == "bf16" and DemoConfig().arithmetic() == "fp32"


def test_cuda_s_default_precision_is_fp16_on_a_gpu_without_bf16(monkeypatch):
    """Before Ampere (a T4, a V100) torch only emulates bf16 and Inductor's bf16 kernels fail: the default
    there is fp16 (its loss scaled), bf16 elsewhere on CUDA, fp32 on the CPU; an explicit choice stands."""
    from comera_compile.examples.demo_dist import resolve_precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for native, expected in ((False, "fp16"), (True, "bf16")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, n=native: n)
        assert resolve_precision(None, "cuda") == expected
        assert DemoConfig(device="cuda").arithmetic() == expected
    assert resolve_precision(None, "cpu") == "fp32" and resolve_precision("bf16", "cuda") == "bf16"


def _scaler_starting_at(monkeypatch, scale: float) -> None:
    """Every GradScaler made from now on starts at `scale`: one far too large overflows float16's gradients
    at the first steps, which the scaler then skips, halving the scale each time."""
    real = torch.amp.GradScaler
    monkeypatch.setattr(torch.amp, "GradScaler", lambda device="cuda", **kw: real(device, init_scale=scale))


def test_fp16_steps_the_loss_scaler_skipped_leave_rank_adaptive_and_the_curve_alone(tiny_data, monkeypatch):
    """CoMERA at --precision fp16 (eager steps) with a scaler starting at 2^28: the first steps (and, as the
    gradients grow, a later one) overflow and are skipped.  RankAdaptive steps only after the others, the
    skipped steps' losses are None in the history (finite elsewhere) and counted in skipped_steps and in the
    table's last line, and the run trains on after them."""
    cfg, data, _ = tiny_data
    cfg = replace(cfg, minutes=None, steps=24, evals=1, precision="fp16", compile=False)
    _, tt = code_mlm.build_models(cfg, data.vocab_size)
    _scaler_starting_at(monkeypatch, 2.0 ** 28)
    calls = []
    ra_step = cc.RankAdaptive.step
    monkeypatch.setattr(cc.RankAdaptive, "step", lambda ra, loss=None: calls.append(loss) or ra_step(ra, loss))
    r = demo_train.train_one("comera", tt, cfg, data, 10_000)
    losses = r["history"]["loss"]
    skipped = [i for i, v in enumerate(losses) if v is None]
    assert r["skipped_steps"] == len(skipped) > 0 and skipped[0] == 0
    assert len(calls) == cfg.steps - len(skipped) > 0
    assert all(math.isfinite(v) for v in losses if v is not None)
    said = demo_report.skipped_words({"dense": {"skipped_steps": 0}, "comera": r}, {"comera": "CoMERA"})
    assert said.endswith(f": CoMERA {len(skipped)}.")   # the table's last line; none where no step was skipped
    assert demo_report.skipped_words({"dense": {"skipped_steps": 0}}, {}) is None


def test_a_run_whose_every_step_overflows_float16_stops_with_what_to_do(tiny_data, monkeypatch):
    """A loss scaler that skips step after step (here: a scale of 2^40 and at most 3 skips in a row) means
    the run diverged: an error that says so and what to change, not a run that trains nothing."""
    from comera_compile.examples import demo_dist

    cfg, data, _ = tiny_data
    cfg = replace(cfg, minutes=None, steps=10, evals=1, precision="fp16", compile=False)
    dense, _ = code_mlm.build_models(cfg, data.vocab_size)
    _scaler_starting_at(monkeypatch, 2.0 ** 40)
    monkeypatch.setattr(demo_dist, "MAX_SKIPPED", 3)
    with pytest.raises(DemoError, match="skipped 4 steps in a row.*lower the learning rate"):
        demo_train.train_one("dense", dense, cfg, data, demo_train.encoder_params(dense))


# -- a whole run -------------------------------------------------------------------------------------------
def _run_cli(tmp_path, *extra: str) -> dict:
    _write_corpus(tmp_path / "data")
    out = tmp_path / "out"
    assert main(["demo", "--data", str(tmp_path / "data"), "--out", str(out), "--size", "tiny", "--steps", "6",
                 "--batch", "4", "--seq-len", "32", "--vocab-size", "300", "--eval-blocks", "8", "--evals", "3",
                 "--no-progress", *extra]) == 0
    for name in ("table.md", "curves.png", "results.json"):
        assert (out / name).stat().st_size > 0
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads((out / "results.json").read_text())


def _check_figures(result: dict) -> None:
    d, c = result["runs"]["dense"], result["runs"]["comera"]
    size = code_mlm.SIZES["tiny"]
    layer = _encoder_layer_params(size.d_model, size.ffn)
    assert d["params_encoder"] == size.layers * layer == result["dense_params"]["encoder"]
    assert c["compression_encoder"] == pytest.approx(d["params_encoder"] / c["params_encoder"])
    # The non-encoder parameters are the same in both models.
    assert d["params_model"] - d["params_encoder"] == c["params_model"] - c["params_encoder"]
    # CoMERA's encoder: its TT layers at the ranks reported, plus the dense biases and LayerNorms.
    import comera_compile as cc

    d_model, ffn = size.d_model, size.ffn
    dims = {"q": (d_model, d_model), "k": (d_model, d_model), "v": (d_model, d_model),
            "out": (d_model, d_model), "ffn_up": (d_model, ffn), "ffn_down": (ffn, d_model)}
    tt_total = 0
    for name, ranks in c["ranks"].items():
        n_in, n_out = dims[name.rsplit(".", 1)[-1]]
        spec = cc.make_spec("tt", n_in, n_out, list(ranks[1:-1]))
        tt_total += spec.num_params() + n_out
    assert len(c["ranks"]) == 6 * size.layers
    assert c["params_encoder"] == tt_total + size.layers * 4 * d_model
    for run_ in (d, c):
        h = run_["history"]
        assert h["step"] == list(range(1, 7)) and run_["steps"] == 6
        assert min(h["step_time_s"]) <= run_["median_step_s"] <= max(h["step_time_s"])
        assert [e["step"] for e in run_["evals"]] == [2, 4, 6]
        assert run_["heldout_accuracy"] == run_["evals"][-1]["accuracy"]
        assert 0 <= run_["heldout_accuracy"] <= 1 and run_["heldout_loss"] > 0
        assert run_["peak_bytes"] > 0
    assert d["history"]["encoder_compression"] == [1.0] * 6
    s = result["summary"]
    assert s["step_speedup"] == pytest.approx(d["median_step_s"] / c["median_step_s"])
    assert s["comera_at_equal_steps"]["step"] == d["steps"]
    uni = result["corpus"]["unigram"]
    assert 0 < uni["accuracy"] < 1 and uni["loss"] > 0
    table = (Path(result["config"]["out"]) / "table.md").read_text()
    for run_ in (d, c):
        assert f"{100 * run_['heldout_accuracy']:.2f}%" in table
    assert f"{c['params_encoder']:,}" in table and f"{100 * uni['accuracy']:.2f}%" in table
    assert f"tokens in {'bf16 autocast' if result['config']['precision'] == 'bf16' else 'fp32'};" in table


def test_demo_smoke_eager_writes_consistent_outputs(tmp_path, monkeypatch, capsys):
    """The whole demo, eager, stopped once in CoMERA's run: dense's run is kept in <out>/runs, and --resume
    trains CoMERA alone (evaluated at dense's kept step count) and writes the outputs of both."""
    args = ("--no-compile", "--dense-backend", "eager", "--target-ratio", "0.5", "--precision", "bf16")
    real, trained = code_mlm.train_one, []

    def stop_in_comera(name, *a, **k):
        trained.append((name, k.get("eval_steps", ())))
        if name == "comera":
            raise KeyboardInterrupt
        return real(name, *a, **k)

    monkeypatch.setattr(code_mlm, "train_one", stop_in_comera)
    with pytest.raises(SystemExit) as stop:   # Ctrl-C: the hint below, status 130, no traceback
        _run_cli(tmp_path, *args)
    assert stop.value.code == 130
    out = tmp_path / "out"
    assert f"stopped: dense finished and kept in {out / 'runs'}" in capsys.readouterr().out
    kept = json.loads((out / "runs" / "dense.json").read_text())["run"]
    monkeypatch.setattr(code_mlm, "train_one", lambda name, *a, **k: (trained.append((name, k.get("eval_steps", ()))),
                                                                      real(name, *a, **k))[1])
    trained.clear()
    result = _run_cli(tmp_path, *args, "--resume")
    assert trained == [("comera", (kept["steps"],))] and result["runs"]["dense"] == kept
    assert all(r["precision"] == "bf16" for r in result["runs"].values())
    assert result["runs"]["comera"]["execution"] == result["runs"]["dense"]["execution"] == "eager"
    assert result["config"]["target_ratio"] == 0.5 and result["runs"]["comera"]["stage"] == "late"
    assert result["config"]["minutes"] is None  # --steps alone is the budget
    _check_figures(result)
    # A budget that ends inside CoMERA's first compile leaves no steady step: its step time is not measured,
    # and no speed-up is read off compile times.
    c = result["runs"]["comera"]
    c["median_step_s"], c["compile_s"] = demo_report.step_figures(c["history"]["step_time_s"], range(c["steps"]))
    assert c["median_step_s"] is None and c["compile_s"] == pytest.approx(sum(c["history"]["step_time_s"]))
    result["summary"] = demo_report.summarize(result)
    assert result["summary"]["step_speedup"] is None
    row = next(line for line in demo_report.format_table(result).splitlines() if line.startswith("| median step"))
    assert "n/a (every step compiled; raise --minutes)" in row and "faster" not in row


def test_step_figures_leave_the_compiling_steps_out_of_the_median():
    """The median over the steady steps; the compile time is what the compiling steps took beyond it."""
    median, compile_s = demo_report.step_figures([10.0, 1.0, 1.2, 0.8, 5.0, 1.1], [0, 4])
    assert median == pytest.approx(1.05) and compile_s == pytest.approx((10.0 - 1.05) + (5.0 - 1.05))
    assert demo_report.step_figures([3.0, 0.5], [0, 1]) == (None, 3.5)


@pytest.mark.slow
def test_demo_compiled_with_backend_comera(tmp_path):
    result = _run_cli(tmp_path, "--dense-backend", "inductor")
    assert "comera" in result["runs"]["comera"]["execution"]
    assert "inductor" in result["runs"]["dense"]["execution"]
    _check_figures(result)
