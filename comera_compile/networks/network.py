"""Tensor networks: tensors with named indices, and the networks the layers contract.

A network is the input to every planner in this package: the tensors (each index one letter), the size of
every index, the output's indices and which index counts rows.  TT linear maps, TTM embedding lookups and
plain einsum expressions build their networks here, so the search, the cost model and the executor all
see one description.
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Mapping, Sequence, Tuple, Union

from ..tt import TTSpec

__all__ = ["TensorSpec", "Network", "Tree", "tt_linear_network", "ttm_embedding_network", "einsum_network",
           "pairwise_flops"]

_LETTERS = string.ascii_letters

# A contraction tree: a tensor's position in the network, or a pair of subtrees contracted together.
Tree = Union[int, Tuple["Tree", "Tree"]]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a network: its indices, whether it needs a gradient, whether it depends on the rows."""

    name: str
    indices: str
    requires_grad: bool = True
    per_row: bool = False


@dataclass(frozen=True)
class Network:
    """Tensors with named indices (one letter each), the size of every index and the output's indices."""

    tensors: tuple[TensorSpec, ...]
    sizes: tuple[tuple[str, int], ...]
    output: str
    rows_index: str = ""  # the index that counts rows, if any: executed with the actual row count

    @property
    def size_of(self) -> dict[str, int]:
        return dict(self.sizes)

    @cached_property
    def input_position(self) -> int | None:
        """The position of the network's input: the one tensor holding the row index (None when no tensor or
        several do, as in a lookup, whose rows index is a hyperedge)."""
        holders = [k for k, t in enumerate(self.tensors) if self.rows_index and self.rows_index in t.indices]
        return holders[0] if len(holders) == 1 else None

    def needed_outside(self, members: frozenset[int]) -> set[str]:
        """The indices an intermediate of the tensors at positions `members` must keep: the output's and
        those of every tensor outside it."""
        keep = set(self.output)
        for i, t in enumerate(self.tensors):
            if i not in members:
                keep.update(t.indices)
        return keep


def pairwise_flops(a: str, b: str, out: str, sizes: dict[str, int]) -> int:
    """FLOPs of contracting two tensors: 2 per multiply-add when an index is summed, else 1 per product."""
    involved = set(a) | set(b)
    n = math.prod(sizes[i] for i in involved)
    return 2 * n if involved - set(out) else n


def tt_linear_network(spec: TTSpec, rows: int, input_requires_grad: bool = True) -> Network:
    """X[b, i_1..i_d] and the 2d cores of a TT linear map; output Y[b, j_1..j_d].

    Boundary ranks (always 1) are dropped, so the first core is (i_1, a_1) and the last (a_{2d-1}, j_d)."""
    d_in = len(spec.in_modes)
    n = d_in + len(spec.out_modes)
    letters = iter(_LETTERS)
    batch = next(letters)
    phys = [next(letters) for _ in range(n)]
    bonds = [next(letters) for _ in range(n - 1)]
    sizes = {batch: rows}
    sizes.update(zip(phys, spec.in_modes + spec.out_modes))
    sizes.update(zip(bonds, spec.ranks[1:-1]))
    tensors = [TensorSpec("x", batch + "".join(phys[:d_in]), input_requires_grad, per_row=True)]
    for k in range(n):
        idx = (bonds[k - 1] if k > 0 else "") + phys[k] + (bonds[k] if k < n - 1 else "")
        tensors.append(TensorSpec(f"core{k}", idx))
    return Network(tuple(tensors), tuple(sizes.items()), batch + "".join(phys[d_in:]), batch)


def ttm_embedding_network(spec: TTSpec, rows: int) -> Network:
    """The gathered core slices S_k[b, a_{k-1}, e_k, a_k] of `rows` TTM lookups; output E[b, e_1..e_d].

    The row index b is shared by every slice (a hyperedge): each lookup contracts its own chain."""
    d = len(spec.in_modes)
    letters = iter(_LETTERS)
    batch = next(letters)
    cols = [next(letters) for _ in range(d)]
    bonds = [next(letters) for _ in range(d - 1)]
    sizes = {batch: rows}
    sizes.update(zip(cols, spec.out_modes))
    sizes.update(zip(bonds, spec.ranks[1:-1]))
    tensors = []
    for k in range(d):
        idx = batch + (bonds[k - 1] if k > 0 else "") + cols[k] + (bonds[k] if k < d - 1 else "")
        tensors.append(TensorSpec(f"slice{k}", idx, per_row=True))
    return Network(tuple(tensors), tuple(sizes.items()), batch + "".join(cols), batch)


def einsum_network(inputs: Sequence[Iterable[str]], output: Iterable[str], sizes: Mapping[str, int],
                   requires_grad: Sequence[bool] | None = None) -> Network:
    """Any einsum expression as a network: the indices of each input (any iterable of one-letter labels, as
    opt_einsum passes them), the output's, every index's size, and which inputs need a gradient (default
    all).  Costs do not depend on index order, so labels are sorted."""
    grads = [True] * len(inputs) if requires_grad is None else list(requires_grad)
    if len(grads) != len(inputs):
        raise ValueError(f"requires_grad has {len(grads)} entries for {len(inputs)} inputs")
    tensors = tuple(TensorSpec(f"t{k}", "".join(sorted(set(idx))), bool(g))
                    for k, (idx, g) in enumerate(zip(inputs, grads)))
    used = sorted(set().union(*(t.indices for t in tensors), output))
    return Network(tensors, tuple((c, int(sizes[c])) for c in used), "".join(sorted(set(output))))
