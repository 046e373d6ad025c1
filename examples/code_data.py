"""The demo's data: a corpus of code split by file, a byte-level BPE tokenizer trained on it, token blocks,
BERT's masking, and the unigram baseline every MLM model must beat.

The corpus defaults to the Python standard library's own source code, which every machine with Python has;
any folder of text or code works.  Nothing is downloaded.
"""

from __future__ import annotations

import os
import random
import stat
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["DemoError", "Corpus", "SPECIAL_TOKENS", "MASK_FRACTION", "stdlib_dir", "list_files", "copy_key",
           "load_corpus", "train_tokenizer", "to_blocks", "mask_batch", "unigram_baseline"]

SPECIAL_TOKENS = ("[PAD]", "[MASK]", "[SEP]")
MASK_FRACTION = 0.15
# Folders never read as corpus: version control, environments, caches, and (for the standard library)
# third-party packages installed inside it.
_SKIP_DIRS = {".git", ".hg", ".svn", "__pycache__", "site-packages", "dist-packages", ".venv", "venv",
              "node_modules", ".tox", ".mypy_cache", ".pytest_cache"}


class DemoError(ValueError):
    """Bad input to the demo (no data, too little data, impossible sizes); the message says what to do."""


# --------------------------------------------------------------------------------------------------------
# Corpus and tokenizer
# --------------------------------------------------------------------------------------------------------
def stdlib_dir() -> Path:
    """The directory of the running Python's standard library source."""
    return Path(sysconfig.get_paths()["stdlib"])


def _text_kind(path: Path) -> str:
    """What a file holds, judged on its first 4 KiB: "text" (UTF-8, no NUL bytes), "other" (text in another
    encoding, such as Latin-1, which is skipped: callers count it so their messages can say so) or "binary"
    (NUL bytes, or unreadable)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return "binary"
    if b"\0" in head:
        return "binary"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:  # a multi-byte character cut at the 4 KiB boundary is still text
        return "text" if e.start >= len(head) - 3 else "other"
    return "text"


def _is_text(path: Path) -> bool:
    """A file that reads as UTF-8 text (checked on its first 4 KiB; no NUL bytes)."""
    return _text_kind(path) == "text"


def _walk(root: Path, suffixes: tuple[str, ...] | None = None) -> list[Path]:
    """Every file under root (or those ending in one of suffixes), sorted, skipping hidden files and folders,
    caches, environments and third-party packages, and each file listed once: a symlink or hard link to a file
    already listed is left out, since a split by file would otherwise put the same text on both sides.
    Symlinked folders are followed, each folder walked once (a link back up the tree ends there)."""
    found, walked = [], set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        try:
            st = os.stat(dirpath)
        except OSError:
            dirnames[:] = []
            continue
        if (st.st_dev, st.st_ino) in walked:
            dirnames[:] = []
            continue
        walked.add((st.st_dev, st.st_ino))
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        found.extend(Path(dirpath) / n for n in filenames
                     if not n.startswith(".") and (suffixes is None or n.endswith(suffixes)))
    out, seen = [], set()
    for p in sorted(found):
        try:
            st = p.stat()  # follows a symlink: its target's device and inode
        except OSError:
            continue
        key = (st.st_dev, st.st_ino) if st.st_ino else p
        if stat.S_ISREG(st.st_mode) and key not in seen:
            seen.add(key)
            out.append(p)
    return out


def list_files(root: Path, suffixes: tuple[str, ...] | None = None) -> list[Path]:
    """Every UTF-8 text file under root (or those ending in one of suffixes), sorted, each once (links to one
    file count once), skipping hidden folders, caches, environments and third-party packages."""
    return [p for p in _walk(root, suffixes) if _is_text(p)]


def copy_key(text: str) -> str:
    """What two documents are compared on to find copies: the text without its leading and trailing
    whitespace, so copies that differ only in a newline around them (a file with and without its final
    newline, a piece after an end-of-text marker and its newline) are one document.  The demo's split and
    pretrain's both skip a document whose key was already taken."""
    return text.strip()


@dataclass
class Corpus:
    """Texts of the training and held-out files (split by file), where they came from, and how many files
    were skipped as copies of a text already taken (the same text under another path)."""

    root: Path
    train_files: list[Path]
    heldout_files: list[Path]
    train_texts: list[str]
    heldout_texts: list[str]
    copies: int = 0

    @property
    def train_bytes(self) -> int:
        return sum(len(t.encode("utf-8")) for t in self.train_texts)

    @property
    def heldout_bytes(self) -> int:
        return sum(len(t.encode("utf-8")) for t in self.heldout_texts)


def _read_until(files: list[Path], max_bytes: int, seen: set[str], most: int | None = None
                ) -> tuple[list[Path], list[str], int, int]:
    """Files in order until max_bytes are read (the last one cut at the budget, on a line boundary) or `most`
    are taken.  Blank files and copies of a text in `seen` (compared whole, on copy_key, before any cut) are
    skipped; each text taken is added to `seen`, so the other side of the split skips any copy of it.  Returns
    the files and texts taken, how far along `files` it went, and the copies skipped."""
    used, texts, total, copies = [], [], 0, 0
    for k, p in enumerate(files):
        if total >= max_bytes or len(texts) == most:
            return used, texts, k, copies
        try:
            text = p.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if not text.strip():
            continue
        key = copy_key(text)
        if key in seen:
            copies += 1
            continue
        seen.add(key)
        encoded = text.encode("utf-8")
        if total + len(encoded) > max_bytes:   # the last file cut at the budget, on a line boundary
            kept = encoded[:max_bytes - total].decode("utf-8", errors="ignore")
            text = kept[:kept.rfind("\n") + 1]
            if not text:   # not one whole line fits
                return used, texts, k + 1, copies
            encoded = text.encode("utf-8")
        used.append(p)
        texts.append(text)
        total += len(encoded)
    return used, texts, len(files), copies


def load_corpus(data: Path | None, seed: int, heldout_fraction: float, max_bytes: int) -> Corpus:
    """Split the files of `data` (default: the standard library's *.py files) by a seeded shuffle into
    held-out and training files, and read at most max_bytes of training text (heldout_fraction of that of
    held-out text).  As pretrain's split does: the held-out files are the first of the shuffled order that are
    neither blank nor a copy of one already taken, and training skips any copy of a text already taken (the
    same text under two paths), so no held-out text trains; Corpus.copies counts the files skipped so."""
    if data is None:
        root, suffixes = stdlib_dir(), (".py",)
    else:
        root, suffixes = Path(data).expanduser(), None
        if not root.exists():
            raise DemoError(f"data directory {str(root)!r} does not exist; pass --data with a folder of text "
                            f"or code files, or leave --data out to use the Python standard library")
        if not root.is_dir():
            raise DemoError(f"--data {str(root)!r} is a file; pass the folder that holds the text or code files")
    files = list_files(root, suffixes)
    if len(files) < 2:
        raise DemoError(f"{str(root)!r} holds {len(files)} UTF-8 text file(s); the demo needs at least 2 (some for "
                        f"training, at least one held out for evaluation). Point --data at a larger folder")
    order = list(files)
    random.Random(seed).shuffle(order)
    n_heldout = max(1, round(heldout_fraction * len(order)))
    seen: set[str] = set()   # every text taken, held-out ones first: training skips any copy of one
    heldout_files, heldout_texts, end, held_copies = _read_until(
        order, max(1000, int(max_bytes * heldout_fraction)), seen, most=n_heldout)
    train_files, train_texts, _, train_copies = _read_until(order[max(end, n_heldout):], max_bytes, seen)
    copies = held_copies + train_copies
    if not train_texts or not heldout_texts:
        raise DemoError(f"the text files under {str(root)!r} are empty{' or copies of one another' if copies else ''}"
                        f" (no training or no held-out text); point --data at a folder of non-empty text or code "
                        f"files")
    return Corpus(root, train_files, heldout_files, train_texts, heldout_texts, copies)


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer (HF tokenizers) trained on texts, with the special tokens
    [PAD], [MASK], [SEP] as ids 0, 1, 2."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as e:
        raise DemoError("the demo needs the 'tokenizers' package: pip install 'comera-compile[examples]'") from e
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def to_blocks(tokenizer: Any, texts: list[str], seq_len: int) -> torch.Tensor:
    """All texts tokenized, joined with [SEP] and cut into (n, seq_len) blocks (the tail is dropped)."""
    sep = tokenizer.token_to_id("[SEP]")
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(sep)
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).reshape(n, seq_len)


def mask_batch(blocks: torch.Tensor, generator: torch.Generator, mask_id: int, vocab_size: int,
               first_regular: int = len(SPECIAL_TOKENS)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BERT's masking: 15% of each block's positions (exactly round(0.15 * seq_len), so shapes are static)
    are predicted; of those 80% become [MASK], 10% a random token, 10% stay.  Returns (inputs, positions,
    labels) with positions and labels of shape (batch, k)."""
    b, s = blocks.shape
    k = max(1, round(MASK_FRACTION * s))
    positions = torch.rand(b, s, generator=generator).argsort(dim=1)[:, :k].sort(dim=1).values
    labels = blocks.gather(1, positions)
    r = torch.rand(b, k, generator=generator)
    random_tokens = torch.randint(first_regular, vocab_size, (b, k), generator=generator)
    replaced = torch.where(r < 0.8, torch.full_like(labels, mask_id), torch.where(r < 0.9, random_tokens, labels))
    inputs = blocks.clone().scatter_(1, positions, replaced)
    return inputs, positions, labels


def unigram_baseline(train: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> dict[str, float]:
    """What a model that ignores the context scores on `labels`: the training tokens' frequencies (add-one
    smoothed) as its distribution, the most frequent token as its guess.  An MLM that learns nothing from
    the context ends here."""
    counts = torch.bincount(train.reshape(-1), minlength=vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    flat = labels.reshape(-1)
    return {"loss": float(-logp[flat].mean()), "accuracy": float((flat == counts.argmax()).double().mean())}
