"""nn.Module faces of the Tempo ops, and the adapters graph nodes call to read a module's p and
train/eval flag at run time.  A module in eval mode runs torch's own op, as the ops do under no_grad,
torch.export and torch.compile: the saving is for an eager backward pass, and eval has none to train."""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from comera_compile.ops.attention import softmax_dropout_matmul
from comera_compile.ops.bit_dropout import dropout
from comera_compile.ops.buffers import FLOATS, HALF_FLOATS, dtype_fallback, plain_ops, traced
from comera_compile.ops.gelu import gelu, gelu_dropout, prepare_tables
from comera_compile.ops.layer_norm import layer_norm
from comera_compile.ops.rms_norm import rms_norm, rms_norm_reference, silu_mul, upcast_rms_norm

__all__ = ["TempoGELU", "TempoGELUDropout", "TempoLayerNorm", "TempoDropout", "TempoRMSNorm", "TempoUpcastRMSNorm",
           "TempoGatedMLP", "TEMPO_MODULES", "tempo_dropout",
           "module_dropout", "module_gelu", "module_gelu_dropout", "module_layer_norm", "module_attention",
           "module_rms_norm"]


def tempo_dropout(x: torch.Tensor, p: float = 0.5, training: bool = True) -> torch.Tensor:
    """bit_dropout.dropout (the mask as bits), or torch's F.dropout under torch.export and torch.compile
    (buffers.traced) and, with a warning (once), at dtypes other than float32, float64, bfloat16, float16."""
    if traced():
        return F.dropout(x, p, training)
    if training and 0.0 < p < 1.0 and x.dtype not in FLOATS + HALF_FLOATS and x.is_floating_point() \
            and not plain_ops(x):
        dtype_fallback("dropout", x.dtype)
    return dropout(x, p, training)


# ---------------------------------------------------------------------------------------------------------
# Modules


class TempoGELU(nn.GELU):
    """nn.GELU keeping its output (and a bit per element) for backward instead of its input; in eval, nn.GELU.
    Its form's tables are built with the module (prepare_tables), not in a forward torch.compile traces."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__(approximate)
        prepare_tables(approximate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return F.gelu(x, approximate=self.approximate)
        return gelu(x, self.approximate)


class TempoGELUDropout(nn.GELU):
    """nn.GELU then nn.Dropout(p) as one module (gelu_dropout: the dropout output, the mask as bits and the
    branch bits kept); in eval, nn.GELU.  Takes the place of the activation of torch's transformer layers,
    whose dropout then becomes nn.Identity."""

    def __init__(self, p: float = 0.5, approximate: str = "none") -> None:
        super().__init__(approximate)
        self.p = p
        prepare_tables(approximate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_dropout(x, self.p, self.training, self.approximate)

    def extra_repr(self) -> str:
        return f"p={self.p}, {super().extra_repr()}"


class TempoLayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose backward works from its output and per-row statistics; in eval, nn.LayerNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class TempoRMSNorm(nn.RMSNorm):
    """nn.RMSNorm whose backward works from its output and per-row 1/rms; in eval, nn.RMSNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return rms_norm(x, len(self.normalized_shape), self.weight, eps)


class TempoUpcastRMSNorm(nn.Module):
    """The RMSNorm of transformers' decoders (Llama, Qwen2, Mistral, ...: normalised in float32, cast back to
    the input's dtype, then scaled by ``weight``; ``variance_epsilon`` inside the root), whose backward works
    from its output and per-row 1/rms when input and weight are float32, and recomputes the norm from its
    input at other dtypes (a bfloat16 model: upcast_rms_norm); in eval, that module's own computation."""

    def __init__(self, weight: nn.Parameter, variance_epsilon: float) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            return upcast_rms_norm(x, self.weight, self.variance_epsilon)
        return self.weight * rms_norm_reference(x.to(torch.float32), 1, None, self.variance_epsilon).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class TempoGatedMLP(nn.Module):
    """A SiLU-gated MLP, ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (transformers' Llama, Qwen2,
    Mistral, ... MLP), whose gating keeps gate and up for backward, not the activation's output besides
    (silu_mul); in eval, the same expression with its own act_fn.  Holds the MLP's own projections under their
    names (the state_dict is unchanged) and its other plain attributes (config, sizes)."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        for name, value in vars(mlp).items():
            if not name.startswith("_") and name != "training":
                setattr(self, name, value)
        for name, child in mlp.named_children():
            self.add_module(name, child)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


class TempoDropout(nn.Dropout):
    """nn.Dropout keeping its mask as bits for backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inplace:
            return F.dropout(x, self.p, self.training, inplace=True)
        return tempo_dropout(x, self.p, self.training)


# ---------------------------------------------------------------------------------------------------------
# Graph adapters: nodes replacing call_module nodes read p and training from the module at run time


def module_dropout(x: torch.Tensor, module: nn.Dropout) -> torch.Tensor:
    """dropout with the p and training flag of an nn.Dropout (graph target for call_module dropouts)."""
    return tempo_dropout(x, module.p, module.training)


def module_gelu(x: torch.Tensor, approximate: str, module: nn.Module) -> torch.Tensor:
    """Tempo gelu while `module` (the nn.GELU it replaces) trains, torch's F.gelu in eval."""
    return gelu(x, approximate) if module.training else F.gelu(x, approximate=approximate)


def module_layer_norm(x: torch.Tensor, module: nn.LayerNorm) -> torch.Tensor:
    """Tempo layer_norm with an nn.LayerNorm's shape, eps and parameters (read at run time) while it trains,
    torch's F.layer_norm in eval."""
    fn = layer_norm if module.training else F.layer_norm
    return fn(x, tuple(module.normalized_shape), module.weight, module.bias, module.eps)


def module_gelu_dropout(x: torch.Tensor, approximate: str, module: nn.Dropout) -> torch.Tensor:
    """gelu_dropout with the p and training flag of an nn.Dropout."""
    return gelu_dropout(x, module.p, module.training, approximate)


def module_attention(scores: torch.Tensor, v: torch.Tensor, dim: int, module: nn.Dropout) -> torch.Tensor:
    """softmax_dropout_matmul with the p and training flag of an nn.Dropout."""
    return softmax_dropout_matmul(scores, v, module.p, module.training, dim)


def module_rms_norm(x: torch.Tensor, module: nn.RMSNorm) -> torch.Tensor:
    """Tempo rms_norm with an nn.RMSNorm's shape, eps and weight (read at run time) while it trains, torch's
    F.rms_norm in eval."""
    if not module.training:
        return F.rms_norm(x, module.normalized_shape, module.weight, module.eps)
    eps = torch.finfo(x.dtype).eps if module.eps is None else module.eps
    return rms_norm(x, len(module.normalized_shape), module.weight, eps)


TEMPO_MODULES = (TempoGELU, TempoGELUDropout, TempoLayerNorm, TempoDropout, TempoRMSNorm, TempoUpcastRMSNorm,
                 TempoGatedMLP)
