"""A DLRM-style click model trained dense and tensorized on synthetic click data from a hidden teacher.

The model (Naumov et al.'s DLRM, small): a bottom MLP on 13 dense features, several embedding tables with
power-law vocabulary sizes (1e3 .. 1e7 rows) read as nn.EmbeddingBag sums of multi-hot bags, pairwise
dot-product interaction of all the vectors, a top MLP to one logit.  The data: category ids drawn from Zipf
laws (scattered over the id space, as hashed ids are), labels drawn from a hidden teacher whose logit mixes
the dense features, a pseudo-random latent vector per category id and their pairwise products, so popular
ids carry a signal both models can learn.

Both models train in one loop, a dense step then a tensorized step, so their step times are measured under
the same machine load.  The dense model is trained as recommendation models are: sparse embedding gradients
with torch.optim.SparseAdam (no step over untouched rows), AdamW for the MLPs; the tensorized one with
AdamW on everything (its tables are a few hundred thousand parameters).

Peak memory = parameters + optimizer state + the peak of the tensors a training step creates (counted by
comera_compile.memory.PeakMemory), i.e. what training needs beyond the interpreter.

Run it: ``python -m comera_compile.examples.dlrm [--steps N] [--batch B] [--seed S] [--quick]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from comera_compile.embedding import TTEmbeddingBag
from comera_compile.memory import PeakMemory, storage_key
from comera_compile.passes.module.tensorize import LayerShape, tensorize
from comera_compile.tt import balanced_factors, choose_modes

__all__ = ["DLRM", "Teacher", "table_sizes", "make_batch", "auc", "run", "main"]

DENSE_FEATURES = 13
TT_MIN_ROWS = 10_000  # smaller tables stay dense: their TT form would not be much smaller


def table_sizes(count: int, smallest: int = 1_000, largest: int = 10_000_000) -> list[int]:
    """`count` vocabulary sizes spaced evenly in log scale from smallest to largest (a power law)."""
    if count == 1:
        return [largest]
    return [round(math.exp(math.log(smallest) + k * (math.log(largest) - math.log(smallest)) / (count - 1)))
            for k in range(count)]


class DLRM(nn.Module):
    """Bottom MLP on the dense features, one nn.EmbeddingBag (sum) per categorical feature, dot-product
    interaction of every pair of vectors, top MLP to a click logit."""

    def __init__(self, sizes: Sequence[int], dim: int = 16, bottom: Sequence[int] = (64,),
                 top: Sequence[int] = (64, 32)) -> None:
        super().__init__()
        layers, width = [], DENSE_FEATURES
        for h in (*bottom, dim):
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.bottom = nn.Sequential(*layers)
        self.tables = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum") for n in sizes)
        with torch.no_grad():
            for t in self.tables:
                t.weight.normal_(0, 0.1)
        vectors = len(sizes) + 1
        layers, width = [], dim + vectors * (vectors - 1) // 2
        for h in top:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.top = nn.Sequential(*layers)
        self.register_buffer("_pairs", torch.triu_indices(vectors, vectors, offset=1), persistent=False)

    def forward(self, dense: torch.Tensor, ids: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
        x = self.bottom(dense)
        vecs = torch.stack([x] + [t(i, o) for t, i, o in zip(self.tables, ids, offsets)], dim=1)
        z = torch.bmm(vecs, vecs.transpose(1, 2))[:, self._pairs[0], self._pairs[1]]
        return self.top(torch.cat([x, z], dim=1)).squeeze(1)


def _pseudo_random(ids: torch.Tensor, salt: int, k: int) -> torch.Tensor:
    """A fixed pseudo-random N(0,1)-like vector of length k per id, computed from the id alone (no table)."""
    h = ids.unsqueeze(1) * 2654435761 + (torch.arange(k) * 40503 + salt * 9973)
    h = (h ^ (h >> 13)) * 1274126177 % 2_147_483_647
    u = (h.double() + 0.5) / 2_147_483_647
    return math.sqrt(3.0) * (2 * u - 1)  # uniform with unit variance


class Teacher:
    """The hidden click model: a logit from the dense features (a random tanh layer), a pseudo-random
    latent vector per category id (k-dimensional, per table) through a fixed readout, and the pairwise
    products of the latents of different tables."""

    def __init__(self, sizes: Sequence[int], seed: int, k: int = 4, zipf: float = 1.1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.sizes, self.k, self.zipf = list(sizes), k, zipf
        self.w_in = torch.randn(DENSE_FEATURES, 8, generator=g, dtype=torch.float64) / math.sqrt(DENSE_FEATURES)
        self.w_out = torch.randn(8, generator=g, dtype=torch.float64)
        self.readout = torch.randn(len(sizes), k, generator=g, dtype=torch.float64) * 0.6
        self.cross = torch.randn(len(sizes), len(sizes), generator=g, dtype=torch.float64) * 0.25
        self.bias = -1.0

    def ids(self, size: int, n: int, g: torch.Generator) -> torch.Tensor:
        """n ids of a table: Zipf ranks (inverse-CDF of a power law) scattered over the ids by a bijection."""
        u = torch.rand(n, generator=g, dtype=torch.float64)
        a = 1.0 - self.zipf
        ranks = (((u * ((size + 1) ** a - 1)) + 1) ** (1.0 / a) - 1).long().clamp_(0, size - 1)
        return (ranks * 2654435761 + 12345) % size if math.gcd(2654435761, size) == 1 else ranks

    def logit(self, dense: torch.Tensor, ids: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
        out = torch.tanh(dense.double() @ self.w_in) @ self.w_out + self.bias
        latents = []
        for t, (i, o) in enumerate(zip(ids, offsets)):
            z = F.embedding_bag(torch.arange(i.numel()), _pseudo_random(i, t, self.k), o, mode="mean")
            latents.append(z)
            out = out + z @ self.readout[t]
        for s in range(len(latents)):
            for t in range(s + 1, len(latents)):
                out = out + self.cross[s, t] * (latents[s] * latents[t]).sum(1)
        return out


def make_batch(teacher: Teacher, n: int, g: torch.Generator, max_bag: int = 3):
    """n samples: dense features, per table a 1-D id tensor with offsets (bags of 1..max_bag ids), labels."""
    dense = torch.randn(n, DENSE_FEATURES, generator=g)
    ids, offsets = [], []
    for size in teacher.sizes:
        counts = torch.randint(1, max_bag + 1, (n,), generator=g)
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)[:-1]]))
        ids.append(teacher.ids(size, int(counts.sum()), g))
    p = torch.sigmoid(teacher.logit(dense, ids, offsets))
    labels = torch.bernoulli(p, generator=g).float()
    return dense, ids, offsets, labels, p


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (the Mann-Whitney statistic, tied scores counted half)."""
    scores, labels = scores.double().flatten(), labels.flatten() > 0.5
    pos, neg = int(labels.sum()), int((~labels).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = torch.argsort(scores)
    s = scores[order]
    ranks = torch.empty_like(s)
    ranks[order] = torch.arange(1, len(s) + 1, dtype=torch.float64)
    # average the ranks of tied scores
    uniq, inverse, counts = torch.unique(s, return_inverse=True, return_counts=True)
    if len(uniq) < len(s):
        mean_rank = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, ranks[order])
        ranks[order] = (mean_rank / counts)[inverse]
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def _tt_shapes(model: DLRM, rank: int) -> dict[str, LayerShape]:
    dim = model.tables[0].embedding_dim
    cols = tuple(balanced_factors(dim, 3))
    return {f"tables.{k}": LayerShape(choose_modes(t.num_embeddings, 3), cols, rank)
            for k, t in enumerate(model.tables) if t.num_embeddings >= TT_MIN_ROWS}


def _bytes(tensors) -> int:
    seen: dict = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            key, n = storage_key(t)
            seen[key] = n
    return sum(seen.values())


def _state_bytes(opts) -> int:
    return _bytes(v for o in opts for st in o.state.values() for v in st.values())


def run(steps: int = 400, batch: int = 1024, seed: int = 0, quick: bool = False, tables: int = 8,
        dim: int = 16, rank: int = 16, largest: int = 10_000_000, smallest: int = 1_000, lr: float = 3e-3,
        eval_samples: int = 50_000, progress: bool = True, threads: int | None = None,
        tt_lr: float | None = 1e-2) -> dict:
    """Train the dense and the tensorized DLRM for the same steps on the same batches; every figure in a
    dict: compression, peak memory, median step times, held-out log-loss and AUC (and the teacher's).

    threads: torch intra-op threads while running (None keeps the current setting); both models run with
    the same setting.  On a busy machine 1 is steadier: every op of these models is small, and OpenMP
    threads waiting for a descheduled peer make small ops many times slower.  lr: learning rate of the dense tables
    (SparseAdam); tt_lr: of the TT cores (None: lr), higher, as CoMERA gives cores a higher rate."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(steps, batch, seed, quick, tables, dim, rank, largest, smallest, lr,
                    lr if tt_lr is None else tt_lr, eval_samples, progress)
    finally:
        torch.set_num_threads(before)


def _run(steps: int, batch: int, seed: int, quick: bool, tables: int, dim: int, rank: int, largest: int,
         smallest: int, lr: float, tt_lr: float, eval_samples: int, progress: bool) -> dict:
    if quick:
        steps, batch, tables, largest, eval_samples = min(steps, 120), min(batch, 512), min(tables, 5), \
            min(largest, 1_000_000), min(eval_samples, 20_000)
    sizes = table_sizes(tables, smallest, largest)
    teacher = Teacher(sizes, seed + 1)
    torch.manual_seed(seed)
    dense = DLRM(sizes, dim)
    for t in dense.tables:
        t.sparse = True
    torch.manual_seed(seed)  # the same MLPs and small tables; the large tables become TT below
    tt = DLRM(sizes, dim)
    shapes = _tt_shapes(tt, rank)
    tt = tensorize(tt, shapes=shapes, include=list(shapes), inplace=True, trace=False)
    for t in tt.tables:
        if isinstance(t, TTEmbeddingBag):  # a fresh random init with nn.EmbeddingBag's scale of this model
            with torch.no_grad():
                t.cores[0].mul_(0.1)

    dense_tables = [p for t in dense.tables for p in t.parameters()]
    dense_mlp = [p for n, p in dense.named_parameters() if not n.startswith("tables.")]
    dense_opts = [torch.optim.SparseAdam(dense_tables, lr=lr), torch.optim.AdamW(dense_mlp, lr=1e-3, fused=True)]
    tt_tables = [p for t in tt.tables for p in t.parameters()]
    tt_mlp = [p for n, p in tt.named_parameters() if not n.startswith("tables.")]
    tt_opts = [torch.optim.AdamW(tt_tables, lr=tt_lr, weight_decay=0.0, fused=True),
               torch.optim.AdamW(tt_mlp, lr=1e-3, fused=True)]

    def train_step(model, opts, data):
        dense_x, ids, offs, labels = data
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss = F.binary_cross_entropy_with_logits(model(dense_x, ids, offs), labels)
        loss.backward()
        for o in opts:
            o.step()
        return float(loss.detach())

    g = torch.Generator().manual_seed(seed + 2)
    times: dict[str, list[float]] = {"dense": [], "tt": []}
    peaks: dict[str, int] = {}
    state: dict[str, int] = {}
    losses = {"dense": 0.0, "tt": 0.0}
    bar = range(steps)
    if progress:
        from tqdm import tqdm

        bar = tqdm(bar, desc="DLRM dense | TT", unit="step")
    for step in bar:
        dense_x, ids, offs, labels, _ = make_batch(teacher, batch, g)
        data = (dense_x, ids, offs, labels)
        for name, model, opts in (("dense", dense, dense_opts), ("tt", tt, tt_opts)):
            if step == 2:  # optimizer state exists by now: measure one step's own tensors
                with PeakMemory() as mem:
                    losses[name] = train_step(model, opts, data)
                peaks[name] = mem.peak
                state[name] = _state_bytes(opts)
                continue
            t0 = time.perf_counter()
            loss = train_step(model, opts, data)
            times[name].append(time.perf_counter() - t0)
            losses[name] = 0.95 * losses[name] + 0.05 * loss if step else loss
        if progress:
            bar.set_postfix(loss_dense=f"{losses['dense']:.3f}", loss_tt=f"{losses['tt']:.3f}")

    eval_g = torch.Generator().manual_seed(seed + 3)
    results = {"steps": steps, "batch": batch, "tables": sizes, "dim": dim, "rank": rank}
    with torch.no_grad():
        scores = {"dense": [], "tt": []}
        labels_all, p_all = [], []
        for start in range(0, eval_samples, 4096):
            dense_x, ids, offs, labels, p = make_batch(teacher, min(4096, eval_samples - start), eval_g)
            labels_all.append(labels)
            p_all.append(p)
            for name, model in (("dense", dense), ("tt", tt)):
                scores[name].append(model(dense_x, ids, offs))
        labels = torch.cat(labels_all)
        p = torch.cat(p_all)
        for name in scores:
            logits = torch.cat(scores[name])
            results[f"{name}_logloss"] = float(F.binary_cross_entropy_with_logits(logits, labels))
            results[f"{name}_auc"] = auc(logits, labels)
        results["teacher_auc"] = auc(p, labels)
        results["teacher_logloss"] = float(F.binary_cross_entropy(p.float(), labels))
    emb_dense = sum(t.weight.numel() for t in dense.tables)
    emb_tt = sum(p.numel() for p in tt_tables)
    for name, model in (("dense", dense), ("tt", tt)):
        params = _bytes(model.parameters())
        results[f"{name}_param_mb"] = params / 2**20
        results[f"{name}_optimizer_state_mb"] = state[name] / 2**20
        results[f"{name}_step_peak_mb"] = peaks[name] / 2**20
        results[f"{name}_peak_mb"] = (params + state[name] + peaks[name]) / 2**20
        results[f"{name}_step_ms"] = statistics.median(times[name][3:] or times[name]) * 1e3
    results.update(
        embedding_params_dense=emb_dense, embedding_params_tt=emb_tt, compression=emb_dense / emb_tt,
        peak_memory_ratio=results["dense_peak_mb"] / results["tt_peak_mb"],
        step_time_ratio=results["dense_step_ms"] / results["tt_step_ms"],
        auc_gap=results["dense_auc"] - results["tt_auc"],
        tt_tables=[k for k, t in enumerate(tt.tables) if isinstance(t, TTEmbeddingBag)],
    )
    return results


def format_results(r: dict) -> str:
    """A short report of run()'s figures."""
    tables = ", ".join(f"{n:.0e}" for n in r["tables"])
    return "\n".join([
        f"DLRM, {len(r['tables'])} tables ({tables} rows) x {r['dim']}, TT rank {r['rank']} on tables "
        f"{r['tt_tables']}, {r['steps']} steps of {r['batch']}",
        f"embedding parameters: dense {r['embedding_params_dense']:,} | TT {r['embedding_params_tt']:,} "
        f"-> {r['compression']:.0f}x fewer",
        f"peak memory (params + optimizer state + step peak): dense {r['dense_peak_mb']:.1f} MB "
        f"({r['dense_param_mb']:.1f} + {r['dense_optimizer_state_mb']:.1f} + {r['dense_step_peak_mb']:.1f}) | "
        f"TT {r['tt_peak_mb']:.1f} MB ({r['tt_param_mb']:.1f} + {r['tt_optimizer_state_mb']:.1f} + "
        f"{r['tt_step_peak_mb']:.1f}) -> {r['peak_memory_ratio']:.1f}x lower",
        f"step time (median): dense {r['dense_step_ms']:.1f} ms | TT {r['tt_step_ms']:.1f} ms "
        f"({r['step_time_ratio']:.2f}x)",
        f"held-out log-loss: dense {r['dense_logloss']:.4f} | TT {r['tt_logloss']:.4f} | teacher "
        f"{r['teacher_logloss']:.4f}",
        f"held-out AUC: dense {r['dense_auc']:.4f} | TT {r['tt_auc']:.4f} (gap {r['auc_gap']:+.4f}) | teacher "
        f"{r['teacher_auc']:.4f}",
    ])


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="tables up to 1e6 rows, 120 steps of 512 (about 10 s)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (default 0: torch's own setting)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    r = run(steps=args.steps, batch=args.batch, seed=args.seed, quick=args.quick, tables=args.tables,
            dim=args.dim, rank=args.rank, progress=not args.no_progress, threads=args.threads or None)
    print(format_results(r))
    return r


if __name__ == "__main__":
    main()
