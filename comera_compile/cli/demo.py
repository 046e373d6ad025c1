"""`comera-compile demo`: masked-language-model pretraining on code, dense vs CoMERA side by side."""

from __future__ import annotations

import argparse
from pathlib import Path

from comera_compile.cli.launch import add_config_options, given_options, train

CUDA_DEMO_BATCH = 32   # demo --device cuda: the paper's MNLI batch, unless --batch says otherwise

# Options of `demo` that map one to one onto DemoConfig fields (None: the preset's value).
_DEMO_OPTIONS = ("data", "out", "size", "minutes", "steps", "batch", "micro_batches", "seq_len", "vocab_size", "rank",
                 "lr", "dense_lr", "warmup_steps", "target_ratio", "cut_every", "evals", "eval_blocks", "seed", "max_bytes",
                 "dense_backend", "device", "parallel", "precision")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    from comera_compile.examples import code_mlm

    given = given_options(args, _DEMO_OPTIONS)
    if args.no_compile:
        given["compile"] = False
    if args.resume:
        given["resume"] = True
    if args.device == "cuda" and args.batch is None:
        given["batch"] = CUDA_DEMO_BATCH   # a GPU wants more rows per step than the CPU default
    return train("demo", code_mlm, args, argv, given, threads=args.threads)


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("demo", help="masked-language-model pretraining on code, dense vs CoMERA side by side",
                       description="Train a BERT-like encoder on masked-language modelling of code twice -- dense, "
                                   "and CoMERA-style (tensorize + RankAdaptive + backend 'comera') -- and write a "
                                   "table, a plot and a JSON of every figure to runs/<timestamp>/.")
    from comera_compile.examples.code_mlm import PRESETS, SIZES, DemoConfig
    from comera_compile.examples.demo_dist import PRECISIONS

    defaults = DemoConfig()
    d.add_argument("--preset", choices=list(PRESETS), default="demo",
                   help="demo: equal wall-clock budgets, minutes; long: equal steps, 1-2 hours on 2 cores, the "
                        "README's quality figure (options below override the preset's)")
    d.add_argument("--data", type=Path, default=None, metavar="DIR",
                   help="folder of text or code files (default: the Python standard library's *.py files)")
    d.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="output directory (default: runs/<YYYYmmdd-HHMMSS> under the current directory)")
    d.add_argument("--size", choices=list(SIZES), default=None,
                   help="model size: " + "; ".join(f"{k}: d_model {v.d_model}, {v.layers} layers, FFN {v.ffn}, "
                                                   f"rank {v.rank}" for k, v in SIZES.items())
                        + f" (default {defaults.size})")
    # (option, type, what it sets), each a DemoConfig field; the defaults shown are the demo preset's, and the
    # long preset's where it differs.
    add_config_options(d, (
            ("--minutes", float, "training budget per model, wall clock with compiles, without evaluations"),
            ("--steps", int, "training steps per model (alone: the budget; with --minutes: a cap)"),
            ("--batch", int, "sequences per step"),
            ("--micro-batches", int, "gradient accumulation: each step's sequences (each process's) in this many "
                                     "forward and backward passes, one optimizer step: --batch's update at the "
                                     "memory of a part"),
            ("--seq-len", int, "tokens per sequence"),
            ("--vocab-size", int, "BPE vocabulary trained on the data"),
            ("--rank", int, "initial TT rank of the CoMERA encoder (default: the size's)"),
            ("--lr", float, "CoMERA's learning rate, cc.param_groups(model, lr): TT cores 2x, gates 20x"),
            ("--dense-lr", float, "the dense model's learning rate (the best of the README's sweep)"),
            ("--warmup-steps", int, "linear learning-rate warm-up, both models"),
            ("--target-ratio", float, "start RankAdaptive's late stage halfway through, steering the TT size "
                                      "toward this fraction (0, 1] of its size then (default: early stage only)"),
            ("--cut-every", int, "steps between RankAdaptive's rank checks"),
            ("--evals", int, "held-out evaluations per model, at equal marks of the budget"),
            ("--eval-blocks", int, "held-out blocks evaluated"),
            ("--seed", int, "seed of split, init, data order, masks"),
            ("--max-bytes", int, "training text read, in bytes")), defaults, PRESETS)
    d.add_argument("--threads", type=int, default=None, help="intra-op CPU threads (default: torch's, all cores)")
    d.add_argument("--dense-backend", choices=("inductor", "eager"), default=None,
                   help="how the dense model runs: eager, or its encoder layers under torch.compile's Inductor "
                        f"(default {defaults.dense_backend})")
    d.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help=f"where both models train (default cpu); cuda also makes --batch default to "
                        f"{CUDA_DEMO_BATCH} and times each step to the end of its GPU work")
    d.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="the training steps' arithmetic: fp32, tf32 (fp32 with TF32 matmuls, CUDA), bf16 (autocast; "
                        "weights and optimizer state in fp32) or fp16 (autocast, the loss scaled); default bf16 on "
                        "CUDA (fp16 on GPUs without bf16), fp32 on the CPU")
    d.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="train data-parallel on N local processes (started through torchrun; gloo on CPU, nccl on "
                        "CUDA), each on its rows of every global batch of --batch rows; on several machines "
                        "run torchrun -m comera_compile demo yourself (README: Distributed)")
    d.add_argument("--parallel", choices=("ddp", "fsdp"), default=None,
                   help="with several processes: DistributedDataParallel (default) or FSDP2 (fully_shard per "
                        "encoder layer, then the model)")
    d.add_argument("--no-compile", action="store_true",
                   help="run the CoMERA model eagerly instead of under torch.compile(backend='comera')")
    d.add_argument("--resume", action="store_true",
                   help="go on with the run in --out: keep the model runs it finished (saved in <out>/runs/ as "
                        "each finishes; trained with the same options, data, device, threads and torch) and train "
                        "the other")
    d.add_argument("--no-progress", action="store_true", help="no progress bars")
