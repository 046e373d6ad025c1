"""tensorize on transformers models built from small configs (nothing downloaded)."""

from __future__ import annotations

import warnings

import pytest
import torch

import comera_compile as cc
from comera_compile.embedding import TTEmbedding
from comera_compile.layers import TTLinear
from helpers import FULL

transformers = pytest.importorskip("transformers")

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


def _opt():
    cfg = transformers.OPTConfig(vocab_size=211, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=80, word_embed_proj_dim=64,
                                 pad_token_id=0, dropout=0.0)
    return transformers.OPTForCausalLM(cfg)


def _gemma3():
    cfg = transformers.Gemma3TextConfig(vocab_size=211, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                        head_dim=16, max_position_embeddings=64, pad_token_id=0,
                                        tie_word_embeddings=False)
    return transformers.Gemma3ForCausalLM(cfg)


@pytest.mark.parametrize("factory,kept", [(_opt, "model.decoder.embed_positions"), (_gemma3, "model.embed_tokens")],
                         ids=["opt", "gemma3"])
def test_embeddings_with_their_own_forward_stay_dense_and_the_logits_match_dense(factory, kept):
    """OPT's learned position embedding (called with a mask) and Gemma's scaled word embedding (rows times
    sqrt(d)) are nn.Embedding subclasses computing something else: tensorize keeps them dense with a
    warning, and at full rank the TT model's logits are the dense model's (float64)."""
    dense = factory().double().eval()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        tt = cc.tensorize(dense, rank=FULL, init="svd", min_features=1, tied="untie")
    assert any("own forward" in str(w.message) and kept in str(w.message) for w in rec)
    assert "has its own forward" in tt.comera_summary.kept_dense[kept]
    assert sum(isinstance(m, TTLinear) for m in tt.modules()) >= 13  # every layer's and the head
    ids = torch.randint(1, 211, (2, 16))
    torch.testing.assert_close(tt(ids).logits, dense(ids).logits, rtol=1e-8, atol=1e-8)


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
    Conv1D as Conv1D: tests/test_pretrained.py), the logits those of the TT model."""
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


def _t5():  # T5's attention drops out functionally at config.dropout_rate: 0 here, for comparable runs
    cfg = transformers.T5Config(vocab_size=211, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                decoder_start_token_id=0, dropout_rate=0.0)
    return transformers.T5ForConditionalGeneration(cfg)


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def _vit():
    cfg = transformers.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=128, num_labels=3)
    return transformers.ViTForImageClassification(cfg)


def _batch(name):
    g = torch.Generator().manual_seed(1)
    if name == "vit":
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g), "labels": torch.tensor([0, 2])}
    ids = torch.randint(1, 211, (2, 9), generator=g)
    if name == "bert":
        return {"input_ids": ids, "labels": torch.tensor([0, 2])}
    return {"input_ids": ids, "labels": ids}


def _no_dropout(model):
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


# T5 here takes about 2 min: slow (test_t5_reads_its_tt_layers_weight_dtype_and_trains and test_pretrained keep it)
@pytest.mark.parametrize("name,factory", [("bert", _bert), ("gpt2", _gpt2),
                                         pytest.param("t5", _t5, marks=pytest.mark.slow), ("llama", _llama),
                                         ("vit", _vit)])
def test_family_trains_eager_and_compiled_and_round_trips(name, factory, tmp_path):
    """tensorize, a training step eager and one under backend "comera" (its logits those of eager at the same
    weights), then save_pretrained and cc.from_pretrained: identical logits; a dense from_pretrained of the
    folder fails."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tt = _no_dropout(cc.tensorize(factory(), rank=8, min_features=32))
    assert any(isinstance(m, TTLinear) for m in tt.modules())
    opt = torch.optim.AdamW(cc.param_groups(tt, lr=1e-3))
    batch = _batch(name)
    tt(**batch).loss.backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        eager = tt(**batch).logits
    out = torch.compile(tt, backend="comera")(**batch)
    torch.testing.assert_close(out.logits.detach(), eager, rtol=1e-4, atol=1e-4)
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    tt.eval()
    with torch.no_grad():
        want = tt(**batch).logits
    tt.save_pretrained(tmp_path)
    with pytest.raises(KeyError, match="metadata"):   # loud, not fresh dense layers: the index has no metadata
        type(tt).from_pretrained(tmp_path)
    back = cc.from_pretrained(type(tt), tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(back(**batch).logits, want)
    torch._dynamo.reset()


def test_transformer_encoder_trains_compiled_and_round_trips_through_state_dict():
    def build():
        layer = torch.nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0, batch_first=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return cc.tensorize(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), rank=8,
                                min_features=32)

    torch.manual_seed(0)
    tt = build()
    opt = torch.optim.AdamW(cc.param_groups(tt, lr=1e-3))
    ra = cc.RankAdaptive(tt, optimizer=opt, cut_every=1, realloc_at=1.0)
    compiled = torch.compile(tt, backend="comera")
    x = torch.randn(2, 5, 64)
    for step, run in enumerate((tt, compiled)):
        run(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            with torch.no_grad():
                tt.layers[0].linear1.gates[2][:3] = 0.0
        ra.step()  # the second check re-allocates linear1 at smaller ranks
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), tt(x), rtol=1e-4, atol=1e-5)  # after the re-allocation
    tt.eval()
    with torch.no_grad():
        want = tt(x)
    torch.manual_seed(5)
    back = build().eval()  # freshly tensorized: full ranks, other values
    back.load_state_dict(tt.state_dict())
    assert back.layers[0].linear1.ranks == tt.layers[0].linear1.ranks
    with torch.no_grad():
        assert torch.equal(back(x), want)
    torch._dynamo.reset()


def _loss(name):
    if name in ("bert", "vit"):
        return lambda out, y: torch.nn.functional.cross_entropy(out.logits, y)
    return lambda out, y: torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())


@pytest.mark.parametrize("name,factory", [pytest.param("bert", _bert, marks=pytest.mark.slow), ("gpt2", _gpt2),
                                         ("llama", _llama), ("vit", _vit)])   # BERT compiled: the 12-layer test below
def test_compile_step_at_its_defaults_compiles_each_layer_once_trains_as_eager_and_honours_eval(name, factory):
    """cc.compile_step at its defaults (regional: the stacked layers compiled one by one) on transformers
    models: their layers are the repeated blocks, three SGD steps land where three eager steps do, and
    eval() afterwards is honoured by the compiled layers (their logits are eager's in eval)."""
    def make():
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = _no_dropout(cc.tensorize(factory(), rank=8, min_features=32))
        # SGD, not AdamW: attention's key bias has an exactly-zero gradient, and Adam would turn the
        # rounding noise around zero into lr-sized steps of random sign in either run
        return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    batch = _batch(name)
    args = tuple(batch.values())   # the model's input, then the labels
    eager, eager_opt = make()
    for _ in range(3):
        _loss(name)(eager(args[0]), args[1]).backward()
        eager_opt.step()
        eager_opt.zero_grad()
    torch._dynamo.reset()
    model, opt = make()
    blocks = cc.repeated_blocks(model)
    assert len(blocks) == 2 and type(blocks[0]).__name__.endswith(("Layer", "Block"))
    step = cc.compile_step(model, _loss(name), opt)
    for _ in range(3):
        step(*args)
    assert all(b._compiled_call_impl is not None for b in blocks)
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p - q).norm() <= 1e-4 * q.norm() + 1e-6, n
    drops = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    for m in drops:   # dropout back on: eval must switch it off in the compiled layers too
        m.p = 0.5
    with torch.no_grad():
        with torch.compiler.set_stance("force_eager"):
            model.eval()
            want = model(args[0]).logits
            model.train()
        if drops:   # the check can fail: in train mode the compiled layers do drop
            assert not torch.allclose(model(args[0]).logits, want, rtol=1e-4, atol=1e-5)
        model.eval()
        got = model(args[0]).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


def test_a_12_layer_bert_keeps_its_pretrained_pad_row_frozen_embeddings_and_hooks_eager_and_compiled():
    """A 12-layer BertForMaskedLM as it comes from a checkpoint (its [PAD] row not zero, as BERT's own
    checkpoints have it), its embeddings frozen for fine-tuning and a forward hook of the user's on one
    layer, tensorized at the defaults but for full-rank svd: the logits are the dense model's (float64, pad
    tokens in the batch); then cc.compile_step at its defaults with RankAdaptive trains it in float32, with
    the first step's loss the eager model's, the frozen embeddings unchanged and RankAdaptive saying it leaves them."""
    cfg = transformers.BertConfig(vocab_size=211, hidden_size=32, num_hidden_layers=12, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, pad_token_id=0,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                  tie_word_embeddings=False)   # a tied head would keep the table dense
    dense = transformers.BertForMaskedLM(cfg).double()
    emb = dense.bert.embeddings.word_embeddings
    with torch.no_grad():
        emb.weight[0] = torch.randn(32, dtype=torch.float64)
    emb.requires_grad_(False)
    dense.bert.encoder.layer[5].intermediate.dense.register_forward_hook(lambda m, args, out: 0.1 * out)
    ids = torch.randint(1, 211, (2, 12))
    ids[:, -3:] = 0   # padding, attended as BERT's own inputs without an attention mask are
    dense.eval()
    want = dense(input_ids=ids).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tt = cc.tensorize(dense, rank=FULL, init="svd", min_features=1)
    word = tt.bert.embeddings.word_embeddings
    assert isinstance(word, TTEmbedding) and not any(p.requires_grad for p in word.parameters())
    assert isinstance(tt.bert.encoder.layer[5].intermediate.dense, TTLinear)
    torch.testing.assert_close(tt(input_ids=ids).logits, want, rtol=1e-9, atol=1e-9)

    tt.float().train()   # trained in float32, as users train
    labels = torch.where(ids > 0, ids, -100)
    torch.manual_seed(0)
    eager_loss = tt(input_ids=ids, labels=labels).loss
    frozen = [p.clone() for p in word.parameters()]
    opt = torch.optim.AdamW([p for p in tt.parameters() if p.requires_grad], lr=1e-3)
    with pytest.warns(UserWarning, match=r"leaves 1 frozen TT layer\(s\) at their ranks \(bert.embeddings.word"):
        ra = cc.RankAdaptive(tt, optimizer=opt)
    torch._dynamo.reset()
    step = cc.compile_step(tt, None, opt, rank_adaptive=ra)
    losses = [step(input_ids=ids, labels=labels) for _ in range(3)]
    torch.testing.assert_close(losses[0], eager_loss.detach(), rtol=2e-6, atol=2e-6)
    assert losses[2] < losses[0] and ra.steps == 3
    assert all(torch.equal(p, q) for p, q in zip(word.parameters(), frozen))
    torch._dynamo.reset()
