"""explain(model): what the TT rewrite did to each layer, as a table and as data."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import nn

from .embedding import TTEmbedding
from .layers import DEFAULT_TAU, TTLayer

__all__ = ["explain", "Explanation", "LayerRow"]


@dataclass
class LayerRow:
    """One TT layer: its shapes, ranks, sizes and costs."""

    name: str
    kind: str
    dense_shape: tuple[int, int]
    in_modes: tuple[int, ...]
    out_modes: tuple[int, ...]
    padded_shape: tuple[int, int]
    ranks_active: tuple[int, ...]
    ranks_allocated: tuple[int, ...]
    dense_params: int
    tt_params: int
    flops_per_row: float
    dense_flops_per_row: int
    contraction: tuple[str, ...]

    @property
    def compression(self) -> float:
        return self.dense_params / max(self.tt_params, 1)

    @property
    def padded(self) -> bool:
        return self.padded_shape != self.dense_shape


@dataclass
class Explanation:
    """Rows for every TT layer plus model totals.  ``str()`` is a readable table; ``to_dict()`` the data."""

    rows: list[LayerRow]
    total_params: int
    dense_total_params: int
    kept_dense: dict[str, str]
    rows_for_flops: int

    @property
    def compression(self) -> float:
        return self.dense_total_params / max(self.total_params, 1)

    def to_dict(self) -> dict:
        return {
            "layers": [dict(asdict(r), compression=r.compression) for r in self.rows],
            "total_params": self.total_params,
            "dense_total_params": self.dense_total_params,
            "compression": self.compression,
            "kept_dense": dict(self.kept_dense),
            "rows_for_flops": self.rows_for_flops,
        }

    def __str__(self) -> str:
        head = ("layer", "kind", "dense shape", "modes (in / out)", "ranks active/allocated", "dense params",
                "TT params", "compr.", "FLOPs/row TT", "dense")
        body = []
        for r in self.rows:
            modes = f"{'x'.join(map(str, r.in_modes))} / {'x'.join(map(str, r.out_modes))}"
            if r.padded:
                modes += f" (pad {r.dense_shape[0]}x{r.dense_shape[1]}->{r.padded_shape[0]}x{r.padded_shape[1]})"
            ranks = (",".join(map(str, r.ranks_active)) if r.ranks_active == r.ranks_allocated else
                     f"{','.join(map(str, r.ranks_active))} / {','.join(map(str, r.ranks_allocated))}")
            body.append((r.name, r.kind, f"{r.dense_shape[0]}x{r.dense_shape[1]}", modes, ranks,
                         f"{r.dense_params:,}", f"{r.tt_params:,}", f"{r.compression:.1f}x",
                         _si(r.flops_per_row), _si(r.dense_flops_per_row)))
        widths = [max(len(str(x)) for x in col) for col in zip(head, *body)] if body else [len(h) for h in head]
        line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
        out = [line(head), line(["-" * w for w in widths])] + [line(b) for b in body]
        tt_dense = sum(r.dense_params for r in self.rows)
        tt_now = sum(r.tt_params for r in self.rows)
        out.append("")
        out.append(f"TT layers: {len(self.rows)}, {tt_dense:,} -> {tt_now:,} parameters "
                   f"({tt_dense / max(tt_now, 1):.1f}x); FLOPs per row at {self.rows_for_flops} rows")
        out.append(f"model: {self.dense_total_params:,} parameters dense -> {self.total_params:,} "
                   f"({self.compression:.1f}x smaller)")
        if self.kept_dense:
            out.append("kept dense: " + "; ".join(f"{n} ({why})" for n, why in self.kept_dense.items()))
        return "\n".join(out)


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def explain(model: nn.Module, rows: int = 1024, tau: float = DEFAULT_TAU) -> Explanation:
    """Per TT layer: qualified name, kind, dense shape, modes (and padding), ranks (active / allocated),
    dense vs TT parameters, compression, forward FLOPs per row at `rows` rows of the order a training
    forward runs (listed beside them); and totals for the whole model.  Gates with |g| < tau count as
    switched off."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"explain: rows must be a positive integer (the row count FLOPs are reported for), "
                         f"got {rows!r}")
    table: list[LayerRow] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, TTLayer):
            continue
        s = mod.spec
        kind = type(mod).__name__
        plan = None if isinstance(mod, TTEmbedding) else mod.plan(rows)   # training's forward: the order listed
        contraction = () if plan is None else plan.equations
        table.append(LayerRow(
            name=name, kind=kind, dense_shape=(s.in_features, s.out_features), in_modes=s.in_modes,
            out_modes=s.out_modes, padded_shape=(s.in_padded, s.out_padded),
            ranks_active=mod.active_ranks(tau), ranks_allocated=s.ranks, dense_params=s.dense_params(),
            tt_params=s.num_params(), flops_per_row=(mod.flops(rows) if plan is None else plan.flops) / rows,
            dense_flops_per_row=0 if isinstance(mod, TTEmbedding) else 2 * s.in_features * s.out_features,
            contraction=contraction))
    total = sum(p.numel() for p in model.parameters())
    dense_total = total + sum(r.dense_params - r.tt_params for r in table)
    # A TT layer that stands in for a dense layer with a bias keeps the bias: counted in both totals.
    summary = getattr(model, "comera_summary", None)
    kept = dict(summary.kept_dense) if summary is not None else {}
    return Explanation(table, total, dense_total, kept, rows)


def times_faster(ratio: float, digits: int = 1) -> str:
    """A speed ratio (old time / new time) in words: "2.3x faster", or "1.4x slower" below 1."""
    return f"{ratio:.{digits}f}x faster" if ratio >= 1 else f"{1 / ratio:.{digits}f}x slower"

