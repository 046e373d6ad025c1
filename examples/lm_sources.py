"""Where decoder-LM pretraining's documents come from: a folder of text files, JSON Lines, Parquet, a
``datasets`` folder written by ``save_to_disk``, a single file, or the Python standard library's own source.
Every format becomes a _Source (a count and a fetch by index), read only as far as the budget needs."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from comera_compile.examples.code_data import _SKIP_DIRS, DemoError, _is_text, list_files, stdlib_dir

EOT_TOKEN = "<|endoftext|>"
_JSON_SUFFIXES = (".jsonl", ".json")
_STRUCTURED_SUFFIXES = (".jsonl", ".json", ".parquet")
_HELDOUT_SPLITS = ("validation", "valid", "val", "test")


class DataError(DemoError):
    """Bad input to the LM data pipeline (missing path, unreadable format, too little data, impossible sizes);
    the message says what to do."""


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


def _size(paths: list[Path]) -> int:
    return sum(p.stat().st_size for p in paths)


def _folder_source(root: Path, column: str, cap: int) -> _Source:
    """A folder's documents: a saved dataset; its .jsonl/.json/.parquet files (text files beside them ignored)
    when those hold most of its bytes; else every text file, one document each."""
    if _is_saved_dataset(root):
        return _saved_dataset_source(root, column, cap)
    files = _walk(root)
    structured = [p for p in files if p.name.endswith(_STRUCTURED_SUFFIXES)]
    others = [p for p in files if not p.name.endswith(_STRUCTURED_SUFFIXES) and _is_text(p)] if structured else []
    if structured and _size(others) > _size(structured):
        # Mostly plain text with a few structured files among it (a source tree's .json configs): documents, the
        # JSON ones included, rather than a dataset whose shards are the few.
        texts = list_files(root)
        return _files_source(texts, f"text files under {str(root)!r} (its {len(structured)} .json/.jsonl/.parquet "
                                    f"files, {_size(structured) / 1e6:.3g} MB against {_size(others) / 1e6:.3g} MB of "
                                    f"other text, read as documents too)")
    if structured:
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
