"""transformers' model APIs that read or replace a tensorized model's embeddings and head: the calls users
make when they add tokens, swap a head, count parameters or generate (models from small configs)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import comera_compile as cc
from comera_compile.layers import TTLayer
from helpers import FULL

transformers = pytest.importorskip("transformers")

VOCAB = 211


def _bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, tie_word_embeddings=False, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def _t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0,
        dropout_rate=0.0, tie_word_embeddings=False, eos_token_id=1, pad_token_id=0))


FAMILIES = {"bert": _bert, "gpt2": _gpt2, "llama": _llama, "t5": _t5}


def _tensorized(name: str, tied: str = "untie") -> nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # tied='untie' and small layers announce themselves
        return cc.tensorize(FAMILIES[name]().eval(), rank=8, min_features=1, tied=tied)


def _logits(model: nn.Module, name: str, ids: torch.Tensor) -> torch.Tensor:
    extra = {"decoder_input_ids": ids[:, :4]} if name == "t5" else {}
    return model(input_ids=ids, **extra).logits


pytestmark = pytest.mark.usefixtures("quiet_transformers")


@pytest.mark.parametrize("name", FAMILIES)
def test_input_and_output_embeddings_are_the_tt_layers_the_model_runs(name):
    model = _tensorized(name)
    paths = {id(m): n for n, m in model.named_modules()}
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(emb, TTLayer) and isinstance(head, TTLayer)
    assert paths[id(emb)] in model.comera_summary.rewritten and paths[id(head)] in model.comera_summary.rewritten
    ids = torch.randint(0, VOCAB, (2, 6))
    with torch.no_grad():
        got = _logits(model, name, ids)
        head.cores[0].zero_()   # the head the API names is the one the forward uses
        assert torch.count_nonzero(_logits(model, name, ids) - (head.bias if head.bias is not None else 0)) == 0
    assert got.shape[-1] == VOCAB


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("new, pad", [(240, None), (200, None), (230, 16)], ids=["grow", "shrink", "pad16"])
def test_resize_token_embeddings_keeps_every_old_row_and_trains_on_new_ids(name, new, pad):
    # T5's encoder, decoder and head share its input embedding: kept tied (dense) here, see the test below.
    model = _tensorized(name, tied="keep" if name == "t5" else "untie")
    assert name == "t5" or isinstance(model.get_output_embeddings(), TTLayer)
    ids = torch.randint(0, min(VOCAB, new), (2, 6))
    with torch.no_grad():
        before = _logits(model, name, ids)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.resize_token_embeddings(new, pad_to_multiple_of=pad)
    made_dense = [w for w in caught if "made dense to be resized" in str(w.message)]
    assert len(made_dense) == (name != "t5")
    size = new if pad is None else -(-new // pad) * pad
    assert model.config.vocab_size == size
    assert model.get_input_embeddings().weight.shape[0] == size
    assert model.get_output_embeddings().weight.shape[0] == size
    kept = min(VOCAB, size)
    with torch.no_grad():
        after = _logits(model, name, ids)
    # Old tokens: the same logits over the old vocabulary (the dense tables hold the TT layers' exact rows).
    torch.testing.assert_close(after[..., :kept], before[..., :kept], rtol=1e-5, atol=1e-5)
    reason = model.comera_summary.kept_dense
    assert name == "t5" or any("resize_token_embeddings" in r for r in reason.values())
    # New ids run forward and backward.
    new_ids = torch.randint(0, size, (2, 6))
    new_ids[0, 0] = size - 1
    _logits(model, name, new_ids).float().pow(2).mean().backward()
    assert model.get_output_embeddings().weight.grad is not None
    # The rest stays TT.
    assert sum(isinstance(m, TTLayer) for m in model.modules()) >= 8


@pytest.mark.parametrize("name", FAMILIES)
def test_set_output_embeddings_swaps_the_head_the_forward_uses(name):
    model = _tensorized(name)
    old = model.get_output_embeddings()
    hidden = old.in_features
    new_head = nn.Linear(hidden, VOCAB, bias=False)
    nn.init.zeros_(new_head.weight)
    model.set_output_embeddings(new_head)
    assert model.get_output_embeddings() is new_head
    ids = torch.randint(0, VOCAB, (2, 6))
    with torch.no_grad():
        assert torch.count_nonzero(_logits(model, name, ids)) == 0


@pytest.mark.parametrize("name", FAMILIES)
def test_num_parameters_counts_the_tt_cores(name):
    dense = FAMILIES[name]()
    model = _tensorized(name)
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())
    assert model.num_parameters() < dense.num_parameters()
    assert model.get_memory_footprint() == sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers())


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
def test_generate_at_full_rank_gives_the_dense_model_s_tokens(name):
    torch.manual_seed(0)
    dense = FAMILIES[name]().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tt = cc.tensorize(dense, rank=FULL, init="svd", min_features=1, tied="untie")
    assert isinstance(tt.get_input_embeddings(), TTLayer)
    prompt = torch.randint(2, VOCAB, (2, 5))
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(tt.generate(prompt, **kwargs), dense.generate(prompt, **kwargs))


@pytest.mark.parametrize("name", FAMILIES)
def test_tie_weights_on_an_untied_model_changes_nothing(name):
    model = _tensorized(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.tie_weights()
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_resize_refuses_to_re_tie_t5_s_untied_encoder_and_decoder_embeddings():
    model = _tensorized("t5", tied="untie")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(cc.TensorizeError, match="tied='keep'"):
        model.resize_token_embeddings(240)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.config.vocab_size == VOCAB


def test_mixtral_experts_and_whisper_s_frozen_positions_are_said_and_kept():
    """transformers' own models at the defaults: Mixtral's experts (3-D Parameters, most of the model) are
    listed as kept dense and warned about; Whisper's frozen sinusoidal encoder positions keep their values
    (random cores would have replaced them for good), with a warning naming them."""
    import transformers

    import comera_compile as cc

    torch.manual_seed(0)
    mixtral = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=128, hidden_size=128, intermediate_size=448, num_hidden_layers=12, num_attention_heads=4,
        num_key_value_heads=4, num_local_experts=4))
    with pytest.warns(UserWarning, match=r"kept 24 weight\(s\) dense that modules hold as plain Parameters"):
        tt = cc.tensorize(mixtral)
    assert sum("experts" in n for n in tt.comera_summary.kept_dense) == 24
    whisper = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=1500,
        max_target_positions=64, num_mel_bins=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1))
    table = whisper.model.encoder.embed_positions.weight.detach().clone()
    with pytest.warns(UserWarning, match=r"frozen layer\(s\) dense \(model.encoder.embed_positions\)"):
        tt = cc.tensorize(whisper)
    assert torch.equal(tt.model.encoder.embed_positions.weight, table)
