"""`comera-compile demo`: corpus split, masking, evaluation, sizes, errors, and a smoke run's outputs."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("tokenizers")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from comera_compile.cli import main  # noqa: E402
from comera_compile.examples import code_mlm  # noqa: E402
from comera_compile.examples.code_mlm import DemoConfig, DemoError  # noqa: E402

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
    a = code_mlm.load_corpus(tmp_path, seed=1, heldout_fraction=0.2, max_bytes=10**9)
    b = code_mlm.load_corpus(tmp_path, seed=1, heldout_fraction=0.2, max_bytes=10**9)
    c = code_mlm.load_corpus(tmp_path, seed=2, heldout_fraction=0.2, max_bytes=10**9)
    assert len(a.heldout_files) == 4 and len(a.train_files) == 16
    assert not set(a.heldout_files) & set(a.train_files)
    assert a.heldout_files == b.heldout_files and a.train_files == b.train_files
    assert set(a.heldout_files) != set(c.heldout_files)
    assert a.train_texts[0] == a.train_files[0].read_text()


def test_corpus_skips_binary_hidden_and_package_folders(tmp_path):
    _write_corpus(tmp_path, files=3, lines=5)
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1") * 10)
    for folder in (".git", "site-packages", "__pycache__"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "x.py").write_text("print('not corpus')\n")
    files = code_mlm.list_files(tmp_path)
    assert [f.name for f in files] == ["mod_0.py", "mod_1.py", "mod_2.py"]


def test_default_corpus_is_the_standard_library():
    corpus = code_mlm.load_corpus(None, seed=0, heldout_fraction=0.1, max_bytes=20_000)
    assert corpus.root == code_mlm.stdlib_dir()
    assert (corpus.root / "os.py").is_file()
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in corpus.train_files)
    assert 20_000 <= corpus.train_bytes < 20_000 + max(len(t.encode()) for t in corpus.train_texts)


# -- masking -----------------------------------------------------------------------------------------------
def test_mask_batch_follows_bert_masking():
    vocab, mask_id = 500, 1
    blocks = torch.randint(3, vocab, (400, 100), generator=torch.Generator().manual_seed(0))
    inputs, positions, labels = code_mlm.mask_batch(blocks, torch.Generator().manual_seed(3), mask_id, vocab)
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
    again = code_mlm.mask_batch(blocks, torch.Generator().manual_seed(3), mask_id, vocab)
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
    data = code_mlm.Data(torch.zeros(1, 8, dtype=torch.long),
                         [(torch.zeros(4, 8, dtype=torch.long), p, lab) for p, lab in zip(positions, labels)],
                         vocab, 1)
    got = code_mlm.evaluate(_FixedLogits(vocab), data)
    pos, lab = torch.cat(positions).flatten(), torch.cat(labels).flatten()
    hit = (pos % vocab == lab).float()
    # logit 2 on the predicted token, 0 elsewhere: log-softmax of the label is 2 - log(e^2 + 6) on a hit
    per_token = torch.log(torch.tensor(math.e ** 2 + vocab - 1)) - 2.0 * hit
    assert got["masked_tokens"] == 60
    assert got["accuracy"] == pytest.approx(hit.mean().item())
    assert got["loss"] == pytest.approx(per_token.mean().item(), rel=1e-6)


# -- models ------------------------------------------------------------------------------------------------
def _encoder_layer_params(d: int, ffn: int) -> int:
    attention = 4 * (d * d + d)
    return attention + (d * ffn + ffn) + (ffn * d + d) + 2 * 2 * d  # two LayerNorms


def test_default_size_compresses_the_encoder_at_least_10x_before_any_cut():
    cfg = DemoConfig()
    size = cfg.model_size()
    dense, tt = code_mlm.build_models(cfg, vocab_size=cfg.vocab_size)
    assert code_mlm.encoder_params(dense) == size.layers * _encoder_layer_params(size.d_model, size.ffn)
    assert code_mlm.encoder_params(dense) / code_mlm.encoder_params(tt) >= 10
    # Only the encoder is tensorized; embeddings, norms and the head start from identical weights.
    dense_sd, tt_sd = dense.state_dict(), tt.state_dict()
    shared = [k for k in dense_sd if not k.startswith("layers.")]
    assert shared and all(torch.equal(dense_sd[k], tt_sd[k]) for k in shared)
    ids = torch.randint(3, cfg.vocab_size, (2, cfg.seq_len))
    pos = torch.tensor([[0, 5, 9], [1, 2, 3]])
    assert tt(ids, pos).shape == dense(ids, pos).shape == (2, 3, cfg.vocab_size)


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
        code_mlm.load_corpus(data, seed=0, heldout_fraction=0.1, max_bytes=10_000)
    assert "--data" in str(err.value)


@pytest.mark.parametrize("override, message", [
    ({"steps": 0}, "--steps"), ({"batch": 0}, "--batch"), ({"seq_len": 4}, "--seq-len"),
    ({"vocab_size": 100}, "--vocab-size"), ({"rank": 0}, "--rank"), ({"size": "huge"}, "tiny, small"),
    ({"target_ratio": 1.5}, "--target-ratio"),
])
def test_bad_sizes_are_rejected_with_the_option_named(override, message):
    with pytest.raises(DemoError, match=message):
        DemoConfig(**override).check()


def test_cli_reports_errors_without_a_traceback(tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        main(["demo", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "out"), "--no-progress"])
    assert "comera-compile demo:" in str(err.value) and "does not exist" in str(err.value)


def test_too_little_text_for_one_batch(tmp_path):
    _write_corpus(tmp_path / "data", files=3, lines=2)
    cfg = DemoConfig(data=tmp_path / "data", out=tmp_path / "out", size="tiny", steps=1, batch=64, progress=False)
    with pytest.raises(DemoError, match="fewer than one batch"):
        code_mlm.run(cfg, log=lambda s: None)
    assert not (tmp_path / "out").exists()  # nothing written for a run that could not start


# -- a whole run -------------------------------------------------------------------------------------------
def _run_cli(tmp_path, *extra: str) -> dict:
    _write_corpus(tmp_path / "data")
    out = tmp_path / "out"
    assert main(["demo", "--data", str(tmp_path / "data"), "--out", str(out), "--size", "tiny", "--steps", "6",
                 "--batch", "4", "--seq-len", "32", "--vocab-size", "300", "--no-progress", *extra]) == 0
    for name in ("table.md", "loss_compression.png", "results.json"):
        assert (out / name).stat().st_size > 0
    assert (out / "loss_compression.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads((out / "results.json").read_text())


def _check_figures(result: dict) -> None:
    d, c = result["runs"]["dense"], result["runs"]["comera"]
    size = code_mlm.SIZES["tiny"]
    layer = _encoder_layer_params(size.d_model, size.ffn)
    assert d["params_encoder"] == size.layers * layer
    assert c["compression_encoder"] == pytest.approx(d["params_encoder"] / c["params_encoder"])
    assert c["compression_model"] == pytest.approx(d["params_model"] / c["params_model"])
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
        assert h["step"] == list(range(1, 7)) and len(h["loss"]) == 6
        assert min(h["step_time_s"]) <= run_["median_step_s"] <= max(h["step_time_s"])
        assert run_["evals"][-1]["step"] == 6
        assert run_["heldout_accuracy"] == run_["evals"][-1]["accuracy"]
        assert 0 <= run_["heldout_accuracy"] <= 1 and run_["heldout_loss"] > 0
        assert run_["peak_bytes"] > 0
    assert d["history"]["encoder_compression"] == [1.0] * 6
    table = (Path(result["config"]["out"]) / "table.md").read_text()
    for run_ in (d, c):
        assert f"{100 * run_['heldout_accuracy']:.2f}%" in table
        assert f"{run_['params_encoder']:,}" in table


def test_demo_smoke_eager_writes_consistent_outputs(tmp_path):
    result = _run_cli(tmp_path, "--no-compile", "--dense-backend", "eager", "--target-ratio", "0.5")
    assert result["runs"]["comera"]["execution"] == result["runs"]["dense"]["execution"] == "eager"
    assert result["config"]["target_ratio"] == 0.5 and result["runs"]["comera"]["stage"] == "late"
    _check_figures(result)


@pytest.mark.slow
def test_demo_compiled_with_backend_comera(tmp_path):
    result = _run_cli(tmp_path, "--dense-backend", "inductor")
    assert "comera" in result["runs"]["comera"]["execution"]
    assert "inductor" in result["runs"]["dense"]["execution"]
    _check_figures(result)
