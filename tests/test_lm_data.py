"""The causal-LM data (examples/lm_data.py): every input format, the split by document (no held-out text in
training), GPT packing checked against a reference built another way, user tokenizers, determinism, the
default corpus, and each bad input's error naming its fix."""

from __future__ import annotations

import json
import random
import sys

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
    not JSON Lines at all, is a folder of documents, not a dataset of those few; the source line says so."""
    docs = _docs(20)
    _write_texts(tmp_path, docs)
    (tmp_path / "config.json").write_text('{\n  "an": "indented config, not JSON Lines"\n}\n')
    lm = load_lm_data(tmp_path, **SMALL, val_fraction=0.1)
    assert sum(lm.documents) == 21
    assert "text files under" in lm.source and "1 .json/.jsonl/.parquet files" in lm.source
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
    with pytest.raises(DataError, match=r"neither text nor"):
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
    got = lm_sources._read_until(src, list(range(len(texts))), budget)
    size = sum(len(t.encode("utf-8")) for t in got)
    whole = sum(len(t.encode("utf-8")) for t in texts if t.strip())
    assert size <= budget
    assert size >= min(budget, whole) - 3  # a character cut at the boundary loses at most 3 bytes
    assert all(t.strip() for t in got[:-1]) and all(t in texts for t in got[:-1])
