"""Data for decoder-LM (causal LM) pretraining: documents, a held-out split, a tokenizer, packed blocks.

Documents come from a folder of text files, JSON Lines, Parquet, a ``datasets`` folder written by
``save_to_disk``, a single file, or (the default) the Python standard library's own source, so nothing is
downloaded.  They are split by document before anything else happens, blank ones dropped and a copy of a text
already taken (a duplicate file, a repeated paragraph) skipped, so no held-out text is ever trained on, not
even by the tokenizer.  Each split is packed the GPT way: every document followed by the
end-of-text token, the stream cut into fixed-length blocks, the tail dropped.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from comera_compile.examples.code_data import copy_key
from comera_compile.examples.lm_sources import EOT_TOKEN, DataError, _open_source, _Source, invalid_note

__all__ = ["DataError", "LMData", "EOT_TOKEN", "EOT_CANDIDATES", "load_lm_data", "train_bpe", "load_tokenizer",
           "pack", "id_space", "tokenizer_file", "missing_tokenizer"]

# The end-of-text tokens recognised in a user's tokenizer.json, first match wins.
EOT_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]", "<|end_of_text|>")
# Formats read front to back (JSON Lines, Parquet, Arrow, one text file) stop after this many times max_bytes
# of text: enough documents to split and fill both budgets, without reading a huge dataset whole.  A folder's
# files are read one at a time as the split asks for them, none further than max_bytes.
_SCAN_FACTOR = 8
# The held-out set gets at least this many bytes per position of a block (about four blocks at four bytes
# per token), so evaluation has something to average over even when max_bytes is small.
_MIN_HELDOUT_BYTES_PER_POSITION = 16


@dataclass
class LMData:
    """A causal-LM corpus ready to train: packed token blocks of the training and held-out documents
    (disjoint by document), and the tokenizer that made them."""

    train: torch.Tensor          # (n_train_blocks, seq_len) int64
    val: torch.Tensor            # (n_val_blocks, seq_len) int64, held-out documents only
    vocab_size: int              # embedding rows: the tokenizer's largest id + 1 (its ids may have gaps)
    eot_id: int                  # the end-of-text id that follows every document
    tokenizer: Any               # a tokenizers.Tokenizer
    source: str                  # one line: where the data came from, how it was split and tokenized
    documents: tuple[int, int]   # (training documents, held-out documents) read

    def train_tokens(self) -> int:
        """Tokens in the training blocks."""
        return self.train.numel()


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


def tokenizer_file(path: str | Path) -> Path:
    """The file a --tokenizer names (a folder: its tokenizer.json), ~ expanded and, where it exists, as the file
    system names it: ``tok``, ``./tok/tokenizer.json`` and ``~/x/tok`` give one path."""
    p = Path(path).expanduser()
    p = p / "tokenizer.json" if p.is_dir() else p
    return Path(os.path.realpath(p)) if p.exists() else p


def missing_tokenizer(path: str | Path | None) -> str | None:
    """What to tell the user when --tokenizer names no file (None: it does, or was not given)."""
    if path is None or tokenizer_file(path).is_file():
        return None
    return (f"--tokenizer {str(tokenizer_file(path))!r} does not exist; pass the path of a tokenizer.json (HF "
            f"tokenizers format, as in a Hugging Face model folder), or leave --tokenizer out to train one on the "
            f"data")


def load_tokenizer(path: str | Path) -> tuple[Any, int]:
    """A user's tokenizer.json (HF tokenizers format; a folder holding one also works) and its end-of-text
    id: the first of EOT_CANDIDATES among its special tokens.  Truncation and padding are switched off, so
    documents encode whole."""
    tk = _tokenizers()
    missing = missing_tokenizer(path)
    if missing is not None:
        raise DataError(missing)
    p = tokenizer_file(path)
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


def id_space(tokenizer: Any) -> int:
    """The rows an embedding needs for every id `tokenizer` can give: its largest id (vocabulary and added
    tokens) + 1.  Not get_vocab_size(), a count: a tokenizer.json whose ids have gaps (tokens removed, special
    tokens placed high) has ids at and beyond its count."""
    ids = list(tokenizer.get_vocab(with_added_tokens=True).values())
    ids += list(tokenizer.get_added_tokens_decoder())
    return max(ids, default=-1) + 1


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, with no special tokens added, and a literal end-of-text string inside a text
    encoded as ordinary text, so the only separators in the stream are the ones packing puts there."""
    before = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True
    try:
        # encode_batch_fast (tokenizers 0.21+) skips the character offsets nothing here reads: about 30% faster
        encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]
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


def _read_until(source: _Source, order: list[int], budget: int, seen: set[str] | None = None, *,
                most: int | None = None, limit: int | None = None) -> tuple[list[str], int, int]:
    """Documents of `source` in `order` until `budget` bytes are read (the last one cut to fit, at a character
    boundary) or `most` are taken, each read at most `limit` bytes long (default: the budget).  Blank ones and
    copies of a text in `seen` are skipped, compared on copy_key (a stray newline around a copy, as the last
    paragraph of a file or a piece after an end-of-text marker has, does not make it another text), and each
    text taken is added to `seen`, so a later call (the other side of the split) skips any copy of it.  Returns
    the texts, how far along `order` it went, and the copies skipped."""
    seen = set() if seen is None else seen
    texts: list[str] = []
    left, copies = budget, 0
    for start in range(0, len(order), 64):
        for k, t in enumerate(source.fetch(order[start:start + 64], budget if limit is None else limit)):
            if t is None or not t.strip():
                continue
            key = copy_key(t)
            if key in seen:
                copies += 1
                continue
            seen.add(key)
            raw = t.encode("utf-8")
            if len(raw) > left:
                t = raw[:left].decode("utf-8", errors="ignore")
            texts.append(t)
            left -= len(raw)
            if left <= 0 or len(texts) == most:
                return texts, start + k + 1, copies
    return texts, len(order), copies


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
    validation/test split is used as given; blank documents and copies of one already taken skipped, so no text
    is on both sides), at most max_bytes of training text read (about val_fraction of
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
    # Every text taken, held-out ones first: training skips any copy of one.  Both sides read each document to
    # the same length, so a copy reads the same on either side.
    seen: set[str] = set()
    limit = max(max_bytes, heldout_budget)
    if source.heldout is not None:
        if source.count < 1 or source.heldout.count < 1:
            raise DataError(f"{source.describe}: its training or held-out split is empty; save documents in both")
        train_order, held_order = list(range(source.count)), list(range(source.heldout.count))
        rng.shuffle(train_order)
        rng.shuffle(held_order)
        held_texts, _, held_copies = _read_until(source.heldout, held_order, heldout_budget, seen, limit=limit)
    else:
        if source.count < 2:
            bad = f" ({note})" if (note := invalid_note(source)) else ""
            raise DataError(f"{source.describe} holds {source.count} document(s){bad}; at least 2 are needed (one "
                            f"for training, one held out for evaluation): point --data at more documents")
        order = list(range(source.count))
        rng.shuffle(order)
        n_held = min(source.count - 1, max(1, round(val_fraction * source.count)))
        # The held-out documents: the first n_held of the shuffled order that are neither blank nor a copy.
        held_texts, end, held_copies = _read_until(source, order, heldout_budget, seen, most=n_held, limit=limit)
        train_order = order[max(end, n_held):]
    train_texts, _, train_copies = _read_until(source, train_order, max_bytes, seen, limit=limit)
    copies = held_copies + train_copies
    if not train_texts or not held_texts:
        which = "training" if not train_texts else "held-out"
        bad = f"; {note}" if (note := invalid_note(source)) else ""
        raise DataError(f"{source.describe}: no readable {which} text (its documents are empty"
                        f"{' or copies of ones already taken' if copies else ''}{bad}); point --data at more, "
                        f"non-empty UTF-8 documents")

    if user_tok is not None:
        tok, eot_id = user_tok
        tok_note = f"tokenizer {str(tokenizer_file(tokenizer))!r}"
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
    notes = (invalid_note(source), f"{copies} copies of other documents skipped" if copies else "")
    skipped = "".join(f"{note}, " for note in notes if note)
    line = (f"{source.describe}: {len(train_texts)} training / {len(held_texts)} held-out documents ({skipped}"
            f"{n_bytes / 1e6:.3g} MB training text, {train.numel()} / {val.numel()} tokens in blocks of {seq_len}); "
            f"{tok_note}")
    return LMData(train=train, val=val, vocab_size=id_space(tok), eot_id=eot_id, tokenizer=tok,
                  source=line, documents=(len(train_texts), len(held_texts)))
