"""comera-compile: tensor-train compressed, rank-adaptive training (CoMERA) as a torch.compile pass.

Public API only; see README.md for a quick start.  Names are imported on first use (PEP 562), so
``import comera_compile`` costs little beyond torch, and importing the formats (``comera_compile.tt``) does
not import the compiler.  The "comera" backend is found by torch.compile through the package's
torch_dynamo_backends entry point; from a source tree that is not installed, importing the package
registers it (and then imports the backend).  Importing the package registers its log names with
torch._logging (comera_compile.logs).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "TTSpec": "comera_compile.tt",
    "make_spec": "comera_compile.tt",
    "TTLinear": "comera_compile.layers",
    "TTEmbedding": "comera_compile.embedding",
    "TTEmbeddingBag": "comera_compile.embedding",
    "tensorize": "comera_compile.passes.module.tensorize",
    "densify": "comera_compile.passes.module.tensorize",
    "LayerShape": "comera_compile.passes.module.tensorize",
    "TensorizeSummary": "comera_compile.passes.module.tensorize",
    "TensorizeError": "comera_compile.passes.module.tensorize",
    "PRESETS": "comera_compile.passes.module.tensorize",
    "save_pretrained": "comera_compile.checkpoint",
    "from_pretrained": "comera_compile.checkpoint",
    "save_checkpoint": "comera_compile.distributed",
    "load_checkpoint": "comera_compile.distributed",
    "explain": "comera_compile.report",
    "Explanation": "comera_compile.report",
    "comera_backend": "comera_compile.backend",
    "compile_step": "comera_compile.step",
    "repeated_blocks": "comera_compile.regional",
    "compile_block": "comera_compile.regional",
    "compile_blocks": "comera_compile.regional",
    "RanEagerlyWarning": "comera_compile.compiled_region",
    "rewritten_graphs": "comera_compile.backend",
    "GraphReport": "comera_compile.logs",
    "profile": "comera_compile.profiling",
    "LayerProfile": "comera_compile.profiling",
    "breakdown": "comera_compile.step_time",
    "StepBreakdown": "comera_compile.step_time",
    "count_flops": "comera_compile.step_time",
    "matmul_peak": "comera_compile.step_time",
    "RankAdaptive": "comera_compile.rank_adaptive",
    "param_groups": "comera_compile.optim",
    "tempo": "comera_compile.passes.module.tempo",
    "saved_bytes": "comera_compile.memory",
    "peak_bytes": "comera_compile.memory",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'comera_compile' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from comera_compile.backend import comera_backend, rewritten_graphs
    from comera_compile.step import compile_step
    from comera_compile.regional import compile_block, compile_blocks, repeated_blocks
    from comera_compile.compiled_region import RanEagerlyWarning
    from comera_compile.logs import GraphReport
    from comera_compile.profiling import LayerProfile, profile
    from comera_compile.step_time import StepBreakdown, breakdown, count_flops, matmul_peak
    from comera_compile.checkpoint import from_pretrained, save_pretrained
    from comera_compile.distributed import load_checkpoint, save_checkpoint
    from comera_compile.embedding import TTEmbedding, TTEmbeddingBag
    from comera_compile.layers import TTLinear
    from comera_compile.memory import peak_bytes, saved_bytes
    from comera_compile.passes.module.tempo import tempo
    from comera_compile.passes.module.tensorize import (PRESETS, LayerShape, TensorizeError, TensorizeSummary,
                                                        densify, tensorize)
    from comera_compile.optim import param_groups
    from comera_compile.rank_adaptive import RankAdaptive
    from comera_compile.report import Explanation, explain
    from comera_compile.tt import TTSpec, make_spec
else:
    from importlib.metadata import entry_points as _entry_points

    if not _entry_points(group="torch_dynamo_backends", name="comera"):   # a source tree, not installed
        from comera_compile.backend import register as _register_backend

        _register_backend()
    # The "comera" log and "comera_graphs" artifact, for torch._logging.set_logs (comera_compile.logs).
    from comera_compile.logs import register as _register_logs

    _register_logs()
