"""Regional compilation beyond decoder LMs: an image encoder (ViT) and an encoder-decoder (Whisper) from
transformers at 12 layers a stack, trained by cc.compile_step at its defaults with RankAdaptive attached.
Each kind of block compiles one graph whatever the depth, no block runs eagerly, and every step computes what
the same loop computes eagerly."""

from __future__ import annotations

import copy
import warnings
from typing import Callable

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import comera_compile as cc
from comera_compile.regional import eager_blocks

transformers = pytest.importorskip("transformers")

LAYERS = 12


def _vit() -> tuple[nn.Module, Callable[[torch.Generator], dict], int]:
    cfg = transformers.ViTConfig(hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                                 intermediate_size=256, image_size=32, patch_size=8, num_labels=10)

    def batch(g: torch.Generator) -> dict:
        return dict(pixel_values=torch.randn(4, 3, 32, 32, generator=g), labels=torch.randint(0, 10, (4,), generator=g))
    return transformers.ViTForImageClassification(cfg), batch, 1


def _whisper() -> tuple[nn.Module, Callable[[torch.Generator], dict], int]:
    cfg = transformers.WhisperConfig(
        d_model=64, encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256, num_mel_bins=16,
        max_source_positions=16, max_target_positions=32, vocab_size=200, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1)

    def batch(g: torch.Generator) -> dict:
        return dict(input_features=torch.randn(2, 16, 32, generator=g),
                    labels=torch.randint(3, 200, (2, 10), generator=g))
    return transformers.WhisperForConditionalGeneration(cfg), batch, 2   # encoder layers, decoder layers


@pytest.mark.slow
@pytest.mark.parametrize("factory", [_vit, _whisper], ids=["vit", "whisper"])
def test_encoder_models_compile_one_graph_per_kind_of_block_and_train_as_eager(factory, fresh_dynamo):
    """ViT (12 encoder layers: one graph) and Whisper (12 encoder and 12 decoder layers: two graphs), tensorized
    at rank 8 with RankAdaptive: three steps of cc.compile_step give the eager loop's losses and parameters,
    with no block left eager."""
    torch.manual_seed(0)
    dense, batch, kinds = factory()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # Whisper's frozen sinusoidal positions stay dense, said by a warning
        model = cc.tensorize(dense.train(), rank=8)
    eager = copy.deepcopy(model)

    def optimizer(m: nn.Module) -> tuple[torch.optim.Optimizer, cc.RankAdaptive]:
        opt = torch.optim.AdamW(cc.param_groups(m, lr=1e-3))
        return opt, cc.RankAdaptive(m, optimizer=opt)

    opt, ra = optimizer(model)
    eager_opt, eager_ra = optimizer(eager)
    step = cc.compile_step(model, None, opt, rank_adaptive=ra)
    assert len(cc.repeated_blocks(model)) == LAYERS * kinds
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        b = batch(g)
        want = eager(**b).loss
        want.backward()
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)
        eager_ra.step(want.detach())
        torch.testing.assert_close(step(**b), want.detach(), rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == kinds
    assert eager_blocks(model) == {}
    # Attention's key bias is left out: its gradient is zero in exact arithmetic (softmax ignores a shift all
    # keys share), so AdamW scales round-off of either sign into steps of the learning rate's size.
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        if not name.endswith("k_proj.bias"):
            torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
