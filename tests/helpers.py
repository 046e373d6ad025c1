"""Helpers shared by the test modules (imported as `helpers`: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import shlex
import textwrap
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# An int rank this large is capped at every bond's largest meaningful rank: an exact factorization (TT-SVD).
FULL = 10**9


def rel_err(got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | float | None = None) -> float:
    """norm(got - ref) / max(norm(scale or ref), tiny), computed in float64."""
    got, ref = got.detach().double(), ref.detach().double()
    if scale is None:
        denom = float(ref.norm())
    else:
        denom = float(torch.as_tensor(scale).detach().double().norm())
    return float((got - ref).norm()) / max(denom, 1e-300)


def perturb_gates(layer, generator: torch.Generator | int = 1) -> None:
    """Gates start at 1; give them values in [0.5, 1.5) (from `generator`, or a generator seeded with it)
    so gate gradients and gate placement are really tested."""
    if isinstance(generator, int):
        generator = torch.Generator().manual_seed(generator)
    with torch.no_grad():
        for g in layer.gates:
            g.copy_(0.5 + torch.rand(g.shape, generator=generator, dtype=torch.float64).to(g.dtype))


class LargestAllocation(TorchDispatchMode):
    """Records the bytes of the largest storage any aten op returns on a real (non-meta) device, and which
    op returned it (`what`)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.what = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                nbytes = t.untyped_storage().nbytes()
                if nbytes > self.largest:
                    self.largest, self.what = nbytes, f"{func} -> {tuple(t.shape)}"
        return out


def readme_block(section: str, lang: str = "bash", index: int = 0) -> str:
    """The index-th ```lang code block under `## section` in the README (before the next section)."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return body.split(f"```{lang}\n")[index + 1].split("```", 1)[0]


def readme_marked_block(marker: str) -> str:
    """The fenced python block that follows the marker comment (e.g. ``<!-- trainer-lines -->``) in the
    README, dedented (blocks inside list items are indented)."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    start = text.index("```python\n", text.index(marker)) + len("```python\n")
    return textwrap.dedent(text[start:text.index("```", start)])


def readme_commands(section: str) -> list[list[str]]:
    """The shell commands of the first bash block under `section` in the README, continuations joined,
    comments dropped."""
    block = readme_block(section)
    lines = [line.split("  #", 1)[0].strip() for line in block.replace("\\\n", " ").splitlines()]
    return [shlex.split(line) for line in lines if line and not line.startswith("#")]
