"""`comera-compile pretrain`: Llama-style causal-LM pretraining, dense vs CoMERA vs GaLore."""

from __future__ import annotations

import argparse
from pathlib import Path

from comera_compile.cli.launch import add_config_options, given_options, train

# Options of `pretrain` that map one to one onto PretrainConfig fields (None: the preset's value).
_PRETRAIN_OPTIONS = ("data", "tokenizer", "text_column", "out", "minutes", "steps", "batch", "micro_batches",
                     "seq_len", "vocab_size", "lr", "comera_lr", "comera_core_lr", "comera_gate_lr", "galore_lr",
                     "warmup_steps", "clip", "rank", "galore_rank", "evals", "eval_blocks", "max_bytes", "val_fraction",
                     "seed", "device", "precision", "threads")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    from comera_compile.examples import lm_pretrain

    given = given_options(args, _PRETRAIN_OPTIONS)
    if args.methods is not None:
        given["methods"] = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    if args.steps is not None and args.minutes is None and args.warmup_steps is None:
        given["warmup_steps"] = None   # a step budget: warm up for a tenth of it, as --help says
    if args.no_clip:
        given["clip"] = None
    if args.resume:
        given["resume"] = True
    return train("pretrain", lm_pretrain, args, argv, given, threads=args.threads)   # also inside torchrun


def add_parser(sub: argparse._SubParsersAction) -> None:
    from comera_compile.examples.demo_dist import PRECISIONS
    from comera_compile.examples.lm_pretrain import METHODS, PRESETS, SHAPES, preset

    p = sub.add_parser(
        "pretrain", help="Llama-style causal-LM pretraining: dense vs CoMERA vs GaLore on equal wall-clock",
        description="Train a Llama-style decoder (transformers' LlamaForCausalLM, built from its config) from "
                    "scratch three ways from one seed and batch order -- dense (Inductor), CoMERA (tensorize + "
                    "RankAdaptive + backend 'comera') and GaLore (GaLoreAdamW) -- each on the same budget, with "
                    "validation perplexity at equal time and equal tokens; writes table.md, curves.png and "
                    "results.json to runs/pretrain-<timestamp>/ (each method's run to runs/<method>.json there "
                    "as it finishes: --resume goes on from a stopped run).")
    p.add_argument("--preset", choices=list(PRESETS), default="tiny",
                   help="model shape and budget: " + "; ".join(
                       f"{k}: hidden {SHAPES[k].hidden}, intermediate {SHAPES[k].intermediate}, {SHAPES[k].heads} "
                       f"heads, {SHAPES[k].layers} layers, "
                       + (f"{v['minutes']:g} min" if v.get("minutes") else f"{v.get('steps')} steps")
                       + f", batch {v.get('batch')}" for k, v in PRESETS.items()) + " (default tiny; options below override the preset's)")
    p.add_argument("--methods", default=None, metavar="LIST",
                   help=f"comma-separated methods to train, run in the order {','.join(METHODS)} (default: all)")
    p.add_argument("--data", default=None, metavar="SOURCE",
                   help="text to train on, as examples.lm_data reads it (default: the Python standard library's "
                        "source)")
    p.add_argument("--tokenizer", default=None, metavar="NAME",
                   help="tokenizer to use (default: a byte-level BPE of --vocab-size trained on the training text)")
    p.add_argument("--text-column", default=None, metavar="NAME", help="the text column of a dataset (default text)")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="output directory (default: runs/pretrain-<YYYYmmdd-HHMMSS> under the current directory)")
    add_config_options(p, (
            ("--minutes", float, "training budget per model, wall clock with compiles, without evaluations"),
            ("--steps", int, "training steps per model (alone: the budget, and the schedule runs on steps; with "
                             "--minutes: a cap)"),
            ("--batch", int, "sequences per step (global, over --nproc processes)"),
            ("--micro-batches", int, "gradient accumulation: each process runs its rows of a step as this many "
                                     "forward and backward passes, then one optimizer step: the papers' batch of "
                                     "512 at the memory of --batch / N (default 1)"),
            ("--seq-len", int, "tokens per sequence (default 256)"),
            ("--vocab-size", int, "BPE vocabulary trained on the data (default 4096)")))
    # Each method's peak rates are its own, tuned apart (GaLore's is 10x dense's): --lr is dense's alone, and the
    # help shows every preset's values (add_config_options: "default" is tiny's, then the other presets').
    add_config_options(p, (
            ("--lr", float, "dense AdamW's peak learning rate; CoMERA and GaLore keep their own (the options "
                            "below), which every preset sets"),
            ("--comera-lr", float, "CoMERA's peak learning rate of the parameters outside TT layers (embeddings, "
                                   "head, norms): cc.param_groups(model, lr)"),
            ("--comera-core-lr", float, "CoMERA's TT cores' peak learning rate, param_groups' core_lr"),
            ("--comera-gate-lr", float, "CoMERA's rank gates' peak learning rate, param_groups' gate_lr"),
            ("--galore-lr", float, "GaLore's peak learning rate")), defaults=preset("tiny"), presets=PRESETS)
    add_config_options(p, (
            ("--warmup-steps", int, "linear warm-up steps before the cosine decay (default: the preset's; a tenth "
                                    "of --steps with --steps alone)"),
            ("--clip", float, "gradient-norm clipping (default 1.0)"),
            ("--rank", int, "initial TT rank of CoMERA's decoder linears (default: the preset's)"),
            ("--galore-rank", int, "GaLore's projection rank (default: the preset's)"),
            ("--evals", int, "validation evaluations per model at equal marks of the budget (default 6)"),
            ("--eval-blocks", int, "validation blocks evaluated (default: the preset's)"),
            ("--max-bytes", int, "training text read, in bytes (default: tiny 8,000,000, the others 64,000,000)"),
            ("--val-fraction", float, "fraction of the documents held out for validation (default 0.05)"),
            ("--seed", int, "seed of the initialisation and the batch order (default 0)")))
    p.add_argument("--no-clip", action="store_true", help="no gradient clipping")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op CPU threads (default: the preset's; tiny: 1, the others: torch's, all cores)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="where the models train (default cpu)")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="the training steps' arithmetic: fp32, tf32 (fp32 with TF32 matmuls, CUDA), bf16 (autocast; "
                        "weights and optimizer state in fp32) or fp16 (autocast, the loss scaled); default bf16 on "
                        "CUDA (fp16 on GPUs without bf16), fp32 on the CPU")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="train data-parallel (DDP) on N local processes started through torchrun, each on its rows "
                        "of every global batch, as demo --nproc")
    p.add_argument("--resume", action="store_true",
                   help="go on with the run in --out: keep the methods it finished (saved in <out>/runs/ as each "
                        "finishes; trained with the same options, data, device, threads and torch) and train the "
                        "others")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")

