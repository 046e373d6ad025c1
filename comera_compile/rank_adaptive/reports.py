"""RankAdaptive's reports: active and allocated ranks, the TT size, the compression against the dense model,
and a printable summary."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["Reports"]


class Reports:
    """Report methods of RankAdaptive, read from its allocation (``_alloc``), layers and counters."""

    layers: dict[str, Any]
    model: nn.Module
    dense_params: int
    steps: int
    stage: str
    cuts: int
    _alloc: Any

    def ranks(self) -> dict[str, tuple[int, ...]]:
        """Active ranks per layer (boundary 1s included)."""
        return dict(self._alloc.ranks)

    def allocated_ranks(self) -> dict[str, tuple[int, ...]]:
        """Ranks the cores are allocated at (>= the active ranks until the next re-allocation)."""
        return {name: layer.spec.ranks for name, layer in self.layers.items()}

    def size(self) -> int:
        """S(g): sum over layers and cores of size_k * nnz(g_{k-1}) * nnz(g_k)."""
        return self._alloc.size

    def model_params(self) -> int:
        """Parameters of the whole model as it is allocated now."""
        return sum(p.numel() for p in self.model.parameters())

    def compression(self) -> float:
        """Dense parameter count of the model over its current active parameter count."""
        active = self.model_params() - sum(m.spec.core_params() for m in self.layers.values()) + self.size()
        return self.dense_params / max(active, 1)

    def report(self) -> str:
        lines = [f"step {self.steps} ({self.stage} stage), {self.cuts} cuts; TT size {self.size():,} "
                 f"(active), model {self.model_params():,} parameters allocated "
                 f"({self.model_params() * 4 / 2**20:.2f} MiB in float32), {self.compression():.1f}x vs dense"]
        alloc = self.allocated_ranks()
        for name, r in self.ranks().items():
            lines.append(f"  {name}: ranks {','.join(map(str, r))} active / {','.join(map(str, alloc[name]))}")
        return "\n".join(lines)
