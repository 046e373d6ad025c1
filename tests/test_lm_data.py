"""The causal-LM data (examples/lm_data.py): every input format, the split by document (no held-out text in
training), GPT packing checked against a reference built another way, user tokenizers, determinism, the
default corpus, and each bad input's error naming its fix."""

from __future__ import annotations

import io
import json
import random
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("tokenizers")

from comera_compile.examples import lm_data, lm_sources  # noqa: E402
from comera_compile.examples.code_data import DemoError  # noqa: E402
from comera_compile.examples.lm_data import EOT_TOKEN, DataError, LMData, load_lm_data, pack  # noqa: E402

WORDS = ["alpha", "beta", "gamma", "delta", "return", "value", "print", "import", "tensor", "train", "rank",
         "core", "é", "ünï", "→", "data", "model", "loss"]
SMALL = dict(seq_len=16, vocab_size=300)


def _sentinel(i: int) -> str:
    return f"@@{i:04d}@@"


def _docs(n: int, seed: int = 0, words: int = 60) -> list[str]:
    """n documents, each opening with its own sentinel string, deterministic, a few hundred bytes each."""
    rng = random.Random(seed)
    return [_sentinel(i) + "\n" + " ".join(rng.choice(WORDS) for _ in range(words)) + "\n" for i in range(n)]


def _stream(lm: LMData, blocks: torch.Tensor) -> str:
    """The blocks decoded back to text as one stream (separators shown as the end-of-text string)."""
    return lm.tokenizer.decode(blocks.reshape(-1).tolist(), skip_special_tokens=False)


def _sentinels_in(text: str, n: int) -> set[int]:
    return {i for i in range(n) if _sentinel(i) in text}


def _segments(lm: LMData, blocks: torch.Tensor) -> tuple[list[str], str]:
    """The blocks cut at the separator ids and decoded: the whole documents, and the cut-off last one."""
    pieces: list[list[int]] = [[]]
    for t in blocks.reshape(-1).tolist():
        if t == lm.eot_id:
            pieces.append([])
        else:
            pieces[-1].append(t)
    texts = [lm.tokenizer.decode(p) for p in pieces]
    return texts[:-1], texts[-1].rstrip("\ufffd")  # a character the cut split decodes as U+FFFD


def _check_packing(lm: LMData, docs: list[str], seq_len: int) -> None:
    """The reference, built from the documents themselves: the held-out documents are exactly those whose
    sentinel the val blocks show; every other document trains; the train stream is those documents, each
    encoded alone and followed by the separator, cut to whole blocks."""
    n = len(docs)
    held = _sentinels_in(_stream(lm, lm.val), n)
    train_seen = _sentinels_in(_stream(lm, lm.train), n)
    assert held and not held & train_seen, "a held-out document's text is in the training blocks"
    train_docs = [docs[i] for i in range(n) if i not in held]

    def enc(t: str) -> list[int]:
        return lm.tokenizer.encode(t, add_special_tokens=False).ids

    total = sum(len(enc(d)) + 1 for d in train_docs)
    assert lm.train.dtype == torch.int64 and lm.train.shape == (total // seq_len, seq_len)
    flat = lm.train.reshape(-1).tolist()
    # Recover the (seeded) document order from the stream, then rebuild the ids from scratch.
    full, partial = _segments(lm, lm.train)
    assert set(full) <= set(train_docs) and len(set(full)) == len(full)
    ref: list[int] = []
    for d in full:
        ref += enc(d) + [lm.eot_id]
    assert flat[: len(ref)] == ref
    assert partial == "" or any(d.startswith(partial) for d in set(train_docs) - set(full))
    # Every held-out document (each fits its budget here) is in the val stream, separated the same way.
    assert set(_segments(lm, lm.val)[0]) <= {docs[i] for i in held}


def _write_texts(root, docs: list[str]) -> None:
    (root / "sub").mkdir(parents=True)
    for i, d in enumerate(docs):
        (root / ("sub" if i % 3 == 0 else "") / f"doc_{i}.txt").write_text(d, encoding="utf-8")


def _write_jsonl(path, docs: list[str], column: str = "text") -> None:
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, column: d}) + "\n")


# --------------------------------------------------------------------------------------------------------
# Formats
# --------------------------------------------------------------------------------------------------------
def test_text_folder_packing_and_split(tmp_path):
    docs = _docs(20)
    _write_texts(tmp_path, docs)
    (tmp_path / ".hidden.txt").write_text(_sentinel(999) + " never read")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "x.txt").write_text(_sentinel(998) + " never read")
    lm = load_lm_data(tmp_path, **SMALL, val_fraction=0.1)
    assert isinstance(lm, LMData) and lm.documents == (18, 2)
    assert lm.eot_id == lm.tokenizer.token_to_id(EOT_TOKEN) and lm.vocab_size == lm.tokenizer.get_vocab_size()
    assert lm.vocab_size <= 300 and int(lm.train.max()) < lm.vocab_size
    assert lm.train_tokens() == lm.train.numel() and lm.val.shape[1] == 16
    _check_packing(lm, docs, 16)
    everything = _stream(lm, lm.train) + _stream(lm, lm.val)
    assert "never read" not in everything
    assert "text files under" in lm.source and "18 training / 2 held-out" in lm.source


def test_jsonl_json_folder_takes_structured_files_and_says_so(tmp_path):
    docs = _docs(16)
    _write_jsonl(tmp_path / "a.jsonl", docs[:10])
    (tmp_path / "b.json").write_text(json.dumps([{"text": d, "n": 1} for d in docs[10:]]))  # a JSON array
    (tmp_path / "notes.txt").write_text(_sentinel(500) + " a text file beside the structured ones")
    lm = load_lm_data(tmp_path, **SMALL)
    assert sum(lm.documents) == 16 and lm.documents[1] == 1
    assert "1 other text files beside them ignored" in lm.source and "column 'text'" in lm.source
    _check_packing(lm, docs, 16)
    assert "beside the structured" not in _stream(lm, lm.train) + _stream(lm, lm.val)


def test_a_source_tree_with_a_few_json_files_is_read_as_text(tmp_path):
    """A folder that is mostly plain text (a source tree, a site-packages) with a few .json files among it, one
    not JSON Lines at all, is a folder of documents, not a dataset of those few; the source line says so, and
    that a .parquet file among them is not read."""
    docs = _docs(20)
    _write_texts(tmp_path, docs)
    (tmp_path / "config.json").write_text('{\n  "an": "indented config, not JSON Lines"\n}\n')
    (tmp_path / "tiny.parquet").write_bytes(b"PAR1\0\0PAR1")
    lm = load_lm_data(tmp_path, **SMALL, val_fraction=0.1)
    assert sum(lm.documents) == 21
    assert "text files under" in lm.source and "1 .json/.jsonl files read as documents too" in lm.source
    assert "its 1 .parquet files ignored" in lm.source
    assert "indented config" in _stream(lm, lm.train) + _stream(lm, lm.val)


def test_single_jsonl_file_with_text_column_and_literal_separator(tmp_path):
    docs = _docs(10)
    docs[3] = docs[3] + f" a literal {EOT_TOKEN} inside a document is text, not a separator\n"
    _write_jsonl(tmp_path / "d.jsonl", docs, column="content")
    lm = load_lm_data(tmp_path / "d.jsonl", **SMALL, text_column="content", val_fraction=0.3)
    assert lm.documents == (7, 3)
    assert lm.eot_id not in lm_data._encode(lm.tokenizer, [docs[3]])[0]
    assert lm.tokenizer.encode(EOT_TOKEN).ids == [lm.eot_id]  # the tokenizer itself is left as it was
    full = _segments(lm, lm.train)[0] + _segments(lm, lm.val)[0]
    assert set(full) <= set(docs) and len(full) >= 8  # each split loses at most its last document to the tail


def test_single_text_file_documents(tmp_path):
    paragraphs = _docs(8)
    (tmp_path / "book.txt").write_text("\n\n".join(paragraphs))
    lm = load_lm_data(tmp_path / "book.txt", **SMALL, val_fraction=0.2)
    assert lm.documents == (6, 2)
    marked = [d.replace("\n\n", "\n") for d in _docs(6, seed=1)]
    (tmp_path / "dump.txt").write_text(EOT_TOKEN.join(marked))
    lm = load_lm_data(tmp_path / "dump.txt", **SMALL, val_fraction=0.2)
    assert sum(lm.documents) == 6


def test_parquet_folder_and_file(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    docs = _docs(14)
    pq.write_table(pa.table({"text": docs[:7], "id": list(range(7))}), tmp_path / "part-0.parquet")
    pq.write_table(pa.table({"text": docs[7:] + [None], "id": list(range(8))}), tmp_path / "part-1.parquet")
    lm = load_lm_data(tmp_path, **SMALL)
    assert sum(lm.documents) == 14 and ".parquet files under" in lm.source
    _check_packing(lm, docs, 16)
    one = load_lm_data(tmp_path / "part-0.parquet", **SMALL, val_fraction=0.3)
    assert one.documents == (5, 2)
    with pytest.raises(DataError, match=r"no column 'body'.*'text', 'id'.*--text-column"):
        load_lm_data(tmp_path, **SMALL, text_column="body")


def test_saved_dataset_with_and_without_datasets(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    docs = _docs(15)
    datasets.Dataset.from_dict({"text": docs, "label": list(range(15))}).save_to_disk(str(tmp_path / "ds"))
    lm = load_lm_data(tmp_path / "ds", **SMALL, seed=3)
    assert sum(lm.documents) == 15 and "dataset saved at" in lm.source
    _check_packing(lm, docs, 16)
    monkeypatch.setattr(lm_sources, "_import_datasets", lambda: None)  # the pyarrow reader
    bare = load_lm_data(tmp_path / "ds", **SMALL, seed=3)
    assert "read with pyarrow" in bare.source
    assert torch.equal(bare.train, lm.train) and torch.equal(bare.val, lm.val)
    with pytest.raises(DataError, match=r"no column 'body'.*'text', 'label'"):
        load_lm_data(tmp_path / "ds", **SMALL, text_column="body")


def test_saved_dataset_dict_uses_its_validation_split(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    docs = _docs(16)
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs[:12]}),
                               "validation": datasets.Dataset.from_dict({"text": docs[12:]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    lm = load_lm_data(tmp_path / "dd", **SMALL, max_bytes=100_000)
    assert lm.documents == (12, 4) and "split 'train'" in lm.source
    assert _sentinels_in(_stream(lm, lm.train), 16) <= set(range(12))
    assert _sentinels_in(_stream(lm, lm.val), 16) == {12, 13, 14, 15}
    monkeypatch.setattr(lm_sources, "_import_datasets", lambda: None)
    bare = load_lm_data(tmp_path / "dd", **SMALL, max_bytes=100_000)
    assert torch.equal(bare.train, lm.train) and torch.equal(bare.val, lm.val)



def test_user_tokenizer_round_trip(tmp_path):
    docs = _docs(12)
    _write_texts(tmp_path / "data", docs)
    tok = lm_data.train_bpe(docs, 300, special_tokens=("<pad>", "[SEP]", "</s>"))
    tok.enable_truncation(max_length=4)  # must not cut documents
    tok.enable_padding(length=8)
    tok.save(str(tmp_path / "tokenizer.json"))
    lm = load_lm_data(tmp_path / "data", tokenizer=tmp_path / "tokenizer.json", seq_len=16, vocab_size=999)
    assert lm.eot_id == tok.token_to_id("</s>") == 2 and lm.vocab_size == tok.get_vocab_size()
    assert "tokenizer" in lm.source and lm.tokenizer.truncation is None and lm.tokenizer.padding is None
    assert _stream(lm, lm.train).count("</s>") == int((lm.train == 2).sum())
    # the same tokenizer from its folder gives the same blocks
    same = load_lm_data(tmp_path / "data", tokenizer=tmp_path, seq_len=16)
    assert torch.equal(same.train, lm.train)
    # first match in the candidates' order wins
    tok2 = lm_data.train_bpe(docs, 300, special_tokens=("[SEP]", EOT_TOKEN))
    tok2.save(str(tmp_path / "t2.json"))
    assert load_lm_data(tmp_path / "data", tokenizer=tmp_path / "t2.json", seq_len=16).eot_id == 1


# --------------------------------------------------------------------------------------------------------
# Budgets, determinism, the default corpus
# --------------------------------------------------------------------------------------------------------
def test_max_bytes_caps_training_text(tmp_path):
    docs = _docs(30, words=80)
    _write_texts(tmp_path, docs)
    lm = load_lm_data(tmp_path, **SMALL, max_bytes=1500)
    text = _stream(lm, lm.train).replace(EOT_TOKEN, "")
    assert len(text.encode("utf-8")) <= 1500 and lm.documents[0] <= 4


def test_seeded_split_is_deterministic(tmp_path):
    docs = _docs(20)
    _write_texts(tmp_path, docs)
    a, b = (load_lm_data(tmp_path, **SMALL, seed=5, val_fraction=0.25) for _ in range(2))
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val) and a.source == b.source
    c = load_lm_data(tmp_path, **SMALL, seed=6, val_fraction=0.25)  # 5 of 20 held out: another 5
    assert _sentinels_in(_stream(c, c.val), 20) != _sentinels_in(_stream(a, a.val), 20)
    assert not torch.equal(a.train[:4], c.train[:4])


def test_default_corpus_is_the_standard_library():
    lm = load_lm_data(seq_len=32, vocab_size=400, max_bytes=30_000)
    assert "standard library" in lm.source and lm.documents[0] >= 1 and lm.documents[1] >= 1
    assert lm.train.shape[1] == lm.val.shape[1] == 32 and lm.train.shape[0] > 0 and lm.val.shape[0] > 0
    assert 0 < len(_stream(lm, lm.train).replace(EOT_TOKEN, "").encode("utf-8")) <= 30_000


# --------------------------------------------------------------------------------------------------------
# Copies, blank documents, big files, metadata, encodings
# --------------------------------------------------------------------------------------------------------
def _held_and_trained(lm: LMData, n: int) -> tuple[set[int], set[int]]:
    return _sentinels_in(_stream(lm, lm.val), n), _sentinels_in(_stream(lm, lm.train), n)


def test_linked_and_copied_files_never_straddle_the_split(tmp_path):
    """The same text under several paths (a symlink, a hard link, a plain copy) is one document: read once,
    on one side of the split only."""
    docs = _docs(10)
    _write_texts(tmp_path / "docs", docs)
    for i, p in enumerate(sorted((tmp_path / "docs").rglob("*.txt"))):
        try:
            (tmp_path / f"link_{i}.txt").symlink_to(p)
            (tmp_path / f"hard_{i}.txt").hardlink_to(p)
        except (OSError, NotImplementedError):
            pytest.skip("this filesystem has no symlinks or hard links")
        (tmp_path / f"copy_{i}.txt").write_text(p.read_text())
    for seed in range(6):
        lm = load_lm_data(tmp_path, **SMALL, val_fraction=0.25, seed=seed)
        held, trained = _held_and_trained(lm, 10)
        assert held and not held & trained, f"seed {seed}: held-out documents {held & trained} also train"
        assert sum(lm.documents) == 10 and "copies of other documents skipped" in lm.source
    assert len(lm_sources._walk(tmp_path)) == 20  # each linked file listed once; the copies are other files


def test_a_symlinked_folder_is_read_and_a_link_loop_ends(tmp_path):
    """A corpus whose folders are symlinks (a shelf of books linked in) is read through them, each folder once:
    a link back up the tree (a loop) and a second link to a folder already read add nothing."""
    books = tmp_path / "elsewhere" / "books"
    _write_texts(books, _docs(8))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    try:
        (corpus / "books").symlink_to(books, target_is_directory=True)
        (corpus / "again").symlink_to(books, target_is_directory=True)
        (books / "up").symlink_to(corpus, target_is_directory=True)
    except (OSError, NotImplementedError):
        pytest.skip("this filesystem has no symlinks")
    assert len(lm_sources._walk(corpus)) == 8
    lm = load_lm_data(corpus, **SMALL, val_fraction=0.25)
    assert sum(lm.documents) == 8


def test_repeated_paragraphs_and_records_stay_on_one_side(tmp_path):
    """Boilerplate repeated through one text file (or one JSON Lines file) is held out or trained, never both."""
    docs = _docs(6) + [f"{_sentinel(6 + i)} boilerplate paragraph {i}\n" for i in range(4)]
    paragraphs = [docs[i % 10] for i in range(40)]  # every paragraph four times
    random.Random(0).shuffle(paragraphs)
    (tmp_path / "book.txt").write_text("\n\n".join(paragraphs))
    _write_jsonl(tmp_path / "d.jsonl", paragraphs)
    for path in (tmp_path / "book.txt", tmp_path / "d.jsonl"):
        for seed in range(6):
            lm = load_lm_data(path, seq_len=8, vocab_size=300, val_fraction=0.2, seed=seed)
            held, trained = _held_and_trained(lm, 10)
            assert held and not held & trained and sum(lm.documents) <= 10


def test_blank_documents_do_not_count_in_the_split(tmp_path):
    """Empty files (a source tree's __init__.py) are dropped before the split: the held-out set is never
    just blanks, whatever the seed."""
    _write_texts(tmp_path, _docs(10))
    for i in range(10):
        (tmp_path / f"blank_{i}.py").write_text("" if i % 2 else " \n\n")
    for seed in range(8):
        assert load_lm_data(tmp_path, **SMALL, val_fraction=0.1, seed=seed).documents == (8, 2)


class _Counted(io.FileIO):
    """A file that counts the bytes read from it (class-wide), to check a reader against its budget."""

    read = 0

    def readinto(self, b):  # a BufferedReader's sized reads come through here
        n = super().readinto(b)
        _Counted.read += n or 0
        return n

    def readall(self):  # and a read of the whole file through here
        data = super().readall()
        _Counted.read += len(data)
        return data


def _count_reads_of(monkeypatch, target: Path) -> None:
    """Every open of target, from here on, reads through a _Counted file (other files open as usual)."""
    real = io.open

    def counting_open(file, mode="r", buffering=-1, encoding=None, errors=None, newline=None, *a, **k):
        if str(file) != str(target):
            return real(file, mode, buffering, encoding, errors, newline, *a, **k)
        buf = io.BufferedReader(_Counted(file, "r"))
        return buf if "b" in mode else io.TextIOWrapper(buf, encoding=encoding, errors=errors, newline=newline)
    _Counted.read = 0
    monkeypatch.setattr(io, "open", counting_open)
    monkeypatch.setattr("builtins.open", counting_open)


def test_big_files_are_read_only_as_far_as_the_budget(tmp_path, monkeypatch):
    """A text file far larger than the budget, alone or in a folder, is read about as far as the budget needs
    (one buffer more), not whole."""
    big = tmp_path / "big.txt"
    big.write_text("\n\n".join(d for _ in range(200) for d in _docs(30, seed=2)))  # 2.5 MB
    max_bytes, buffer = 4000, 8192
    cap = lm_data._SCAN_FACTOR * (max_bytes + 16 * SMALL["seq_len"])  # what a single file is scanned for
    assert big.stat().st_size > 50 * cap
    _count_reads_of(monkeypatch, big)
    lm = load_lm_data(big, **SMALL, max_bytes=max_bytes)
    # a look at its first 4 KiB, a scan for end-of-text markers, the read: each one buffer over at most
    assert 0 < _Counted.read <= 2 * cap + 3 * buffer and "its first" in lm.source
    _write_texts(tmp_path / "folder", _docs(12))
    big = big.rename(tmp_path / "folder" / "big.txt")
    _count_reads_of(monkeypatch, big)
    max_bytes = 20_000  # more than the small files hold: the big one is read on whichever side it falls
    for seed in range(3):
        load_lm_data(tmp_path / "folder", **SMALL, max_bytes=max_bytes, seed=seed)
    assert 0 < _Counted.read <= 3 * (max_bytes + 2 * buffer)  # a look at its first 4 KiB, then max_bytes a load


def test_metadata_json_beside_shards_is_skipped_and_said(tmp_path):
    """A Hub snapshot: data/*.jsonl shards, a README and a dataset_infos.json (one JSON object, pretty or on
    one line) beside them; the metadata is skipped and the source line says so."""
    docs = _docs(16)
    info = {"default": {"features": {"text": {"dtype": "string"}}, "splits": {"train": {"num_examples": 16}}}}
    for indent in (2, None):
        root = tmp_path / f"snap_{indent}"
        (root / "data").mkdir(parents=True)
        _write_jsonl(root / "data" / "train-00000-of-00002.jsonl", docs[:8])
        _write_jsonl(root / "data" / "train-00001-of-00002.jsonl", docs[8:])
        (root / "README.md").write_text("---\nlicense: mit\n---\n# corpus\n")
        (root / "dataset_infos.json").write_text(json.dumps(info, indent=indent))
        lm = load_lm_data(root, **SMALL)
        assert sum(lm.documents) == 16 and "1 .json metadata file(s) (a single JSON object each)" in lm.source
        _check_packing(lm, docs, 16)


def test_jsonl_records_without_the_column_are_errors_and_a_bom_is_fine(tmp_path):
    docs = _docs(6)
    with open(tmp_path / "m.jsonl", "w", encoding="utf-8") as f:
        f.write(json.dumps({"text": docs[0]}) + "\n" + "\n".join(json.dumps({"content": d}) for d in docs[1:]))
    with pytest.raises(DataError, match=r"line 2 of '.*m\.jsonl' has no column 'text'.*'content'.*give every record"):
        load_lm_data(tmp_path / "m.jsonl", **SMALL)
    with open(tmp_path / "bom.jsonl", "w", encoding="utf-8-sig") as f:  # a byte-order mark, then a null to skip
        f.write("\n".join(json.dumps({"text": d}) for d in docs + [None]))
    assert sum(load_lm_data(tmp_path / "bom.jsonl", **SMALL, val_fraction=0.3).documents) == 6


def test_non_utf8_files_are_counted_and_named(tmp_path):
    (tmp_path / "mixed").mkdir()
    (tmp_path / "latin").mkdir()
    for i, d in enumerate(_docs(12)):
        latin = d.replace("→", "->") + " café"
        (tmp_path / ("mixed" if i % 2 else "latin") / f"{i}.txt").write_bytes(latin.encode("latin-1"))
        (tmp_path / "mixed" / f"u{i}.txt").write_text(d)
    assert "(6 non-UTF-8 files skipped)" in load_lm_data(tmp_path / "mixed", **SMALL).source
    with pytest.raises(DataError, match=r"no UTF-8 text files \(6 non-UTF-8 files skipped: convert them to UTF-8"):
        load_lm_data(tmp_path / "latin", **SMALL)
    with pytest.raises(DataError, match=r"neither UTF-8 text nor .*another encoding: convert it to UTF-8, e\.g\. "):
        load_lm_data(tmp_path / "latin" / "0.txt", **SMALL)


def test_tokenizers_pin_has_encode_special_tokens():
    """lm_data sets Tokenizer.encode_special_tokens, new in tokenizers 0.15.1: the extra pins that."""
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '"tokenizers>=0.15.1"' in pyproject
    assert hasattr(lm_data.train_bpe(["a b"], 260), "encode_special_tokens")


# --------------------------------------------------------------------------------------------------------
# Errors: each says what to do
# --------------------------------------------------------------------------------------------------------
def test_errors_are_demo_errors():
    assert issubclass(DataError, DemoError)


def test_path_errors(tmp_path):
    with pytest.raises(DataError, match=r"does not exist.*leave --data out"):
        load_lm_data(tmp_path / "nope", **SMALL)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no readable text.*point --data"):
        load_lm_data(tmp_path / "empty", **SMALL)
    (tmp_path / "blank").mkdir()
    for i in range(3):
        (tmp_path / "blank" / f"{i}.txt").write_text("  \n")
    with pytest.raises(DataError, match=r"no readable training text.*non-empty"):
        load_lm_data(tmp_path / "blank", **SMALL)
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.txt").write_text(_docs(1)[0])
    with pytest.raises(DataError, match=r"1 document\(s\); at least 2"):
        load_lm_data(tmp_path / "one", **SMALL)
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2" * 100)
    with pytest.raises(DataError, match=r"neither UTF-8 text nor"):
        load_lm_data(tmp_path / "blob.bin", **SMALL)


def test_json_errors(tmp_path):
    _write_jsonl(tmp_path / "d.jsonl", _docs(5), column="body")
    with pytest.raises(DataError, match=r"no column 'text'.*'id', 'body'.*--text-column"):
        load_lm_data(tmp_path / "d.jsonl", **SMALL)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(DataError, match=r"line 2 .* not JSON"):
        load_lm_data(tmp_path / "bad.jsonl", **SMALL)
    (tmp_path / "list.jsonl").write_text('{"text": ["a", "b"]}\n')
    with pytest.raises(DataError, match=r"holds list values, not text"):
        load_lm_data(tmp_path / "list.jsonl", **SMALL)


def test_size_errors(tmp_path):
    docs = _docs(20)
    _write_texts(tmp_path / "d", docs)
    with pytest.raises(DataError, match=r"longer than the model's 8 positions; use --seq-len 8"):
        load_lm_data(tmp_path / "d", seq_len=16, max_positions=8)
    with pytest.raises(DataError, match=r"training text makes \d+ tokens.*use --seq-len \d+ or less.*--max-bytes"):
        load_lm_data(tmp_path / "d", seq_len=64, vocab_size=300, max_bytes=40)
    tiny = [f"{_sentinel(i)} x" for i in range(20)]
    _write_texts(tmp_path / "t", tiny)
    with pytest.raises(DataError, match=r"held-out text makes \d+ tokens.*--val-fraction"):
        load_lm_data(tmp_path / "t", seq_len=16, vocab_size=300)
    with pytest.raises(DataError, match=r"--vocab-size 257 or more"):
        load_lm_data(tmp_path / "d", seq_len=16, vocab_size=100)
    with pytest.raises(DataError, match=r"between 0 and 1"):
        load_lm_data(tmp_path / "d", **SMALL, val_fraction=1.0)


def test_tokenizer_errors(tmp_path):
    _write_texts(tmp_path / "d", _docs(6))
    with pytest.raises(DataError, match=r"does not exist.*tokenizer.json.*leave --tokenizer out"):
        load_lm_data(tmp_path / "d", tokenizer=tmp_path / "missing.json", **SMALL)
    (tmp_path / "tokenizer_config.json").write_text('{"model_max_length": 512}')
    with pytest.raises(DataError, match=r"not a tokenizer.json"):
        load_lm_data(tmp_path / "d", tokenizer=tmp_path / "tokenizer_config.json", **SMALL)
    lm_data.train_bpe(_docs(6), 300, special_tokens=("<pad>",)).save(str(tmp_path / "noeot.json"))
    with pytest.raises(DataError, match=r"no end-of-text special token.*<pad>.*add_special_tokens"):
        load_lm_data(tmp_path / "d", tokenizer=tmp_path / "noeot.json", **SMALL)


def test_missing_optional_packages(tmp_path, monkeypatch):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "x.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed
    with pytest.raises(DataError, match=r"pip install pyarrow"):
        load_lm_data(tmp_path / "p", **SMALL)
    monkeypatch.undo()
    pytest.importorskip("pyarrow")
    ds = tmp_path / "ds"  # a save_to_disk layout this reader cannot follow
    ds.mkdir()
    (ds / "dataset_info.json").write_text("{}")
    (ds / "state.json").write_text('{"_data_files": [{"filename": "missing.arrow"}]}')
    monkeypatch.setattr(lm_sources, "_import_datasets", lambda: None)
    with pytest.raises(DataError, match=r"without the 'datasets' package.*pip install datasets"):
        load_lm_data(ds, **SMALL)


# --------------------------------------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(docs=st.lists(st.lists(st.integers(1, 50), max_size=12), max_size=10), seq_len=st.integers(1, 9))
def test_pack_matches_concatenation(docs, seq_len):
    blocks = pack(docs, 0, seq_len)
    parts = [torch.tensor(d + [0], dtype=torch.long) for d in docs]
    stream = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    n = stream.numel() // seq_len
    assert blocks.dtype == torch.int64 and blocks.shape == (n, seq_len)
    assert torch.equal(blocks.reshape(-1), stream[: n * seq_len])
    ends = torch.cumsum(torch.tensor([len(d) + 1 for d in docs], dtype=torch.long), 0) - 1 if docs else []
    expected_eot = [int(e) for e in ends if e < n * seq_len]
    assert (blocks.reshape(-1) == 0).nonzero().reshape(-1).tolist() == expected_eot


@settings(max_examples=60, deadline=None)
@given(texts=st.lists(st.text(max_size=40), max_size=8), budget=st.integers(1, 200))
def test_read_until_budget(texts, budget):
    src = lm_sources._list_source(texts, "t")
    got = lm_data._read_until(src, list(range(len(texts))), budget)[0]
    size = sum(len(t.encode("utf-8")) for t in got)
    whole = sum(len(t.encode("utf-8")) for t in set(texts) if t.strip())  # each distinct text once
    assert size <= budget
    assert size >= min(budget, whole) - 3  # a character cut at the boundary loses at most 3 bytes
    assert all(t.strip() for t in got[:-1]) and all(t in texts for t in got[:-1])
    assert len(set(got)) == len(got)


def test_copies_a_stray_newline_apart_stay_on_one_side(tmp_path):
    """A single text file whose first document is repeated (documents joined by end-of-text markers, each
    marker followed by a newline: the first copy reads "X\\n", later ones "\\nX\\n"), and a file of paragraphs
    whose last one repeats an earlier one with no final newline ("X" against "X\\n"): the copies are one
    document, held out or trained, never both (decoded from the blocks), whatever the seed."""
    docs = [d.replace("\n", " ").strip() for d in _docs(20, words=80)]
    (tmp_path / "dump.txt").write_text("".join(d + EOT_TOKEN + "\n" for d in docs + [docs[0]] * 3))
    (tmp_path / "paras.txt").write_text("\n\n".join(docs + [docs[5]]))   # no newline at the end
    for name in ("dump.txt", "paras.txt"):
        for seed in range(12):
            lm = load_lm_data(tmp_path / name, **SMALL, val_fraction=0.2, seed=seed)
            held, trained = _held_and_trained(lm, 20)
            assert held and not held & trained, f"{name}, seed {seed}: held-out {sorted(held & trained)} also train"
            assert sum(lm.documents) == 20
