"""The GPU tier: what a user training on a CUDA device relies on, marked ``cuda``.

By default these run on the first CUDA device and skip cleanly where there is none.  ``pytest -m cuda
--device cpu`` (``make test-device``) runs the same code paths on the CPU wherever they exist there; the
checks only CUDA has (CUDA Graph trees, ``torch.cuda.max_memory_allocated``, device-side asserts) skip
with the reason.

References are computed another way: TT layers against the dense product of their cores in float64 on the
CPU (autograd through the dense weight for the gradients); embeddings against F.embedding of the dense
table; the Tempo ops against the plain torch ops; compiled steps against eager steps; dropout masks against
the gradient autograd sends through them.
"""

from __future__ import annotations

import copy
import math
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera_compile as cc
from comera_compile.backend import CudaGraphCaptures
from comera_compile.embedding import TTEmbedding, TTEmbeddingBag
from comera_compile.layers import TTLinear
from comera_compile.optim import param_groups
from helpers import perturb_gates, rel_err

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def needs_cuda(device: torch.device, what: str) -> None:
    if device.type != "cuda":
        pytest.skip(f"{what} exists only on CUDA (ran with --device {device.type})")


def _dense_reference(layer: TTLinear, x: torch.Tensor, grad_out: torch.Tensor):
    """y = x W^T + b and the gradients of <y, grad_out> for x, the cores, the gates and the bias, computed in
    float64 on the CPU through the dense weight the cores represent."""
    ref = copy.deepcopy(layer).to(device="cpu", dtype=torch.float64)
    x64 = x.detach().to("cpu", torch.float64).requires_grad_()
    y = x64 @ ref.to_dense().t() + ref.bias
    params = [x64, *ref.cores, *ref.gates, ref.bias]
    grads = torch.autograd.grad((y * grad_out.to("cpu", torch.float64)).sum(), params)
    return y.detach(), grads


def _tt_grads(layer: TTLinear, x: torch.Tensor, grad_out: torch.Tensor, autocast: torch.dtype | None = None):
    x = x.detach().clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=autocast, enabled=autocast is not None):
        y = layer(x)
    params = [x, *layer.cores, *layer.gates, layer.bias]
    return y, torch.autograd.grad((y.float() * grad_out).sum(), params)


@pytest.mark.parametrize("shape", [(768, 3072, 30, 256), (100, 300, 12, 33)], ids=["ffn-up-r30", "padded"])
def test_tt_linear_forward_backward_against_dense_fp32(device, shape):
    fan_in, fan_out, rank, rows = shape
    torch.manual_seed(0)
    layer = TTLinear(fan_in, fan_out, rank=rank).to(device)
    perturb_gates(layer)
    x = torch.randn(rows, fan_in, device=device)
    grad_out = torch.randn(rows, fan_out, device=device)
    y, grads = _tt_grads(layer, x, grad_out)
    y_ref, grads_ref = _dense_reference(layer, x, grad_out)
    assert y.dtype == torch.float32 and y.device.type == device.type
    # float32 GEMMs (TF32 off, torch's default): ~1e-6 here; a wrong contraction is off by O(1)
    assert rel_err(y.cpu(), y_ref) < 1e-4
    for g, r in zip(grads, grads_ref):
        assert rel_err(g.cpu(), r) < 1e-4


def test_tt_linear_under_bf16_autocast(device):
    """Under autocast to bfloat16 the layer computes and returns bfloat16 as nn.Linear does, with bf16-sized
    errors against the float64 product; parameter gradients stay in the parameters' float32."""
    torch.manual_seed(0)
    layer = TTLinear(768, 3072, rank=30).to(device)
    perturb_gates(layer)
    dense = nn.Linear(768, 3072).to(device)
    x = torch.randn(64, 768, device=device)
    grad_out = torch.randn(64, 3072, device=device)
    y, grads = _tt_grads(layer, x, grad_out, autocast=torch.bfloat16)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        assert dense(x).dtype == y.dtype == torch.bfloat16
    y_ref, grads_ref = _dense_reference(layer, x, grad_out)
    assert rel_err(y.float().cpu(), y_ref) < 2e-2
    for g, r, p in zip(grads[1:], grads_ref[1:], [*layer.cores, *layer.gates, layer.bias]):
        assert g.dtype == p.dtype == torch.float32
        assert rel_err(g.cpu(), r) < 3e-2


@pytest.mark.parametrize("cls", [TTEmbedding, TTEmbeddingBag], ids=["embedding", "bag"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_tt_embedding_lookups_against_the_dense_table(device, cls, compiled):
    torch.manual_seed(0)
    layer = (cls(30522, 768, rank=16) if cls is TTEmbedding else cls(30522, 768, mode="sum", rank=16)).to(device)
    perturb_gates(layer)
    idx = torch.randint(0, 30522, (4, 37), device=device)
    idx[0, :5] = idx[1, :5]   # repeated rows, as real batches have
    run = torch.compile(layer, backend="comera", fullgraph=True) if compiled else layer
    out = run(idx)
    table = layer.to_dense().detach().double().cpu()
    ref = F.embedding(idx.cpu(), table) if cls is TTEmbedding else F.embedding_bag(idx.cpu(), table, mode="sum")
    assert out.device.type == device.type
    assert rel_err(out.cpu(), ref) < 1e-5
    w = torch.randn(out.shape, device=device)
    (out * w).sum().backward()
    cores64 = [c.detach().double().cpu().requires_grad_() for c in layer.cores]
    gates64 = [g.detach().double().cpu().requires_grad_() for g in layer.gates]
    from comera_compile.tt import cores_to_dense

    dense = cores_to_dense(cores64, gates64, layer.spec)
    ref_out = F.embedding(idx.cpu(), dense) if cls is TTEmbedding else F.embedding_bag(idx.cpu(), dense, mode="sum")
    (ref_out * w.double().cpu()).sum().backward()
    for p, r in zip([*layer.cores, *layer.gates], [*cores64, *gates64]):
        assert rel_err(p.grad.cpu(), r.grad) < 1e-4


@pytest.mark.parametrize("cls", [TTEmbedding, TTEmbeddingBag], ids=["embedding", "bag"])
def test_out_of_range_indices_raise_eager_and_compiled(device, cls):
    """Eager: nn.Embedding's IndexError.  Compiled: a run-time error, never a wrapped-around row.  On CUDA a
    compiled lookup fails by a device-side assert (as a compiled nn.Embedding does), which ends the process's
    CUDA context, so that part runs in a child process."""
    torch.manual_seed(0)
    layer = cls(256, 16, rank=4).to(device)
    for bad in (256, -1):
        with pytest.raises(IndexError):
            layer(torch.tensor([[0, bad, 7]], device=device))
    if device.type == "cpu":
        run = torch.compile(layer, backend="comera", fullgraph=True)
        torch.testing.assert_close(run(torch.tensor([[0, 5, 255]])), layer(torch.tensor([[0, 5, 255]])))
        with pytest.raises(RuntimeError, match="index out of range"):
            run(torch.tensor([[0, 256, 7]]))
        return
    code = textwrap.dedent(f"""
        import torch, comera_compile as cc
        from comera_compile.embedding import {cls.__name__} as C
        layer = C(256, 16, rank=4).cuda()
        run = torch.compile(layer, backend="comera", fullgraph=True)
        good = run(torch.tensor([[0, 5, 255]], device="cuda"))
        assert torch.allclose(good, layer(torch.tensor([[0, 5, 255]], device="cuda")))
        print("good rows ok", flush=True)
        run(torch.tensor([[0, 256, 7]], device="cuda"))
        torch.cuda.synchronize()
        print("NO ERROR", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert "good rows ok" in done.stdout, done.stderr[-3000:]
    assert "NO ERROR" not in done.stdout and done.returncode != 0
    assert "index out of range" in done.stderr or "device-side assert" in done.stderr, done.stderr[-3000:]


class _Block(nn.Module):
    def __init__(self, width: int = 64, dropout: float = 0.0) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.norm = nn.LayerNorm(2 * width)
        self.down = nn.Linear(2 * width, width)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(F.gelu(self.norm(self.up(x))), self.dropout, training=self.training)
        return x + self.down(h)


class _Net(nn.Module):
    def __init__(self, depth: int = 2, width: int = 64, dropout: float = 0.0) -> None:
        super().__init__()
        self.inp = nn.Linear(32, width)
        self.blocks = nn.ModuleList(_Block(width, dropout) for _ in range(depth))
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _tensorized_net(device: torch.device, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return cc.tensorize(_Net(), rank=6, min_features=32).to(device)


def _batch(device: torch.device, rows: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 32, generator=g).to(device), torch.randint(0, 5, (rows,), generator=g).to(device)


def test_backend_replays_recorded_cuda_graphs_one_recording_per_shape(device):
    """A loop as users write it -- forward, backward, gradients cleared -- records once per shape and replays
    after that.  (Without clearing, the gradients would add up in memory the next replay overwrites:
    test_gradients_added_across_replays_are_right_or_an_error.)"""
    needs_cuda(device, "CUDA Graph trees")
    model = _tensorized_net(device)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="comera")
    a, b = _batch(device, 16)[0], _batch(device, 24)[0]

    def train(x):
        compiled(x).sum().backward()
        model.zero_grad(set_to_none=True)

    with CudaGraphCaptures() as captures:
        for _ in range(3):   # Inductor's graph trees warm up once, record on the next call
            train(a)
        after_a = captures.count
        for _ in range(5):
            train(a)
        assert captures.count == after_a, "steady steps must replay, not record"
        for _ in range(3):   # a second shape (dynamo may recompile for it, and a's graph with it)
            train(b)
            train(a)
        after_b = captures.count
        for _ in range(3):
            train(a)
            train(b)
        assert captures.count == after_b, "every shape seen replays its recording"
    assert after_a > 0 and after_b > after_a
    assert captures.skips == 0
    torch.testing.assert_close(compiled(a), eager(a), rtol=1e-4, atol=1e-5)


def test_gradients_added_across_replays_are_right_or_an_error(device):
    """Gradients left uncleared across calls (accumulation over micro-batches) under CUDA Graph trees: the
    .grad tensors are the previous replay's memory, so torch either adds correctly or raises; a wrong sum
    would be the silent failure.  (compile_step clears the gradients every step; options={"cudagraphs": False}
    accumulates as eager autograd does.)"""
    needs_cuda(device, "CUDA Graph trees")
    model = _tensorized_net(device)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="comera")
    batches = [_batch(device, 16, seed=s)[0] for s in range(4)]
    try:
        for x in batches:
            compiled(x).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
    except RuntimeError as e:
        assert "overwritten" in str(e), e
        return
    for x in batches:
        ref(x).sum().backward()
    for g, p in zip(grads, ref.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)


def _eager_losses(model, opt, loss_fn, x, target, steps, sched=None):
    """The losses of `steps` eager training steps on one batch (the scheduler, if any, stepped after each)."""
    losses = []
    for _ in range(steps):
        loss = loss_fn(model(x), target)
        losses.append(loss.detach())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return losses


def _train_as_eager_steps(device, graphs, optimizer, **step_options) -> None:
    """8 steps of compile_step (in cuda_graphs mode `graphs`) on one batch of 32 rows against 8 eager steps
    of the same optimizer: equal losses and parameters; on CUDA, graphs recorded in the first 4 steps only
    (and no graph skipped); "step" captures once after its two warm-ups."""
    x, target = _batch(device, 32)
    loss_fn = nn.CrossEntropyLoss()
    eager = _tensorized_net(device)
    ref_losses = _eager_losses(eager, optimizer(eager), loss_fn, x, target, 8)
    model = _tensorized_net(device)
    step = cc.compile_step(model, loss_fn, optimizer(model), cuda_graphs=graphs, **step_options)
    with CudaGraphCaptures() as captures:
        losses = [step(x, target) for _ in range(4)]
        recorded = captures.count
        losses += [step(x, target) for _ in range(4)]
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p - q).norm() <= 1e-4 * q.norm() + 1e-6, name
    if device.type == "cuda" and graphs != "off":
        assert recorded > 0 and captures.count == recorded and captures.skips == 0
    if graphs == "step":
        assert (step.graph.warmups, step.graph.captures, step.graph.replays) == (2, 1, 6)


@pytest.mark.parametrize("graphs", ["compiled", "step", "off"])
@pytest.mark.parametrize("groups", ["plain", "param_groups"])
def test_compile_step_trains_as_eager_adamw_in_every_cuda_graph_mode(device, graphs, groups):
    """compile_step with a plain AdamW(model.parameters()) or CoMERA's param_groups, in each cuda_graphs mode,
    trains as eager AdamW steps do; the losses it returned all stay readable (none is CUDA Graph memory a
    later replay overwrote).  On CUDA: "compiled" records its graphs once and then replays; "step" captures
    once, after its warm-up."""
    if graphs == "step":
        needs_cuda(device, "a captured CUDA graph")

    def optimizer(m):
        return torch.optim.AdamW(m.parameters() if groups == "plain" else param_groups(m, lr=1e-3), lr=1e-3,
                                 weight_decay=0.0)

    _train_as_eager_steps(device, graphs, optimizer)


@pytest.mark.parametrize("graphs", ["compiled", "step"])
def test_micro_batches_train_as_eager_steps_on_the_whole_batch_in_each_cuda_graph_mode(device, graphs):
    """compile_step(micro_batches=4), a batch of 32 rows: the losses and parameters of eager AdamW steps on the
    whole batch.  "compiled": the gradients added up across the blocks' graph replays stay right (the step
    keeps them out of graph memory the next micro-batch's replay reuses), with no recording after the first
    steps; "step": all four micro-batches in the one captured graph."""
    if graphs == "step":
        needs_cuda(device, "a captured CUDA graph")
    _train_as_eager_steps(device, graphs, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), micro_batches=4)


@pytest.mark.parametrize("graphs, micro_batches", [("compiled", 1), ("auto", 4)])   # two compiles: GPU minutes are few
def test_float16_steps_train_as_the_eager_gradscaler_loop(device, graphs, micro_batches):
    """compile_step(autocast=torch.float16) makes its own GradScaler: 8 steps against torch's eager recipe
    (forward under float16 autocast, scaler.scale(loss).backward(), scaler.step, scaler.update) with the same
    AdamW, whole or in 4 micro-batches (the eager loop accumulating the same 4 parts: at float16 a gate's
    near-zero gradient summed in another order can flip AdamW's update by 2 lr).  The parameters move as the
    eager loop's (their difference within 5% of the eager update), no step is skipped, and on CUDA "auto"
    keeps per-graph replays with a warning (the scaler's overflow check is a host read), recording in the
    first steps only."""
    x, target = _batch(device, 32)
    loss_fn = nn.CrossEntropyLoss()
    eager = _tensorized_net(device)
    start = [p.detach().clone() for p in eager.parameters()]
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-3, weight_decay=0.0)
    scaler = torch.amp.GradScaler(device.type)
    for _ in range(8):
        for xs, ts in zip(x.chunk(micro_batches), target.chunk(micro_batches)):   # equal parts: each weighs 1/n
            with torch.autocast(device.type, dtype=torch.float16):
                loss = loss_fn(eager(xs), ts) / micro_batches
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    model = _tensorized_net(device)
    warns = pytest.warns(UserWarning, match="loss scaler") if device.type == "cuda" and graphs == "auto" \
        else warnings.catch_warnings()
    with warns:
        step = cc.compile_step(model, loss_fn, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0),
                               autocast=torch.float16, cuda_graphs=graphs, micro_batches=micro_batches)
    assert step.cuda_graphs == ("compiled" if device.type == "cuda" else None)
    skipped = []

    def run(steps: int) -> None:
        for _ in range(steps):
            step(x, target)
            skipped.append(step.skipped)

    with CudaGraphCaptures() as captures:
        run(4)
        recorded = captures.count
        run(4)
    assert not any(skipped) and step.scaler.get_scale() == scaler.get_scale()
    for (name, p), q, p0 in zip(model.named_parameters(), eager.parameters(), start):
        assert (p - q).norm() <= 0.05 * (q - p0).norm() + 1e-6, name
    if device.type == "cuda":
        assert recorded > 0 and captures.count == recorded


def test_the_trainer_s_fp16_overflow_skips_rank_adaptive(device, tmp_path):
    """``TrainingArguments(fp16=True)`` at transformers' default optimizer (fused AdamW, which takes the
    scaler's overflow flag in its kernel, so accelerate does not see the skip): batches that overflow float16
    at the first and third steps leave the parameters alone, and RankAdaptive's callback skips those steps too."""
    needs_cuda(device, "accelerate's fp16 (it refuses the CPU)")
    transformers = pytest.importorskip("transformers")

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.factor = _tensorized_net(device), 1.0

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            logits = self.net(x * self.factor)
            return {"loss": F.cross_entropy(logits.float(), labels), "logits": logits}

    class Overflow(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            model.factor = 1e6 if state.global_step in (0, 2) else 1.0

    x, y = _batch(torch.device("cpu"), 64)
    model = Classifier()
    ra = cc.RankAdaptive(model)
    moved = []

    class Moved(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            self.before = [p.detach().clone() for p in model.parameters()]

        def on_step_end(self, args, state, control, model=None, **kwargs):
            moved.append(any(not torch.equal(p, q) for p, q in zip(model.parameters(), self.before)))

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=16, learning_rate=1e-3, fp16=True,
        report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True)
    assert args.optim == "adamw_torch_fused"
    trainer = transformers.Trainer(model=model, args=args, train_dataset=[{"x": a, "labels": b} for a, b in
                                                                          zip(x, y)],
                                   callbacks=[Overflow(), Moved(), ra.trainer_callback()])
    trainer.train()
    assert moved == [False, True, False, True]
    assert ra.steps == 2


def test_whole_step_graph_reads_a_scheduled_sgd_rate_each_replay(device):
    """SGD with momentum under a per-step LambdaLR, cuda_graphs="step": compile_step makes SGD fused and its
    rate a device tensor the scheduler fills, so one capture serves every rate, and the steps equal eager
    SGD's under the same schedule."""
    needs_cuda(device, "a captured CUDA graph")
    x, target = _batch(device, 32)
    loss_fn = nn.CrossEntropyLoss()
    eager = _tensorized_net(device)
    opt = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.8**i)
    ref_losses = _eager_losses(eager, opt, loss_fn, x, target, 8, schedule)
    model = _tensorized_net(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.8**i)
    step = cc.compile_step(model, loss_fn, opt, cuda_graphs="step")
    losses = []
    for _ in range(8):
        losses.append(step(x, target))
        sched.step()
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p - q).norm() <= 1e-4 * q.norm() + 1e-6, name
    assert (step.graph.warmups, step.graph.captures, step.graph.replays) == (2, 1, 6)


class _EmbeddedNet(nn.Module):
    """Token embedding (tensorized: an eager TT lookup outside the compiled blocks), a block, a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1024, 64)
        self.block = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.head = nn.Linear(64, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(ids)).mean(1))


def test_whole_step_graph_captures_an_eager_tt_embedding_and_trains_as_eager(device):
    """cuda_graphs="step" captures the eager parts of the step too: a TT embedding's lookup, which reads its
    indices on the host in eager mode (range check, distinct rows), takes its static path inside the capture
    instead of failing it; the losses and parameters equal an eager AdamW loop's."""
    needs_cuda(device, "a captured CUDA graph")
    torch.manual_seed(0)
    net = cc.tensorize(_EmbeddedNet(), rank=8, min_features=32)
    assert isinstance(net.embed, TTEmbedding)
    eager, model = copy.deepcopy(net).to(device), copy.deepcopy(net).to(device)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 1024, (16, 12), generator=g).to(device)
    target = torch.randint(0, 5, (16,), generator=g).to(device)
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    ref = _eager_losses(eager, opt, loss_fn, ids, target, 6)
    step = cc.compile_step(model, loss_fn, torch.optim.AdamW(model.parameters(), lr=1e-2), cuda_graphs="step")
    losses = [step(ids, target) for _ in range(6)]
    assert (step.graph.warmups, step.graph.captures, step.graph.replays) == (2, 1, 4)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref), rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p - q).norm() <= 1e-4 * q.norm() + 1e-6, name


def test_whole_step_graph_refuses_a_host_read_before_capturing_and_cuda_still_works(device):
    """A loss that reads a device value on the host: the probing warm-up (torch's CUDA sync debug mode) finds
    it and the error names its line, before any capture; the process's CUDA state is intact afterwards (a
    failed capture would have broken its random number generator), so cuda_graphs="compiled" trains on."""
    needs_cuda(device, "a captured CUDA graph")
    x, target = _batch(device, 16)

    def checked_loss(logits, y):
        if (y < 0).any():   # bool() of a CUDA tensor: a synchronizing read
            raise ValueError("negative class")
        return F.cross_entropy(logits, y)

    model = _tensorized_net(device)
    step = cc.compile_step(model, checked_loss, torch.optim.AdamW(model.parameters(), lr=1e-3), cuda_graphs="step")
    step(x, target)
    with pytest.raises(RuntimeError, match=r"reads device values on the host.*test_device\.py:\d+"):
        step(x, target)
    assert step.graph.captures == 0
    torch.randn(4, device=device)   # the generator is not left capturing
    other = _tensorized_net(device, seed=1)
    again = cc.compile_step(other, checked_loss, torch.optim.AdamW(other.parameters(), lr=1e-3))
    losses = [float(again(x, target)) for _ in range(3)]
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0]
    # "auto" probes the same way and falls back to per-graph replays, with a warning naming the read
    model = _tensorized_net(device, seed=2)
    auto = cc.compile_step(model, checked_loss, torch.optim.AdamW(model.parameters(), lr=1e-3), cuda_graphs="auto")
    assert auto.cuda_graphs == "step"
    losses = [float(auto(x, target))]
    with pytest.warns(UserWarning, match=r"test_device\.py:\d+.*cuda_graphs='compiled' from now on"):
        losses.append(float(auto(x, target)))
    losses += [float(auto(x, target)) for _ in range(3)]
    assert auto.cuda_graphs == "compiled" and all(map(math.isfinite, losses)) and losses[-1] < losses[0]


def test_auto_captures_a_12_layer_transformers_llama_whole_and_trains_as_eager(device):
    """cuda_graphs="auto" (the default-to-be on CUDA) on a tensorized 12-layer Llama from transformers, with
    CoMERA's param_groups and RankAdaptive: the probe finds no host read in transformers' code on a real GPU,
    so the whole step is captured once and replayed, and the losses and parameters are the eager loop's."""
    needs_cuda(device, "a captured CUDA graph")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=12,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)

    def build():
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = cc.tensorize(transformers.AutoModelForCausalLM.from_config(config), rank=8,
                                 min_features=64).to(device)
        opt = torch.optim.AdamW(param_groups(model, lr=1e-3))
        return model, opt, cc.RankAdaptive(model, optimizer=opt)

    def loss_fn(out, labels):
        return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())

    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 256, (4, 32), generator=g).to(device) for _ in range(2))
    model, opt, ra = build()
    ref, ref_opt, ref_ra = build()
    step = cc.compile_step(model, loss_fn, opt, cuda_graphs="auto", rank_adaptive=ra)
    assert step.cuda_graphs == "step"
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)   # no fallback, no block run eagerly
        losses = [step(x, y) for _ in range(6)]
    ref_losses = []
    for _ in range(6):
        loss = loss_fn(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_ra.step(loss.detach())
        ref_losses.append(loss.detach())
    assert step.cuda_graphs == "step" and (step.graph.warmups, step.graph.captures, step.graph.replays) == (2, 1, 4)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p - q).norm() <= 1e-4 * q.norm() + 1e-6, name


@pytest.mark.parametrize("graphs", ["step", "auto"])
def test_a_captured_step_draws_new_dropout_masks_at_every_replay(device, graphs):
    """Dropout inside the whole-step graph (hash masks from words torch's CUDA generator draws in the step):
    every replay draws new words, as every eager step does, so the same batch at a zero learning rate gives a
    new loss each replay; without dropout the replays agree.  A mask frozen at the capture would train on one
    sub-network, silently."""
    needs_cuda(device, "a captured CUDA graph")
    x, target = _batch(device, 64)
    losses = {}
    for p in (0.5, 0.0):
        torch.manual_seed(0)
        model = cc.tensorize(_Net(dropout=p), rank=6, min_features=32).to(device)
        step = cc.compile_step(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.0),
                               cuda_graphs=graphs)
        losses[p] = [float(step(x, target)) for _ in range(7)]
        assert (step.graph.warmups, step.graph.captures, step.graph.replays) == (2, 1, 5)
    replayed = losses[0.5][2:]   # the capturing call replays too
    assert len(set(replayed)) == len(replayed), losses
    assert max(losses[0.0]) - min(losses[0.0]) <= 1e-6 * abs(losses[0.0][0]), losses


def test_whole_step_graph_is_one_launch_per_step(device):
    """cuda_graphs="step": one CUDA graph launch per step and no kernel launched on its own, the batch copied
    into the static inputs and the loss out (torch's profiler counts the CUDA runtime calls); "compiled"
    launches the eager parts' kernels one by one."""
    from comera_compile.profiling import launches_per_step

    needs_cuda(device, "a captured CUDA graph")
    x, target = _batch(device, 32)
    counts = {}
    for graphs in ("step", "compiled"):
        model = _tensorized_net(device)
        step = cc.compile_step(model, nn.CrossEntropyLoss(), torch.optim.AdamW(model.parameters()),
                               cuda_graphs=graphs)
        for _ in range(5):
            step(x, target)
        counts[graphs] = launches_per_step(lambda: step(x, target))
    whole = counts["step"]
    assert whole["graphs"] == 1, counts
    assert whole["kernels"] <= 1, counts   # at most the loss's copy out, where it is a kernel
    assert whole["device_kernels"] > 10, counts   # the step's kernels ran, inside the graph
    assert counts["compiled"]["kernels"] > 10 * max(whole["kernels"], 1), counts


def test_breakdown_sees_the_kernels_inside_a_replayed_step(device):
    """cc.breakdown of the whole-step graph: one graph launch, its kernels seen on the device (matrix
    products among them), busy time no longer than the profiled step allows; and the measured matmul peak
    and the step's FLOP rate are finite and ordered (the step's rate under the peak)."""
    needs_cuda(device, "a captured CUDA graph")
    x, target = _batch(device, 256)
    model = _tensorized_net(device)
    opt = torch.optim.AdamW(model.parameters())
    eager = _tensorized_net(device)
    flops = cc.count_flops(lambda: nn.CrossEntropyLoss()(eager(x), target).backward(), model=eager)
    step = cc.compile_step(model, nn.CrossEntropyLoss(), opt, cuda_graphs="step")
    peak = cc.matmul_peak(device)
    b = cc.breakdown(lambda: step(x, target), device=device, warmup=5, flops=flops, peak_flops=peak)
    assert b.graphs == 1 and b.launches <= 1, b
    assert b.kernels > 10 and b.categories["matmul"]["count"] >= 3, b
    assert sum(c["count"] for c in b.categories.values()) == pytest.approx(b.kernels)
    assert 0 < b.busy_ms and 0 < flops.tt_layers <= flops.total, b
    assert 1e12 < peak < 1e16 and 0 < b.peak_share < 1, b


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled-profile-option"])
def test_profile_gives_each_tt_layer_its_kernel_time(device, compiled):
    """cc.profile on CUDA: every TT layer's forward and backward kernels are timed on the device, and
    together they fit inside the time the device was busy; the table is in device time."""
    needs_cuda(device, "kernel time")
    x, target = _batch(device, 256)
    model = _tensorized_net(device)
    opt = torch.optim.AdamW(model.parameters())
    if compiled:
        step = cc.compile_step(model, nn.CrossEntropyLoss(), opt, options={"profile": True})
    else:
        def step(x, target):
            nn.CrossEntropyLoss()(model(x), target).backward()
            opt.step()
            opt.zero_grad()
    prof = cc.profile(step, x, target, model=model, steps=3, warmup=3)
    tt = [m for m in model.modules() if isinstance(m, TTLinear)]
    assert len(prof.layers) == len(tt), str(prof)
    assert all(t.device_ms > 0 and t.backward_device_ms > 0 for t in prof.layers), str(prof)
    assert 0 < sum(t.total_device_ms for t in prof.layers) <= prof.device_busy_ms * 1.01, str(prof)
    assert "% of device busy" in str(prof)


def test_breakdown_of_a_cpu_step_on_a_gpu_machine_says_so(device):
    """Where CUDA is the default device but the step runs on the CPU, breakdown refuses rather than report an
    all-idle GPU."""
    needs_cuda(device, "a GPU beside the CPU")
    model = nn.Linear(32, 32)
    with pytest.raises(ValueError, match="no kernel ran on the GPU"):
        cc.breakdown(lambda: model(torch.randn(8, 32)), steps=1, repeat=1)


def test_hash_dropout_keep_rate_and_mask_agreement(device):
    """Compiled dropout (hash masks in the generated kernels: Triton on CUDA, C++ on the CPU) keeps 1 - p of
    the elements, scales them by 1 / (1 - p), and the backward lets the gradient through exactly where the
    forward kept an element."""
    p, n = 0.3, 1 << 20
    x = (torch.rand(n, device=device) + 0.5).requires_grad_()   # no zeros: a zero output means dropped
    fn = torch.compile(lambda t: F.dropout(t, p, training=True) * 2.0, backend="comera")
    y = fn(x)
    kept = y != 0
    rate = kept.float().mean().item()
    assert abs(rate - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5
    torch.testing.assert_close(y[kept], 2.0 * x.detach()[kept] / (1 - p))
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, kept.float() * 2.0 / (1 - p))
    y2 = fn(x)
    assert not torch.equal(y2 != 0, kept), "each call draws a new mask"


def test_tempo_ops_against_the_plain_torch_ops(device):
    from comera_compile.ops.attention import softmax_dropout_matmul
    from comera_compile.ops.gelu import gelu
    from comera_compile.ops.layer_norm import layer_norm

    torch.manual_seed(0)
    x = torch.randn(8, 128, 256, device=device)
    w, b = torch.randn(256, device=device), torch.randn(256, device=device)
    scores, v = torch.randn(2, 4, 64, 64, device=device), torch.randn(2, 4, 64, 32, device=device)
    cases = {
        "gelu": (lambda t: gelu(t), lambda t: F.gelu(t), [x]),
        "layer_norm": (lambda t, w, b: layer_norm(t, 256, w, b), lambda t, w, b: F.layer_norm(t, (256,), w, b),
                       [x, w, b]),
        "attention": (lambda s, v: softmax_dropout_matmul(s, v, 0.0), lambda s, v: s.softmax(-1) @ v, [scores, v]),
    }
    for name, (ours, plain, inputs) in cases.items():
        leaves = [t.clone().requires_grad_() for t in inputs]
        refs = [t.clone().requires_grad_() for t in inputs]
        out, ref = ours(*leaves), plain(*refs)
        grad = torch.randn_like(ref)
        out.backward(grad)
        ref.backward(grad)
        assert out.device.type == device.type, name
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5, msg=name)
        for g, r in zip(leaves, refs):
            torch.testing.assert_close(g.grad, r.grad, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("graphs", ["compiled", "step"])
def test_rank_reallocation_under_cuda_graphs_records_once_and_runs_the_new_shapes(device, graphs):
    """A RankAdaptive cut mid-run makes new, smaller Parameters: the compiled step recompiles and records
    once for them, then replays; no graph of the old shapes runs again (the losses match an eager model cut
    the same way, step for step).  The whole-step graph is captured anew after its warm-up."""
    if graphs == "step":
        needs_cuda(device, "a captured CUDA graph")
    x, target = _batch(device, 32)
    loss_fn = nn.CrossEntropyLoss()

    def run(compiled: bool):
        model = _tensorized_net(device)
        opt = torch.optim.AdamW(param_groups(model, lr=1e-3), weight_decay=0.0)
        ra = cc.RankAdaptive(model, optimizer=opt, cut_every=4, realloc_at=1.0)
        step = cc.compile_step(model, lambda out, t: ra.loss(loss_fn(out, t)), opt,
                               cuda_graphs=graphs) if compiled else None
        losses, counts, cuts = [], [], []
        with CudaGraphCaptures() as captures:
            for i in range(12):
                if compiled:
                    losses.append(float(step(x, target)))
                else:
                    loss = ra.loss(loss_fn(model(x), target))
                    losses.append(float(loss.detach()))
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                if i == 3:   # switch a slice off in every layer just before the cut check (the 4th ra.step)
                    with torch.no_grad():
                        for layer in ra.layers.values():
                            layer.gates[0][0] = 0.0
                cuts.append(ra.step())
                counts.append(captures.count)
        return losses, counts, cuts, captures.skips, ra

    losses, counts, cuts, skips, ra = run(True)
    ref_losses, _, ref_cuts, _, ref_ra = run(False)
    assert cuts == ref_cuts and sum(cuts) == 1 and ra.ranks() == ref_ra.ranks()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
    if device.type == "cuda":
        cut_at = cuts.index(True)
        assert skips == 0
        assert counts[2] == counts[cut_at]                   # replays before the cut
        assert counts[cut_at + 3] > counts[cut_at]           # one re-record for the new shapes
        assert counts[-1] == counts[cut_at + 3]              # then replays again


def test_cuda_memory_figures_from_the_allocator(device):
    """A TT training step holds less device memory than the dense one it replaces (peak bytes from
    torch.cuda.max_memory_allocated on CUDA; the tracked live tensors of comera_compile.memory elsewhere)."""
    from comera_compile.benchmarks.device_step import step_peak_bytes

    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).to(device)
    tt = cc.tensorize(copy.deepcopy(dense), rank=16).to(device)
    x = torch.randn(8, 1024, device=device)
    peaks = {}
    for name, model in (("dense", dense), ("tt", tt)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(model=model, opt=opt):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        peaks[name] = step_peak_bytes(step, model, opt, device)
    dense_weights = sum(p.numel() * p.element_size() for p in dense.parameters())
    assert peaks["dense"] >= 3 * dense_weights   # weights, gradients, two Adam moments
    assert peaks["tt"] < peaks["dense"] / 10
