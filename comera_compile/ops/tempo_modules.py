"""nn.Module faces of the Tempo ops, and the adapters graph nodes call to read a module's p and
train/eval flag at run time."""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from comera_compile.ops.attention import softmax_dropout_matmul
from comera_compile.ops.bit_dropout import dropout
from comera_compile.ops.gelu import gelu, gelu_dropout
from comera_compile.ops.layer_norm import layer_norm

__all__ = ["TempoGELU", "TempoLayerNorm", "TempoDropout", "TEMPO_MODULES", "module_dropout", "module_gelu_dropout",
           "module_attention"]


# ---------------------------------------------------------------------------------------------------------
# Modules


class TempoGELU(nn.GELU):
    """nn.GELU keeping its output (and a bit per element) for backward instead of its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu(x, self.approximate)


class TempoLayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose backward works from its output and per-row statistics."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class TempoDropout(nn.Dropout):
    """nn.Dropout keeping its mask as bits for backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inplace:
            return F.dropout(x, self.p, self.training, inplace=True)
        return dropout(x, self.p, self.training)


# ---------------------------------------------------------------------------------------------------------
# Graph adapters: nodes replacing call_module nodes read p and training from the module at run time


def module_dropout(x: torch.Tensor, module: nn.Dropout) -> torch.Tensor:
    """dropout with the p and training flag of an nn.Dropout (graph target for call_module dropouts)."""
    return dropout(x, module.p, module.training)


def module_gelu_dropout(x: torch.Tensor, approximate: str, module: nn.Dropout) -> torch.Tensor:
    """gelu_dropout with the p and training flag of an nn.Dropout."""
    return gelu_dropout(x, module.p, module.training, approximate)


def module_attention(scores: torch.Tensor, v: torch.Tensor, dim: int, module: nn.Dropout) -> torch.Tensor:
    """softmax_dropout_matmul with the p and training flag of an nn.Dropout."""
    return softmax_dropout_matmul(scores, v, module.p, module.training, dim)


TEMPO_MODULES = (TempoGELU, TempoLayerNorm, TempoDropout)
