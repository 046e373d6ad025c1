"""Data for decoder-LM (causal LM) pretraining: documents, a held-out split, a tokenizer, packed blocks.

Documents come from a folder of text files, JSON Lines, Parquet, a ``datasets`` folder written by
``save_to_disk``, a single file, or (the default) the Python standard library's own source, so nothing is
downloaded.  They are split by document before anything else happens, so no held-out text is ever trained
on, not even by the tokenizer.  Each split is packed the GPT way: every document followed by the
end-of-text token, the stream cut into fixed-length blocks, the tail dropped.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from comera_compile.examples.code_data import _SKIP_DIRS, DemoError, _is_text, list_files, stdlib_dir

__all__ = ["DataError", "LMData", "EOT_TOKEN", "EOT_CANDIDATES", "load_lm_data", "train_bpe", "load_tokenizer",
           "pack"]

EOT_TOKEN = "<|endoftext|>"
# The end-of-text tokens recognised in a user's tokenizer.json, first match wins.
EOT_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]", "<|end_of_text|>")
_JSON_SUFFIXES = (".jsonl", ".json")
_STRUCTURED_SUFFIXES = (".jsonl", ".json", ".parquet")
_HELDOUT_SPLITS = ("validation", "valid", "val", "test")
# Formats read front to back (JSON Lines, Parquet, Arrow, one text file) stop after this many times max_bytes
# of text: enough documents to split and fill both budgets, without reading a huge dataset whole.
_SCAN_FACTOR = 8
# The held-out set gets at least this many bytes per position of a block (about four blocks at four bytes
# per token), so evaluation has something to average over even when max_bytes is small.
_MIN_HELDOUT_BYTES_PER_POSITION = 16


class DataError(DemoError):
    """Bad input to the LM data pipeline (missing path, unreadable format, too little data, impossible sizes);
    the message says what to do."""


@dataclass
class LMData:
    """A causal-LM corpus ready to train: packed token blocks of the training and held-out documents
    (disjoint by document), and the tokenizer that made them."""

    train: torch.Tensor          # (n_train_blocks, seq_len) int64
    val: torch.Tensor            # (n_val_blocks, seq_len) int64, held-out documents only
    vocab_size: int              # the tokenizer's vocabulary size, special tokens included
    eot_id: int                  # the end-of-text id that follows every document
    tokenizer: Any               # a tokenizers.Tokenizer
    source: str                  # one line: where the data came from, how it was split and tokenized
    documents: tuple[int, int]   # (training documents, held-out documents) read

    def train_tokens(self) -> int:
        """Tokens in the training blocks."""
        return self.train.numel()


# --------------------------------------------------------------------------------------------------------
# Documents: every format becomes a _Source (a count and a fetch by index)
# --------------------------------------------------------------------------------------------------------
@dataclass
class _Source:
    """Documents addressable by index, so a seeded split can pick them before any text is read; `heldout`
    is a split the data itself names as held out (a DatasetDict's validation split)."""

    describe: str
    count: int
    fetch: Callable[[list[int]], list[Any]]
    heldout: _Source | None = None


def _list_source(texts: list[str], describe: str) -> _Source:
    return _Source(describe, len(texts), lambda idx: [texts[i] for i in idx])


def _files_source(files: list[Path], describe: str) -> _Source:
    def fetch(idx: list[int]) -> list[str | None]:
        out: list[str | None] = []
        for i in idx:
            try:
                out.append(files[i].read_text(encoding="utf-8", errors="replace"))
            except OSError:
                out.append(None)
        return out
    return _Source(describe, len(files), fetch)


def _import_pyarrow(what: str) -> Any:
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError as e:
        raise DataError(f"reading {what} needs the 'pyarrow' package: pip install pyarrow") from e
    return pyarrow


def _import_datasets() -> Any:
    """The `datasets` package, or None where it is not installed (a seam the tests patch)."""
    try:
        import datasets
    except ImportError:
        return None
    return datasets


def _column_error(where: str, column: str, columns: Iterable[str]) -> DataError:
    names = ", ".join(repr(c) for c in columns) or "none"
    return DataError(f"{where} has no column {column!r}; its columns are {names}: pass the one that holds the "
                     f"text with --text-column")


def _check_text(value: Any, column: str, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise DataError(f"column {column!r} of {where} holds {type(value).__name__} values, not text; pass a column "
                    f"of strings with --text-column")


def _json_texts(path: Path, column: str) -> Iterator[str | None]:
    """The `column` field of each record of a JSON Lines file (or of a .json file holding one array of
    records)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(1 << 16).lstrip()
        f.seek(0)
        if head.startswith("["):
            try:
                records = json.load(f)
            except json.JSONDecodeError as e:
                raise DataError(f"{str(path)!r} is not valid JSON ({e}); fix it or remove it from --data") from e
            lines: Iterable[tuple[int, Any]] = enumerate(records, 1)
        else:
            lines = ((n, line) for n, line in enumerate(f, 1))
        checked = False
        for n, item in lines:
            if isinstance(item, str):
                if not item.strip():
                    continue
                try:
                    item = json.loads(item)
                except json.JSONDecodeError as e:
                    raise DataError(f"line {n} of {str(path)!r} is not JSON ({e.msg}); a .jsonl/.json file needs "
                                    f"one JSON object per line: fix or remove it") from e
            if not isinstance(item, dict):
                raise DataError(f"record {n} of {str(path)!r} is a {type(item).__name__}, not an object with a "
                                f"{column!r} field; each line must be a JSON object such as "
                                f'{{"{column}": "..."}}')
            if not checked:
                if column not in item:
                    raise _column_error(f"{str(path)!r}", column, item.keys())
                checked = True
            yield _check_text(item.get(column), column, repr(str(path)))


def _parquet_texts(path: Path, column: str) -> Iterator[str | None]:
    pa = _import_pyarrow(".parquet files")
    try:
        pf = pa.parquet.ParquetFile(str(path))
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{str(path)!r} is not a readable Parquet file ({e}); fix or remove it") from e
    if column not in pf.schema_arrow.names:
        raise _column_error(f"{str(path)!r}", column, pf.schema_arrow.names)
    for batch in pf.iter_batches(columns=[column], batch_size=1024):
        for v in batch.column(0).to_pylist():
            yield _check_text(v, column, repr(str(path)))


def _arrow_stream_texts(path: Path, column: str) -> Iterator[str | None]:
    """The `column` of an Arrow IPC stream file, the format `datasets` writes its shards in."""
    pa = _import_pyarrow("a saved dataset without the 'datasets' package")
    with pa.memory_map(str(path)) as mm, pa.ipc.open_stream(mm) as reader:
        if column not in reader.schema.names:
            raise _column_error(f"the dataset at {str(path.parent)!r}", column, reader.schema.names)
        for batch in reader:
            for v in batch.column(column).to_pylist():
                yield _check_text(v, column, repr(str(path.parent)))


def _text_file_documents(path: Path) -> Iterator[str]:
    """A single text file's documents: the pieces between end-of-text markers if it has them (a dump of a
    pretraining corpus), else its paragraphs (separated by blank lines)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if EOT_TOKEN in text:
        yield from text.split(EOT_TOKEN)
        return
    para: list[str] = []
    for line in text.splitlines(keepends=True):
        if line.strip():
            para.append(line)
        elif para:
            yield "".join(para)
            para = []
    if para:
        yield "".join(para)


def _collect(streams: Iterable[Iterator[str | None]], cap: int) -> tuple[list[str], bool]:
    """The non-blank documents of the streams in order, stopping once `cap` bytes are read; also whether it
    stopped early."""
    texts, total = [], 0
    for stream in streams:
        for t in stream:
            if total >= cap:
                return texts, True
            if t is None or not t.strip():
                continue
            texts.append(t)
            total += len(t.encode("utf-8"))
    return texts, False


def _streamed_source(readers: list[Callable[[], Iterator[str | None]]], describe: str, cap: int) -> _Source:
    texts, capped = _collect((r() for r in readers), cap)
    if capped:
        describe += f" (its first {len(texts)} documents, {cap / 1e6:.3g} MB)"
    return _list_source(texts, describe)


def _walk(root: Path) -> list[Path]:
    """Every file under root, sorted, skipping what code_data.list_files skips (hidden files, caches,
    environments, version control)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        out.extend(Path(dirpath) / n for n in filenames if not n.startswith("."))
    return sorted(p for p in out if p.is_file())


def _is_saved_dataset(root: Path) -> bool:
    return (root / "dataset_dict.json").is_file() or (
        (root / "state.json").is_file() and (root / "dataset_info.json").is_file())


def _saved_dataset_source(root: Path, column: str, cap: int) -> _Source:
    """A folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`: its "train" split (or its
    only split) as documents, its validation/test split (if any) as the held-out set."""
    where = f"the dataset saved at {str(root)!r}"
    datasets = _import_datasets()
    if datasets is not None:
        loaded = datasets.load_from_disk(str(root))
        if isinstance(loaded, datasets.DatasetDict):
            train_name, held_name = _pick_splits(list(loaded.keys()), where)
            parts = [(train_name, loaded[train_name])] + ([(held_name, loaded[held_name])] if held_name else [])
        else:
            parts = [(None, loaded)]
        sources = []
        for name, ds in parts:
            if column not in ds.column_names:
                raise _column_error(where + (f" (split {name!r})" if name else ""), column, ds.column_names)
            ds = ds.select_columns([column]).with_format(None)
            label = f"{where}, split {name!r}" if name else where

            def fetch(idx: list[int], ds: Any = ds, label: str = label) -> list[str | None]:
                return [_check_text(v, column, label) for v in ds[idx][column]]
            sources.append(_Source(f"{label} (column {column!r})", len(ds), fetch))
        train = sources[0]
        train.heldout = sources[1] if len(sources) > 1 else None
        return train
    # Without `datasets`: the shards are Arrow IPC streams listed in each split's state.json.
    try:
        if (root / "dataset_dict.json").is_file():
            splits = json.loads((root / "dataset_dict.json").read_text())["splits"]
            train_name, held_name = _pick_splits(list(splits), where)
            parts = [(train_name, root / train_name)] + ([(held_name, root / held_name)] if held_name else [])
        else:
            parts = [(None, root)]
        sources = []
        for name, folder in parts:
            shards = [folder / d["filename"] for d in json.loads((folder / "state.json").read_text())["_data_files"]]
            label = f"{where}, split {name!r}" if name else where
            readers = [lambda s=s: _arrow_stream_texts(s, column) for s in shards]
            sources.append(_streamed_source(readers, f"{label} (column {column!r}, read with pyarrow)", cap))
    except DataError:
        raise
    except Exception as e:  # a layout this reader does not know: the datasets package does
        raise DataError(f"could not read {where} without the 'datasets' package ({type(e).__name__}: {e}); "
                        f"pip install datasets") from e
    train = sources[0]
    train.heldout = sources[1] if len(sources) > 1 else None
    return train


def _pick_splits(names: list[str], where: str) -> tuple[str, str | None]:
    if "train" in names:
        train = "train"
    elif len(names) == 1:
        train = names[0]
    else:
        raise DataError(f"{where} is a DatasetDict without a 'train' split (its splits: {', '.join(names)}); "
                        f"save the training documents as its 'train' split")
    held = next((s for s in _HELDOUT_SPLITS if s in names and s != train), None)
    return train, held


def _folder_source(root: Path, column: str, cap: int) -> _Source:
    if _is_saved_dataset(root):
        return _saved_dataset_source(root, column, cap)
    files = _walk(root)
    structured = [p for p in files if p.name.endswith(_STRUCTURED_SUFFIXES)]
    if structured:
        others = [p for p in files if not p.name.endswith(_STRUCTURED_SUFFIXES) and _is_text(p)]
        kinds = sorted({p.suffix for p in structured})
        describe = f"{'/'.join(kinds)} files under {str(root)!r} (column {column!r}"
        describe += f"; {len(others)} other text files beside them ignored)" if others else ")"
        readers = [(lambda p=p: _parquet_texts(p, column)) if p.suffix == ".parquet"
                   else (lambda p=p: _json_texts(p, column)) for p in structured]
        return _streamed_source(readers, describe, cap)
    texts = list_files(root)
    if not texts:
        raise DataError(f"{str(root)!r} holds no readable text: no text files, .jsonl/.json/.parquet files or "
                        f"saved dataset; point --data at a folder of documents")
    return _files_source(texts, f"text files under {str(root)!r}")


def _file_source(path: Path, column: str, cap: int) -> _Source:
    if path.name.endswith(_JSON_SUFFIXES):
        return _streamed_source([lambda: _json_texts(path, column)], f"{str(path)!r} (column {column!r})", cap)
    if path.suffix == ".parquet":
        return _streamed_source([lambda: _parquet_texts(path, column)], f"{str(path)!r} (column {column!r})", cap)
    if not _is_text(path):
        raise DataError(f"{str(path)!r} is neither text nor a .jsonl/.json/.parquet file; pass a text file, a "
                        f"structured file or a folder of documents with --data")
    how = "split at end-of-text markers or blank lines"
    return _streamed_source([lambda: _text_file_documents(path)], f"{str(path)!r} ({how})", cap)


def _open_source(data: str | Path | None, column: str, cap: int) -> _Source:
    if data is None:
        root = stdlib_dir()
        return _files_source(list_files(root, (".py",)), f"the Python standard library's *.py files ({root})")
    path = Path(data).expanduser()
    if not path.exists():
        raise DataError(f"--data {str(path)!r} does not exist; pass a folder or file of documents (text, "
                        f".jsonl, .parquet, or a saved dataset), or leave --data out to use the Python standard "
                        f"library")
    return _folder_source(path, column, cap) if path.is_dir() else _file_source(path, column, cap)


def _read_until(source: _Source, order: list[int], budget: int) -> list[str]:
    """Documents of `source` in `order` until `budget` bytes are read (the last one cut to fit, at a character
    boundary); blank ones are skipped."""
    texts: list[str] = []
    left = budget
    for start in range(0, len(order), 64):
        for t in source.fetch(order[start:start + 64]):
            if t is None or not t.strip():
                continue
            raw = t.encode("utf-8")
            if len(raw) > left:
                t = raw[:left].decode("utf-8", errors="ignore")
            texts.append(t)
            left -= len(raw)
            if left <= 0:
                return texts
    return texts


# --------------------------------------------------------------------------------------------------------
# Tokenizer and packing
# --------------------------------------------------------------------------------------------------------
def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as e:
        raise DataError("the LM data needs the 'tokenizers' package: pip install 'comera-compile[examples]'") from e
    return tokenizers


def train_bpe(texts: Sequence[str], vocab_size: int, special_tokens: Sequence[str] = (EOT_TOKEN,)) -> Any:
    """A byte-level BPE tokenizer (HF tokenizers, GPT-2 style: any text encodes, no unknown token) trained on
    texts, with special_tokens as its first ids.  The vocabulary stops short of vocab_size when the texts
    have no more merges to give."""
    tk = _tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def load_tokenizer(path: str | Path) -> tuple[Any, int]:
    """A user's tokenizer.json (HF tokenizers format; a folder holding one also works) and its end-of-text
    id: the first of EOT_CANDIDATES among its special tokens.  Truncation and padding are switched off, so
    documents encode whole."""
    tk = _tokenizers()
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise DataError(f"--tokenizer {str(p)!r} does not exist; pass the path of a tokenizer.json (HF tokenizers "
                        f"format, as in a Hugging Face model folder), or leave --tokenizer out to train one on "
                        f"the data")
    try:
        tok = tk.Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises plain Exception for a file it cannot parse
        raise DataError(f"--tokenizer {str(p)!r} is not a tokenizer.json in the HF tokenizers format ({e}); pass "
                        f"the tokenizer.json file itself (not tokenizer_config.json or a vocab file)") from e
    tok.no_truncation()
    tok.no_padding()
    specials = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    for name in EOT_CANDIDATES:
        if name in specials:
            return tok, specials[name]
    raise DataError(f"tokenizer {str(p)!r} has no end-of-text special token (looked for "
                    f"{', '.join(EOT_CANDIDATES)}; its special tokens: {', '.join(specials) or 'none'}); add one: "
                    f"tok.add_special_tokens([{EOT_TOKEN!r}]); tok.save(path)")


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, with no special tokens added, and a literal end-of-text string inside a text
    encoded as ordinary text, so the only separators in the stream are the ones packing puts there."""
    before = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True
    try:
        return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    finally:
        tokenizer.encode_special_tokens = before


def pack(documents: Iterable[Sequence[int]], eot_id: int, seq_len: int) -> torch.Tensor:
    """GPT pretraining packing: each document's ids followed by eot_id, all joined and cut into
    (n, seq_len) int64 blocks; the tail shorter than a block is dropped."""
    ids: list[int] = []
    for doc in documents:
        ids.extend(doc)
        ids.append(eot_id)
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).reshape(n, seq_len)


def _largest_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n > 0 else 0


# --------------------------------------------------------------------------------------------------------
# The whole pipeline
# --------------------------------------------------------------------------------------------------------
def load_lm_data(data: str | Path | None = None, *, seq_len: int = 256, vocab_size: int = 4096,
                 tokenizer: str | Path | None = None, text_column: str = "text", val_fraction: float = 0.05,
                 max_bytes: int = 8_000_000, seed: int = 0, max_positions: int | None = None) -> LMData:
    """Documents of `data` (default: the Python standard library's *.py files) split by a seeded shuffle
    into training and held-out documents (val_fraction of them, at least one; a saved DatasetDict's
    validation/test split is used as given), at most max_bytes of training text read (about val_fraction of
    that held out), tokenized (the given tokenizer.json, else a byte-level BPE of vocab_size trained on the
    training documents only) and packed into (n, seq_len) blocks.  Raises DataError for bad input."""
    if seq_len < 2:
        raise DataError(f"--seq-len {seq_len} is too short: a causal LM block needs at least 2 tokens")
    if max_positions is not None and seq_len > max_positions:
        raise DataError(f"--seq-len {seq_len} is longer than the model's {max_positions} positions; use "
                        f"--seq-len {max_positions} or less")
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--val-fraction {val_fraction} must lie strictly between 0 and 1 (e.g. 0.05)")
    if max_bytes <= 0:
        raise DataError(f"--max-bytes {max_bytes} must be positive (e.g. 8000000)")
    if tokenizer is None and vocab_size < 257:
        raise DataError(f"--vocab-size {vocab_size} is too small for a byte-level BPE (256 byte symbols and "
                        f"{EOT_TOKEN}); use --vocab-size 257 or more")
    user_tok = load_tokenizer(tokenizer) if tokenizer is not None else None

    heldout_budget = max(int(max_bytes * val_fraction), _MIN_HELDOUT_BYTES_PER_POSITION * seq_len)
    source = _open_source(data, text_column, _SCAN_FACTOR * (max_bytes + heldout_budget))
    rng = random.Random(seed)
    if source.heldout is not None:
        if source.count < 1 or source.heldout.count < 1:
            raise DataError(f"{source.describe}: its training or held-out split is empty; save documents in both")
        train_order, held_order = list(range(source.count)), list(range(source.heldout.count))
        rng.shuffle(train_order)
        rng.shuffle(held_order)
        held_source = source.heldout
    else:
        if source.count < 2:
            raise DataError(f"{source.describe} holds {source.count} document(s); at least 2 are needed (one for "
                            f"training, one held out for evaluation): point --data at more documents")
        order = list(range(source.count))
        rng.shuffle(order)
        n_held = min(source.count - 1, max(1, round(val_fraction * source.count)))
        held_order, train_order = order[:n_held], order[n_held:]
        held_source = source
    train_texts = _read_until(source, train_order, max_bytes)
    held_texts = _read_until(held_source, held_order, heldout_budget)
    if not train_texts or not held_texts:
        which = "training" if not train_texts else "held-out"
        raise DataError(f"{source.describe}: no readable {which} text (its documents are empty); point --data at "
                        f"non-empty documents")

    if user_tok is not None:
        tok, eot_id = user_tok
        tok_note = f"tokenizer {str(tokenizer)!r}"
    else:
        tok = train_bpe(train_texts, vocab_size)
        eot_id = tok.token_to_id(EOT_TOKEN)
        tok_note = f"byte-level BPE ({tok.get_vocab_size()} tokens) trained on the training documents"
    train_ids, held_ids = _encode(tok, train_texts), _encode(tok, held_texts)
    train = pack(train_ids, eot_id, seq_len)
    val = pack(held_ids, eot_id, seq_len)
    for blocks, ids, name, fix in ((train, train_ids, "training", f"raise --max-bytes (now {max_bytes}) or point "
                                    f"--data at more documents"),
                                   (val, held_ids, "held-out", f"hold out more (raise --val-fraction, now "
                                    f"{val_fraction}, or --max-bytes) or point --data at more documents")):
        if blocks.shape[0] == 0:
            n = sum(len(d) + 1 for d in ids)
            smaller = f"use --seq-len {_largest_pow2(n)} or less, or " if n >= 2 else ""
            raise DataError(f"the {name} text makes {n} tokens, fewer than one block of --seq-len {seq_len}: "
                            f"{smaller}{fix}")

    n_bytes = sum(len(t.encode("utf-8")) for t in train_texts)
    line = (f"{source.describe}: {len(train_texts)} training / {len(held_texts)} held-out documents "
            f"({n_bytes / 1e6:.3g} MB training text, {train.numel()} / {val.numel()} tokens in blocks of {seq_len}); "
            f"{tok_note}")
    return LMData(train=train, val=val, vocab_size=tok.get_vocab_size(), eot_id=eot_id, tokenizer=tok,
                  source=line, documents=(len(train_texts), len(held_texts)))
