"""TT embedding lookups: training steps against dense nn.Embedding and a naive per-row TT lookup, and the
tracked memory of training a 10M-row table.

CoMERA's word embedding (30522 x 768, TTM rows 16,20,10,10 / cols 4,4,8,6, ranks 32) on 32 x 128 token
batches drawn from a Zipf law (realistic repetition): forward + backward + AdamW step of dense
nn.Embedding, of TTEmbedding (distinct rows, planned core merging) and of the same cores looked up row by
row (no dedupe, no merged tables).  Then a 10M x 128 table (5.1 GB dense in float32) trained with AdamW:
peak tracked tensor memory of a step (comera_compile.memory.PeakMemory) and its time.

Run it: ``python -m comera_compile.benchmarks.embeddings [--quick] [--threads N]``."""

from __future__ import annotations

import math

import torch
from torch import nn

from comera_compile.embedding import TTEmbedding
from comera_compile.memory import PeakMemory

from .common import compare

__all__ = ["run", "format_rows", "naive_lookup", "zipf_batches"]


def zipf_batches(vocab: int, shape: tuple[int, ...], count: int, exponent: float = 1.1,
                 seed: int = 0) -> list[torch.Tensor]:
    """`count` index tensors whose entries follow a Zipf law over `vocab` ids (rank k has weight
    1 / k^exponent), the ranks scattered over the ids by a fixed permutation."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    out = []
    for _ in range(count):
        # inverse-CDF sampling of a continuous power law, floored: no vocab-sized weight vector needed
        u = torch.rand(n, generator=g, dtype=torch.float64)
        if exponent == 1.0:
            ranks = torch.exp(u * math.log(vocab + 1)) - 1
        else:
            a = 1.0 - exponent
            ranks = ((u * ((vocab + 1) ** a - 1)) + 1) ** (1.0 / a) - 1
        ranks = ranks.long().clamp_(0, vocab - 1)
        ids = (ranks * 2654435761 + 12345) % vocab  # a fixed scattering of ranks over ids
        out.append(ids.reshape(shape))
    return out


def naive_lookup(layer: TTEmbedding, indices: torch.Tensor) -> torch.Tensor:
    """The baseline: every index looked up on its own (batched over rows), its core slices contracted left
    to right; no dedupe of repeated indices, no merged core tables."""
    s = layer.spec
    flat = indices.reshape(-1)
    n = flat.shape[0]
    acc, cols = None, 1
    for k, core in enumerate(layer.gated_cores()):
        digit = torch.div(flat, layer._strides[k], rounding_mode="floor") % s.in_modes[k]
        sl = core.index_select(1, digit)  # (r_{k-1}, n, e_k, r_k)
        cols *= s.out_modes[k]
        if acc is None:
            acc = sl.reshape(n, cols, s.ranks[1])
        else:
            sl = sl.permute(1, 0, 2, 3).reshape(n, s.ranks[k], s.out_modes[k] * s.ranks[k + 1])
            acc = torch.bmm(acc, sl).reshape(n, cols, s.ranks[k + 1])
    return acc.reshape(n, s.out_padded)[:, : layer.embedding_dim].reshape(*indices.shape, layer.embedding_dim)


def _stepper(forward, module: nn.Module, batches: list[torch.Tensor], grad: torch.Tensor):
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=True)  # the fastest AdamW, for all
    state = {"k": 0}

    def step():
        idx = batches[state["k"] % len(batches)]
        state["k"] += 1
        opt.zero_grad(set_to_none=True)
        forward(idx).backward(grad)
        opt.step()

    return step


def _word_embedding(quick: bool, device: torch.device) -> dict:
    torch.manual_seed(0)
    vocab, dim, shape = 30522, 768, (32, 128)
    tt = TTEmbedding(vocab, dim, rank=32, row_modes=(16, 20, 10, 10), col_modes=(4, 4, 8, 6), device=device)
    naive = TTEmbedding(vocab, dim, rank=32, row_modes=(16, 20, 10, 10), col_modes=(4, 4, 8, 6), device=device)
    naive.load_state_dict(tt.state_dict())
    dense = nn.Embedding(vocab, dim, device=device)
    batches = [b.to(device) for b in zipf_batches(vocab, shape, 8)]
    grad = torch.randn(*shape, dim, device=device)
    cases = {
        "dense": _stepper(dense, dense, batches, grad),
        "tt": _stepper(tt, tt, batches, grad),
        "naive": _stepper(lambda i: naive_lookup(naive, i), naive, batches, grad),
    }
    m = compare(cases, warmup=2, repeat=5 if quick else 15, device=device)
    distinct = sum(int(torch.unique(b).numel()) for b in batches) / len(batches)
    return {
        "benchmark": "word_embedding_30522x768_r32_step", "device": device.type, "tokens": math.prod(shape),
        "distinct_per_batch": distinct, "plan": tt.plan(int(distinct)).describe(),
        "dense_ms": m["dense"].median * 1e3, "tt_ms": m["tt"].median * 1e3, "naive_ms": m["naive"].median * 1e3,
        "speedup_vs_naive": m["naive"].median / m["tt"].median,
        "speedup_vs_dense": m["dense"].median / m["tt"].median,
        "compression": dense.weight.numel() / tt.tt_params(),
    }


def _big_table(quick: bool, device: torch.device) -> dict:
    torch.manual_seed(0)
    vocab, dim, shape = 10_000_000, 128, (32, 128)
    tt = TTEmbedding(vocab, dim, rank=32, row_modes=(250, 200, 200), col_modes=(8, 4, 4), device=device)
    batches = [b.to(device) for b in zipf_batches(vocab, shape, 4, seed=1)]
    grad = torch.randn(*shape, dim, device=device)
    step = _stepper(tt, tt, batches, grad)
    peaks = []
    with PeakMemory() as mem:  # the first step creates AdamW's state: counted
        for _ in range(2 if quick else 4):
            mem.reset_peak()
            step()
            peaks.append(mem.peak)
        live_after = mem.current
    m = compare({"tt": step}, warmup=1, repeat=3 if quick else 7, device=device)
    params = sum(p.numel() * p.element_size() for p in tt.parameters())
    return {
        "benchmark": "table_10Mx128_r32_step", "device": device.type, "tokens": math.prod(shape),
        "dense_table_mb": vocab * dim * 4 / 2**20, "tt_params_mb": params / 2**20,
        "peak_step_mb": max(peaks) / 2**20, "peak_first_step_mb": peaks[0] / 2**20,
        "state_after_mb": live_after / 2**20, "step_ms": m["tt"].median * 1e3,
        "plan": tt.plan(int(torch.unique(batches[0]).numel())).describe(),
    }


def run(quick: bool = False, threads: int | None = None, device: str | torch.device = "cpu") -> list[dict]:
    """Rows of figures (medians, each baseline timed in the same run, interleaved), on `device`.

    threads: torch intra-op threads for every case, baselines included (None keeps the current setting).
    On a machine busy with other work, 1 gives steadier figures: OpenMP threads waiting for a descheduled
    peer make small ops many times slower at random, which no median repairs."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        device = torch.device(device)
        rows = [_word_embedding(quick, device), _big_table(quick, device)]
    finally:
        torch.set_num_threads(before)
    for r in rows:
        r["threads"] = threads or before
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        if r["benchmark"].startswith("word_embedding"):
            lines.append(
                f"word embedding 30522x768 r=32, {r['tokens']} Zipf tokens ({r['distinct_per_batch']:.0f} distinct), "
                f"fwd+bwd+AdamW: dense {r['dense_ms']:.1f} ms | TT {r['tt_ms']:.1f} ms | naive per-row TT "
                f"{r['naive_ms']:.1f} ms -> {r['speedup_vs_naive']:.2f}x vs naive, {r['speedup_vs_dense']:.2f}x vs "
                f"dense ({r['compression']:.0f}x fewer parameters; {r['threads']} thread(s))\n  plan: {r['plan']}")
        else:
            lines.append(
                f"table 10M x 128 r=32 (dense {r['dense_table_mb']:.0f} MB), {r['tokens']} Zipf tokens, "
                f"fwd+bwd+AdamW: peak tracked {r['peak_step_mb']:.1f} MB (first step, AdamW state created: "
                f"{r['peak_first_step_mb']:.1f} MB), parameters {r['tt_params_mb']:.1f} MB, "
                f"{r['step_ms']:.1f} ms/step\n  plan: {r['plan']}")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="TT embedding benchmarks")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (default 0: torch's own setting)")
    args = parser.parse_args()
    print(format_rows(run(quick=args.quick, threads=args.threads or None)))
