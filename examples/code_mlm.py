"""Code MLM: CodeBERT-style masked-language-model pretraining, dense and CoMERA-style, side by side.

The corpus defaults to the Python standard library's own source code, which every machine with Python has;
any folder of text or code works (``--data DIR``).  Files are split, seeded, into training and held-out
files; a byte-level BPE tokenizer is trained in-process on the training files (nothing is downloaded).
The same BERT-like encoder is then trained twice from the same seed, data order and masks: once dense,
once tensorized (``cc.tensorize``) with ``cc.RankAdaptive`` and ``torch.compile(backend="comera")``.
The run writes a table, a plot and a JSON of every figure to ``runs/<timestamp>/``.

Run it: ``comera-compile demo`` (options: ``comera-compile demo --help``).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import random
import statistics
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from comera_compile.examples.six_encoder import EncoderLayer, SixEncoderConfig

__all__ = ["DemoConfig", "SIZES", "CodeMLM", "Corpus", "load_corpus", "train_tokenizer", "mask_batch", "run",
           "DemoError"]

SPECIAL_TOKENS = ("[PAD]", "[MASK]", "[SEP]")
MASK_FRACTION = 0.15
# Folders never read as corpus: version control, environments, caches, and (for the standard library)
# third-party packages installed inside it.
_SKIP_DIRS = {".git", ".hg", ".svn", "__pycache__", "site-packages", "dist-packages", ".venv", "venv",
              "node_modules", ".tox", ".mypy_cache", ".pytest_cache"}


class DemoError(ValueError):
    """Bad input to the demo (no data, too little data, impossible sizes); the message says what to do."""


# --------------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSize:
    """Encoder sizes and the TT rank the CoMERA run starts from."""

    d_model: int
    heads: int
    ffn: int
    layers: int
    rank: int


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(d_model=64, heads=2, ffn=256, layers=2, rank=8),
    "small": ModelSize(d_model=128, heads=4, ffn=512, layers=4, rank=8),
    "base": ModelSize(d_model=256, heads=4, ffn=1024, layers=4, rank=16),
}


@dataclass
class DemoConfig:
    """Everything a demo run depends on; ``comera-compile demo`` fills it from its options."""

    data: Path | None = None  # None: the Python standard library's source
    out: Path | None = None  # None: runs/<YYYYmmdd-HHMMSS> under the current directory
    size: str = "small"
    steps: int = 500
    batch: int = 16
    seq_len: int = 128
    vocab_size: int = 2048
    rank: int | None = None  # None: the size's rank
    seed: int = 0
    lr: float = 1e-3
    # Rates of the 500-step default run (cores at 2e-3 left the encoder at the unigram guess).
    core_lr: float = 5e-4
    gate_lr: float = 1e-3
    warmup: float = 0.05  # fraction of the steps with a linear learning-rate warm-up, then constant
    dropout: float = 0.0
    heldout_fraction: float = 0.1
    max_bytes: int = 3_000_000  # training text read (and the tokenizer trained on)
    eval_blocks: int = 256
    evals: int = 5  # held-out evaluations during training (the last at the final step)
    compile: bool = True  # CoMERA run under torch.compile(backend="comera"); False: eager
    dense_backend: str = "eager"  # "eager" or "inductor" (torch.compile per encoder layer)
    # None: early stage only (task loss + gamma * mean |gate|).  A ratio starts RankAdaptive's late stage
    # toward that fraction of the size at late_stage_at; in a 500-step run it costs accuracy (the task loss gets
    # 0.1 of the weight whenever the size is further from its target) for little size.
    target_ratio: float | None = None
    late_stage_at: float = 0.5  # fraction of the steps after which RankAdaptive's late stage starts
    # None: one cut, after the last step.  Under torch.compile every cut changes the cores' shapes and costs
    # a recompile of each encoder layer (their ranks differ), 15-60 s apiece on a 2-core CPU.
    cut_every: int | None = None
    progress: bool = True

    def model_size(self) -> ModelSize:
        if self.size not in SIZES:
            raise DemoError(f"unknown size {self.size!r}; choose one of {', '.join(SIZES)}")
        s = SIZES[self.size]
        return s if self.rank is None else replace(s, rank=self.rank)

    def check(self) -> None:
        """Raise DemoError for settings that cannot run, saying which option to change."""
        self.model_size()
        checks = [
            (self.steps >= 1, f"--steps must be at least 1, got {self.steps}"),
            (self.batch >= 1, f"--batch must be at least 1, got {self.batch}"),
            (self.seq_len >= 8, f"--seq-len must be at least 8 (15% of it is masked), got {self.seq_len}"),
            (self.vocab_size >= 256 + len(SPECIAL_TOKENS),
             f"--vocab-size must be at least {256 + len(SPECIAL_TOKENS)} (the 256 byte symbols and "
             f"{len(SPECIAL_TOKENS)} special tokens), got {self.vocab_size}"),
            (self.rank is None or self.rank >= 1, f"--rank must be a positive integer, got {self.rank}"),
            (0 < self.heldout_fraction < 1, f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}"),
            (self.max_bytes >= 1000, f"--max-bytes must be at least 1000, got {self.max_bytes}"),
            (self.eval_blocks >= 1, f"eval_blocks must be at least 1, got {self.eval_blocks}"),
            (self.dense_backend in ("inductor", "eager"),
             f"--dense-backend must be 'inductor' or 'eager', got {self.dense_backend!r}"),
            (self.target_ratio is None or 0 < self.target_ratio <= 1,
             f"--target-ratio must be in (0, 1], got {self.target_ratio}"),
            (0 < self.late_stage_at <= 1, f"late_stage_at must be a fraction in (0, 1], got {self.late_stage_at}"),
        ]
        for ok, message in checks:
            if not ok:
                raise DemoError(message)
        s = self.model_size()
        if s.d_model % s.heads:
            raise DemoError(f"size {self.size!r}: d_model {s.d_model} is not divisible by {s.heads} heads")


# --------------------------------------------------------------------------------------------------------
# Corpus and tokenizer
# --------------------------------------------------------------------------------------------------------
def stdlib_dir() -> Path:
    """The directory of the running Python's standard library source."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_text(path: Path) -> bool:
    """A file that reads as UTF-8 text (checked on its first 4 KiB; no NUL bytes)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:  # a multi-byte character cut at the 4 KiB boundary is still text
        return e.start >= len(head) - 3
    return True


def list_files(root: Path, suffixes: tuple[str, ...] | None = None) -> list[Path]:
    """Every text file under root (or those ending in one of suffixes), sorted, skipping hidden folders,
    caches, environments and third-party packages."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in filenames:
            if name.startswith("."):
                continue
            p = Path(dirpath) / name
            if suffixes is not None and not name.endswith(suffixes):
                continue
            if p.is_file() and _is_text(p):
                files.append(p)
    return sorted(files)


@dataclass
class Corpus:
    """Texts of the training and held-out files (split by file), and where they came from."""

    root: Path
    train_files: list[Path]
    heldout_files: list[Path]
    train_texts: list[str]
    heldout_texts: list[str]

    @property
    def train_bytes(self) -> int:
        return sum(len(t.encode("utf-8")) for t in self.train_texts)

    @property
    def heldout_bytes(self) -> int:
        return sum(len(t.encode("utf-8")) for t in self.heldout_texts)


def _read_until(files: list[Path], max_bytes: int) -> tuple[list[Path], list[str]]:
    used, texts, total = [], [], 0
    for p in files:
        if total >= max_bytes:
            break
        try:
            text = p.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if not text.strip():
            continue
        used.append(p)
        texts.append(text)
        total += len(text.encode("utf-8"))
    return used, texts


def load_corpus(data: Path | None, seed: int, heldout_fraction: float, max_bytes: int) -> Corpus:
    """Split the files of `data` (default: the standard library's *.py files) by a seeded shuffle into
    held-out and training files, and read at most max_bytes of training text (heldout_fraction of that of
    held-out text)."""
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
        raise DemoError(f"{str(root)!r} holds {len(files)} text file(s); the demo needs at least 2 (some for "
                        f"training, at least one held out for evaluation). Point --data at a larger folder")
    order = list(files)
    random.Random(seed).shuffle(order)
    n_heldout = max(1, round(heldout_fraction * len(order)))
    heldout_pool, train_pool = order[:n_heldout], order[n_heldout:]
    train_files, train_texts = _read_until(train_pool, max_bytes)
    heldout_files, heldout_texts = _read_until(heldout_pool, max(1000, int(max_bytes * heldout_fraction)))
    if not train_texts or not heldout_texts:
        raise DemoError(f"the text files under {str(root)!r} are empty (no training or no held-out text); "
                        f"point --data at a folder of non-empty text or code files")
    return Corpus(root, train_files, heldout_files, train_texts, heldout_texts)


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


# --------------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------------
class CodeMLM(nn.Module):
    """A BERT-like encoder with an MLM head tied to the word embedding.

    forward(input_ids (b, s), positions (b, k)) -> logits (b, k, vocab) at the masked positions only, so
    the vocabulary projection costs 15% of what it would over every position."""

    def __init__(self, vocab_size: int, seq_len: int, size: ModelSize, dropout: float = 0.0) -> None:
        super().__init__()
        c = SixEncoderConfig(vocab_size=vocab_size, d_model=size.d_model, heads=size.heads, ffn=size.ffn,
                             layers=size.layers, max_positions=seq_len, dropout=dropout)
        self.d_model = size.d_model
        self.word = nn.Embedding(vocab_size, size.d_model)
        self.position = nn.Embedding(seq_len, size.d_model)
        self.embed_norm = nn.LayerNorm(size.d_model)
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList([EncoderLayer(c) for _ in range(size.layers)])
        self.head = nn.Linear(size.d_model, size.d_model)
        self.head_norm = nn.LayerNorm(size.d_model)
        self.decoder_bias = nn.Parameter(torch.zeros(vocab_size))
        with torch.no_grad():  # BERT's embedding init; the tied output projection then starts near uniform
            self.word.weight.normal_(0.0, 0.02)
            self.position.weight.normal_(0.0, 0.02)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.dropout(self.embed_norm(self.word(input_ids) + self.position(pos)[None]))
        for layer in self.layers:
            x = layer(x, None)
        h = x.gather(1, positions.unsqueeze(-1).expand(-1, -1, self.d_model))
        h = self.head_norm(F.gelu(self.head(h)))
        return h @ self.word.weight.t() + self.decoder_bias


def encoder_params(model: nn.Module) -> int:
    """Parameters of the encoder layers (attention and FFN, their LayerNorms included)."""
    return sum(p.numel() for p in model.layers.parameters())


def total_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------------------
# Training and evaluation
# --------------------------------------------------------------------------------------------------------
@dataclass
class Data:
    """Token blocks for training, fixed masked batches for held-out evaluation, and the ids that matter."""

    train: torch.Tensor  # (n, seq_len)
    heldout: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (inputs, positions, labels) batches
    vocab_size: int
    mask_id: int


def batches(data: Data, cfg: DemoConfig) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Masked training batches in a seeded order (a fresh permutation every epoch): the same sequence for
    every model trained with the same config."""
    g = torch.Generator().manual_seed(cfg.seed)
    n = data.train.shape[0]
    while True:
        order = torch.randperm(n, generator=g)
        for i in range(0, n - cfg.batch + 1, cfg.batch):
            yield mask_batch(data.train[order[i: i + cfg.batch]], g, data.mask_id, data.vocab_size)


@torch.no_grad()
def evaluate(model: nn.Module, data: Data) -> dict[str, float]:
    """Held-out MLM loss (mean cross-entropy) and accuracy over every masked position, eagerly."""
    was_training = model.training
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    with torch.compiler.set_stance("force_eager"):
        for inputs, positions, labels in data.heldout:
            logits = model(inputs, positions).reshape(-1, data.vocab_size)
            flat = labels.reshape(-1)
            loss_sum += float(F.cross_entropy(logits, flat, reduction="sum"))
            correct += int((logits.argmax(dim=-1) == flat).sum())
            count += flat.numel()
    model.train(was_training)
    return {"loss": loss_sum / count, "accuracy": correct / count, "masked_tokens": count}


def _lr_factor(cfg: DemoConfig) -> Callable[[int], float]:
    """Linear warm-up over cfg.warmup of the steps, then constant (a short run gains nothing from decay)."""
    warm = max(1, round(cfg.warmup * cfg.steps))

    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warm)
    return factor


def _task_loss(model: nn.Module, inputs: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor,
               vocab_size: int) -> torch.Tensor:
    return F.cross_entropy(model(inputs, positions).reshape(-1, vocab_size), labels.reshape(-1))


def _peak_step_bytes(model: nn.Module, batch: tuple[torch.Tensor, ...], vocab_size: int) -> int:
    """Peak tracked tensor memory of one eager forward + backward (gradients included), in bytes."""
    from comera_compile.memory import peak_bytes

    def step() -> None:
        _task_loss(model, *batch, vocab_size).backward()

    with torch.compiler.set_stance("force_eager"):
        peak = peak_bytes(step)
    model.zero_grad(set_to_none=True)
    return peak


def _active_encoder_params(model: nn.Module, ra: Any) -> int:
    """Encoder parameters counting only the active rank slices of the TT layers (what a cut leaves)."""
    allocated_cores = sum(m.spec.core_params() for m in ra.layers.values())
    return encoder_params(model) - allocated_cores + ra.size()


def train_one(name: str, model: nn.Module, cfg: DemoConfig, data: Data, dense_encoder: int,
              dense_total: int) -> dict[str, Any]:
    """Train `model` for cfg.steps steps; returns its history and final figures.

    name "comera": the model is tensorized; RankAdaptive runs (late stage and cuts as configured) and the
    encoder layers compile with backend "comera".  Otherwise the encoder layers compile with
    cfg.dense_backend (or run eagerly)."""
    import comera_compile as cc
    from tqdm.auto import tqdm

    comera = name == "comera"
    ra = None
    if comera:
        opt = torch.optim.AdamW(cc.param_groups(model, lr=cfg.lr, core_lr=cfg.core_lr, gate_lr=cfg.gate_lr))
        late = max(1, round(cfg.late_stage_at * cfg.steps)) if cfg.target_ratio is not None else None
        cut_every = cfg.cut_every or cfg.steps
        ra = cc.RankAdaptive(model, target_ratio=cfg.target_ratio, late_stage_at=late, cut_every=cut_every,
                             optimizer=opt)
        backend = "comera" if cfg.compile else None
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        backend = None if cfg.dense_backend == "eager" else cfg.dense_backend
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor(cfg))
    if backend is not None:
        for layer in model.layers:  # regional compilation: one compiled layer serves every layer
            layer.compile(backend=backend, fullgraph=True)
    execution = f"torch.compile {backend!r}, per layer" if backend is not None else "eager"

    eval_at = sorted({max(1, round(cfg.steps * (i + 1) / cfg.evals)) for i in range(cfg.evals)})
    history: dict[str, list] = {"step": [], "loss": [], "step_time_s": [], "encoder_compression": [],
                                "model_compression": []}
    evals: list[dict[str, float]] = []
    stream = batches(data, cfg)
    first_batch = None
    bar = tqdm(range(1, cfg.steps + 1), desc=f"{name:>6}", disable=not cfg.progress, dynamic_ncols=True,
               mininterval=0.5 if sys.stderr.isatty() else 10.0, file=sys.stderr)
    model.train()
    for step in bar:
        inputs, positions, labels = next(stream)
        if first_batch is None:
            first_batch = (inputs, positions, labels)
        t0 = time.perf_counter()
        task = _task_loss(model, inputs, positions, labels, data.vocab_size)
        loss = ra.loss(task) if ra is not None else task
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if ra is not None:
            ra.step()
        dt = time.perf_counter() - t0
        if ra is not None:
            enc_c = dense_encoder / _active_encoder_params(model, ra)
            model_c = dense_total / (total_params(model) - encoder_params(model) + _active_encoder_params(model, ra))
        else:
            enc_c = model_c = dense_encoder / encoder_params(model)
        history["step"].append(step)
        history["loss"].append(float(task.detach()))
        history["step_time_s"].append(dt)
        history["encoder_compression"].append(enc_c)
        history["model_compression"].append(model_c)
        bar.set_postfix(loss=f"{history['loss'][-1]:.3f}", step=f"{dt * 1e3:.0f}ms", enc=f"{enc_c:.1f}x", refresh=False)
        if step in eval_at:
            evals.append({"step": step, **evaluate(model, data)})
    bar.close()
    if ra is not None:
        ra.cut()  # what is switched off goes for real, so the parameter counts below are what is allocated
    times = history["step_time_s"]
    steady = times[2:] if len(times) > 3 else times
    result = {
        "name": name,
        "execution": execution,
        "params_model": total_params(model),
        "params_encoder": encoder_params(model),
        "compression_encoder": dense_encoder / encoder_params(model),
        "compression_model": dense_total / total_params(model),
        "median_step_s": statistics.median(steady),
        "first_step_s": times[0],
        "peak_bytes": _peak_step_bytes(model, first_batch, data.vocab_size),
        "heldout_loss": evals[-1]["loss"],
        "heldout_accuracy": evals[-1]["accuracy"],
        "evals": evals,
        "history": history,
    }
    if ra is not None:
        result["ranks"] = {k: list(v) for k, v in ra.ranks().items()}
        result["cuts"] = ra.cuts
        result["stage"] = ra.stage
    return result


# --------------------------------------------------------------------------------------------------------
# The whole demo and its outputs
# --------------------------------------------------------------------------------------------------------
def prepare_data(cfg: DemoConfig, log: Callable[[str], None]) -> tuple[Data, Corpus, dict[str, Any]]:
    """Corpus, tokenizer, training blocks and fixed held-out batches; checks there is enough of each."""
    t0 = time.perf_counter()
    corpus = load_corpus(cfg.data, cfg.seed, cfg.heldout_fraction, cfg.max_bytes)
    log(f"corpus: {corpus.root} -- {len(corpus.train_files)} training files ({corpus.train_bytes / 1e6:.2f} MB), "
        f"{len(corpus.heldout_files)} held-out files ({corpus.heldout_bytes / 1e6:.2f} MB)")
    tok = train_tokenizer(corpus.train_texts, cfg.vocab_size)
    vocab = tok.get_vocab_size()
    train = to_blocks(tok, corpus.train_texts, cfg.seq_len)
    heldout = to_blocks(tok, corpus.heldout_texts, cfg.seq_len)
    if train.shape[0] < cfg.batch:
        raise DemoError(f"the training text makes {train.shape[0]} blocks of {cfg.seq_len} tokens, fewer than one "
                        f"batch of {cfg.batch}; use more data (--data, --max-bytes) or a smaller --batch/--seq-len")
    if heldout.shape[0] < 1:
        raise DemoError(f"the held-out files make no full block of {cfg.seq_len} tokens; use more data (--data) "
                        f"or a smaller --seq-len")
    g = torch.Generator().manual_seed(cfg.seed + 1)
    pick = torch.randperm(heldout.shape[0], generator=g)[: cfg.eval_blocks].sort().values
    heldout = heldout[pick]
    mask_id = tok.token_to_id("[MASK]")
    eval_batches = [mask_batch(heldout[i: i + cfg.batch], g, mask_id, vocab)
                    for i in range(0, heldout.shape[0], cfg.batch)]
    info = {"root": str(corpus.root), "train_files": len(corpus.train_files),
            "heldout_files": len(corpus.heldout_files), "train_bytes": corpus.train_bytes,
            "heldout_bytes": corpus.heldout_bytes, "vocab_size": vocab, "train_blocks": int(train.shape[0]),
            "train_tokens": int(train.numel()), "heldout_blocks": int(heldout.shape[0]),
            "heldout_masked_tokens": sum(int(b[2].numel()) for b in eval_batches),
            "epochs": cfg.steps * cfg.batch / train.shape[0], "prepare_s": time.perf_counter() - t0}
    log(f"tokenizer: byte-level BPE, {vocab} tokens; {info['train_blocks']} training blocks of {cfg.seq_len} "
        f"tokens ({info['epochs']:.2f} epochs in {cfg.steps} steps of {cfg.batch}), {info['heldout_blocks']} "
        f"held-out blocks ({info['heldout_masked_tokens']} masked tokens)")
    return Data(train, eval_batches, vocab, mask_id), corpus, info


def build_models(cfg: DemoConfig, vocab_size: int) -> tuple[nn.Module, nn.Module]:
    """The dense model and its CoMERA twin: the same initial embeddings, norms and head (one seed); the
    encoder layers of the twin tensorized at the size's rank (TT cores initialised at nn.Linear's
    variance)."""
    import comera_compile as cc

    size = cfg.model_size()
    torch.manual_seed(cfg.seed)
    dense = CodeMLM(vocab_size, cfg.seq_len, size, cfg.dropout)
    torch.manual_seed(cfg.seed)
    twin = CodeMLM(vocab_size, cfg.seq_len, size, cfg.dropout)
    twin.load_state_dict(dense.state_dict())
    torch.manual_seed(cfg.seed)
    tt = cc.tensorize(twin, rank=size.rank, include="layers.*", inplace=True, trace=False)
    return dense, tt


def format_table(result: dict[str, Any]) -> str:
    """The end-of-run table (Markdown)."""
    d, c = result["runs"]["dense"], result["runs"]["comera"]
    rows = [
        ("execution", d["execution"], c["execution"]),
        ("parameters, encoder layers", f"{d['params_encoder']:,}", f"{c['params_encoder']:,}"),
        ("parameters, whole model", f"{d['params_model']:,}", f"{c['params_model']:,}"),
        ("compression, encoder / whole model", "1.0x / 1.0x",
         f"{c['compression_encoder']:.1f}x / {c['compression_model']:.2f}x"),
        ("median step time", f"{d['median_step_s'] * 1e3:.0f} ms", f"{c['median_step_s'] * 1e3:.0f} ms"),
        ("first step (with compile)", f"{d['first_step_s']:.1f} s", f"{c['first_step_s']:.1f} s"),
        ("peak tracked memory, one eager fwd+bwd", f"{d['peak_bytes'] / 2**20:.1f} MiB",
         f"{c['peak_bytes'] / 2**20:.1f} MiB"),
        ("held-out MLM loss", f"{d['heldout_loss']:.3f}", f"{c['heldout_loss']:.3f}"),
        ("held-out MLM accuracy", f"{100 * d['heldout_accuracy']:.2f}%", f"{100 * c['heldout_accuracy']:.2f}%"),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows + [("", "dense", "")])
    w2 = max(len(r[2]) for r in rows + [("", "", "CoMERA")])
    lines = [f"| {'':<{w0}} | {'dense':>{w1}} | {'CoMERA':>{w2}} |", f"| {'-' * w0} | {'-' * (w1 - 1)}: | {'-' * (w2 - 1)}: |"]
    lines += [f"| {a:<{w0}} | {b:>{w1}} | {x:>{w2}} |" for a, b, x in rows]
    cfg = result["config"]
    lines.append("")
    lines.append(f"{cfg['steps']} steps of {cfg['batch']} x {cfg['seq_len']} tokens, size {cfg['size']!r}, seed "
                 f"{cfg['seed']}, {result['threads']} thread(s); held-out: {result['corpus']['heldout_masked_tokens']} "
                 f"masked tokens of {result['corpus']['heldout_files']} files never trained on; accuracy gap "
                 f"{100 * (d['heldout_accuracy'] - c['heldout_accuracy']):+.2f} points (dense - CoMERA); wall time "
                 f"{result['wall_time_s']:.0f} s")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Training loss (and held-out loss) and encoder compression against step, both models (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_comp) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"dense": "tab:blue", "comera": "tab:orange"}
    labels = {"dense": "dense", "comera": "CoMERA"}
    for name, run_ in result["runs"].items():
        h = run_["history"]
        window = max(1, len(h["loss"]) // 25)
        smooth = [statistics.fmean(h["loss"][max(0, i - window + 1): i + 1]) for i in range(len(h["loss"]))]
        ax_loss.plot(h["step"], h["loss"], color=colors[name], alpha=0.25, linewidth=0.8)
        ax_loss.plot(h["step"], smooth, color=colors[name], label=f"{labels[name]} (training, smoothed)")
        ax_loss.plot([e["step"] for e in run_["evals"]], [e["loss"] for e in run_["evals"]], "o--",
                     color=colors[name], label=f"{labels[name]} (held-out)")
        ax_comp.plot(h["step"], h["encoder_compression"], color=colors[name], label=f"{labels[name]}, encoder")
        ax_comp.plot(h["step"], h["model_compression"], ":", color=colors[name], label=f"{labels[name]}, whole model")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("MLM loss")
    ax_loss.set_title("masked-language-model loss")
    ax_loss.legend(fontsize=8)
    ax_comp.set_xlabel("step")
    ax_comp.set_ylabel("compression vs dense (x)")
    ax_comp.set_yscale("log")
    ax_comp.set_title("compression (active ranks)")
    top = max(max(r["history"]["encoder_compression"]) for r in result["runs"].values())
    ax_comp.set_ylim(0.7, 5 * top)  # headroom in the log scale, so the legend sits above the lines
    ax_comp.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def default_out_dir() -> Path:
    return Path("runs") / _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def run(cfg: DemoConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole demo: data, both trainings, evaluation, and the table, PNG and JSON in cfg.out."""
    cfg.check()
    t_start = time.perf_counter()
    out = Path(cfg.out) if cfg.out is not None else default_out_dir()
    if out.exists() and not out.is_dir():
        raise DemoError(f"--out {str(out)!r} is a file; give a directory (created if missing)")
    data, corpus, corpus_info = prepare_data(cfg, log)
    dense, tt = build_models(cfg, data.vocab_size)
    dense_encoder, dense_total = encoder_params(dense), total_params(dense)
    runs: dict[str, dict[str, Any]] = {}
    with torch._dynamo.config.patch(recompile_limit=64, automatic_dynamic_shapes=False):
        for name, model in (("dense", dense), ("comera", tt)):
            runs[name] = train_one(name, model, cfg, data, dense_encoder, dense_total)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    config["out"] = str(out)
    size = cfg.model_size()
    result = {
        "config": config,
        "model": asdict(size) | {"vocab_size": data.vocab_size, "seq_len": cfg.seq_len, "dropout": cfg.dropout},
        "corpus": corpus_info,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "runs": runs,
        "wall_time_s": time.perf_counter() - t_start,
    }
    out.mkdir(parents=True, exist_ok=True)
    paths = {"table": out / "table.md", "plot": out / "loss_compression.png", "json": out / "results.json"}
    result["files"] = {k: str(v) for k, v in paths.items()}
    table = format_table(result)
    paths["table"].write_text(table + "\n")
    plot(result, paths["plot"])
    paths["json"].write_text(json.dumps(result, indent=1) + "\n")
    log("")
    log(table)
    log("")
    for key, p in paths.items():
        log(f"{key:>5}: {p}")
    return result
