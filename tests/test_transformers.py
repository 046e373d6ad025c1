"""tensorize on transformers models built from small configs (nothing downloaded)."""

from __future__ import annotations

import warnings

import pytest
import torch

import comera_compile as cc
from comera_compile.layers import TTEmbedding, TTLinear

transformers = pytest.importorskip("transformers")

FULL = 10**9


def _bert():
    cfg = transformers.BertConfig(vocab_size=211, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=64, num_labels=3)
    return transformers.BertForSequenceClassification(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=211, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("factory", [_bert, _gpt2], ids=["bert", "gpt2"])
def test_full_rank_svd_logits_match_dense(factory):
    dense = factory().eval()
    with pytest.warns(UserWarning, match="no smaller as TT"):  # full rank: exact, and bigger than dense
        tt = cc.tensorize(dense, rank=FULL, init="svd", min_features=1)
    assert type(tt) is type(dense)
    assert sum(isinstance(m, (TTLinear, TTEmbedding)) for m in tt.modules()) >= 9
    ids = torch.randint(0, 211, (2, 16))
    ref, out = dense(ids).logits, tt(ids).logits
    assert (out - ref).abs().max() <= 1e-4 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("factory", [_bert, _gpt2], ids=["bert", "gpt2"])
def test_forward_and_backward_at_low_rank(factory):
    dense = factory()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tt = cc.tensorize(dense, rank=4, min_features=32)
    ids = torch.randint(0, 211, (2, 16))
    out = tt(ids, labels=torch.tensor([0, 2]) if factory is _bert else ids)
    out.loss.backward()
    tt_layers = [m for m in tt.modules() if isinstance(m, (TTLinear, TTEmbedding))]
    assert tt_layers
    for m in tt_layers:
        assert all(c.grad is not None and torch.isfinite(c.grad).all() for c in m.cores)
    assert sum(p.numel() for p in tt.parameters()) < sum(p.numel() for p in dense.parameters())


def test_gpt2_tied_embedding_and_head_stay_tied_by_default():
    dense = _gpt2()
    assert dense.lm_head.weight is dense.transformer.wte.weight
    with pytest.warns(UserWarning, match="share one weight; left dense"):
        tt = cc.tensorize(dense, rank=8, min_features=1)
    assert type(tt.transformer.wte) is torch.nn.Embedding
    assert tt.lm_head.weight is tt.transformer.wte.weight
    assert "tied" in tt.comera_summary.kept_dense["lm_head"]
    assert isinstance(tt.transformer.h[0].attn.c_attn, TTLinear)  # Conv1D look-alike rewritten


def test_gpt2_untie_is_explicit_and_announced():
    dense = _gpt2()
    with pytest.warns(UserWarning, match="UNTIED"):
        tt = cc.tensorize(dense, rank=8, min_features=1, tied="untie")
    assert isinstance(tt.transformer.wte, TTEmbedding)
    assert isinstance(tt.lm_head, TTLinear)


@pytest.mark.parametrize("factory", [_bert, _gpt2], ids=["bert", "gpt2"])
def test_densify_gives_back_plain_layers_with_the_same_logits(factory):
    """tensorize at a low rank, then densify: every layer a plain nn.Linear / nn.Embedding again (GPT-2's
    Conv1D comes back as nn.Linear), the logits those of the TT model."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tt = cc.tensorize(factory().eval(), rank=4, min_features=1)
    dense = cc.densify(tt)
    assert type(dense) is type(tt)
    assert not any(isinstance(m, (TTLinear, TTEmbedding)) for m in dense.modules())
    assert any(isinstance(m, TTLinear) for m in tt.modules())  # densify copied: the TT model is unchanged
    ids = torch.randint(0, 211, (2, 9))
    with torch.no_grad():
        want, got = tt(ids).logits, dense(ids).logits
    assert (got - want).norm() <= 1e-5 * want.norm()


def test_t5_reads_its_tt_layers_weight_dtype_and_trains():
    cfg = transformers.T5Config(vocab_size=211, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tt = cc.tensorize(model, rank=8, min_features=1)
    assert isinstance(tt.encoder.block[0].layer[1].DenseReluDense.wo, TTLinear)
    ids = torch.randint(0, 211, (2, 7))
    out = tt(input_ids=ids, labels=ids)
    out.loss.backward()
    wo = tt.encoder.block[0].layer[1].DenseReluDense.wo
    torch.testing.assert_close(wo.weight, wo.to_dense())
    assert wo.cores[0].grad is not None


def test_transformer_encoder_keeps_attention_out_proj_dense_and_runs():
    layer = torch.nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tt = cc.tensorize(enc, rank=8, min_features=1)
    assert isinstance(tt.layers[0].linear1, TTLinear)
    assert isinstance(tt.layers[0].self_attn.out_proj, torch.nn.Linear)
    assert "MultiheadAttention" in tt.comera_summary.kept_dense["layers.0.self_attn.out_proj"]
    x = torch.randn(2, 5, 64)
    tt(x).sum().backward()
    assert tt.layers[0].linear1.cores[0].grad is not None
    tt.eval()  # eval under no_grad takes nn.TransformerEncoderLayer's fused path, which reads the weights
    with torch.no_grad():
        want, got = cc.densify(tt)(x), tt(x)
    assert (got - want).norm() <= 1e-5 * want.norm()
