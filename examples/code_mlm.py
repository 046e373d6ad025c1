"""Code MLM: CodeBERT-style masked-language-model pretraining, dense and CoMERA, side by side on equal time.

The same BERT-like encoder (the paper's layer shapes, d_model 768, at reduced depth) is trained twice from
the same seed, data order and masks: dense, in eager PyTorch at the learning rate that suits it, and
tensorized (``cc.tensorize``) with ``cc.RankAdaptive`` at its defaults and ``torch.compile(backend=
"comera")``.  Each gets the same wall-clock budget (compiles included, held-out evaluations excluded) and is
evaluated on held-out files at fixed marks of it, so the run answers: what does the same CPU time buy?
The run writes a table, a plot and a JSON of every figure to ``runs/<timestamp>/``.

Run it: ``comera-compile demo`` (options: ``comera-compile demo --help``; ``--preset long`` for the long run).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from comera_compile.examples.code_data import (SPECIAL_TOKENS, Corpus, DemoError, load_corpus, mask_batch,
                                               to_blocks, train_tokenizer, unigram_baseline)
from comera_compile.examples.six_encoder import EncoderLayer, SixEncoderConfig

__all__ = ["DemoConfig", "SIZES", "PRESETS", "CodeMLM", "Data", "DemoError", "preset", "prepare_data",
           "build_models", "train_one", "evaluate", "run"]


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
    "small": ModelSize(d_model=256, heads=4, ffn=1024, layers=2, rank=8),
    # BERT-base's layer shapes (the paper's) at two layers: wide enough for TT layers to pay.
    "base": ModelSize(d_model=768, heads=12, ffn=3072, layers=2, rank=16),
}


@dataclass
class DemoConfig:
    """Everything a demo run depends on; ``comera-compile demo`` fills it from its options."""

    data: Path | None = None  # None: the Python standard library's source
    out: Path | None = None  # None: runs/<YYYYmmdd-HHMMSS> under the current directory
    size: str = "base"
    # Training budget per model in wall-clock minutes (compiles included, evaluations excluded); None: steps.
    minutes: float | None = 3.25
    steps: int | None = None  # at most this many steps per model (with minutes None: exactly this many)
    batch: int = 8
    seq_len: int = 128
    vocab_size: int = 2048
    rank: int | None = None  # None: the size's rank
    seed: int = 0
    # Both from the README's sweep of dense's rate (1e-4, 3e-4, 1e-3; 1e-3 leaves this post-LayerNorm encoder
    # at the unigram guess): CoMERA at the same rate, through cc.param_groups (TT cores 2x, rank gates 20x).
    lr: float = 3e-4
    dense_lr: float = 3e-4
    warmup_steps: int = 30  # linear learning-rate warm-up, then constant (both models)
    dropout: float = 0.0
    heldout_fraction: float = 0.1
    max_bytes: int = 3_000_000  # training text read (and the tokenizer trained on)
    eval_blocks: int = 128
    evals: int = 6  # held-out evaluations at equal marks of the budget (the last at its end)
    compile: bool = True  # CoMERA run under torch.compile(backend="comera"); False: eager
    dense_backend: str = "eager"  # "eager" or "inductor" (torch.compile per encoder layer)
    # None: RankAdaptive's early stage only.  A ratio starts its late stage at late_stage_at of the budget,
    # steering the TT size toward that fraction of its size then.
    target_ratio: float | None = None
    late_stage_at: float = 0.5
    cut_every: int = 100  # RankAdaptive's rounding and switch-off check, in steps
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
            (self.minutes is not None or self.steps is not None,
             "give a budget: --minutes (wall clock per model) or --steps (steps per model)"),
            (self.minutes is None or self.minutes > 0, f"--minutes must be positive, got {self.minutes}"),
            (self.steps is None or self.steps >= 1, f"--steps must be at least 1, got {self.steps}"),
            (self.batch >= 1, f"--batch must be at least 1, got {self.batch}"),
            (self.seq_len >= 8, f"--seq-len must be at least 8 (15% of it is masked), got {self.seq_len}"),
            (self.vocab_size >= 256 + len(SPECIAL_TOKENS),
             f"--vocab-size must be at least {256 + len(SPECIAL_TOKENS)} (the 256 byte symbols and "
             f"{len(SPECIAL_TOKENS)} special tokens), got {self.vocab_size}"),
            (self.rank is None or self.rank >= 1, f"--rank must be a positive integer, got {self.rank}"),
            (self.lr > 0 and self.dense_lr > 0, f"--lr and --dense-lr must be positive, got {self.lr}, {self.dense_lr}"),
            (self.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {self.warmup_steps}"),
            (0 < self.heldout_fraction < 1, f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}"),
            (self.max_bytes >= 1000, f"--max-bytes must be at least 1000, got {self.max_bytes}"),
            (self.eval_blocks >= 1, f"--eval-blocks must be at least 1, got {self.eval_blocks}"),
            (self.evals >= 1, f"--evals must be at least 1, got {self.evals}"),
            (self.dense_backend in ("inductor", "eager"),
             f"--dense-backend must be 'inductor' or 'eager', got {self.dense_backend!r}"),
            (self.target_ratio is None or 0 < self.target_ratio <= 1,
             f"--target-ratio must be in (0, 1], got {self.target_ratio}"),
            (0 < self.late_stage_at <= 1, f"late_stage_at must be a fraction in (0, 1], got {self.late_stage_at}"),
            (self.cut_every >= 1, f"--cut-every must be at least 1, got {self.cut_every}"),
        ]
        for ok, message in checks:
            if not ok:
                raise DemoError(message)
        s = self.model_size()
        if s.d_model % s.heads:
            raise DemoError(f"size {self.size!r}: d_model {s.d_model} is not divisible by {s.heads} heads")


# The long run behind the README's quality figure: equal steps rather than equal time.
PRESETS: dict[str, dict[str, Any]] = {
    "demo": {},
    "long": {"minutes": None, "steps": 3000, "evals": 10, "eval_blocks": 256, "rank": 32},
}


def preset(name: str, **overrides: Any) -> DemoConfig:
    """The DemoConfig of a preset, with overrides (options the user gave) on top."""
    if name not in PRESETS:
        raise DemoError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    known = {f.name for f in fields(DemoConfig)}
    unknown = set(overrides) - known
    if unknown:
        raise TypeError(f"DemoConfig has no field(s) {sorted(unknown)}")
    return DemoConfig(**{**PRESETS[name], **overrides})


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


def _rss_bytes() -> int | None:
    """The process's resident memory now (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _active_encoder_params(model: nn.Module, ra: Any) -> int:
    """Encoder parameters counting only the active rank slices of the TT layers (what a cut leaves)."""
    allocated_cores = sum(m.spec.core_params() for m in ra.layers.values())
    return encoder_params(model) - allocated_cores + ra.size()


def train_one(name: str, model: nn.Module, cfg: DemoConfig, data: Data, dense_encoder: int,
              eval_steps: tuple[int, ...] = ()) -> dict[str, Any]:
    """Train `model` for cfg's budget (minutes and/or steps); returns its history and figures.

    name "comera": the model is tensorized, RankAdaptive runs at its defaults and the encoder layers compile
    with backend "comera" (one compiled layer serves them all).  Otherwise the dense model trains with
    cfg.dense_lr, eagerly or compiled by cfg.dense_backend.  Held-out evaluations run at cfg.evals equal
    marks of the budget and at eval_steps (the other model's step count, for a comparison at equal steps);
    the clock stops while they run."""
    import comera_compile as cc
    from tqdm.auto import tqdm

    comera = name == "comera"
    ra = None
    if comera:
        opt = torch.optim.AdamW(cc.param_groups(model, lr=cfg.lr))
        ra = cc.RankAdaptive(model, target_ratio=cfg.target_ratio, cut_every=cfg.cut_every, optimizer=opt)
        start_tt = ra.size()
        backend = "comera" if cfg.compile else None
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.dense_lr, weight_decay=0.0)
        backend = None if cfg.dense_backend == "eager" else cfg.dense_backend
    warm = max(1, cfg.warmup_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    if backend is not None:
        for layer in model.layers:  # regional compilation: one compiled layer serves every layer
            layer.compile(backend=backend, fullgraph=True)
    execution = f"torch.compile {backend!r}, per layer" if backend is not None else "eager"

    budget = cfg.minutes * 60.0 if cfg.minutes is not None else None
    if budget is not None:
        time_marks = [budget * (i + 1) / cfg.evals for i in range(cfg.evals)]
        step_marks = set(eval_steps)
    else:
        time_marks = []
        step_marks = {max(1, round(cfg.steps * (i + 1) / cfg.evals)) for i in range(cfg.evals)} | set(eval_steps)
    history: dict[str, list] = {"step": [], "time_s": [], "loss": [], "step_time_s": [], "active_tt_params": [],
                                "encoder_compression": []}
    evals: list[dict[str, Any]] = []
    stream = batches(data, cfg)
    first_batch = None
    elapsed = 0.0  # training seconds: wall time with the held-out evaluations left out
    start_encoder = encoder_params(model)
    compiling, compile_steps = True, []  # steps that (re)compiled: the first, and the first after a re-allocation
    rss_peak = _rss_bytes() or 0
    total = cfg.steps if budget is None else None
    bar = tqdm(total=total if total is not None else round(budget), desc=f"{name:>6}", disable=not cfg.progress,
               dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 10.0, file=sys.stderr,
               unit="step" if total is not None else "s")

    def active_tt() -> int:
        return ra.size() if ra is not None else 0

    def record_eval(step: int) -> None:
        e = evaluate(model, data)
        enc = _active_encoder_params(model, ra) if ra is not None else encoder_params(model)
        evals.append({"step": step, "time_s": elapsed, **e, "active_tt_params": active_tt(),
                      "encoder_params": enc})

    model.train()
    step = 0
    while (cfg.steps is None or step < cfg.steps) and (budget is None or elapsed < budget):
        step += 1
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
        reallocated = ra.step() if ra is not None else False
        dt = time.perf_counter() - t0
        elapsed += dt
        if compiling and backend is not None:
            compile_steps.append(step - 1)
        compiling = reallocated
        if ra is not None and cfg.target_ratio is not None and ra.stage == "early" and ra.late_stage_at is None:
            if (budget is not None and elapsed >= cfg.late_stage_at * budget) or (
                    budget is None and step >= cfg.late_stage_at * cfg.steps):
                ra.late_stage_at = ra.steps + 1  # the late stage starts at the next step
        rss_peak = max(rss_peak, _rss_bytes() or 0)
        enc = _active_encoder_params(model, ra) if ra is not None else encoder_params(model)
        history["step"].append(step)
        history["time_s"].append(elapsed)
        history["loss"].append(float(task.detach()))
        history["step_time_s"].append(dt)
        history["active_tt_params"].append(active_tt())
        history["encoder_compression"].append(dense_encoder / enc)
        bar.set_postfix(loss=f"{history['loss'][-1]:.3f}", step=f"{dt * 1e3:.0f}ms", enc=f"{dense_encoder / enc:.0f}x",
                        refresh=False)
        bar.update(1 if total is not None else min(round(elapsed), round(budget)) - bar.n)
        due = step in step_marks
        while time_marks and elapsed >= time_marks[0]:
            time_marks.pop(0)
            due = True
        if due or (cfg.steps is not None and step == cfg.steps):
            record_eval(step)
    bar.close()
    if not evals or evals[-1]["step"] != step:
        record_eval(step)
    if ra is not None:
        ra.cut(share=False)  # what is switched off goes for real: the parameter counts below are the model's
    times = history["step_time_s"]
    steady = [t for i, t in enumerate(times) if i not in compile_steps] or times
    median = statistics.median(steady)
    result = {
        "name": name,
        "execution": execution,
        "steps": step,
        "time_s": elapsed,
        "params_model": total_params(model),
        "params_encoder": encoder_params(model),
        "params_encoder_start": start_encoder,
        "compression_encoder": dense_encoder / encoder_params(model),
        "median_step_s": median,
        "compile_s": sum(max(0.0, times[i] - median) for i in compile_steps),
        "compile_steps": [i + 1 for i in compile_steps],
        "peak_bytes": _peak_step_bytes(model, first_batch, data.vocab_size),
        "peak_rss_bytes": rss_peak or None,
        "heldout_loss": evals[-1]["loss"],
        "heldout_accuracy": evals[-1]["accuracy"],
        "evals": evals,
        "history": history,
    }
    if ra is not None:
        result["active_tt_params_start"] = start_tt
        result["active_tt_params_end"] = ra.size()
        result["ranks"] = {k: list(v) for k, v in ra.ranks().items()}
        result["cuts"] = ra.cuts
        result["stage"] = ra.stage
    return result


# --------------------------------------------------------------------------------------------------------
# The whole demo
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
    labels = torch.cat([b[2].reshape(-1) for b in eval_batches])
    info = {"root": str(corpus.root), "train_files": len(corpus.train_files),
            "heldout_files": len(corpus.heldout_files), "train_bytes": corpus.train_bytes,
            "heldout_bytes": corpus.heldout_bytes, "vocab_size": vocab, "train_blocks": int(train.shape[0]),
            "train_tokens": int(train.numel()), "heldout_blocks": int(heldout.shape[0]),
            "heldout_masked_tokens": int(labels.numel()), "unigram": unigram_baseline(train, labels, vocab),
            "prepare_s": time.perf_counter() - t0}
    log(f"tokenizer: byte-level BPE, {vocab} tokens; {info['train_blocks']} training blocks of {cfg.seq_len} "
        f"tokens, {info['heldout_blocks']} held-out blocks ({info['heldout_masked_tokens']} masked tokens); "
        f"unigram baseline: accuracy {100 * info['unigram']['accuracy']:.2f}%, loss {info['unigram']['loss']:.3f}")
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


def default_out_dir() -> Path:
    return Path("runs") / _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def run(cfg: DemoConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole demo: data, both trainings (dense first; CoMERA is also evaluated at dense's step count),
    and the table, PNG and JSON in cfg.out."""
    from comera_compile.examples import demo_report

    cfg.check()
    t_start = time.perf_counter()
    out = Path(cfg.out) if cfg.out is not None else default_out_dir()
    if out.exists() and not out.is_dir():
        raise DemoError(f"--out {str(out)!r} is a file; give a directory (created if missing)")
    data, corpus, corpus_info = prepare_data(cfg, log)
    dense, tt = build_models(cfg, data.vocab_size)
    dense_encoder, dense_total = encoder_params(dense), total_params(dense)
    budget = f"{cfg.minutes:g} min" if cfg.minutes is not None else f"{cfg.steps} steps"
    log(f"model: size {cfg.size!r} {asdict(cfg.model_size())}; encoder {dense_encoder:,} dense parameters, "
        f"{encoder_params(tt):,} as TT; budget {budget} per model, {torch.get_num_threads()} thread(s)")
    runs: dict[str, dict[str, Any]] = {}
    runs["dense"] = train_one("dense", dense, cfg, data, dense_encoder)
    del dense  # its memory is not the CoMERA run's
    runs["comera"] = train_one("comera", tt, cfg, data, dense_encoder, eval_steps=(runs["dense"]["steps"],))
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    config["out"] = str(out)
    result = {
        "config": config,
        "model": asdict(cfg.model_size()) | {"vocab_size": data.vocab_size, "seq_len": cfg.seq_len,
                                             "dropout": cfg.dropout},
        "corpus": corpus_info,
        "dense_params": {"encoder": dense_encoder, "model": dense_total},
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "runs": runs,
    }
    result["summary"] = demo_report.summarize(result)
    result["wall_time_s"] = time.perf_counter() - t_start
    out.mkdir(parents=True, exist_ok=True)
    paths = {"table": out / "table.md", "plot": out / "curves.png", "json": out / "results.json"}
    result["files"] = {k: str(v) for k, v in paths.items()}
    table = demo_report.format_table(result)
    paths["table"].write_text(table + "\n")
    demo_report.plot(result, paths["plot"])
    paths["json"].write_text(json.dumps(result, indent=1) + "\n")
    log("")
    log(table)
    log("")
    for key, p in paths.items():
        log(f"{key:>5}: {p}")
    return result
