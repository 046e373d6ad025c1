"""Gradient accumulation in a compiled step: ``compile_step(..., micro_batches=N)`` against eager AdamW steps on
the whole batch (float64), the batch split the way it says, and the errors for batches it cannot split.  The
captured whole step with micro-batches is tests/test_step_graph.py's; two processes, tests/test_ddp.py's; the
CUDA modes, tests/test_device.py's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import comera_compile as cc
from comera_compile.micro_batches import split_batch
from helpers import BlockNet

pytestmark = pytest.mark.usefixtures("single_thread")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return cc.tensorize(BlockNet(), rank=4, min_features=16).double()


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(cc.param_groups(model, lr=3e-3), weight_decay=0.01)


def test_micro_batches_train_as_eager_steps_on_the_whole_batch():
    """Three micro-batches per call (the blocks compiled one by one, by dynamo with the "eager" backend: the
    accumulation is the step's, whatever compiles the blocks; backend "comera" runs it in
    test_regional.py's README test), a batch of 10 rows among ones of 12 (micro-batches of 4, 3 and 3): each
    call returns the whole batch's loss and leaves the parameters of an eager AdamW step on the whole batch,
    step for step, in float64."""
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(rows, 16, generator=g, dtype=torch.float64), torch.randint(0, 5, (rows,), generator=g))
               for rows in (12, 12, 10, 12, 12)]
    ref = _net()
    ref_opt = _optimizer(ref)
    model = _net()
    step = cc.compile_step(model, nn.CrossEntropyLoss(), _optimizer(model), backend="eager", micro_batches=3)
    _assert_trains_as_eager(step, model, ref, ref_opt, [((x, y), {}) for x, y in batches],
                            lambda x, y: F.cross_entropy(ref(x), y))
    assert all(p.grad is None for p in model.parameters())


def _assert_trains_as_eager(step, model: nn.Module, ref: nn.Module, ref_opt: torch.optim.Optimizer, calls: list,
                            ref_loss, loss_tol: tuple[float, float] = (1e-12, 1e-12), param_atol: float = 1e-12
                            ) -> None:
    """step(*args, **kwargs) for each call against an eager step of ref on the whole batch, call by call: the
    loss (within loss_tol, rtol and atol) and every parameter (float64, rtol 1e-10, atol param_atol)."""
    for i, (args, kwargs) in enumerate(calls):
        loss = step(*args, **kwargs)
        expected = ref_loss(*args, **kwargs)
        expected.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss, expected.detach(), rtol=loss_tol[0], atol=loss_tol[1],
                                   msg=f"loss of step {i}")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=param_atol, msg=f"{name} after step {i}")


@pytest.mark.parametrize("regional", [True, False], ids=["blocks", "whole-model"])
def test_micro_batches_pass_arguments_without_a_batch_dimension_whole(regional):
    """A float and a 0-dim tensor among the inputs, one passed by keyword, reach every micro-batch as they
    are; the step equals the eager one on the whole batch, with the blocks compiled one by one or forward and
    loss as one graph (regional=False)."""
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(8, 16, generator=g, dtype=torch.float64), torch.randint(0, 5, (8,), generator=g)
    weight = torch.tensor(0.5, dtype=torch.float64)
    ref = _net()
    ref_opt = _optimizer(ref)
    (F.cross_entropy(ref(x, 0.7), y) * weight).backward()
    ref_opt.step()
    model = _net()

    class WithWeight(nn.Module):   # passes the 0-dim weight through to the loss
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, x, scale, w=None):
            return self.net(x, scale), w

    step = cc.compile_step(WithWeight(), lambda out, t: F.cross_entropy(out[0], t) * out[1],
                           _optimizer(model), backend="eager", regional=regional, micro_batches=4)
    step(x, 0.7, y, w=weight)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def test_micro_batches_split_the_tensors_inside_dicts_lists_and_tuples():
    """A target passed as a dict of row tensors (labels and row weights) and an input inside a tuple are split
    with the rest: the step equals the eager one on the whole batch at 2 and at 8 micro-batches (one row each,
    where an unsplit 8-row target would broadcast against 1-row outputs).  A mapping it cannot look inside
    (transformers' BatchEncoding is a UserDict) is an error that says what to pass."""
    from collections import UserDict

    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 16, generator=g, dtype=torch.float64)
    target = {"y": torch.randint(0, 5, (8,), generator=g), "w": [torch.rand(8, generator=g, dtype=torch.float64)]}

    class Packed(nn.Module):   # takes its input inside a tuple
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def forward(self, xs: tuple) -> torch.Tensor:
            return self.net(xs[0])

    def loss_fn(out: torch.Tensor, t: dict) -> torch.Tensor:
        return (F.cross_entropy(out, t["y"], reduction="none") * t["w"][0]).mean()

    for parts in (2, 8):
        ref, model = _net(), _net()
        ref_opt = _optimizer(ref)
        step = cc.compile_step(Packed(model), loss_fn, _optimizer(model), backend="eager", micro_batches=parts)
        _assert_trains_as_eager(step, model, ref, ref_opt, [(((x,), target), {})] * 2,
                                lambda xs, t: loss_fn(ref(xs[0]), t))
    with pytest.raises(ValueError, match=r"argument 1 is a UserDict holding tensors.*\*\*batch"):
        step((x,), UserDict(target))
    with pytest.raises(ValueError, match=r"argument 1\['w'\]\[0\] has shape \(6,\) against 8 rows"):
        step((x,), {"y": target["y"], "w": [target["w"][0][:6]]})


def test_micro_batch_errors_say_what_to_do():
    """A count that is not a whole number >= 1 is refused when the step is built; a batch that cannot be split
    (a tensor whose first dimension is not the batch, fewer rows than micro-batches, no tensor at all) at the
    call, before any forward, so the parameters are untouched."""
    model = _net()
    opt = _optimizer(model)
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="micro_batches=.*whole number >= 1"):
            cc.compile_step(model, nn.CrossEntropyLoss(), opt, backend="eager", micro_batches=bad)
    before = [p.detach().clone() for p in model.parameters()]
    step = cc.compile_step(model, nn.CrossEntropyLoss(), opt, backend="eager", micro_batches=4)
    x = torch.randn(8, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"argument 1 has shape \(6,\) against 8 rows in argument 0"):
        step(x, torch.zeros(6, dtype=torch.long))
    with pytest.raises(ValueError, match="batch of 3 row.*at least 4 rows, or fewer micro-batches"):
        step(x[:3], torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="has none: pass the batch as tensors"):
        split_batch((1.0, "y"), 2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), parts=st.integers(1, 12), width=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_split_batch_covers_the_batch_in_order_and_its_shares_make_the_mean(rows, parts, width, seed):
    """For any batch of at least `parts` rows: the micro-batches put back together are the batch, their sizes
    differ by at most one row, and the shares (rows over the batch) weigh the micro-batches' row means into
    the batch's mean (to float64 rounding)."""
    if rows < parts:
        with pytest.raises(ValueError):
            split_batch((torch.zeros(rows, width),), parts)
        return
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g, dtype=torch.float64)
    target = torch.randint(0, 9, (rows,), generator=g)
    pieces = split_batch((x, 2.0, target), parts)
    assert len(pieces) == parts
    assert torch.equal(torch.cat([p[0][0] for p in pieces]), x)
    assert torch.equal(torch.cat([p[0][2] for p in pieces]), target)
    assert all(p[0][1] == 2.0 for p in pieces)
    sizes = [p[0][0].shape[0] for p in pieces]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    mean = sum(share * part[0].mean(0) for part, share in pieces)
    torch.testing.assert_close(mean, x.mean(0), rtol=1e-12, atol=1e-12)


def _transformers_model(family: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    small = dict(vocab_size=48, num_hidden_layers=2, num_attention_heads=2)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_key_value_heads=2, **small))
    elif family == "gpt2":   # no loss_type: transformers' default causal loss
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=32, n_layer=2, n_head=2, vocab_size=48, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0))
    else:                    # a masked LM: labels not shifted (dropout off: the two runs draw differently)
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            hidden_size=32, intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **small))
    return cc.tensorize(model, rank=4, min_features=32).double()


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_micro_batches_of_a_padded_transformers_batch_make_its_token_mean(family):
    """A transformers model given labels averages its loss over the label tokens that are not -100.  Rows
    padded to different lengths (and, for the masked LM, a few positions labelled each), split into three
    micro-batches of which one has no label token at all: each call returns the whole batch's loss and
    leaves the parameters of an eager AdamW step on the whole batch, in float64.  Weighing the micro-batches
    by rows instead is off by far more than the tolerance (the first row holds most of the tokens)."""
    g = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(3):
        ids = torch.randint(1, 48, (6, 12), generator=g)
        lengths = torch.tensor([12, 11, 1, 1, 3, 2])   # micro-batches of rows (0, 1), (2, 3), (4, 5)
        mask = (torch.arange(12) < lengths[:, None]).long()
        labels = ids.masked_fill(mask == 0, -100)
        if family == "bert":   # a masked LM's labels: the positions it predicts, here one in three
            labels = labels.masked_fill(torch.rand(6, 12, generator=g) > 0.34, -100)
            labels[2:4] = -100
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    ref = _transformers_model(family)
    ref_opt = _optimizer(ref)
    model = _transformers_model(family)
    step = cc.compile_step(model, None, _optimizer(model), backend="eager", micro_batches=3)
    # transformers computes the loss in float32 (its logits upcast), the gradients in float64; GPT-2's key bias
    # gets a gradient of rounding noise (softmax ignores it), which AdamW scales up: 1e-12-sized differences
    _assert_trains_as_eager(step, model, ref, ref_opt, [((), batch) for batch in batches],
                            lambda **batch: ref(**batch).loss, loss_tol=(1e-6, 1e-7), param_atol=1e-11)
    rows = _transformers_model(family)
    by_rows = cc.compile_step(rows, None, _optimizer(rows), backend="eager", micro_batches=3,
                              micro_batch_weights="rows")
    for batch in batches:
        by_rows(**batch)
    assert max(float((p - q).detach().abs().max()) for p, q in zip(rows.parameters(), ref.parameters())) > 1e-4


class _PerToken(nn.Module):
    """BlockNet on every position of a (rows, positions, 16) batch, its logits laid out (rows, 5, positions)
    as nn.CrossEntropyLoss takes a sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).transpose(1, 2)


def _padded_calls(seed: int) -> list:
    """Three batches of 6 rows x 8 positions whose targets are -100 (ignored) past each row's length: rows 0
    and 1 hold most of the tokens, so micro-batches of two rows hold very different counts."""
    g = torch.Generator().manual_seed(seed)
    calls = []
    for _ in range(3):
        x = torch.randn(6, 8, 16, generator=g, dtype=torch.float64)
        lengths = torch.tensor([8, 7, 1, 2, 1, 3])
        y = torch.randint(0, 5, (6, 8), generator=g).masked_fill(torch.arange(8) >= lengths[:, None], -100)
        calls.append(((x, y), {}))
    return calls


@pytest.mark.parametrize("case", ["CrossEntropyLoss", "function, tokens", "sum"])
def test_micro_batches_of_a_token_mean_loss_fn_make_the_whole_batch_mean(case):
    """A loss_fn averaging over the target's entries other than -100 (a padded or masked batch): with
    nn.CrossEntropyLoss the micro-batches weigh by their share of those tokens by default, a plain function
    does with micro_batch_weights="tokens", and a summing loss adds its micro-batches up; each call returns
    the whole batch's loss and leaves the parameters of an eager AdamW step on it (float64).  Weighing by rows
    instead (what a plain function gets by default) leaves other parameters."""
    loss_fn, weights = {"CrossEntropyLoss": (nn.CrossEntropyLoss(), None),
                        "function, tokens": (lambda out, y: F.cross_entropy(out, y), "tokens"),
                        "sum": (nn.CrossEntropyLoss(reduction="sum"), None)}[case]
    ref = _PerToken()
    ref_opt = _optimizer(ref)
    model = _PerToken()
    step = cc.compile_step(model, loss_fn, _optimizer(model), backend="eager", micro_batches=3,
                           micro_batch_weights=weights)
    _assert_trains_as_eager(step, model, ref, ref_opt, _padded_calls(6), lambda x, y: loss_fn(ref(x), y))
    if case == "sum":
        return
    rows = _PerToken()
    by_rows = cc.compile_step(rows, loss_fn, _optimizer(rows), backend="eager", micro_batches=3,
                              micro_batch_weights="rows")
    for args, _ in _padded_calls(6):
        by_rows(*args)
    gap = max(float((p - q).detach().abs().max()) for p, q in zip(rows.parameters(), ref.parameters()))
    assert gap > 1e-4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_models_token_weighted_micro_batches_make_the_float64_mean(dtype):
    """A half-precision model whose loss comes out in its dtype: the micro-batches' shares of 70,000 label
    tokens (above float16's largest number; bfloat16 rounds counts above 256) still make the batch's mean,
    and the step updates every parameter."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(4, 16), nn.Linear(16, 4))
    ref = [p.detach().double() for p in model.parameters()]
    model = model.to(dtype)
    x = torch.randint(0, 4, (2, 35_000), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 4, (2, 35_000), generator=torch.Generator().manual_seed(2))
    y[1, 30_001:] = -100   # parts of 35,000 and 30,001 tokens: shares 0.538... and 0.461...
    loss_fn = lambda out, t: F.cross_entropy(out.transpose(1, 2), t)   # noqa: E731  (in the model's dtype)
    step = cc.compile_step(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1), backend="eager",
                           micro_batches=2, micro_batch_weights="tokens")
    loss = step(x, y)
    emb, lin_w, lin_b = ref
    expected = F.cross_entropy((F.embedding(x, emb) @ lin_w.t() + lin_b).transpose(1, 2), y)
    assert loss.dtype == dtype
    torch.testing.assert_close(loss.double(), expected, rtol=2e-2, atol=0)
    assert all(not torch.equal(p.detach().double(), r) for p, r in zip(model.parameters(), ref))


def _token_mean(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A token mean written out as users write it: 0/0 (NaN, and a NaN backward) for a batch without tokens."""
    keep = y.ne(-100)
    per = F.cross_entropy(logits, y.clamp(min=0), reduction="none")
    return (per * keep).sum() / keep.sum()


@pytest.mark.parametrize("empty", [0, 1, 2])
def test_a_micro_batch_without_tokens_leaves_a_written_out_token_means_step_as_the_whole_batchs(empty):
    """Micro-batch `empty` of three holds only -100 targets: its share of the token mean is zero, and its NaN
    backward (0/0 in the user's loss) reaches no parameter; the step is an eager step on the whole batch."""
    calls = []
    for (x, y), kw in _padded_calls(7):
        y = y.clone()
        y[2 * empty: 2 * empty + 2] = -100
        calls.append(((x, y), kw))
    ref = _PerToken()
    ref_opt = _optimizer(ref)
    model = _PerToken()
    step = cc.compile_step(model, _token_mean, _optimizer(model), backend="eager", micro_batches=3,
                           micro_batch_weights="tokens")
    _assert_trains_as_eager(step, model, ref, ref_opt, calls, lambda x, y: _token_mean(ref(x), y))


def test_a_padded_target_weighed_by_rows_by_default_is_said_once():
    """A function of the user's as loss_fn (weighed by rows by default) whose target holds -100 entries: the
    first call warns once, at the caller's line, naming micro_batch_weights='tokens'; asking for rows, or a
    loss module that weighs by tokens itself, says nothing, nor does a target without -100."""
    import warnings

    calls = _padded_calls(6)
    model = _PerToken()
    step = cc.compile_step(model, lambda out, y: F.cross_entropy(out, y), _optimizer(model), backend="eager",
                           micro_batches=3)
    with pytest.warns(UserWarning, match="holds -100 entries.*micro_batch_weights='tokens'") as said:
        step(*calls[0][0])
    ours = [w for w in said if "holds -100 entries" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*holds -100 entries")
        step(*calls[1][0])   # once
        for loss_fn, weights in ((lambda out, y: F.cross_entropy(out, y), "rows"), (nn.CrossEntropyLoss(), None)):
            quiet = cc.compile_step(model, loss_fn, _optimizer(model), backend="eager", micro_batches=3,
                                    micro_batch_weights=weights)
            quiet(*calls[2][0])
        unpadded = cc.compile_step(model, lambda out, y: F.cross_entropy(out, y), _optimizer(model), backend="eager",
                                   micro_batches=3)
        x, y = calls[0][0]
        unpadded(x, y.clamp(min=0))


def test_micro_batch_weights_that_cannot_be_right_are_refused():
    """A weighting that is not one of the four, or that contradicts the loss module (tokens or rows for a sum,
    a sum for a mean, a token count for a class-weighted mean), is refused when the step is built; "tokens"
    with a target that is not a tensor, or without a loss_fn on a model that is not transformers', at the
    call, before any forward."""
    model = _PerToken()
    opt = _optimizer(model)
    with pytest.raises(ValueError, match="micro_batch_weights='mean': choose 'rows'"):
        cc.compile_step(model, nn.CrossEntropyLoss(), opt, micro_batches=2, micro_batch_weights="mean")
    with pytest.raises(ValueError, match=r"reduction='sum'\): the loss sums.*add up as they are"):
        cc.compile_step(model, nn.CrossEntropyLoss(reduction="sum"), opt, micro_batches=2, micro_batch_weights="tokens")
    with pytest.raises(ValueError, match=r"reduction='sum'\): the loss sums"):
        cc.compile_step(model, nn.MSELoss(reduction="sum"), opt, micro_batches=2, micro_batch_weights="rows")
    with pytest.raises(ValueError, match=r"reduction='mean'\): the loss averages"):
        cc.compile_step(model, nn.MSELoss(), opt, micro_batches=2, micro_batch_weights="sum")
    with pytest.raises(ValueError, match="class-weighted mean"):
        cc.compile_step(model, nn.CrossEntropyLoss(weight=torch.ones(5, dtype=torch.float64)), opt, micro_batches=2,
                        micro_batch_weights="tokens")
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 8, 16, dtype=torch.float64)
    step = cc.compile_step(model, lambda out, scale: out.square().mean() * scale, opt, backend="eager",
                           micro_batches=2, micro_batch_weights="tokens")
    with pytest.raises(ValueError, match="target .*is float: pass the target as a tensor"):
        step(x, 2.0)
    step = cc.compile_step(model, None, opt, backend="eager", micro_batches=2, micro_batch_weights="tokens")
    with pytest.raises(ValueError, match="is not one or the call passes no labels"):
        step(x)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(2, 12), positions=st.integers(1, 6), parts=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_token_weights_make_the_token_mean_of_any_padding(rows, positions, parts, seed):
    """For any batch whose targets hold -100 anywhere (rows with none left too), the micro-batches' token
    means weighed by micro_batches.token_counts make the whole batch's token mean (float64)."""
    from comera_compile.micro_batches import token_counts, weigh

    parts = min(parts, rows)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, 5, positions, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (rows, positions), generator=g).masked_fill(
        torch.rand(rows, positions, generator=g) < 0.5, -100)
    y[0, 0] = 1   # at least one token in the batch
    pieces = split_batch((logits, y), parts)
    counts = token_counts(nn.Module(), nn.CrossEntropyLoss(), "tokens", [(p, {}) for p, _ in pieces], asked=False)
    total = torch.stack(counts).sum()
    got = sum(weigh(F.cross_entropy(p[0], p[1]), c, total) for (p, _), c in zip(pieces, counts))
    torch.testing.assert_close(got, F.cross_entropy(logits, y), rtol=1e-12, atol=1e-12)
