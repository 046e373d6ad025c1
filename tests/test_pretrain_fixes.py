"""`comera-compile pretrain`: each method pays its own Inductor compile (no cache carried over from the method
before it), a tokenizer whose ids have gaps, --resume with --data/--tokenizer spelled another way, --lr's
help, and invalid UTF-8 past a file's head or inside a JSON Lines file (skipped and counted)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from comera_compile.cli import main  # noqa: E402
from comera_compile.examples import lm_pretrain as lp  # noqa: E402
from comera_compile.examples.lm_data import load_lm_data  # noqa: E402

MICRO_SHAPE = lp.LlamaShape(hidden=64, intermediate=128, heads=2, layers=2, max_positions=64)
MICRO_PRESET = {"minutes": None, "steps": 2, "batch": 2, "rank": 4, "galore_rank": 4, "warmup_steps": 1,
                "eval_blocks": 2, "evals": 1, "threads": 1}
MICRO_ARGS = ["--seq-len", "32", "--vocab-size", "300", "--max-bytes", "30000", "--no-progress"]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


@pytest.fixture
def micro(monkeypatch):
    """The "micro" preset: a 2-layer, 64-wide Llama, two steps, the caller's threads kept."""
    monkeypatch.setitem(lp.SHAPES, "micro", MICRO_SHAPE)
    monkeypatch.setitem(lp.PRESETS, "micro", dict(MICRO_PRESET))
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _documents(folder: Path, n: int = 40, seed: int = 0) -> Path:
    """`n` text files of random words (about 1.5 KB each) in `folder`."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (folder / f"{i}.txt").write_text(f"doc {i} " + " ".join(rng.choice(WORDS) for _ in range(250)) + "\n")
    return folder


# -- 1. every method compiles in its own Inductor cache ----------------------------------------------------
@pytest.mark.slow   # about 85 s: two methods compile for real (own_compile_cache's own test is the fast one)
def test_the_second_method_compiles_afresh_rather_than_from_the_first_methods_cache(tmp_path, micro, monkeypatch):
    """dense and GaLore compile the same Llama forward and backward with Inductor; GaLore, trained second, must
    compile them itself (cache misses) and find nothing dense left in Inductor's FX-graph or AOTAutograd
    caches (no hits), so its compile time is inside its own budget as dense's is inside dense's."""
    pytest.importorskip("galore_torch")
    from torch._dynamo.utils import counters

    keys = (("inductor", "fxgraph_cache_hit"), ("aot_autograd", "autograd_cache_hit"),
            ("inductor", "fxgraph_cache_miss"))
    seen: dict[str, dict[str, int]] = {}
    real = lp.train_one

    def train_one(method, *a, **k):
        before = {name: counters[group][name] for group, name in keys}
        result = real(method, *a, **k)
        seen[method] = {name: counters[group][name] - before[name] for group, name in keys}
        return result

    monkeypatch.setattr(lp, "train_one", train_one)
    assert main(["pretrain", "--preset", "micro", "--out", str(tmp_path / "out"), "--methods", "dense,galore",
                 "--data", str(_documents(tmp_path / "text")), *MICRO_ARGS]) == 0
    assert set(seen) == {"dense", "galore"}
    for method in ("dense", "galore"):
        assert seen[method]["fxgraph_cache_miss"] > 0, seen          # each compiled its graphs
        assert seen[method]["fxgraph_cache_hit"] == 0, seen          # and took none from another run
        assert seen[method]["autograd_cache_hit"] == 0, seen


def test_own_compile_cache_compiles_again_what_a_dynamo_reset_alone_takes_from_the_cache():
    """The reference: after torch._dynamo.reset() alone (what each method had), a second compile of the same
    function is served from Inductor's cache; in a new own_compile_cache it compiles again, with no hit."""
    from torch._dynamo.utils import counters

    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)

    def compile_once() -> tuple[int, int]:
        hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        torch.compile(lambda x, w: torch.tanh(x @ w).sum(), backend="inductor")(x, w).backward()
        return counters["inductor"]["fxgraph_cache_hit"] - hits, counters["inductor"]["fxgraph_cache_miss"] - misses

    with lp.own_compile_cache():
        assert compile_once() == (0, 2)        # forward and backward compiled
        torch._dynamo.reset()
        assert compile_once() == (2, 0)        # a reset alone: both from the cache
    with lp.own_compile_cache():
        assert compile_once() == (0, 2)        # a fresh cache: compiled again


# -- 2. a tokenizer whose ids have gaps ----------------------------------------------------------------------
def test_a_tokenizer_whose_ids_have_gaps_sizes_the_embedding_by_its_largest_id(tmp_path):
    """A WordLevel tokenizer.json with ids 0, 2, 4, ..., 22, 100 ([UNK]) and 101 (</s>): 14 tokens, ids up to 101.
    The model's vocabulary is the largest id + 1, read from the file itself, and a forward over every block runs
    (sized by the count, the embedding had 14 rows and the first id past them was an IndexError)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "foo bar baz qux quux corge grault garply waldo fred plugh xyzzy".split()
    vocab = {w: 2 * i for i, w in enumerate(words)} | {"[UNK]": 100, "</s>": 101}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    saved = json.loads((tmp_path / "tokenizer.json").read_text())
    largest = max([*saved["model"]["vocab"].values(), *(t["id"] for t in saved["added_tokens"])])
    rng = random.Random(0)
    (tmp_path / "text").mkdir()
    for i in range(30):
        (tmp_path / "text" / f"{i}.txt").write_text(" ".join(rng.choice(words + ["unknown"]) for _ in range(300)))
    data = load_lm_data(tmp_path / "text", tokenizer=tmp_path / "tokenizer.json", seq_len=32)
    assert tok.get_vocab_size() == 14 and largest == 101
    assert data.vocab_size == largest + 1 and data.eot_id == 101
    blocks = torch.cat([data.train, data.val])
    assert int(blocks.max()) == 101 and 100 in blocks   # the end-of-text id and [UNK] are in the blocks
    model = lp.build_model(lp.LlamaShape(hidden=32, intermediate=64, heads=2, layers=1, max_positions=32),
                           data.vocab_size, seed=0)
    assert model(input_ids=blocks).logits.shape == (*blocks.shape, 102)


# -- 3. --resume with --data / --tokenizer spelled another way -----------------------------------------------
def test_resume_keeps_a_finished_run_whatever_the_spelling_of_data_and_tokenizer(tmp_path, micro, monkeypatch):
    """A run trained with `--data text --tokenizer ./tok/tokenizer.json` (relative, from tmp_path) is kept by
    --resume given the absolute --data and `~/tok` for the tokenizer (HOME is tmp_path): the same files.  The
    steps run eagerly (only what is kept matters here)."""
    import comera_compile as cc

    real_step, real_train, trained = cc.compile_step, lp.train_one, []
    monkeypatch.setattr(cc, "compile_step", lambda *a, **k: real_step(*a, **{**k, "backend": "eager"}))
    monkeypatch.setattr(lp, "warm_up_compiler", lambda device: 0.0, raising=False)   # no Inductor here

    def train_one(method, *a, **k):
        trained.append(method)
        return real_train(method, *a, **k)

    monkeypatch.setattr(lp, "train_one", train_one)
    _documents(tmp_path / "text")
    (tmp_path / "tok").mkdir()
    from comera_compile.examples.lm_data import train_bpe

    tok = train_bpe([p.read_text() for p in (tmp_path / "text").iterdir()], 300)
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    args = ["pretrain", "--preset", "micro", "--out", "out", "--methods", "dense", *MICRO_ARGS]
    assert main([*args, "--data", "text", "--tokenizer", "./tok/tokenizer.json"]) == 0 and trained == ["dense"]
    assert main([*args, "--data", str(tmp_path / "text") + "/", "--tokenizer", "~/tok", "--resume"]) == 0
    assert trained == ["dense"]   # kept, not trained again
    assert json.loads((tmp_path / "out" / "results.json").read_text())["resumed"] == ["dense"]


# -- 4. --lr's help says what it sets ---------------------------------------------------------------------
def test_lr_help_says_it_sets_dense_alone_and_shows_each_presets_rates(capsys):
    """--lr 5e-4 moves dense's peak rate only: every preset sets CoMERA's three and GaLore's.  The help says
    so and shows each learning-rate option's value in every preset, read from PRESETS."""
    import re

    for name, fields in lp.PRESETS.items():
        cfg = lp.preset(name, lr=5e-4)
        assert cfg.peak_lr("dense") == 5e-4
        assert (cfg.peak_lr("comera"), cfg.peak_lr("galore")) == (fields["comera_lr"], fields["galore_lr"])
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    helps = dict(re.findall(r"(--(?:[a-z]+-)*lr) [A-Z_]+ (.*?)(?= --[a-z-]+ [A-Z_]{2,} |$)", text))
    assert "dense" in helps["--lr"] and "2x" not in helps["--lr"] and "CoMERA's cc.param_groups" not in helps["--lr"]
    for flag in ("--lr", "--comera-lr", "--comera-core-lr", "--comera-gate-lr", "--galore-lr"):
        field = flag[2:].replace("-", "_")
        tiny = lp.PRESETS["tiny"][field]
        assert f"default {tiny:g}" in helps[flag], (flag, helps[flag])
        for name, fields in lp.PRESETS.items():
            if fields[field] != tiny:
                assert f"--preset {name}: {fields[field]:g}" in helps[flag], (flag, helps[flag])


# -- 5. invalid UTF-8 past a file's head, or in a JSON Lines record ------------------------------------------
def _decoded(data) -> str:
    return data.tokenizer.decode(torch.cat([data.train, data.val]).flatten().tolist())


def test_text_files_with_invalid_utf8_past_their_head_are_skipped_and_counted(tmp_path):
    """Three of 30 files hold latin-1 bytes after 5 KB of ASCII (past the 4 KiB head the folder check reads):
    they are not trained on, and the source line counts them; every other file is read, none with U+FFFD."""
    rng = random.Random(0)
    bad = {3, 11, 20}
    for i in range(30):
        body = f"DOC{i:03d} " + " ".join(rng.choice(WORDS) for _ in range(900)) + "\n"
        tail = ("caf\xe9 na\xefve " * 20).encode("latin-1") if i in bad else b"plain tail\n"
        (tmp_path / f"{i}.txt").write_bytes(body.encode() + tail)
    data = load_lm_data(tmp_path, seq_len=32, vocab_size=300, max_bytes=10**6)
    text = _decoded(data)
    assert "3 file(s) with invalid UTF-8 skipped" in data.source and sum(data.documents) == 27
    assert {f"DOC{i:03d}" for i in range(30) if i not in bad} <= set(text.split())
    assert not {f"DOC{i:03d}" for i in bad} & set(text.split()) and "\ufffd" not in text


def test_jsonl_records_and_text_file_paragraphs_with_invalid_utf8_are_skipped_and_counted(tmp_path):
    """A JSON Lines file whose record 7 holds a latin-1 byte in its text and record 12 an escaped lone surrogate
    (neither encodes as UTF-8): both skipped, counted as 2 records, the other 18 read.  A text file of
    paragraphs with a bad byte in its 15th paragraph, past its head: that paragraph skipped, counted."""
    rng = random.Random(1)
    texts = [f"DOC{i:03d} " + " ".join(rng.choice(WORDS) for _ in range(60)) for i in range(20)]
    lines = [json.dumps({"text": t}).encode() for t in texts]
    lines[7] = lines[7].replace(b"DOC007 ", b"DOC007 caf\xe9 ")
    lines[12] = lines[12].replace(b"DOC012 ", b"DOC012 \\ud800 ")
    (tmp_path / "data.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    data = load_lm_data(tmp_path / "data.jsonl", seq_len=32, vocab_size=300, max_bytes=10**6)
    text = _decoded(data)
    assert "2 record(s) with invalid UTF-8 skipped" in data.source and sum(data.documents) == 18
    assert not {"DOC007", "DOC012"} & set(text.split()) and "\ufffd" not in text
    paragraphs = [t.encode() for t in texts]
    paragraphs[14] = paragraphs[14].replace(b"DOC014 ", b"DOC014 \xff ")
    (tmp_path / "para.txt").write_bytes(b"\n\n".join(paragraphs) + b"\n")
    data = load_lm_data(tmp_path / "para.txt", seq_len=32, vocab_size=300, max_bytes=10**6)
    assert "1 document(s) with invalid UTF-8 skipped" in data.source and sum(data.documents) == 19
    assert "DOC014" not in _decoded(data).split() and "\ufffd" not in _decoded(data)


# -- 6. --minutes with a --steps cap that ends the run ---------------------------------------------------------
def test_a_step_cap_that_ends_a_time_budget_keeps_the_evaluations_schedule_and_says_so(tmp_path, micro,
                                                                                        monkeypatch):
    """--minutes 5 --steps 6 --evals 3 (eager steps on the micro model): the step cap ends the run, so it is
    evaluated at steps 2, 4 and 6 (as --steps alone is), its learning rate follows the cosine over the 6 steps
    (warm-up 1, then down to a tenth at step 6: the reference formula, not the clock's few seconds of 5
    minutes), results.json says "ended_by": "steps" and the table calls the end equal steps, not equal time."""
    import math

    import comera_compile as cc

    real_step = cc.compile_step
    monkeypatch.setattr(cc, "compile_step", lambda *a, **k: real_step(*a, **{**k, "backend": "eager"}))
    monkeypatch.setattr(lp, "warm_up_compiler", lambda device: 0.0, raising=False)   # no Inductor here
    out = tmp_path / "out"
    assert main(["pretrain", "--preset", "micro", "--out", str(out), "--methods", "dense", "--minutes", "5",
                 "--steps", "6", "--evals", "3", "--data", str(_documents(tmp_path / "text")), *MICRO_ARGS]) == 0
    run = json.loads((out / "results.json").read_text())["runs"]["dense"]
    assert run["steps"] == 6 and run["ended_by"] == "steps" and run["time_s"] < 60
    assert [e["step"] for e in run["evals"]] == [2, 4, 6]

    def reference(k: int, total: int = 6, warmup: int = 1) -> float:
        if k <= warmup:
            return k / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (k - warmup) / (total - warmup)))

    assert run["history"]["lr"] == pytest.approx([run["lr"] * reference(k) for k in range(1, 7)], rel=1e-9)
    table = (out / "table.md").read_text()
    assert "val perplexity (loss) at equal steps" in table and "equal time" not in table
    assert "Budget 5 min or 6 steps per model, whichever ends first (both stopped at the 6-step cap)" in table
