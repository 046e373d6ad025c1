"""comera-compile: tensor-train compressed, rank-adaptive training (CoMERA) as a torch.compile pass.

Public API only; see README.md for a quick start.
"""

from comera_compile.backend import comera_backend, compile_step, register as _register_backend
from comera_compile.checkpoint import from_pretrained, save_pretrained
from comera_compile.layers import TTEmbedding, TTEmbeddingBag, TTLinear
from comera_compile.memory import peak_bytes, saved_bytes
from comera_compile.passes.memory import tempo
from comera_compile.rank_adaptive import RankAdaptive, param_groups
from comera_compile.passes.tensorize import (PRESETS, LayerShape, TensorizeError, TensorizeSummary, densify,
                                             tensorize)
from comera_compile.report import Explanation, explain
from comera_compile.tt import TTSpec, make_spec

__version__ = "0.1.0"

_register_backend()

__all__ = [
    "TTLinear",
    "TTEmbedding",
    "TTEmbeddingBag",
    "TTSpec",
    "make_spec",
    "tensorize",
    "densify",
    "save_pretrained",
    "from_pretrained",
    "LayerShape",
    "TensorizeSummary",
    "TensorizeError",
    "PRESETS",
    "explain",
    "Explanation",
    "comera_backend",
    "compile_step",
    "RankAdaptive",
    "param_groups",
    "tempo",
    "saved_bytes",
    "peak_bytes",
]
