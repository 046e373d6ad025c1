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
import gc
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from comera_compile.examples.code_data import (SPECIAL_TOKENS, Corpus, DemoError, load_corpus, mask_batch,
                                               to_blocks, train_tokenizer, unigram_baseline)
from comera_compile.examples.compile_cache import own_compile_cache, warm_up_compiler
from comera_compile.examples.demo_dist import (PARALLEL, World, arithmetic, budget_checks, from_env,
                                               placement_checks, resolve_precision, run_in_world)
from comera_compile.examples.demo_train import Data, encoder_params, total_params, train_one
from comera_compile.examples.run_store import RunStore, fingerprint
from comera_compile.examples.six_encoder import EncoderLayer, SixEncoderConfig

__all__ = ["DemoConfig", "SIZES", "PRESETS", "CodeMLM", "DemoError", "preset", "prepare_data", "build_models", "run"]


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
    micro_batches: int = 1  # gradient accumulation: each process's rows of a step run in this many parts
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
    device: str = "cpu"  # "cuda": both models train on the GPU (comera-compile demo --device cuda)
    # Under torchrun (or comera-compile demo --nproc N): how the processes share the training, each on its
    # rows of every global batch of `batch` rows: "ddp" (DistributedDataParallel) or "fsdp" (FSDP2).
    parallel: str = "ddp"
    precision: str | None = None  # one of demo_dist.PRECISIONS; None: resolve_precision's default
    resume: bool = False  # keep the runs saved in `out` by a run that stopped (trained the same way), train the rest

    def arithmetic(self) -> str:
        """The precision the steps run in: the option, or bf16 on CUDA (fp16 on GPUs without bf16), fp32 on the CPU."""
        return resolve_precision(self.precision, self.device)

    def model_size(self) -> ModelSize:
        if self.size not in SIZES:
            raise DemoError(f"unknown size {self.size!r}; choose one of {', '.join(SIZES)}")
        s = SIZES[self.size]
        return s if self.rank is None else replace(s, rank=self.rank)

    def check(self, processes: int = 1) -> None:
        """Raise DemoError for settings that cannot run (on `processes` data-parallel processes), saying which
        option to change."""
        self.model_size()
        checks = [
            *budget_checks(self.resume, self.out, self.minutes, self.steps, self.batch),
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
            (self.parallel in PARALLEL, f"--parallel must be one of {', '.join(PARALLEL)}, got {self.parallel!r}"),
            *placement_checks(self.device, self.batch, processes, self.precision, self.micro_batches),
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


# --------------------------------------------------------------------------------------------------------
# The whole demo
# --------------------------------------------------------------------------------------------------------
def prepare_data(cfg: DemoConfig, log: Callable[[str], None]) -> tuple[Data, Corpus, dict[str, Any]]:
    """Corpus, tokenizer, training blocks and fixed held-out batches; checks there is enough of each."""
    t0 = time.perf_counter()
    corpus = load_corpus(cfg.data, cfg.seed, cfg.heldout_fraction, cfg.max_bytes)
    log(f"corpus: {corpus.root} -- {len(corpus.train_files)} training files ({corpus.train_bytes / 1e6:.2f} MB), "
        f"{len(corpus.heldout_files)} held-out files ({corpus.heldout_bytes / 1e6:.2f} MB)"
        + (f", {corpus.copies} copies of other files skipped" if corpus.copies else ""))
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
            "heldout_files": len(corpus.heldout_files), "copies_skipped": corpus.copies,
            "train_bytes": corpus.train_bytes,
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
    and the table, PNG and JSON in cfg.out.  Started by torchrun, every process runs it, each training on
    its rows of every global batch (cfg.parallel: DDP or FSDP2); the first process logs and writes."""
    cfg.check()
    world = from_env(cfg.device, cfg.parallel)
    return run_in_world(cfg, world, _run, log)


def _run(cfg: DemoConfig, world: World, log: Callable[[str], None]) -> dict[str, Any]:
    from comera_compile.examples import demo_report

    t_start = time.perf_counter()
    out = Path(cfg.out) if cfg.out is not None else default_out_dir()
    if out.exists() and not out.is_dir():
        raise DemoError(f"--out {str(out)!r} is a file; give a directory (created if missing)")
    data, corpus, corpus_info = prepare_data(cfg, log)
    dense, tt = build_models(cfg, data.vocab_size)
    device = world.device(cfg.device)
    dense, tt = dense.to(device), tt.to(device)
    data.heldout = [tuple(t.to(device) for t in b) for b in data.heldout]
    dense_encoder, dense_total = encoder_params(dense), total_params(dense)
    budget = demo_report.budget_words(cfg.minutes, cfg.steps)
    log(f"model: size {cfg.size!r} {asdict(cfg.model_size())}; encoder {dense_encoder:,} dense parameters, "
        f"{encoder_params(tt):,} as TT; budget {budget} per model, {cfg.arithmetic()}, "
        + (torch.cuda.get_device_name(device) if cfg.device == "cuda" else f"{torch.get_num_threads()} thread(s)")
        + (f" per process, {world.size} processes ({cfg.parallel.upper()}), {cfg.batch // world.size} rows each "
           f"of every global batch of {cfg.batch}" if world.size > 1 else ""))
    env = demo_report.environment(world.size, device)
    corpus_counts = {f"corpus {k}": v for k, v in corpus_info.items() if k not in ("unigram", "prepare_s")}
    store = RunStore(out, ["dense", "comera"], fingerprint(cfg, ("out", "progress", "resume"), env, paths=("data",),
                                                           **corpus_counts),
                     command="demo", resume=cfg.resume, main=world.main, log=log)
    compiles = {"dense": cfg.dense_backend != "eager", "comera": cfg.compile}
    with store.training(), arithmetic(cfg.arithmetic(), device):
        if any(compiles[name] for name in compiles if name not in store.runs):
            warm_s = warm_up_compiler(device)
            log(f"compiler initialised in {warm_s:.1f} s, outside both budgets (its one-time imports and checks); "
                f"each model then compiles in a fresh Inductor cache")
        # each model compiles its own graphs, inside its own budget: none reused from the other or an earlier run
        if "dense" not in store.runs:
            with own_compile_cache():
                store.save("dense", train_one("dense", dense, cfg, data, dense_encoder, world=world))
        del dense  # its memory is not the CoMERA run's
        gc.collect()   # nothing of dense's run (model, optimizer state) waits for the collector while CoMERA trains
        if "comera" not in store.runs:
            with own_compile_cache():
                store.save("comera", train_one("comera", tt, cfg, data, dense_encoder,
                                               eval_steps=(store.runs["dense"]["steps"],), world=world))
    runs = {name: store.runs[name] for name in ("dense", "comera")}
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    config["out"] = str(out)
    result = {
        "config": config,
        "model": asdict(cfg.model_size()) | {"vocab_size": data.vocab_size, "seq_len": cfg.seq_len,
                                             "dropout": cfg.dropout},
        "corpus": corpus_info,
        "dense_params": {"encoder": dense_encoder, "model": dense_total},
        **env,
        "runs": runs,
        "resumed": store.kept,
    }
    return demo_report.finish(result, demo_report.summarize, world.main, out, t_start, demo_report.format_table,
                              demo_report.plot, log)
