"""Tempo for decoder LMs: RMSNorm keeping its output, SwiGLU's gating keeping its two inputs (ops.rms_norm), the
module swap on transformers' Llama, Qwen2 and Mistral and the graph pass on nn.RMSNorm / F.rms_norm / SiLU
products.

References are computed another way: torch's F.rms_norm and F.silu under ordinary autograd, float64
gradcheck, the unmodified transformers model, and the bytes each op saves counted from the tensor sizes.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import comera_compile as cc
from comera_compile.memory import SavedTensors
from comera_compile.ops.buffers import TempoDtypeWarning
from comera_compile.ops.rms_norm import rms_norm, silu_mul, upcast_rms_norm
from comera_compile.ops.tempo_modules import TempoGatedMLP, TempoRMSNorm, TempoUpcastRMSNorm
from comera_compile.passes.fx.tempo import tempo_graph
from comera_compile.passes.module.tempo import tempo_modules
from tempo_helpers import SETTINGS, close, grads_of

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------------------------------------------------
# The ops


@given(st.integers(1, 6), st.sampled_from([(8,), (33,), (4, 5)]), st.booleans(),
       st.sampled_from([torch.float32, torch.float64]), st.integers(0, 99))
@settings(**SETTINGS)
def test_rms_norm_matches_torch(rows, shape, weighted, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 3, *shape, generator=gen, dtype=dtype) * 3 + 1
    g = torch.randn(x.shape, generator=gen, dtype=dtype)
    w = torch.randn(shape, generator=gen, dtype=dtype)
    w.view(-1)[0] = 0.0        # the normalised input cannot be rebuilt from the output there
    w.view(-1)[-1] = 1e-30     # nor here (the product underflows)
    inputs = [x, w] if weighted else [x]
    got = grads_of(lambda x, *w: rms_norm(x, len(shape), *(w or [None]), eps=1e-6), inputs, g)
    ref = grads_of(lambda x, *w: F.rms_norm(x, shape, *(w or [None]), eps=1e-6), inputs, g)
    for a, r in zip(got, ref):
        close(a, r, dtype)


def test_gradcheck_float64():
    x = torch.randn(6, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        w[2] = 0.0
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, 1, b, 1e-6), (x, w))
    assert torch.autograd.gradcheck(lambda a: rms_norm(a, 2, None, 1e-6), (x,))
    up = torch.randn(6, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(silu_mul, (x, up))
    assert torch.autograd.gradcheck(silu_mul, (x, up[:1].detach().clone().requires_grad_()))   # broadcast up


@given(st.integers(1, 5), st.sampled_from([1, 8, 33]), st.booleans(),
       st.sampled_from([torch.bfloat16, torch.float16, torch.float64, torch.float32]), st.integers(0, 99))
@settings(**SETTINGS)
def test_upcast_rms_norm_matches_the_float32_form_written_out(rows, features, weighted, dtype, seed):
    """transformers' form (a float32 copy normalised, cast back, scaled): bit for bit away from float32, where
    the norm is recomputed from its input; within rounding at float32, where the output is kept."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 3, features, generator=gen) * 3 + 1).to(dtype)
    g = torch.randn(x.shape, generator=gen).to(dtype)
    inputs = [x, (torch.rand(features, generator=gen) + 0.5).to(dtype)] if weighted else [x]

    def written(x, *w):
        h = x.to(torch.float32)
        y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return w[0] * y if w else y

    got = grads_of(lambda x, *w: upcast_rms_norm(x, w[0] if w else None, 1e-6), inputs, g)
    ref = grads_of(written, inputs, g)
    for a, r in zip(got, ref):
        if dtype == torch.float32:
            close(a, r, dtype)
        else:
            assert torch.equal(a, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_mul_gives_autograd_s_gradients_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    gate, up, g = (torch.randn(64, 48, generator=gen).to(dtype) * 4 for _ in range(3))
    got = grads_of(silu_mul, [gate, up], g)
    ref = grads_of(lambda a, b: F.silu(a) * b, [gate, up], g)
    for a, r in zip(got, ref):
        assert torch.equal(a, r)


def test_the_ops_keep_less_than_autograd():
    x = torch.randn(32, 64, requires_grad=True)
    w = nn.Parameter(torch.ones(64))
    with SavedTensors(exclude=w) as saved:
        y = rms_norm(x, 1, w, 1e-6)
        kept = saved.breakdown()
    assert kept[0] == ("(32, 64) torch.float32", 32 * 64 * 4)      # the output
    assert sum(n for _, n in kept[1:]) <= 32 * 4 + 16               # 1/rms per row (and empty extras)
    gate, up = torch.randn(32, 96, requires_grad=True), torch.randn(32, 96, requires_grad=True)
    with SavedTensors() as saved:
        out = silu_mul(gate, up)
        assert saved.bytes == 2 * 32 * 96 * 4                        # gate and up, not silu(gate)
    with SavedTensors() as saved:
        ref = F.silu(gate) * up
        assert saved.bytes == 3 * 32 * 96 * 4
    del y, out, ref


@pytest.mark.parametrize("op", [lambda x: rms_norm(x, 1, None, 1e-6), lambda x: silu_mul(x, x.detach())],
                         ids=["rms_norm", "silu_mul"])
def test_a_double_backward_is_an_error_not_a_wrong_gradient(op):
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(op(x).pow(2).sum(), x, create_graph=True)


# ---------------------------------------------------------------------------------------------------------
# transformers' decoders (module swap)


def _decoder(family: str, layers: int = 2) -> nn.Module:
    config = getattr(transformers, f"{family}Config")(
        vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return getattr(transformers, f"{family}ForCausalLM")(config)


def _step(model: nn.Module, ids: torch.Tensor) -> tuple[float, int, list[torch.Tensor]]:
    """Loss, bytes kept for backward (activations only), and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    with SavedTensors(exclude=model) as saved:
        loss = model(input_ids=ids, labels=ids).loss
        kept = saved.bytes
    loss.backward()
    return loss.item(), kept, [p.grad for p in model.parameters()]


def _same_step(ref: nn.Module, model: nn.Module, ids: torch.Tensor, loss_rel: float = 1e-6, rtol: float = 1e-4,
               atol: float = 1e-6) -> tuple[int, int]:
    """One step of ref and of model (its parameters ref's copies): the loss within loss_rel, every gradient
    close; their bytes kept for backward."""
    loss_r, kept_r, grads_r = _step(ref, ids)
    loss_t, kept_t, grads_t = _step(model, ids)
    assert loss_t == pytest.approx(loss_r, rel=loss_rel, abs=0.0)
    for a, b in zip(grads_t, grads_r):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    return kept_r, kept_t


@pytest.mark.parametrize("family", ["Llama", "Qwen2", "Mistral", "Qwen3"])
@pytest.mark.parametrize("tensorized", [False, True], ids=["dense", "tensorized"])
def test_tempo_on_a_decoder_keeps_less_with_the_same_loss_and_gradients(family, tensorized):
    model = _decoder(family)
    if tensorized:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = cc.tensorize(model, rank=4)
    ref = copy.deepcopy(model)
    keys = list(model.state_dict())
    with pytest.warns(UserWarning, match="cannot trace"):
        out = cc.tempo(model)
    counts = out.tempo_summary.counts()
    qk = 2 * 2 if family == "Qwen3" else 0   # Qwen3 normalises each head's queries and keys too
    assert counts == {"rms_norm": 5 + qk, "swiglu": 2}, out.tempo_summary   # 2 per layer, the final norm; MLPs
    assert list(out.state_dict()) == keys
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    kept_r, kept_t = _same_step(ref, out, ids)
    # each norm keeps its output (which the projections after it keep anyway) instead of its input and the
    # normalised input; each MLP no longer keeps silu(gate): 2 activations per norm, 1 intermediate per MLP.
    # Qwen3's query and key norms (4 and 2 heads): their output is kept by nothing else, so 1 activation each
    tokens, f32 = ids.numel(), 4
    expected = 5 * 2 * tokens * 64 * f32 + 2 * tokens * 176 * f32
    if qk:
        expected += 2 * tokens * (4 + 2) * ref.config.head_dim * f32
    assert kept_r - kept_t >= 0.95 * expected, (kept_r, kept_t, expected)


def test_gpt2_s_python_gelu_becomes_torch_s_tempo_gelu():
    """GPT-2 writes the tanh GELU out in Python (NewGELUActivation: four FFN-sized tensors kept for backward);
    tempo swaps it for the Tempo GELU (its output, which c_proj keeps anyway, and a bit per element), besides
    the LayerNorms and dropouts.  The same function, so the loss matches to float rounding."""
    config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)   # no draws
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ref = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="cannot trace"):
        cc.tempo(model)
    assert model.tempo_summary.counts()["gelu"] == 2
    assert "NewGELUActivation" in model.tempo_summary.replaced["transformer.h.0.mlp.act"]
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    kept_r, kept_t = _same_step(ref, model, ids, loss_rel=1e-5, rtol=1e-3, atol=1e-5)
    ffn = ids.numel() * 4 * 64 * 4   # bytes of one FFN-sized float32 tensor
    assert kept_r - kept_t >= 2 * 3.9 * ffn, (kept_r, kept_t, ffn)


def test_eval_no_grad_and_16_bit_weights_compute_what_the_modules_compute():
    model = _decoder("Llama")
    ref = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="cannot trace"):
        cc.tempo(model)
    layer, ref_layer = model.model.layers[0], ref.model.layers[0]
    assert type(layer.mlp) is TempoGatedMLP and type(layer.input_layernorm) is TempoUpcastRMSNorm
    x = torch.randn(2, 8, 64)
    for mode in ("eval", "no_grad"):
        model.train(mode != "eval"), ref.train(mode != "eval")
        with torch.no_grad() if mode == "no_grad" else torch.enable_grad():
            assert torch.equal(layer.mlp(x), ref_layer.mlp(x))
            assert torch.equal(layer.input_layernorm(x), ref_layer.input_layernorm(x))
    model.train(), ref.train()
    model.bfloat16(), ref.bfloat16()
    xb = x.bfloat16().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error", TempoDtypeWarning)   # no fallback at 16 bits (upcast_rms_norm)
        got = layer.input_layernorm(xb)
    assert torch.equal(got, ref_layer.input_layernorm(xb))
    assert torch.equal(layer.mlp(xb), ref_layer.mlp(xb))   # silu_mul at any dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast"])
def test_a_16_bit_or_float64_llama_norm_keeps_its_input_only_with_autograd_s_gradients(dtype, autocast):
    """Away from float32 the swapped norm keeps its input (recomputing the float32 copy and the cast rows in
    the backward), where transformers' norm keeps the float32 copy and the cast rows: at 16 bits a third of
    the bytes.  Output and gradients are the module's bit for bit, also under autocast; a double backward is
    an error."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    ref = LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
    ref = ref.to(dtype)
    swapped = TempoUpcastRMSNorm(nn.Parameter(ref.weight.detach().clone()), ref.variance_epsilon)
    x = (torch.randn(4, 32, 64) * 3).to(dtype)
    g = torch.randn(4, 32, 64).to(dtype)
    results = []
    for norm in (ref, swapped):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), SavedTensors(exclude=norm) as saved:
            y = norm(xi)
            kept = saved.bytes
        y.backward(g)
        results.append((y, xi.grad, norm.weight.grad, kept))
    (y_r, gx_r, gw_r, kept_r), (y_t, gx_t, gw_t, kept_t) = results
    assert torch.equal(y_t, y_r) and torch.equal(gx_t, gx_r) and torch.equal(gw_t, gw_r)
    assert kept_t == x.numel() * x.element_size()
    assert kept_r >= x.numel() * (4 + x.element_size())
    with pytest.raises(RuntimeError, match="double backward"):
        xi = x.clone().requires_grad_()
        torch.autograd.grad(swapped(xi).float().pow(2).sum(), xi, create_graph=True)


def test_a_bfloat16_llama_trains_as_the_untouched_model_keeping_less():
    """A Llama in bfloat16 (its weights too, as many pretraining recipes keep them): after cc.tempo the loss
    and every gradient are the untouched model's bit for bit, and the norms no longer keep float32 copies."""
    model = _decoder("Llama").bfloat16()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # tempo's "cannot trace"
        warnings.simplefilter("error", TempoDtypeWarning)
        cc.tempo(model)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(5))
    with warnings.catch_warnings():
        warnings.simplefilter("error", TempoDtypeWarning)
        loss_t, kept_t, grads_t = _step(model, ids)
    loss_r, kept_r, grads_r = _step(ref, ids)
    assert loss_t == loss_r and all(torch.equal(a, b) for a, b in zip(grads_t, grads_r))
    # 5 norms, each keeping its bfloat16 input instead of a float32 copy, bfloat16 rows and float32 1/rms per
    # row; 2 gatings, silu(gate) no longer
    expected = 5 * ids.numel() * (64 * 4 + 4) + 2 * ids.numel() * 176 * 2
    assert kept_r - kept_t == expected, (kept_r, kept_t, expected)


def test_under_bf16_autocast_the_loss_is_the_same_and_less_is_kept():
    """CPU bf16 autocast: the residual stream stays float32, so the norms run the Tempo op; the gating runs at
    the projections' bfloat16.  The loss is the unmodified model's, bit for bit."""
    model = _decoder("Llama")
    ref = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="cannot trace"):
        cc.tempo(model)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept_r, kept_t = _same_step(ref, model, ids, loss_rel=0.0)
    assert kept_t < 0.9 * kept_r, (kept_t, kept_r)


def test_other_forms_are_left_alone():
    """Gemma's RMSNorm scales by 1 + weight and Phi3 fuses gate and up: not Llama's forms, so not swapped; a
    module of the user's own named like one is not either."""
    class MyRMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.variance_epsilon = nn.Parameter(torch.ones(8)), 1e-6

        def forward(self, x):
            return self.weight * x / x.abs().mean(-1, keepdim=True)

    gemma = transformers.models.gemma.modeling_gemma.GemmaRMSNorm(8)
    phi3 = transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        pad_token_id=0, bos_token_id=0, eos_token_id=0))
    model = nn.ModuleDict({"gemma": gemma, "mine": MyRMSNorm(), "phi3": phi3})
    summary = tempo_modules(model).tempo_summary
    assert all(w.startswith("phi3.") for w in summary.replaced), summary
    # its RMSNorms (Llama's form) are swapped, its MLP is not
    assert not any(w.endswith(".mlp") for w in summary.replaced), summary
    assert type(model["gemma"]) is type(gemma) and type(model["mine"]) is MyRMSNorm


def test_a_module_with_hooks_is_left_as_is_and_listed():
    """A hook on an MLP or norm (a user's activation capture, accelerate's patched forward) would be dropped with
    the module: such a module stays, named in the summary's kept."""
    model = _decoder("Llama", layers=1)
    seen = []
    model.model.layers[0].mlp.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    model.model.norm.forward = model.model.norm.forward   # an instance-level forward, as accelerate sets
    with pytest.warns(UserWarning, match="cannot trace"):
        summary = cc.tempo(model).tempo_summary
    assert "model.layers.0.mlp" in summary.kept and "model.norm" in summary.kept, summary
    assert summary.counts() == {"rms_norm": 2}
    model(input_ids=torch.randint(0, 128, (1, 8)))
    assert seen == [torch.Size([1, 8, 64])]


def test_the_swapped_model_pickles_and_its_norm_output_is_guarded_against_in_place_writes():
    model = _decoder("Qwen2", layers=1)
    with pytest.warns(UserWarning):
        cc.tempo(model)
    clone = copy.deepcopy(model)
    ids = torch.randint(0, 128, (1, 8))
    assert torch.equal(clone(input_ids=ids).logits, model(input_ids=ids).logits)
    y = model.model.norm(torch.randn(2, 64, requires_grad=True))
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


# ---------------------------------------------------------------------------------------------------------
# The graph pass


class _Decoderish(nn.Module):
    """A decoder block of one's own: nn.RMSNorm, F.rms_norm, nn.SiLU and F.silu gating (up * silu in one)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(16)
        self.w2 = nn.Parameter(torch.rand(16) + 0.5)
        self.gate, self.up, self.down = nn.Linear(16, 40), nn.Linear(16, 40), nn.Linear(40, 16)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        h = h + self.down(self.act(self.gate(h)) * self.up(h))
        h2 = F.rms_norm(h, (16,), self.w2, 1e-5)
        return h + self.down(self.up(h2) * F.silu(self.gate(h2)))


def test_the_graph_pass_replaces_rms_norms_and_silu_products_with_the_same_gradients():
    model = _Decoderish()
    gm = torch.fx.symbolic_trace(copy.deepcopy(model))
    summary = tempo_graph(gm).summary
    assert summary.counts() == {"rms_norm": 2, "swiglu": 2}, summary
    x = torch.randn(4, 16, dtype=torch.float64)
    g = torch.randn(4, 16, dtype=torch.float64)
    model.double(), gm.double()
    got = grads_of(gm, [x], g)
    ref = grads_of(model, [x], g)
    for a, r in zip(got, ref):
        close(a, r, torch.float64)
    for (n, p), q in zip(gm.named_parameters(), model.parameters()):
        close(p.grad, q.grad, torch.float64)
    gm.eval()   # the module's mode is read at run time: eval runs torch's RMSNorm
    assert any(n.target.__name__ == "module_rms_norm" for n in gm.graph.nodes if n.op == "call_function")


def test_the_graph_pass_keeps_the_call_of_a_hooked_module():
    model = _Decoderish()
    seen = []
    model.norm.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    model.act.register_forward_pre_hook(lambda m, i: seen.append("act"))
    gm = torch.fx.symbolic_trace(model)
    summary = tempo_graph(gm).summary
    assert summary.counts() == {"rms_norm": 1, "swiglu": 1}, summary   # the functional norm and gating
    assert {"norm (norm)", "act (act)"} <= set(summary.kept), summary
    gm(torch.randn(3, 16))
    assert seen == [torch.Size([3, 16]), "act"]   # both hooks ran, in the forward's order


class _HandNorm(nn.Module):
    """RMSNorm written out by hand, in transformers' float32 form, the form of Meta's Llama code (x.float(),
    then .type_as(x), then the weight), a shorter one (x * x, no cast, no weight, a residual connection reading
    the input too), or gated by the input's sigmoid."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form, self.weight = form, nn.Parameter(torch.rand(16) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.form == "llama":
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            return self.weight * h.to(x.dtype)
        if self.form == "meta":
            h = x.float()
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x) * self.weight
        if self.form == "gated":   # the last product is by another activation, not a weight per feature
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.sigmoid(x)
        return x + x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + 1e-5)   # x also read after


@pytest.mark.parametrize("form,dtype", [("llama", torch.float32), ("meta", torch.float32), ("short", torch.float32),
                                        ("short", torch.float64), ("gated", torch.float32)])
def test_the_graph_pass_finds_rms_norm_written_out(form, dtype):
    """Replaced at the dtype the code computes at: float64 code written without a cast stays float64.  Rows
    multiplied by another activation are normalised by the Tempo op, with no warning of a fallback."""
    model = _HandNorm(form).to(dtype)
    gm = torch.fx.symbolic_trace(copy.deepcopy(model))
    assert tempo_graph(gm).summary.counts() == {"rms_norm": 1}
    x, g = torch.randn(4, 7, 16, dtype=dtype), torch.randn(4, 7, 16, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = grads_of(gm, [x], g)
    ref = grads_of(model, [x], g)
    for a, r in zip(got, ref):
        close(a, r, dtype)
    if form in ("llama", "meta"):
        close(gm.weight.grad, model.weight.grad, dtype)
    gate = x.numel() if form == "gated" else 0   # sigmoid(x), which the sigmoid and the product keep
    with SavedTensors(exclude=gm) as saved:   # the output and 1/rms per row, not the input and h * rsqrt
        y = gm(x.requires_grad_())
        assert saved.bytes <= (x.numel() + 4 * 7 + gate) * dtype.itemsize + 64
    del y


@pytest.mark.parametrize("form", ["llama", "meta"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_the_graph_pass_recomputes_a_written_out_norm_of_16_bit_input_from_that_input(form, dtype):
    """Code that normalises a float32 copy of a 16-bit (or float64) input and casts back keeps that input alone
    after the pass (the copy, the cast rows and 1/rms no longer), with the code's own output and gradients
    bit for bit and no warning of a fallback."""
    model = _HandNorm(form).to(dtype)
    gm = torch.fx.symbolic_trace(copy.deepcopy(model))
    assert tempo_graph(gm).summary.counts() == {"rms_norm": 1}
    x, g = (torch.randn(4, 7, 16) * 3).to(dtype), torch.randn(4, 7, 16).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = grads_of(gm, [x], g)
    ref = grads_of(model, [x], g)
    assert all(torch.equal(a, r) for a, r in zip(got, ref))
    assert torch.equal(gm.weight.grad, model.weight.grad)
    kept = []
    for m in (gm, model):
        with SavedTensors(exclude=m) as saved:
            y = m(x.clone().requires_grad_())
            kept.append(saved.bytes)
        del y
    assert kept[0] == x.numel() * x.element_size()
    assert kept[1] >= x.numel() * (4 + x.element_size()), kept


def test_the_backend_s_memory_option_finds_a_llama_s_norms_and_gating():
    """options={"memory": True}: the Tempo pass on dynamo's graph of a Llama, whose RMSNorm and MLP are inlined
    as torch ops: every norm and gating replaced, the loss and gradients of the model run eagerly."""
    model = _decoder("Llama")
    ref = copy.deepcopy(model)
    summaries = []
    handler = logging.Handler()
    handler.emit = lambda record: summaries.append(record.getMessage())
    logger = logging.getLogger("comera_compile.tempo")
    logger.addHandler(handler), logger.setLevel(logging.INFO)
    try:
        compiled = torch.compile(model, backend="comera", options={"memory": True})
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
        _, kept_t = _same_step(ref, compiled, ids)
        # the bytes of dynamo's graph run as it is (torch 2.11 writes attention out otherwise than eager)
        _, kept_r, _ = _step(torch.compile(ref, backend="eager"), ids)
    finally:
        logger.removeHandler(handler)
    assert any("replaced 5 rms_norm, 2 swiglu" in s for s in summaries), summaries
    expected = 5 * 2 * ids.numel() * 64 * 4 + 2 * ids.numel() * 176 * 4
    assert kept_r - kept_t >= 0.95 * expected, (kept_r, kept_t, expected)


def test_tempo_then_compile_trains_as_eager(fresh_dynamo):
    """cc.tempo on a Llama, then torch.compile with backend "comera": one graph (the ops run torch's ops under
    torch.compile, buffers.traced), losses and gradients as the unmodified model's in eager mode."""
    from torch._dynamo.utils import counters

    model = _decoder("Llama")
    ref = copy.deepcopy(model)
    with pytest.warns(UserWarning):
        cc.tempo(model)
    compiled = torch.compile(model, backend="comera")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    _same_step(ref, compiled, ids, loss_rel=1e-5, rtol=1e-3, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])


def _deep(family: str) -> nn.Module:
    """A 12-layer decoder (hidden 128) from transformers' own config at its defaults (use_cache on),
    tensorized at rank 8."""
    config = getattr(transformers, f"{family}Config")(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=12, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cc.tensorize(getattr(transformers, f"{family}ForCausalLM")(config), rank=8, min_features=64)


@pytest.mark.parametrize("family", ["Llama", pytest.param("Qwen2", marks=pytest.mark.slow)])
def test_a_12_layer_tempo_decoder_under_compile_step_and_the_trainer(family, fresh_dynamo, tmp_path):
    """What users run: cc.tensorize, cc.tempo, RankAdaptive, then cc.compile_step at its defaults (one graph
    for the twelve layers, the losses of the untouched model's eager steps) and the eager Trainer with
    RankAdaptive's callback (the losses of the same Trainer run on the untouched model)."""
    from torch._dynamo.utils import counters

    ref = _deep(family)
    model = copy.deepcopy(ref)
    with pytest.warns(UserWarning, match="cannot trace"):
        summary = cc.tempo(model).tempo_summary
    assert summary.counts() == {"rms_norm": 25, "swiglu": 12}, summary
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 256, (2, 32), generator=g) for _ in range(3)]

    def loss_fn(out, ids):
        return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    runs = []
    for m, compiled in ((ref, False), (copy.deepcopy(model), True)):
        opt = torch.optim.AdamW(cc.param_groups(m, lr=1e-3))
        ra = cc.RankAdaptive(m, optimizer=opt)
        step = cc.compile_step(m, loss_fn, opt, rank_adaptive=ra) if compiled else None
        losses = []
        for ids in batches:
            if compiled:
                losses.append(float(step(ids, ids)))
            else:
                loss = loss_fn(m(ids), ids)
                loss.backward(), opt.step(), opt.zero_grad(set_to_none=True), ra.step(loss.detach())
                losses.append(loss.item())
        runs.append(losses)
    assert runs[1] == pytest.approx(runs[0], rel=1e-4)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])

    data = [{"input_ids": ids[0], "labels": ids[0]} for ids in batches for _ in range(2)]
    logged = []
    for m in (_deep(family), model):
        ra = cc.RankAdaptive(m)
        opt = torch.optim.AdamW(cc.param_groups(m, lr=1e-3))
        args = transformers.TrainingArguments(str(tmp_path / str(len(logged))), max_steps=3, logging_steps=1,
                                              per_device_train_batch_size=2, report_to="none", use_cpu=True)
        trainer = transformers.Trainer(model=m, args=args, train_dataset=data, optimizers=(opt, None),
                                       callbacks=[ra.trainer_callback()])
        trainer.train()
        logged.append([e["loss"] for e in trainer.state.log_history if "loss" in e])
    assert len(logged[1]) == 3 and logged[1] == pytest.approx(logged[0], rel=1e-4)


def test_a_12_layer_bfloat16_tempo_decoder_trains_in_the_trainer_as_the_untouched_model(tmp_path):
    """A 12-layer tensorized Llama with bfloat16 weights (transformers' config at its defaults), cc.tempo, the
    eager Trainer with RankAdaptive's callback: the same logged losses as the untouched model's run, no norm
    falling back (its norms recompute from their 16-bit input), 25 norms and 12 MLPs swapped."""
    ref, model = _deep("Llama").bfloat16(), _deep("Llama").bfloat16()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # tempo's "cannot trace"
        warnings.simplefilter("error", TempoDtypeWarning)
        assert cc.tempo(model).tempo_summary.counts() == {"rms_norm": 25, "swiglu": 12}
    g = torch.Generator().manual_seed(6)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (6, 32), generator=g)]
    logged = []
    for m in (ref, model):
        ra = cc.RankAdaptive(m)
        opt = torch.optim.AdamW(cc.param_groups(m, lr=1e-3))
        args = transformers.TrainingArguments(str(tmp_path / str(len(logged))), max_steps=3, logging_steps=1,
                                              per_device_train_batch_size=2, report_to="none", use_cpu=True)
        trainer = transformers.Trainer(model=m, args=args, train_dataset=data, optimizers=(opt, None),
                                       callbacks=[ra.trainer_callback()])
        with warnings.catch_warnings():
            warnings.simplefilter("error", TempoDtypeWarning)
            trainer.train()
        logged.append([e["loss"] for e in trainer.state.log_history if "loss" in e])
    assert len(logged[1]) == 3 and logged[1] == logged[0], logged
