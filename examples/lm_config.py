"""The pretraining comparison's configuration: the methods, the papers' Llama shapes, the presets (a tiny one
for a 2-core CPU) and PretrainConfig, which `comera-compile pretrain`'s options override."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from comera_compile.examples.code_data import DemoError
from comera_compile.examples.demo_dist import budget_checks, placement_checks, resolve_precision
from comera_compile.examples.lm_data import missing_tokenizer
from comera_compile.examples.lm_sources import missing_data

METHODS = ("dense", "comera", "galore")


# --------------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LlamaShape:
    """A Llama decoder's shape (multi-head attention: as many key/value heads as query heads)."""

    hidden: int
    intermediate: int
    heads: int
    layers: int
    max_positions: int = 1024  # the GaLore configs' max_sequence_length


SHAPES: dict[str, LlamaShape] = {
    # Wide enough for TT layers to pay (a 768 x 2048 SwiGLU), shallow enough for minutes on 2 CPU cores.
    "tiny": LlamaShape(hidden=768, intermediate=2048, heads=12, layers=2),
    # The Llama models of the GaLore and SLTrain papers (their configs/llama_60m.json etc.).
    "60m": LlamaShape(hidden=512, intermediate=1376, heads=8, layers=8),
    "130m": LlamaShape(hidden=768, intermediate=2048, heads=12, layers=12),
    "350m": LlamaShape(hidden=1024, intermediate=2736, heads=16, layers=24),
}

# CoMERA's learning rates at rank 16, from a sweep on the tiny preset (200 steps): the dense parts (embeddings,
# head, norms) at 2e-3, the TT cores at 1e-3 and the rank gates at 1e-2 beat every single
# cc.param_groups(model, lr) tried.  The cores' best rate falls as the rank grows (docs/method.md, "Decoder-LM
# pretraining"): the tiny preset trains at rank 64 with its cores at 5e-4.
_COMERA_LRS = {"comera_lr": 2e-3, "comera_core_lr": 1e-3, "comera_gate_lr": 1e-2}

# Per preset, the PretrainConfig fields that differ from its defaults.  The papers train the dense model at
# lr 1e-3, GaLore at lr 1e-2 with scale 0.25 and rank 128 / 256 / 256, on batches of 512 x 256 tokens; here
# the batch is scaled down to what one machine runs (32; 4 for tiny) and those learning rates are kept.
# The larger presets read up to 64 MB of text, the whole default corpus (the standard library's source, about
# 30 MB and 9M tokens here; 8 MB is 2.3M tokens, under 300 steps of 32 x 256): their budgets would otherwise
# pass over it many times.  tiny runs on one thread: on a shared 2-core machine two OpenMP threads stall each
# other whenever another process takes a core, and CoMERA's many small kernels suffer most (median step at
# batch 8 x 256: 0.54 s on one thread, 4.4 s on two under load; dense 1.46 s and 1.78 s).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"minutes": 2.5, "batch": 4, "rank": 64, "galore_rank": 128, "lr": 1e-3,
             **_COMERA_LRS, "comera_core_lr": 5e-4,
             "galore_lr": 1e-2, "warmup_steps": 20, "eval_blocks": 64, "threads": 1},
    "60m": {"minutes": 30.0, "batch": 32, "rank": 16, "galore_rank": 128, "lr": 1e-3, **_COMERA_LRS,
            "galore_lr": 1e-2, "warmup_steps": 200, "eval_blocks": 256, "max_bytes": 64_000_000},
    "130m": {"minutes": 60.0, "batch": 32, "rank": 24, "galore_rank": 256, "lr": 1e-3, **_COMERA_LRS,
             "galore_lr": 1e-2, "warmup_steps": 200, "eval_blocks": 256, "max_bytes": 64_000_000},
    "350m": {"minutes": 120.0, "batch": 32, "rank": 32, "galore_rank": 256, "lr": 1e-3, **_COMERA_LRS,
             "galore_lr": 1e-2, "warmup_steps": 200, "eval_blocks": 256, "max_bytes": 64_000_000},
}


@dataclass
class PretrainConfig:
    """Everything a pretraining run depends on; ``comera-compile pretrain`` fills it from its options."""

    preset: str = "tiny"
    data: str | None = None        # None: the Python standard library's source (examples.lm_data)
    tokenizer: str | None = None   # None: a byte-level BPE trained on the training text
    text_column: str = "text"
    out: Path | None = None        # None: runs/pretrain-<YYYYmmdd-HHMMSS>
    methods: tuple[str, ...] = METHODS
    # Budget per model: wall-clock minutes (compiles included, evaluations excluded), or steps (alone).
    minutes: float | None = 2.0
    steps: int | None = None
    batch: int = 8
    micro_batches: int = 1         # gradient accumulation: each process's rows of a step run in this many parts
    seq_len: int = 256
    vocab_size: int = 4096
    lr: float = 1e-3               # dense AdamW's peak learning rate (CoMERA's and GaLore's where theirs are None)
    comera_lr: float | None = None  # None: lr; CoMERA's cc.param_groups(model, comera_lr, core_lr, gate_lr)
    comera_core_lr: float | None = None  # None: param_groups' default, 2 x comera_lr
    comera_gate_lr: float | None = None  # None: param_groups' default, 20 x comera_lr
    galore_lr: float | None = None  # None: lr
    warmup_steps: int | None = 20  # None: a tenth of --steps (a step budget) or 20
    min_lr_ratio: float = 0.1      # the cosine decays to this fraction of the peak at the end of the budget
    clip: float | None = 1.0       # gradient norm clipping (None: off)
    weight_decay: float = 0.0
    rank: int = 16                 # initial TT rank of CoMERA's decoder linears
    galore_rank: int = 128
    galore_gap: int = 200          # GaLore's projection refresh (update_proj_gap)
    galore_scale: float = 0.25
    evals: int = 6                 # validation evaluations at equal marks of the budget
    eval_blocks: int | None = 64   # validation blocks evaluated (None: all)
    max_bytes: int = 8_000_000
    val_fraction: float = 0.05
    seed: int = 0
    device: str = "cpu"
    precision: str | None = None   # one of demo_dist.PRECISIONS; None: resolve_precision's default
    threads: int | None = None     # intra-op CPU threads (None: torch's default, every core)
    progress: bool = True
    resume: bool = False           # keep the finished methods' runs saved in `out`, train the others

    def shape(self) -> LlamaShape:
        if self.preset not in SHAPES:
            raise DemoError(f"unknown preset {self.preset!r}; choose one of {', '.join(SHAPES)}")
        return SHAPES[self.preset]

    def peak_lr(self, method: str) -> float:
        return {"comera": self.comera_lr, "galore": self.galore_lr}.get(method) or self.lr

    def micro_batch(self, processes: int = 1) -> int:
        """Rows of one forward and backward pass: a process's share of the batch, split into micro-batches."""
        return max(1, self.batch // (processes * self.micro_batches))

    def arithmetic(self) -> str:
        """The precision the steps run in: the option, or bf16 on CUDA (fp16 on GPUs without bf16), fp32 on the CPU."""
        return resolve_precision(self.precision, self.device)

    def warmup(self) -> int:
        """Warm-up steps: the option, or a tenth of a step budget."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        if self.minutes is None and self.steps:   # a step budget: at least one step left for the decay
            return min(max(1, round(0.1 * self.steps)), self.steps - 1)
        return 20

    def check(self, processes: int = 1) -> None:
        """Raise DemoError for settings that cannot run, saying which option to change."""
        s = self.shape()
        bad = [m for m in self.methods if m not in METHODS]
        checks = [
            (not bad and len(self.methods) > 0,
             f"--methods takes a comma-separated subset of {','.join(METHODS)}, got {','.join(self.methods)!r}"),
            *budget_checks(self.resume, self.out, self.minutes, self.steps, self.batch),
            (self.seq_len >= 2, f"--seq-len must be at least 2 (a token and its successor), got {self.seq_len}"),
            (self.seq_len <= s.max_positions,
             f"--seq-len {self.seq_len} is above the model's {s.max_positions} positions (preset {self.preset!r}, "
             f"max_position_embeddings); use --seq-len {s.max_positions} or less"),
            (self.tokenizer is not None or self.vocab_size >= 257,
             f"--vocab-size must be at least 257 (256 byte symbols and the end-of-text token), got {self.vocab_size}"),
            (0 < self.val_fraction < 1, f"--val-fraction must lie strictly between 0 and 1, got {self.val_fraction}"),
            (all(v is None or v > 0 for v in (self.lr, self.comera_lr, self.comera_core_lr, self.comera_gate_lr,
                                               self.galore_lr)),
             f"learning rates must be positive, got --lr {self.lr}, --comera-lr {self.comera_lr}, --comera-core-lr "
             f"{self.comera_core_lr}, --comera-gate-lr {self.comera_gate_lr}, --galore-lr {self.galore_lr}"),
            (self.warmup_steps is None or self.warmup_steps >= 0,
             f"--warmup-steps must be >= 0, got {self.warmup_steps}"),
            (self.minutes is not None or self.steps is None or self.warmup() < self.steps,
             f"--warmup-steps {self.warmup()} leaves no step of the {self.steps}-step budget for the cosine decay; "
             f"give fewer warm-up steps or more --steps"),
            (0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}"),
            (self.clip is None or self.clip > 0, f"--clip must be positive, got {self.clip}"),
            (self.rank >= 1, f"--rank must be a positive integer, got {self.rank}"),
            (self.galore_rank >= 1, f"--galore-rank must be a positive integer, got {self.galore_rank}"),
            (self.threads is None or self.threads >= 1, f"--threads must be at least 1, got {self.threads}"),
            (self.evals >= 1, f"--evals must be at least 1, got {self.evals}"),
            (self.eval_blocks is None or self.eval_blocks >= 1, f"--eval-blocks must be at least 1, got {self.eval_blocks}"),
            (self.max_bytes >= 1000, f"--max-bytes must be at least 1000, got {self.max_bytes}"),
            *placement_checks(self.device, self.batch, processes, self.precision, self.micro_batches),
            *[(message is None, message) for message in (missing_data(self.data), missing_tokenizer(self.tokenizer))],
        ]
        for ok, message in checks:
            if not ok:
                raise DemoError(message)


def preset(name: str, **overrides: Any) -> PretrainConfig:
    """The PretrainConfig of a preset, with overrides (options the user gave) on top."""
    if name not in PRESETS:
        raise DemoError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    unknown = set(overrides) - {f.name for f in fields(PretrainConfig)}
    if unknown:
        raise TypeError(f"PretrainConfig has no field(s) {sorted(unknown)}")
    return PretrainConfig(**{"preset": name, **PRESETS[name], **overrides})
