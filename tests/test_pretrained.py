"""Saving and loading tensorized transformers models (``save_pretrained`` / ``cc.from_pretrained``) and
densifying them (``cc.densify``): what a user relies on -- the loaded model computes what the saved one did,
in the dtype and mode transformers' own loader gives, and keeps working as a tensorized model; a densified
model is a plain transformers model, whose untied head stays its own (tiny configs)."""

from __future__ import annotations

import inspect
import os
import warnings

import pytest
import torch
from torch import nn

import comera_compile as cc
from comera_compile.layers import TTLayer

transformers = pytest.importorskip("transformers")

VOCAB = 101


def _gpt2(tie: bool = True):   # dropout at GPT-2's defaults (0.1): a model left in training mode shows it
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=tie))


def _llama(tie: bool = True):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        tie_word_embeddings=tie))


def _t5(tie: bool = True):
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
        tie_word_embeddings=tie, eos_token_id=1, pad_token_id=0))


def _bert(tie: bool = True):   # its tie map ties the decoder's bias too, which transformers expands by lookup
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=32, tie_word_embeddings=tie))


FAMILIES = {"gpt2": _gpt2, "llama": _llama, "t5": _t5, "bert": _bert}
IDS = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))


def _tensorized(name: str, tied: str = "untie", exclude: str | None = None, tie: bool = True) -> nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # tied='untie' and small layers announce themselves
        model = cc.tensorize(FAMILIES[name](tie), rank=4, min_features=1, tied=tied, exclude=exclude)
    with torch.no_grad():   # the untied head trained apart from the embedding
        head = model.get_output_embeddings()
        (head.cores[0] if isinstance(head, TTLayer) else head.weight).mul_(3)
    return model


def _logits(model: nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    extra = {"decoder_input_ids": ids[:, :4]} if model.config.is_encoder_decoder else {}
    with torch.no_grad():
        return model(input_ids=ids, **extra).logits


pytestmark = pytest.mark.usefixtures("quiet_transformers")


@pytest.mark.parametrize("name, tied, exclude", [
    ("gpt2", "untie", None), ("llama", "untie", None), ("llama", "untie", "model.embed_tokens"),
    ("llama", "untie", "lm_head"), ("t5", "untie", None), ("gpt2", "keep", None), ("t5", "keep", None),
    ("bert", "untie", None), ("bert", "keep", None)])
def test_from_pretrained_gives_the_saved_model_s_logits_in_eval_mode_and_saves_again(name, tied, exclude,
                                                                                      tmp_path):
    """Untied (both sides TT, or one kept dense) and tied models: the loaded model, as returned (eval mode, as
    transformers' from_pretrained), gives the saved model's logits; saved again, it is still a tensorized
    checkpoint that cc.from_pretrained loads to the same logits."""
    model = _tensorized(name, tied, exclude).eval()
    want = _logits(model)
    model.save_pretrained(tmp_path / "a")
    back = cc.from_pretrained(type(model), tmp_path / "a")
    assert not any(m.training for m in back.modules())
    assert torch.equal(_logits(back), want)
    assert back.comera_summary.untied == model.comera_summary.untied
    assert set(back.comera_summary.rewritten) == set(model.comera_summary.rewritten)
    back.save_pretrained(tmp_path / "b")
    assert "comera_model.pt" in os.listdir(tmp_path / "b") and "model.safetensors" not in os.listdir(tmp_path / "b")
    assert torch.equal(_logits(cc.from_pretrained(type(model), tmp_path / "b")), want)


@pytest.mark.parametrize("name, tied, tie", [("gpt2", "untie", True), ("llama", "keep", False)])
def test_a_loaded_model_resizes_and_ties_as_a_tensorized_one(name, tied, tie, tmp_path):
    """resize_token_embeddings on the loaded model makes its TT embedding and head dense first (as on the
    model tensorize returned): the old tokens' logits are unchanged; tie_weights keeps an untied head."""
    model = _tensorized(name, tied, tie=tie).eval()
    model.save_pretrained(tmp_path)
    back = cc.from_pretrained(type(model), tmp_path)
    want = _logits(back)
    back.tie_weights()
    assert torch.equal(_logits(back), want)
    with pytest.warns(UserWarning, match="made dense to be resized"):
        back.resize_token_embeddings(VOCAB + 9)
    torch.testing.assert_close(_logits(back)[..., :VOCAB], want, rtol=1e-5, atol=1e-5)
    assert back.get_output_embeddings().weight is not back.get_input_embeddings().weight


def test_from_pretrained_builds_in_the_saved_dtype_or_the_one_asked(tmp_path):
    """As transformers: a bfloat16 model comes back bfloat16, every saved value exact, its buffers in the
    dtypes transformers' from_pretrained gives the dense model (Llama's rotary frequencies float32);
    ``dtype=`` (or the older ``torch_dtype=``) asks for another; a dtype not floating point is an error."""
    model = _tensorized("llama", "keep").to(torch.bfloat16).eval()
    want = _logits(model)
    model.save_pretrained(tmp_path)
    back = cc.from_pretrained(type(model), tmp_path)
    assert {p.dtype for p in back.parameters()} == {torch.bfloat16} and back.config.dtype == torch.bfloat16
    saved = model.state_dict()
    assert all(v.dtype == saved[k].dtype and torch.equal(v, saved[k]) for k, v in back.state_dict().items())
    _llama().to(torch.bfloat16).save_pretrained(tmp_path / "dense")
    dense = type(model).from_pretrained(tmp_path / "dense")
    assert {n: b.dtype for n, b in back.named_buffers()} == {n: b.dtype for n, b in dense.named_buffers()}
    torch.testing.assert_close(_logits(back), want, rtol=0.05, atol=0.05)   # rotary float32, not bfloat16
    wide = cc.from_pretrained(type(model), tmp_path, dtype=torch.float32)
    assert {p.dtype for p in wide.parameters()} == {torch.float32}
    assert all(torch.equal(v, saved[k].float()) for k, v in wide.state_dict().items() if v.is_floating_point())
    assert {p.dtype for p in cc.from_pretrained(type(model), tmp_path, torch_dtype="float32").parameters()} == {
        torch.float32}
    with pytest.raises(ValueError, match="floating-point"):
        cc.from_pretrained(type(model), tmp_path, dtype=torch.int64)


def test_from_pretrained_sets_config_fields_and_refuses_other_keywords(tmp_path):
    """Keywords set the config's fields, as transformers' from_pretrained does; a typo or one of transformers'
    loading options (device_map) is an error naming it, not a keyword dropped in silence."""
    model = _tensorized("llama")
    model.save_pretrained(tmp_path)
    assert not cc.from_pretrained(type(model), tmp_path, use_cache=False).config.use_cache
    for bad in ({"not_a_field": 3}, {"device_map": "meta"}):
        with pytest.raises(TypeError, match=f"\\['{next(iter(bad))}'\\] that are neither dtype= nor fields"):
            cc.from_pretrained(type(model), tmp_path, **bad)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_densify_keeps_the_untied_head_its_own_through_tie_weights_and_resize(name):
    """After tied='untie' the head trained apart from the embedding; densified, tie_weights and a resize
    (transformers' own re-tying) leave it: the old tokens' logits stay what they were."""
    dense = cc.densify(_tensorized(name)).eval()
    assert not any(isinstance(m, TTLayer) for m in dense.modules())
    want = _logits(dense)
    dense.tie_weights()
    if "recompute_mapping" in inspect.signature(type(dense).tie_weights).parameters:   # transformers 5
        dense.tie_weights(recompute_mapping=False)   # transformers' record of what it tied, as init_weights
    assert torch.equal(_logits(dense), want)
    dense.resize_token_embeddings(VOCAB + 9)
    assert dense.get_output_embeddings().weight is not dense.get_input_embeddings().weight
    torch.testing.assert_close(_logits(dense)[..., :VOCAB], want, rtol=1e-5, atol=1e-5)


def test_untie_leaves_tie_word_embeddings_set_where_the_forward_reads_it():
    """SwitchTransformers scales its decoder output while config.tie_word_embeddings is set: tied='untie'
    leaves the flag there (clearing it would change the logits), so at full rank the logits are the dense
    model's; Llama's, which only ties, is cleared."""
    torch.manual_seed(0)
    dense = transformers.SwitchTransformersForConditionalGeneration(transformers.SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        num_experts=2, expert_capacity=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cc.tensorize(dense, rank=10**9, init="svd", min_features=1, tied="untie").eval()
    assert model.comera_summary.untied and model.config.tie_word_embeddings
    torch.testing.assert_close(_logits(model), _logits(dense), rtol=1e-4, atol=1e-4)
    assert not _tensorized("llama").config.tie_word_embeddings


def test_densify_keeps_refusing_to_share_t5_s_untied_embeddings_again():
    dense = cc.densify(_tensorized("t5"))
    with pytest.raises(cc.TensorizeError, match="tied='keep'"):
        dense.resize_token_embeddings(VOCAB + 9)


@pytest.mark.parametrize("name, tied, tie", [("gpt2", "untie", True), ("gpt2", "keep", True),
                                             ("llama", "untie", True), ("llama", "keep", False)])
def test_a_densified_model_saves_and_loads_as_a_plain_transformers_model(name, tied, tie, tmp_path):
    """No TT layer left: save_pretrained is transformers' (model.safetensors), and ModelClass.from_pretrained
    loads the folder to the densified model's logits -- GPT-2's layers are Conv1D again, an untied head stays
    untied (through a resize too)."""
    dense = cc.densify(_tensorized(name, tied, tie=tie)).eval()
    want = _logits(dense)
    dense.save_pretrained(tmp_path)
    assert "model.safetensors" in os.listdir(tmp_path) and "comera_model.pt" not in os.listdir(tmp_path)
    back = type(dense).from_pretrained(tmp_path).eval()
    assert not hasattr(back.config, "comera_layout")
    torch.testing.assert_close(_logits(back), want, rtol=0, atol=0)
    if name == "gpt2":
        conv1d = transformers.pytorch_utils.Conv1D
        assert isinstance(back.transformer.h[0].attn.c_attn, conv1d) and isinstance(dense.transformer.h[0].mlp.c_fc,
                                                                                      conv1d)
    back.resize_token_embeddings(VOCAB + 9)
    torch.testing.assert_close(_logits(back)[..., :VOCAB], want, rtol=1e-5, atol=1e-5)


class _TwiceConfig(transformers.PretrainedConfig):
    model_type = "comera_twice"


class _Twice(transformers.PreTrainedModel):
    """One layer registered under two names (``a`` and ``b.0``) and applied twice."""

    config_class = _TwiceConfig

    def __init__(self, config: _TwiceConfig) -> None:
        super().__init__(config)
        self.a = nn.Linear(64, 64)
        self.b = nn.Sequential(self.a)
        self.post_init()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_a_layer_under_two_names_loads_as_one_tt_layer(tmp_path):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cc.tensorize(_Twice(_TwiceConfig()), rank=8, min_features=16).eval()
    x = torch.randn(2, 64)
    model.save_pretrained(tmp_path)
    back = cc.from_pretrained(_Twice, tmp_path)
    assert isinstance(back.a, TTLayer) and back.a is back.b[0]
    with torch.no_grad():
        assert torch.equal(back(x), model(x))


def test_save_pretrained_writes_nothing_on_a_process_that_is_not_the_main_one(tmp_path):
    model = _tensorized("llama")
    model.save_pretrained(tmp_path / "other", is_main_process=False)
    assert not (tmp_path / "other").exists()
    model.save_pretrained(tmp_path / "main", is_main_process=True)
    assert "comera_model.pt" in os.listdir(tmp_path / "main")


@pytest.mark.parametrize("shard", [False, True], ids=["whole", "sharded"])
def test_save_pretrained_over_a_dense_save_leaves_no_dense_weights_behind(shard, tmp_path):
    """Saving a tensorized model into a folder holding the dense model's save (its starting checkpoint, an
    earlier run's output): transformers' weight files are removed, so a plain from_pretrained stops at the TT
    checkpoint instead of returning the old dense weights, and a README text file of the user's stays."""
    dense = FAMILIES["llama"]()
    dense.save_pretrained(tmp_path, max_shard_size="20KB" if shard else "5GB")
    (tmp_path / "NOTES.md").write_text("the user's own file")
    model = _tensorized("llama")
    model.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["NOTES.md", "comera_model.pt", "config.json", "generation_config.json", "pytorch_model.bin.index.json"])
    with pytest.raises(KeyError):
        type(dense).from_pretrained(tmp_path)
    torch.testing.assert_close(_logits(cc.from_pretrained(type(dense), tmp_path).eval()), _logits(model.eval()))
