"""Weights and biases a model shares, and layers tensorize must tell apart: what it rewrites keeps computing
what the model computed and trains as the model would have (a shared bias stays one Parameter, a weight tied
to a module outside the model given is never split in silence), and the layers it cannot rewrite are found
whatever the model's mode or device."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import comera_compile as cc
from comera_compile.layers import TTLayer, TTLinear


class SharedBias(nn.Module):
    """Two layers of different weights and one bias (as BERT's decoder.bias is predictions.bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)
        self.b.bias = self.a.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.filterwarnings("ignore:tensorize. 2 layer")
@pytest.mark.parametrize("inplace", [False, True])
def test_a_shared_bias_stays_one_parameter_through_tensorize_training_and_densify(inplace):
    torch.manual_seed(0)
    dense = SharedBias()
    original = dense.a.bias
    before = original.detach().clone()
    model = cc.tensorize(dense, rank=64, init="svd", min_features=1, inplace=inplace)
    assert isinstance(model.a, TTLinear) and isinstance(model.b, TTLinear)
    assert model.a.bias is model.b.bias
    assert (model.a.bias is original) == inplace   # a copy leaves the user's model its own bias
    x = torch.randn(8, 64, dtype=torch.float64).float()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).square().mean().backward()
    opt.step()
    assert torch.equal(model.a.bias, model.b.bias) and not torch.equal(model.a.bias, before)
    if not inplace:
        assert torch.equal(original, before)
    plain = cc.densify(model)
    assert type(plain.a) is nn.Linear and plain.a.bias is plain.b.bias
    torch.testing.assert_close(plain(x), model(x), rtol=1e-4, atol=1e-5)


def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=101, n_embd=32, n_layer=1, n_head=4, n_positions=16))


def test_tensorizing_the_body_alone_keeps_the_embedding_the_head_is_tied_to_dense_and_says_so():
    model = _tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    with pytest.warns(UserWarning, match=r"outside GPT2Model \(wte\).*left dense so they stay tied"):
        body = cc.tensorize(model.transformer, rank=4, min_features=1)
    assert type(body.wte) is nn.Embedding and isinstance(body.h[0].mlp.c_fc, TTLinear)
    assert "outside" in body.comera_summary.kept_dense["wte"]
    with pytest.warns(UserWarning, match="UNTIED from it"):
        untied = cc.tensorize(model.transformer, rank=4, min_features=1, tied="untie")
    assert isinstance(untied.wte, TTLayer)
    # the whole model: no such warning, the tie is seen inside (kept dense, tied)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        whole = cc.tensorize(model, rank=4, min_features=1)
    assert not any("outside" in str(w.message) for w in caught)
    assert whole.lm_head.weight is whole.transformer.wte.weight


def test_densify_gives_conv1d_back_when_the_summary_sits_on_an_outer_model(tmp_path):
    """GPT-2's square attn.c_proj, tensorized through the body and densified through the whole model: Conv1D
    (weight (in, out)), which GPT-2's checkpoints fit, not a Linear they would load transposed."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = _tiny_gpt2().eval()
    ids = torch.randint(0, 101, (2, 9))
    with torch.no_grad():
        want = model(ids).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.transformer = cc.tensorize(model.transformer, rank=10**6, init="svd", min_features=1)
    plain = cc.densify(model)
    conv = transformers.pytorch_utils.Conv1D
    assert type(plain.transformer.h[0].attn.c_proj) is conv and type(plain.transformer.h[0].attn.c_attn) is conv
    plain.save_pretrained(tmp_path)
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, want, rtol=1e-4, atol=1e-4)


class DropConnect(nn.Linear):
    """A Linear whose forward drops weight entries in training only: not the plain linear map."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, F.dropout(self.weight, 0.5, self.training), self.bias)


class PlainSubclass(nn.Linear):
    """A subclass whose forward is the plain linear map (as Falcon's FalconLinear)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_subclass_whose_forward_differs_in_training_stays_dense_in_either_mode(mode):
    model = nn.Sequential(DropConnect(64, 64), nn.ReLU(), nn.Linear(64, 64))
    getattr(model, mode)()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = cc.tensorize(model, rank=8)
    assert type(out[0]) is DropConnect and isinstance(out[2], TTLinear)


def test_a_plain_subclass_is_rewritten_on_the_meta_device_as_on_the_cpu():
    with torch.device("meta"):
        model = nn.Sequential(PlainSubclass(64, 64), nn.ReLU())
    out = cc.tensorize(model, rank=8)
    assert isinstance(out[0], TTLinear) and out[0].cores[0].is_meta
    assert model[0].weight.is_meta and type(model[0]) is PlainSubclass   # the user's model as it was


def test_numpy_and_tensor_integer_ranks_are_ranks():
    for rank in (np.int64(8), torch.tensor(8)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = cc.tensorize(nn.Sequential(nn.Linear(64, 128)), rank=rank)
        assert out[0].spec.ranks == cc.tensorize(nn.Sequential(nn.Linear(64, 128)), rank=8)[0].spec.ranks
    assert TTLinear(64, 64, rank=np.int64(4)).spec.ranks == TTLinear(64, 64, rank=4).spec.ranks


def test_init_svd_of_weights_on_the_meta_device_is_an_error_that_says_what_to_do():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 128))
    with pytest.raises(cc.TensorizeError, match="meta device.*init='random'"):
        cc.tensorize(model, rank=8, init="svd")


class Aliased(nn.Module):
    """A layer registered under two names (user code that keeps a handle on a block's first layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
        self.first = self.body[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.parametrize("how", ["include", "include-pattern", "exclude", "shapes"])
def test_include_exclude_and_shapes_match_a_layer_by_any_name_it_is_registered_by(how):
    torch.manual_seed(0)
    model = Aliased()
    dense0, dense1 = model.body[0].weight.detach().clone(), model.body[1].weight.detach().clone()
    kwargs = {"include": {"include": "first"}, "include-pattern": {"include": "fir*"}, "exclude": {"exclude": "first"},
              "shapes": {"shapes": {"first": {"in_modes": (16, 16), "out_modes": (16, 16)}}}}[how]
    tt = cc.tensorize(model, rank=8, **kwargs)
    assert tt.first is tt.body[0]  # the alias still names the layer the forward calls
    if how == "exclude":
        assert type(tt.body[0]) is nn.Linear and torch.equal(tt.body[0].weight, dense0)
        assert isinstance(tt.body[1], TTLinear)
    else:
        assert isinstance(tt.body[0], TTLinear)
        if how == "shapes":
            assert tt.body[0].spec.in_modes == (16, 16) and isinstance(tt.body[1], TTLinear)
        else:
            assert type(tt.body[1]) is nn.Linear and torch.equal(tt.body[1].weight, dense1)
