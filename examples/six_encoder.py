"""The six-encoder transformer of CoMERA's MNLI experiment, as a plain dense PyTorch model.

BERT-like: d_model 768, 12 heads, FFN 3072, GELU, post-LayerNorm, dropout 0.1, vocabulary 30522, 512
positions, 2 segments, a d -> d (tanh) -> classes head.  Written so torch.fx can trace it (the optional
inputs are resolved inside wrapped functions), which lets tensorize(trace=True) return a readable
GraphModule.

Run it: ``python -m comera_compile.examples.six_encoder`` prints the dense and tensorized sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

__all__ = ["SixEncoderConfig", "SixEncoder", "build", "example_inputs"]


@dataclass
class SixEncoderConfig:
    vocab_size: int = 30522
    d_model: int = 768
    heads: int = 12
    ffn: int = 3072
    layers: int = 6
    max_positions: int = 512
    segments: int = 2
    num_classes: int = 3
    dropout: float = 0.1


@torch.fx.wrap
def _segments_or_zeros(input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
    return torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids


@torch.fx.wrap
def _additive_mask(attention_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """(batch, seq) 1 = keep, 0 = pad  ->  (batch, 1, 1, seq) additive mask, or None."""
    if attention_mask is None:
        return None
    return (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


@torch.fx.wrap
def _add_mask(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return scores if mask is None else scores + mask


class Attention(nn.Module):
    def __init__(self, c: SixEncoderConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = c.heads, c.d_model // c.heads
        self.q = nn.Linear(c.d_model, c.d_model)
        self.k = nn.Linear(c.d_model, c.d_model)
        self.v = nn.Linear(c.d_model, c.d_model)
        self.out = nn.Linear(c.d_model, c.d_model)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, s, d = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        scores = _add_mask(q @ k.transpose(-1, -2) / math.sqrt(self.head_dim), mask)
        probs = self.dropout(torch.softmax(scores, dim=-1))
        ctx = (probs @ v).transpose(1, 2).reshape(b, s, d)
        return self.out(ctx)


class EncoderLayer(nn.Module):
    def __init__(self, c: SixEncoderConfig) -> None:
        super().__init__()
        self.attention = Attention(c)
        self.attn_norm = nn.LayerNorm(c.d_model)
        self.ffn_up = nn.Linear(c.d_model, c.ffn)
        self.ffn_down = nn.Linear(c.ffn, c.d_model)
        self.ffn_norm = nn.LayerNorm(c.d_model)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = self.attn_norm(x + self.dropout(self.attention(x, mask)))
        h = self.ffn_down(F.gelu(self.ffn_up(x)))   # BERT: no dropout on the intermediate
        return self.ffn_norm(x + self.dropout(h))


class SixEncoder(nn.Module):
    """Sequence classifier: embeddings, `layers` encoder layers, a tanh head on the first token."""

    def __init__(self, config: SixEncoderConfig | None = None) -> None:
        super().__init__()
        c = self.config = config or SixEncoderConfig()
        self.word = nn.Embedding(c.vocab_size, c.d_model)
        self.position = nn.Embedding(c.max_positions, c.d_model)
        self.segment = nn.Embedding(c.segments, c.d_model)
        self.embed_norm = nn.LayerNorm(c.d_model)
        self.dropout = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList([EncoderLayer(c) for _ in range(c.layers)])
        self.fc1 = nn.Linear(c.d_model, c.d_model)
        self.fc2 = nn.Linear(c.d_model, c.num_classes)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = (self.word(input_ids) + self.position(positions)[None]
             + self.segment(_segments_or_zeros(input_ids, token_type_ids)))
        x = self.dropout(self.embed_norm(x))
        mask = _additive_mask(attention_mask, x.dtype)
        for layer in self.layers:
            x = layer(x, mask)
        return self.fc2(torch.tanh(self.fc1(x[:, 0])))


def build(**overrides) -> SixEncoder:
    """The paper's six-encoder model (dense); keyword arguments override SixEncoderConfig fields."""
    return SixEncoder(SixEncoderConfig(**overrides))


def example_inputs(model: SixEncoder, batch: int = 8, seq: int = 128, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random token ids, segment ids and an all-ones attention mask for the model."""
    g = torch.Generator().manual_seed(seed)
    c = model.config
    ids = torch.randint(0, c.vocab_size, (batch, seq), generator=g)
    seg = torch.randint(0, c.segments, (batch, seq), generator=g)
    return ids, seg, torch.ones(batch, seq, dtype=torch.long)


if __name__ == "__main__":
    import comera_compile as cc

    dense = build()
    print(f"dense: {sum(p.numel() for p in dense.parameters()) / 1e6:.2f}M parameters")
    tt = cc.tensorize(dense, preset="comera-six-encoder")
    print(cc.explain(tt))
