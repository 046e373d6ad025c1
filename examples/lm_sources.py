"""Where decoder-LM pretraining's documents come from: a folder of text files, JSON Lines, Parquet, a
``datasets`` folder written by ``save_to_disk``, a single file, or the Python standard library's own source.
Every format becomes a _Source (a count and a fetch by index), read only as far as the budget needs."""

from __future__ import annotations

import codecs
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from comera_compile.examples.code_data import DemoError, _is_text, _text_kind, _walk, list_files, stdlib_dir

EOT_TOKEN = "<|endoftext|>"
_JSON_SUFFIXES = (".jsonl", ".json")
_STRUCTURED_SUFFIXES = (".jsonl", ".json", ".parquet")
_HELDOUT_SPLITS = ("validation", "valid", "val", "test")
# A .json file beside .jsonl/.parquet shards that parses whole as one object is metadata (a Hub snapshot's
# dataset_infos.json); larger ones are not checked (loading them would cost what the budget is there to save).
_METADATA_MAX_BYTES = 16 << 20
_ICONV = "to UTF-8, e.g. iconv -f latin1 -t utf-8 OLD > NEW"
_NOT_UTF8 = re.compile("[\ud800-\udfff]")


class DataError(DemoError):
    """Bad input to the LM data pipeline (missing path, unreadable format, too little data, impossible sizes);
    the message says what to do."""


@dataclass
class _Source:
    """Documents addressable by index, so a seeded split can pick them before any text is read; `heldout`
    is a split the data itself names as held out (a DatasetDict's validation split)."""

    describe: str
    count: int
    fetch: Callable[[list[int], int], Iterable[Any]]  # (indices, at most this many bytes of each document)
    heldout: _Source | None = None
    invalid: _Invalid = field(default_factory=lambda: _Invalid("document(s)"))   # skipped: not UTF-8


@dataclass
class _Invalid:
    """`count` `unit` skipped as read for bytes not UTF-8: lone surrogates in text read as "surrogateescape"."""

    unit: str
    count: int = 0

    def keep(self, texts: Iterable[str | None]) -> Iterator[str | None]:
        """`texts`, each holding invalid UTF-8 counted and given as None (skipped, as a file unread is)."""
        for t in texts:
            self.count += (bad := t is not None and _NOT_UTF8.search(t) is not None)
            yield None if bad else t


def invalid_note(source: _Source) -> str:
    """The source line's note of what reading `source` (and its held-out split) skipped as not UTF-8."""
    n = source.invalid.count + (source.heldout.invalid.count if source.heldout is not None else 0)
    return f"{n} {source.invalid.unit} with invalid UTF-8 skipped" if n else ""


def _list_source(texts: list[str], describe: str, invalid: _Invalid | None = None) -> _Source:
    return _Source(describe, len(texts), lambda idx, limit: [texts[i] for i in idx],
                   invalid=invalid or _Invalid("document(s)"))


def _read_head(path: Path, limit: int) -> str:
    """A file's first `limit` bytes as text, as read_text gives them (universal newlines; bytes that are not
    UTF-8 as lone surrogates), less a character cut at the end: a huge file costs no more than the budget."""
    with open(path, "rb") as f:
        raw = f.read(limit)
    text = codecs.getincrementaldecoder("utf-8")("surrogateescape").decode(raw, final=len(raw) < limit)
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _files_source(files: list[Path], describe: str) -> _Source:
    """One document a file: None for one unreadable, or with invalid UTF-8 in what is read of it (counted)."""
    def heads(idx: list[int], limit: int) -> Iterator[str | None]:
        for i in idx:  # lazily: a reader that stops part-way through idx reads no further file
            try:
                yield _read_head(files[i], limit)
            except OSError:
                yield None
    invalid = _Invalid("file(s)")
    return _Source(describe, len(files), lambda idx, limit: invalid.keep(heads(idx, limit)), invalid=invalid)


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


def _column_error(where: str, column: str, columns: Iterable[str], fix: str = "") -> DataError:
    names = ", ".join(repr(c) for c in columns) or "none"
    fix = fix or "pass the one that holds the text with --text-column"
    return DataError(f"{where} has no column {column!r}; its columns are {names}: {fix}")


def _check_text(value: Any, column: str, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise DataError(f"column {column!r} of {where} holds {type(value).__name__} values, not text; pass a column "
                    f"of strings with --text-column")


def _json_texts(path: Path, column: str) -> Iterator[str | None]:
    """The `column` field of each record (each must have it; null skips one) of a JSON Lines file, or of a .json
    file holding one array of records; a leading byte-order mark allowed, bytes not UTF-8 as lone surrogates."""
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:
        head = f.read(1 << 16).lstrip()
        f.seek(0)
        if head.startswith("["):
            try:
                records = json.load(f)
            except json.JSONDecodeError as e:
                raise DataError(f"{str(path)!r} is not valid JSON ({e}); fix it or remove it from --data") from e
            lines: Iterable[tuple[int, Any]] = enumerate(records, 1)
            unit = "record"
        else:
            lines = ((n, line) for n, line in enumerate(f, 1))
            unit = "line"
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
            if column not in item:
                fix = (f"give every record a {column!r} field (null to skip one), or remove this one" if checked
                       else "")
                raise _column_error(f"{unit} {n} of {str(path)!r}", column, item.keys(), fix)
            checked = True
            yield _check_text(item[column], column, repr(str(path)))


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


def _has_marker(path: Path, limit: int) -> bool:
    """Whether the end-of-text marker occurs in the file's first `limit` bytes (read 1 MiB at a time)."""
    mark, tail, read = EOT_TOKEN.encode(), b"", 0
    with open(path, "rb") as f:
        while read < limit and (chunk := f.read(min(1 << 20, limit - read))):
            if mark in tail + chunk:
                return True
            read, tail = read + len(chunk), chunk[1 - len(mark):]
    return False


def _text_file_documents(path: Path, limit: int) -> Iterator[str]:
    """A single text file's documents, read line by line as asked for (none over `limit` bytes; bytes not UTF-8
    as lone surrogates): the pieces between end-of-text markers if its first `limit` bytes have one (a dump of
    a pretraining corpus), else its paragraphs (separated by blank lines)."""
    marked = _has_marker(path, limit)
    doc: list[str] = []
    size = 0
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        while line := f.readline(min(1 << 20, limit)):
            if marked:
                doc.append(line)
                if EOT_TOKEN in "".join(doc[-2:]):  # a marker, possibly cut between two 1 MiB reads
                    *done, rest = "".join(doc).split(EOT_TOKEN)
                    yield from done
                    doc, size = [rest], len(rest.encode("utf-8", "surrogateescape"))
                    continue
            else:
                for piece in line.splitlines(keepends=True):
                    if piece.strip():
                        doc.append(piece)
                    elif doc:
                        yield "".join(doc)
                        doc, size = [], 0
            size += len(line.encode("utf-8", "surrogateescape"))
            if size >= limit:  # one document as large as the budget: its head is all that can be used
                break
    if doc:
        yield "".join(doc)


def _collect(streams: Iterable[Iterator[str | None]], cap: int) -> tuple[list[str], bool]:
    """The non-blank documents of the streams in order, stopping as soon as `cap` bytes are read (no further
    document is read); also whether it stopped there."""
    texts, total = [], 0
    for stream in streams:
        for t in stream:
            if t is None or not t.strip():
                continue
            texts.append(t)
            total += len(t.encode("utf-8"))
            if total >= cap:
                return texts, True
    return texts, False


def _streamed_source(readers: list[Callable[[], Iterator[str | None]]], describe: str, cap: int,
                     unit: str = "document(s)") -> _Source:
    """The readers' documents up to `cap` bytes, read now; those with invalid UTF-8 skipped, counted as `unit`."""
    invalid = _Invalid(unit)
    texts, capped = _collect((invalid.keep(r()) for r in readers), cap)
    if capped:
        describe += f" (its first {len(texts)} documents, {cap / 1e6:.3g} MB)"
    return _list_source(texts, describe, invalid)


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

            def fetch(idx: list[int], limit: int, ds: Any = ds, label: str = label) -> list[str | None]:
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
    train = "train" if "train" in names else names[0] if len(names) == 1 else None
    if train is None:
        raise DataError(f"{where} is a DatasetDict without a 'train' split (its splits: {', '.join(names)}); "
                        f"save the training documents as its 'train' split")
    held = next((s for s in _HELDOUT_SPLITS if s in names and s != train), None)
    return train, held


def _size(paths: list[Path]) -> int:
    return sum(p.stat().st_size for p in paths)


def _is_metadata(path: Path, column: str) -> bool:
    """A .json file that is one JSON object without text in `column` (not an array, not JSON Lines): a Hub
    snapshot's dataset_infos.json beside its shards, not a shard."""
    if path.suffix != ".json" or path.stat().st_size > _METADATA_MAX_BYTES:
        return False
    try:
        item = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError):  # JSON Lines, or not JSON: a shard, whose reader says what is wrong
        return False
    return isinstance(item, dict) and not isinstance(item.get(column), str)


def _folder_source(root: Path, column: str, cap: int) -> _Source:
    """A folder's documents: a saved dataset; its .jsonl/.json/.parquet files (text files beside them ignored,
    and beside .jsonl/.parquet shards any .json metadata object) when those hold most of its bytes; else every
    UTF-8 text file, one document each (files in another encoding are counted and skipped)."""
    if _is_saved_dataset(root):
        return _saved_dataset_source(root, column, cap)
    files = _walk(root)
    structured = [p for p in files if p.name.endswith(_STRUCTURED_SUFFIXES)]
    kind_of = {p: _text_kind(p) for p in files if not p.name.endswith(_STRUCTURED_SUFFIXES)}
    others = [p for p, kind in kind_of.items() if kind == "text"]
    n_other = sum(kind == "other" for kind in kind_of.values())
    skipped = f"{n_other} non-UTF-8 files skipped" if n_other else ""
    if structured and _size(others) <= _size(structured):
        meta = []
        if any(p.suffix in (".jsonl", ".parquet") for p in structured):
            meta = [p for p in structured if _is_metadata(p, column)]
            structured = [p for p in structured if p not in meta]
        suffixes = "/".join(sorted({p.suffix for p in structured}))
        notes = [f"column {column!r}"] + ([f"{len(others)} other text files beside them ignored"] if others else [])
        notes += [f"{len(meta)} .json metadata file(s) (a single JSON object each) skipped"] if meta else []
        readers = [(lambda p=p: _parquet_texts(p, column)) if p.suffix == ".parquet"
                   else (lambda p=p: _json_texts(p, column)) for p in structured]
        return _streamed_source(readers, f"{suffixes} files under {str(root)!r} ({'; '.join(notes)})", cap, "record(s)")
    texts = sorted(others + [p for p in structured if p.suffix != ".parquet" and _is_text(p)])
    notes = [skipped] if skipped else []
    if structured:
        # Mostly plain text with a few structured files among it (a source tree's .json configs): documents, the
        # JSON ones included, rather than a dataset whose shards are the few.
        n_parquet = sum(p.suffix == ".parquet" for p in structured)
        notes.insert(0, f"its {len(structured) - n_parquet} .json/.jsonl files read as documents too, "
                        f"{_size(structured) / 1e6:.3g} MB of structured files against {_size(others) / 1e6:.3g} MB "
                        f"of other text" + (f"; its {n_parquet} .parquet files ignored" if n_parquet else ""))
    if not texts:
        enc = f" ({skipped}: convert them {_ICONV})" if skipped else ""
        raise DataError(f"{str(root)!r} holds no readable text: no UTF-8 text files{enc}, .jsonl/.json/.parquet "
                        f"files or saved dataset; point --data at a folder of documents")
    return _files_source(texts, f"text files under {str(root)!r}" + (f" ({'; '.join(notes)})" if notes else ""))


def _file_source(path: Path, column: str, cap: int) -> _Source:
    if path.name.endswith(_JSON_SUFFIXES):
        return _streamed_source([lambda: _json_texts(path, column)], f"{str(path)!r} (column {column!r})", cap,
                                "record(s)")
    if path.suffix == ".parquet":
        return _streamed_source([lambda: _parquet_texts(path, column)], f"{str(path)!r} (column {column!r})", cap)
    kind = _text_kind(path)
    if kind != "text":
        how = f" (it looks like text in another encoding: convert it {_ICONV})" if kind == "other" else ""
        raise DataError(f"{str(path)!r} is neither UTF-8 text nor a .jsonl/.json/.parquet file{how}; pass a text "
                        f"file, a structured file or a folder of documents with --data")
    how = "split at end-of-text markers or blank lines"
    return _streamed_source([lambda: _text_file_documents(path, cap)], f"{str(path)!r} ({how})", cap)


def missing_data(data: str | Path | None) -> str | None:
    """What to tell the user when --data names nothing (None: it exists, or was not given)."""
    if data is None or Path(data).expanduser().exists():
        return None
    return (f"--data {str(Path(data).expanduser())!r} does not exist; pass a folder or file of documents (text, "
            f".jsonl, .parquet, or a saved dataset), or leave --data out to use the Python standard library")


def _open_source(data: str | Path | None, column: str, cap: int) -> _Source:
    if data is None:
        root = stdlib_dir()
        return _files_source(list_files(root, (".py",)), f"the Python standard library's *.py files ({root})")
    if (missing := missing_data(data)) is not None:
        raise DataError(missing)
    path = Path(data).expanduser()
    path = Path(os.path.realpath(path))   # named one way whatever the spelling: the source line is in --resume's check
    return _folder_source(path, column, cap) if path.is_dir() else _file_source(path, column, cap)
