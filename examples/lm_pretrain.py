"""Decoder-LM pretraining as the field reports it: a Llama-style causal LM trained from scratch three ways on
equal wall-clock budgets -- dense (compiled with Inductor), CoMERA (TT decoder layers, RankAdaptive, backend
"comera") and GaLore (GaLoreAdamW on the dense model) -- with validation perplexity at equal time and at
equal tokens.

The recipe is the GaLore / SLTrain papers' (AdamW, linear warm-up then cosine decay to 10% of the peak,
sequence length 256, gradient clipping at 1.0), with their model shapes as presets and a ``tiny`` preset
that finishes on a 2-core CPU in minutes.  Every method starts from the same seed and sees the same batches
in the same order; the first model's (dense's) final token count is an extra evaluation point for the
others.  Writes ``table.md``, ``curves.png`` and ``results.json`` to ``runs/pretrain-<timestamp>/``, and each
method's run to ``runs/<method>.json`` there as soon as it finishes, so that ``--resume`` trains only the
methods a stopped run did not finish.

Run it: ``comera-compile pretrain`` (options: ``comera-compile pretrain --help``).
"""


from __future__ import annotations

import datetime as _dt
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from comera_compile.examples.code_data import DemoError
from comera_compile.examples.compile_cache import own_compile_cache, warm_up_compiler
from comera_compile.examples.demo_dist import World, arithmetic, from_env, run_in_world
from comera_compile.examples.lm_config import METHODS, PRESETS, SHAPES, LlamaShape, PretrainConfig, preset
from comera_compile.examples.lm_train import (Schedule, batches, build_model, causal_lm_loss,
                                              decoder_params, evaluate, galore_optimizer, lr_factor, passes,
                                              total_params, train_one)
from comera_compile.examples.run_store import RunStore, fingerprint

__all__ = ["METHODS", "SHAPES", "PRESETS", "PretrainConfig", "LlamaShape", "DemoError", "preset", "lr_factor",
           "Schedule", "build_model", "causal_lm_loss", "evaluate", "batches", "train_one", "run", "decoder_params",
           "total_params", "galore_optimizer", "own_compile_cache", "warm_up_compiler"]

# --------------------------------------------------------------------------------------------------------
# The whole run
# --------------------------------------------------------------------------------------------------------
def default_out_dir() -> Path:
    return Path("runs") / ("pretrain-" + _dt.datetime.now().strftime("%Y%m%d-%H%M%S"))


# Config fields that do not change what a method's run is (where it is written, what else trains, how it is
# shown): --resume keeps a saved run whose other fields, data, device, threads and torch match.
_NOT_FINGERPRINTED = ("out", "methods", "progress", "resume")


def _model_for(method: str, cfg: PretrainConfig, vocab_size: int, device: torch.device) -> nn.Module:
    """Every method's model starts from the same seeded dense model; CoMERA's decoder linears are then
    tensorized at cfg.rank (TT cores at nn.Linear's variance, seeded), the rest kept as it is."""
    import comera_compile as cc

    model = build_model(cfg.shape(), vocab_size, cfg.seed)
    if method == "comera":
        torch.manual_seed(cfg.seed)
        model = cc.tensorize(model, rank=cfg.rank, include="model.layers.*", inplace=True)
    return model.to(device)


def run(cfg: PretrainConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole comparison: data, each method's training (dense first: the others are also evaluated at its
    final token count), and the table, PNG and JSON in cfg.out.  Under torchrun every process trains on its
    rows of every global batch (DDP); the first logs and writes."""
    cfg.check()
    if cfg.threads is not None and "WORLD_SIZE" not in os.environ:  # under torchrun, its choice stands
        torch.set_num_threads(cfg.threads)
    world = from_env(cfg.device)
    return run_in_world(cfg, world, _run, log)


def _run(cfg: PretrainConfig, world: World, log: Callable[[str], None]) -> dict[str, Any]:
    from comera_compile.examples import demo_report, lm_report
    from comera_compile.examples.lm_data import load_lm_data, tokenizer_file

    t_start = time.perf_counter()
    out = Path(cfg.out) if cfg.out is not None else default_out_dir()
    if out.exists() and not out.is_dir():
        raise DemoError(f"--out {str(out)!r} is a file; give a directory (created if missing)")
    shape = cfg.shape()
    data = load_lm_data(cfg.data, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size, tokenizer=cfg.tokenizer,
                        text_column=cfg.text_column, val_fraction=cfg.val_fraction, max_bytes=cfg.max_bytes,
                        seed=cfg.seed, max_positions=shape.max_positions)
    if data.train.shape[0] < cfg.batch:
        raise DemoError(f"the training text makes {data.train.shape[0]} blocks of {cfg.seq_len} tokens, fewer than "
                        f"one batch of {cfg.batch}; use more data (--data, --max-bytes) or a smaller --batch/--seq-len")
    if data.val.shape[0] < 1:
        raise DemoError(f"the validation text makes no full block of {cfg.seq_len} tokens; use more data")
    val = data.val
    if cfg.eval_blocks is not None and val.shape[0] > cfg.eval_blocks:
        pick = torch.randperm(val.shape[0], generator=torch.Generator().manual_seed(cfg.seed + 1))
        val = val[pick[: cfg.eval_blocks].sort().values]
    device = world.device(cfg.device)
    log(f"data: {data.source}; {data.train.shape[0]:,} training blocks ({data.train_tokens():,} tokens), "
        f"{val.shape[0]} of the {data.val.shape[0]:,} validation blocks evaluated")
    budget_passes = passes(cfg.steps, data.train.shape[0], cfg.batch) if cfg.steps is not None else 0.0
    if budget_passes > 1:
        log(f"note: {cfg.steps} steps of {cfg.batch} x {cfg.seq_len} tokens make {budget_passes:.1f} passes over "
            f"the training text: batches repeat; give more text (--data, --max-bytes) to compare on one pass")
    methods = [m for m in METHODS if m in cfg.methods]
    budget = f"{cfg.minutes:g} min" if cfg.minutes is not None else f"{cfg.steps} steps"
    where = (torch.cuda.get_device_name(device) if cfg.device == "cuda" else f"{torch.get_num_threads()} thread(s)")
    if world.size > 1:
        where += f" per process, {world.size} processes (DDP), {cfg.batch // world.size} rows each"
    if cfg.micro_batches > 1:
        where += f"; each step {cfg.micro_batches} micro-batches of {cfg.micro_batch(world.size)} rows"
    log(f"model: Llama {cfg.preset!r} {asdict(shape)}; budget {budget} per model, batch {cfg.batch} x "
        f"{cfg.seq_len}, {cfg.arithmetic()}; methods {', '.join(methods)}; {where}")
    with torch.device("meta"):  # the dense counts, whichever methods run
        dense = build_model(shape, data.vocab_size, cfg.seed)
    dense_params = {"total": total_params(dense), "decoder": decoder_params(dense)}
    del dense
    log(f"dense: {dense_params['total']:,} parameters, {dense_params['decoder']:,} in the decoder layers")
    env = demo_report.environment(world.size, device)
    # each run is also evaluated at the first method's final token count: a run kept must have been too
    tokenizer = str(tokenizer_file(cfg.tokenizer)) if cfg.tokenizer is not None else None   # the file, one spelling
    store = RunStore(out, methods, fingerprint(cfg, _NOT_FINGERPRINTED, env, paths=("data",), tokenizer=tokenizer,
                                               data_source=data.source, vocab_size=data.vocab_size,
                                               evaluated_beside=methods[0]),
                     command="pretrain", resume=cfg.resume, main=world.main, log=log)
    with store.training(), arithmetic(cfg.arithmetic(), device):
        if any(m not in store.runs for m in methods):
            warm_s = warm_up_compiler(device)
            log(f"compiler initialised in {warm_s:.1f} s, outside every budget (its one-time imports and checks); "
                f"each method then compiles in a fresh Inductor cache")
        for method in methods:
            if method in store.runs:
                continue
            # each method compiles its own graphs, inside its own budget: none reused from the method before it
            with own_compile_cache():
                model = _model_for(method, cfg, data.vocab_size, device)
                if method == "comera":
                    log(f"CoMERA: the decoder layers' {decoder_params(model):,} parameters with TT linears at rank "
                        f"{cfg.rank}")
                first = store.runs.get(methods[0])
                eval_tokens = (first["tokens"],) if first is not None else ()
                store.save(method, train_one(method, model, cfg, data.train, val, eval_tokens=eval_tokens,
                                             world=world, log=log))
                del model
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    config["out"] = str(out)
    config["warmup_steps"] = cfg.warmup()
    result: dict[str, Any] = {
        "config": config,
        "model": asdict(shape) | {"vocab_size": data.vocab_size, "seq_len": cfg.seq_len},
        "data": {"source": data.source, "documents": list(data.documents), "train_blocks": int(data.train.shape[0]),
                 "train_tokens": data.train_tokens(), "val_blocks": int(val.shape[0]),
                 "val_tokens": int(val.shape[0] * (cfg.seq_len - 1))},
        "dense_params": dense_params,
        **env,
        "runs": {m: store.runs[m] for m in methods},
        "resumed": store.kept,
    }
    return demo_report.finish(result, lm_report.summarize, world.main, out, t_start, lm_report.format_table,
                              lm_report.plot, log)
