"""Tempo memory passes on a BERT-base encoder layer: eager PyTorch against the layer after tempo_graph.

The layer is the six-encoder model's (d 768, 12 heads, FFN 3072, GELU, post-LayerNorm, dropout 0.1), in
training mode, batch 8 x 128 tokens, float32, and the same weights for both.  Figures, all from one process:
- bytes saved for backward by a forward pass (comera_compile.memory.saved_bytes, parameters left out);
- peak live tensor bytes of a forward + backward (comera_compile.memory.peak_bytes: activations, gradients
  and temporaries; parameters excluded as they exist beforehand);
- the largest batch whose step peak fits a fixed activation budget -- eager's own peak at batch 8 -- found by
  measuring each candidate batch (and the same with saved bytes as the budget);
- median step time (forward, backward, AdamW step), the two variants interleaved (benchmarks.common).
The full run adds the whole six-encoder model (6 layers, embeddings, head) with tempo(model).  Both runs add
the 60M Llama of the pretrain command, dense and tensorized, and dense with bfloat16 weights, whose RMSNorms
and SiLU-gated MLPs tempo swaps (bytes saved for backward, step peak, step time).
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn

from comera_compile.examples import six_encoder
from comera_compile.memory import peak_bytes, saved_bytes
from comera_compile.passes.module.tempo import tempo

from .common import compare

__all__ = ["run", "format_rows"]

MIB = 2.0**20


def _layer_pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    eager = six_encoder.build(layers=1).layers[0]
    return eager, tempo(copy.deepcopy(eager))


def _fwd_bwd(model: nn.Module, make_input: Callable[[int], tuple]) -> Callable[[int], None]:
    def step(batch: int) -> None:
        model(*make_input(batch)).sum().backward()
        model.zero_grad(set_to_none=True)
    return step


def _largest_batch(fits: Callable[[int], bool], start: int) -> int:
    """The largest batch b >= 1 with fits(b), assuming fits is monotone (True up to some b, then False)."""
    lo, hi = 0, start
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _layer_rows(quick: bool, batch: int, seq: int) -> list[dict]:
    eager, temp = _layer_pair()

    def inputs(b: int) -> tuple:
        g = torch.Generator().manual_seed(b)
        return torch.randn(b, seq, 768, generator=g, requires_grad=True), None

    saved = {name: saved_bytes(m, *inputs(batch), exclude=m) for name, m in (("eager", eager), ("tempo", temp))}
    steps = {name: _fwd_bwd(m, inputs) for name, m in (("eager", eager), ("tempo", temp))}
    for step in steps.values():  # warm-up: the GELU tables are built once per process, on first use
        step(2)
    peaks: dict[str, dict[int, int]] = {"eager": {}, "tempo": {}}

    def peak(name: str, b: int) -> int:
        if b not in peaks[name]:
            peaks[name][b] = peak_bytes(steps[name], b)
        return peaks[name][b]

    budget = peak("eager", batch)
    best = {name: _largest_batch(lambda b, n=name: peak(n, b) <= budget, batch) for name in steps}
    saved_budget = saved["eager"]
    saved_best = {name: _largest_batch(
        lambda b, m=m: saved_bytes(m, *inputs(b), exclude=m) <= saved_budget, batch)
        for name, m in (("eager", eager), ("tempo", temp))}

    x = inputs(batch)
    timed = {}
    for name, m in (("eager", eager), ("tempo", temp)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

        def train_step(m=m, opt=opt) -> None:
            m(*x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        timed[name] = train_step
    times = compare(timed, warmup=1 if quick else 2, repeat=3 if quick else 15)
    ms = {name: t.median * 1e3 for name, t in times.items()}
    return [{
        "benchmark": f"bert_base_layer_b{batch}x{seq}", "replaced": temp.tempo_summary.counts(),
        "saved_eager_mib": saved["eager"] / MIB, "saved_tempo_mib": saved["tempo"] / MIB,
        "saved_drop_pct": 100.0 * (1.0 - saved["tempo"] / saved["eager"]),
        "peak_eager_mib": peak("eager", batch) / MIB, "peak_tempo_mib": peak("tempo", batch) / MIB,
        "budget_mib": budget / MIB, "max_batch_eager": best["eager"], "max_batch_tempo": best["tempo"],
        "batch_gain": best["tempo"] / best["eager"],
        "saved_budget_mib": saved_budget / MIB, "saved_max_batch_eager": saved_best["eager"],
        "saved_max_batch_tempo": saved_best["tempo"],
        "step_eager_ms": ms["eager"], "step_tempo_ms": ms["tempo"], "step_ratio": ms["tempo"] / ms["eager"],
        "step_samples_eager_ms": [s * 1e3 for s in times["eager"].samples],
        "step_samples_tempo_ms": [s * 1e3 for s in times["tempo"].samples],
    }]


def _pair_row(name: str, eager: nn.Module, temp: nn.Module, call: Callable[[nn.Module], torch.Tensor],
              repeat: int, peaks: bool = False) -> dict:
    """Saved bytes, optionally the step peak, and interleaved step times (fwd, bwd, AdamW; none when repeat is
    0) of a model before and after tempo, each called as call(model) (a scalar to differentiate)."""
    pair = (("eager", eager), ("tempo", temp))
    saved = {n: saved_bytes(call, m, exclude=m) for n, m in pair}
    row = {
        "benchmark": name, "replaced": temp.tempo_summary.counts(),
        "saved_eager_mib": saved["eager"] / MIB, "saved_tempo_mib": saved["tempo"] / MIB,
        "saved_drop_pct": 100.0 * (1.0 - saved["tempo"] / saved["eager"]),
    }
    if peaks:
        p = {n: peak_bytes(lambda m=m: (call(m).backward(), m.zero_grad(set_to_none=True))) for n, m in pair}
        row.update(peak_eager_mib=p["eager"] / MIB, peak_tempo_mib=p["tempo"] / MIB)
    if not repeat:
        return row
    timed = {}
    for n, m in pair:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

        def train_step(m=m, opt=opt) -> None:
            call(m).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        timed[n] = train_step
    times = compare(timed, warmup=1, repeat=repeat)
    ms = {n: t.median * 1e3 for n, t in times.items()}
    row.update(step_eager_ms=ms["eager"], step_tempo_ms=ms["tempo"], step_ratio=ms["tempo"] / ms["eager"])
    return row


def _model_rows(batch: int, seq: int) -> list[dict]:
    torch.manual_seed(0)
    eager = six_encoder.build()
    temp = tempo(copy.deepcopy(eager))
    ids, seg, mask = six_encoder.example_inputs(eager, batch=batch, seq=seq)
    return [_pair_row(f"six_encoder_model_b{batch}x{seq}", eager, temp, lambda m: m(ids, seg, mask).sum(), 7)]


def _llama_rows(quick: bool) -> list[dict]:
    """The 60M Llama of the pretrain command (8 layers; 2 when quick), dense and tensorized at its preset's
    rank, and dense in bfloat16, at batch 8 x 256 (2 x 128 when quick), vocabulary 4096: tempo swaps its
    RMSNorms and SwiGLU MLPs."""
    import dataclasses
    import warnings

    from comera_compile.examples.lm_config import PRESETS, SHAPES
    from comera_compile.examples.lm_train import build_model
    from comera_compile.passes.module.tensorize import tensorize

    shape = SHAPES["60m"] if not quick else dataclasses.replace(SHAPES["60m"], layers=2)
    batch, seq = (2, 128) if quick else (8, 256)
    ids = torch.randint(0, 4096, (batch, seq), generator=torch.Generator().manual_seed(0))
    rows = []
    for kind in ("dense", "tensorized", "dense_bf16"):
        eager = build_model(shape, 4096, seed=0)
        with warnings.catch_warnings():   # torch.fx cannot trace transformers' models: tempo's module swap
            warnings.simplefilter("ignore")
            if kind == "tensorized":
                eager = tensorize(eager, rank=PRESETS["60m"]["rank"])
            if kind == "dense_bf16":   # bfloat16 weights, as GaLore's recipe trains: the norms recompute
                eager = eager.bfloat16()
            temp = tempo(copy.deepcopy(eager))
        # bfloat16 matmuls on a CPU without bf16 units take about 100 s a step here: its bytes alone
        bf16 = kind == "dense_bf16"
        rows.append(_pair_row(f"llama_60m_{shape.layers}l_{kind}_b{batch}x{seq}", eager, temp,
                              lambda m: m(input_ids=ids, labels=ids).loss, 0 if bf16 else 3 if quick else 7,
                              peaks=not bf16))
    return rows


def run(quick: bool = False, batch: int = 8, seq: int = 128) -> list[dict]:
    """Rows of figures: the BERT-base layer (memory, largest batch in budget, step time), and the 60M Llama
    dense and tensorized (memory, step time); without quick, also the six-encoder model (saved bytes, step
    time).  quick measures the layer at half the batch, the Llama at 2 layers and batch 2 x 128."""
    rows = _layer_rows(quick, max(1, batch // 2) if quick else batch, seq)
    if not quick:
        rows += _model_rows(batch, seq)
    return rows + _llama_rows(quick)


def format_rows(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        replaced = ", ".join(f"{n} {k}" for k, n in sorted(r["replaced"].items()))
        lines.append(f"{r['benchmark']} (tempo replaced: {replaced})")
        lines.append(f"  saved for backward: eager {r['saved_eager_mib']:.1f} MiB, tempo {r['saved_tempo_mib']:.1f} "
                     f"MiB ({r['saved_drop_pct']:.1f}% less)")
        if "peak_eager_mib" in r:
            lines.append(f"  step peak (fwd+bwd): eager {r['peak_eager_mib']:.1f} MiB, tempo "
                         f"{r['peak_tempo_mib']:.1f} MiB")
        if "max_batch_eager" in r:
            lines.append(f"  largest batch with step peak <= {r['budget_mib']:.1f} MiB (eager's at the base batch): "
                         f"eager {r['max_batch_eager']}, tempo {r['max_batch_tempo']} "
                         f"({r['batch_gain']:.2f}x)")
            lines.append(f"  largest batch with saved bytes <= {r['saved_budget_mib']:.1f} MiB: eager "
                         f"{r['saved_max_batch_eager']}, tempo {r['saved_max_batch_tempo']}")
        if "step_eager_ms" in r:
            lines.append(f"  step time (fwd+bwd+AdamW, median): eager {r['step_eager_ms']:.1f} ms, tempo "
                         f"{r['step_tempo_ms']:.1f} ms (tempo/eager {r['step_ratio']:.3f})")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_rows(run()))
