"""A tensorized model under DistributedDataParallel, compiled with backend "comera", trains in two
processes (gloo, CPU, rendezvous on 127.0.0.1) exactly like one process on the same global batch."""

from __future__ import annotations

import contextlib
import datetime
import socket
import time
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers import spawn

STEPS = 5
TIMEOUT = datetime.timedelta(seconds=120)  # a stuck rendezvous or collective fails the test instead of hanging it


def _model() -> nn.Module:
    import comera_compile as cc

    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64), nn.Tanh(), nn.Linear(64, 5))
    return cc.tensorize(dense, rank=6, min_features=32)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, 16, 64, generator=g), torch.randint(0, 5, (STEPS, 16), generator=g)


def _train(model: nn.Module, xs, ys, rank: int = 0, world: int = 1) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    compiled = torch.compile(model, backend="comera")
    per = xs.shape[1] // world
    for x, y in zip(xs, ys):
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        nn.functional.cross_entropy(compiled(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@contextlib.contextmanager
def _process_group(rank: int, world: int, port: int) -> Iterator[None]:
    """One thread, a gloo group on 127.0.0.1 for the block, destroyed after it."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _worker(rank: int, world: int, port: int, out: str) -> None:
    with _process_group(rank, world, port):
        model = nn.parallel.DistributedDataParallel(_model())
        xs, ys = _data()
        params = _train(model, xs, ys, rank, world)
        torch.save(params, f"{out}.{rank}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_ddp_two_processes_match_single_process(tmp_path):
    out = str(tmp_path / "params")
    spawn(_worker, args=(2, _free_port(), out), nprocs=2)
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    for a, b in zip(*ranks):
        assert torch.equal(a, b)
    torch._dynamo.reset()
    xs, ys = _data()
    single = _train(_model(), xs, ys)
    for a, b in zip(ranks[0], single):
        assert (a - b).norm() <= 1e-5 * b.norm() + 1e-7


def _fails_on_rank_one(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank one's own error")


def _sleeps(rank: int) -> None:
    time.sleep(60)


def test_a_spawned_process_s_error_or_hang_fails_the_test_with_its_cause():
    """The tests' processes leave without the interpreter's teardown (os._exit), so their errors travel in a
    file: a raise in one process is the test's failure, with that process's traceback; a hang is killed."""
    with pytest.raises(AssertionError, match=r"(?s)process 1.*ValueError: rank one's own error"):
        spawn(_fails_on_rank_one, nprocs=2)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="_sleeps's 2 processes still ran after 1 s"):
        spawn(_sleeps, nprocs=2, deadline=1.0)
    assert time.monotonic() - start < 30


CUT_STEPS = 15


def _ra_worker(rank: int, world: int, port: int, out: str, compiled: bool, rebuild: str | None) -> None:
    """Train under DDP with RankAdaptive checking every 5 steps; half of every bond switched off by hand (the
    same slices in both processes) before the first check, so it re-allocates the cores.  rebuild: a new DDP
    after each re-allocation, when ra.step() returns True ("return") or in an ra.on_reallocate callback
    ("callback"); None keeps the stale wrapper."""
    import comera_compile as cc

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    result: dict = {"snapshots": [], "error": None}
    try:
        model = _model()
        opt = torch.optim.AdamW(cc.param_groups(model, lr=1e-2))
        ra = cc.RankAdaptive(model, optimizer=opt, cut_every=5)

        def wrap():
            ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=rebuild is None)
            return torch.compile(ddp, backend="comera") if compiled else ddp

        fn = wrap()
        if rebuild == "callback":
            def rewrap(_: cc.RankAdaptive) -> None:
                nonlocal fn
                fn = wrap()

            ra.on_reallocate(rewrap)
        g = torch.Generator().manual_seed(1)
        for step in range(CUT_STEPS):
            x, y = torch.randn(16, 64, generator=g), torch.randint(0, 5, (16,), generator=g)
            x, y = x[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8]
            ra.loss(nn.functional.cross_entropy(fn(x), y)).backward()
            opt.step()
            opt.zero_grad()
            if step == 3:
                with torch.no_grad():
                    for layer in ra.layers.values():
                        for gate in layer.gates:
                            gate[: gate.numel() // 2] = 0.0
            if ra.step():
                result["snapshots"].append([p.detach().clone() for p in model.parameters()])
                if rebuild == "return":
                    fn = wrap()
        result["final"] = [p.detach().clone() for p in model.parameters()]
    except RuntimeError as e:
        result["error"] = str(e)
    finally:
        torch.save(result, f"{out}.{rank}")
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
@pytest.mark.parametrize("compiled,rebuild", [(False, "return"), (True, "callback")],
                         ids=["eager-rebuilt-on-return", "compiled-rebuilt-in-callback"])
def test_ddp_rank_cuts_keep_replicas_identical(tmp_path, compiled, rebuild):
    out = str(tmp_path / "ra")
    spawn(_ra_worker, args=(2, _free_port(), out, compiled, rebuild), nprocs=2)
    a, b = (torch.load(f"{out}.{r}") for r in range(2))
    assert a["error"] is None and b["error"] is None, (a["error"], b["error"])
    assert len(a["snapshots"]) == len(b["snapshots"]) >= 1
    for snap_a, snap_b in zip(a["snapshots"] + [a["final"]], b["snapshots"] + [b["final"]]):
        assert [p.shape for p in snap_a] == [p.shape for p in snap_b]
        assert max((p - q).abs().max().item() for p, q in zip(snap_a, snap_b)) == 0.0


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_ddp_stale_wrapper_after_a_reallocation_is_an_error(tmp_path):
    out = str(tmp_path / "stale")
    spawn(_ra_worker, args=(2, _free_port(), out, False, None), nprocs=2)
    for r in range(2):
        error = torch.load(f"{out}.{r}")["error"]
        assert error is not None and "rebuild the wrapper" in error, error


def _hang(rank: int) -> None:
    time.sleep(600)


def test_a_hung_process_is_killed_and_its_threads_stacks_are_reported():
    """helpers.spawn's deadline: a test whose processes hang fails, and says where each thread stood."""
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"(?s)still ran after 8 s; killed.*process 0's threads.*in _hang"):
        spawn(_hang, nprocs=1, deadline=8)
    assert time.monotonic() - t0 < 60


def _stack() -> nn.Module:
    """A model of repeated blocks the tests did not write: a tensorized nn.TransformerEncoder."""
    import warnings

    import comera_compile as cc

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0, batch_first=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cc.tensorize(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), rank=8, min_features=32)


def _stack_train(model: nn.Module, rank: int = 0, world: int = 1, micro_batches: int = 1,
                 compiled: bool = True) -> list[torch.Tensor]:
    """STEPS of cc.compile_step at its defaults (the encoder layers compiled one by one), or of the eager loop
    (not `compiled`: the reference); SGD, as Adam would turn the exactly-zero gradient of attention's key
    bias into noise-driven steps."""
    import comera_compile as cc

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if compiled:
        step = cc.compile_step(model, nn.functional.mse_loss, opt, micro_batches=micro_batches)
        blocks = cc.repeated_blocks(model)
        assert len(blocks) == 2 and all(b._compiled_call_impl is not None for b in blocks)
    else:
        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    g = torch.Generator().manual_seed(1)
    per = 8 // world
    for _ in range(STEPS):
        x, y = torch.randn(8, 5, 64, generator=g), torch.randn(8, 5, 64, generator=g)
        step(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
    return [p.detach().clone() for p in model.parameters()]


def _stack_worker(rank: int, world: int, port: int, out: str) -> None:
    """Two micro-batches per step in each process, its gradient all-reduces counted."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    with _process_group(rank, world, port):
        ddp = nn.parallel.DistributedDataParallel(_stack())
        reduces = []

        def counting(state, bucket):
            reduces.append(bucket.index())
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, counting)
        torch.save({"params": _stack_train(ddp, rank, world, micro_batches=2), "reduces": reduces}, f"{out}.{rank}")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
@pytest.mark.slow   # compile_step on DDP transformers models runs in the default tier
def test_compile_step_of_a_ddp_model_compiles_its_layers_and_trains_like_one_process(tmp_path):
    """cc.compile_step(DDP(model), ..., micro_batches=2) at its defaults finds the layers inside the wrapper and
    compiles them one by one; two processes end with identical parameters, those of one eager process on the
    whole batch at once, and the gradients are all-reduced once a step (in the last micro-batch's backward: the
    model's one bucket, STEPS times)."""
    out = str(tmp_path / "stack")
    spawn(_stack_worker, args=(2, _free_port(), out), nprocs=2)
    results = [torch.load(f"{out}.{r}") for r in range(2)]
    assert [r["reduces"] for r in results] == [[0] * STEPS] * 2
    a, b = (r["params"] for r in results)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    single = _stack_train(_stack(), compiled=False)
    for p, q in zip(a, single):
        assert (p - q).norm() <= 1e-5 * q.norm() + 1e-7


def _float16_worker(rank: int, world: int, port: int, out: str) -> None:
    """compile_step at its defaults and float16 autocast on DDP(encoder): 3 steps, the second overflowing on
    process 0's rows only (scaled by 1e6); each process saves its parameters after each step and its skips."""
    import comera_compile as cc

    with _process_group(rank, world, port):
        ddp = nn.parallel.DistributedDataParallel(_stack())
        step = cc.compile_step(ddp, nn.functional.mse_loss, torch.optim.SGD(ddp.parameters(), lr=0.05),
                               autocast=torch.float16)
        g = torch.Generator().manual_seed(1)
        saved = []
        for i in range(3):
            x, y = torch.randn(4, 5, 64, generator=g), torch.randn(4, 5, 64, generator=g)
            step(x * (1e6 if i == 1 and rank == 0 else 1.0), y)
            saved.append(([p.detach().clone() for p in ddp.parameters()], step.skipped))
        torch.save(saved, f"{out}.{rank}")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
@pytest.mark.slow   # test_fsdp's overflow on one process runs in the default tier
def test_a_float16_step_overflowing_on_one_process_is_skipped_by_every_ddp_replica(tmp_path):
    """DDP averages the gradients before the scaler's overflow check, so an overflow on one process is every
    process's: both skip that step and no replica diverges; the steps around it train, alike everywhere."""
    out = str(tmp_path / "fp16")
    spawn(_float16_worker, args=(2, _free_port(), out), nprocs=2)
    a, b = (torch.load(f"{out}.{r}") for r in range(2))
    assert [skipped for _, skipped in a] == [skipped for _, skipped in b] == [False, True, False]
    for (pa, _), (pb, _) in zip(a, b):
        assert all(torch.equal(p, q) for p, q in zip(pa, pb)), "the replicas diverged"
    assert all(torch.equal(p, q) for p, q in zip(a[0][0], a[1][0])), "the skipped step changed a parameter"
    assert any(not torch.equal(p, q) for p, q in zip(a[1][0], a[2][0])), "the step after it did not train"
    torch._dynamo.reset()


def _padded_llama_batches() -> list[dict[str, torch.Tensor]]:
    """STEPS batches of 8 rows, each row padded after its own length (-100 labels, mask 0): the first four
    rows are short, so the first process's half holds far fewer label tokens than the second's."""
    g = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(1, 96, (8, 16), generator=g)
        lengths = torch.tensor([3, 2, 5, 4, 16, 15, 16, 12])
        mask = (torch.arange(16) < lengths[:, None]).long()
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return batches


def _llama() -> nn.Module:
    import transformers

    import comera_compile as cc

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32))
    return cc.tensorize(model, rank=6, min_features=32).double()


class _ShiftedLogits(nn.Module):
    """A causal LM's logits for positions 0..n-2, laid out (rows, vocabulary, positions) as nn.CrossEntropyLoss
    takes them against the labels of positions 1..n-1: the model's own loss, computed by a loss_fn."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, attention_mask=mask).logits[:, :-1].transpose(1, 2)


def _token_mean_worker(rank: int, world: int, port: int, out: str, micro_batches: int, loss: str) -> None:
    import comera_compile as cc

    with _process_group(rank, world, port):
        lm = _llama()
        ddp = nn.parallel.DistributedDataParallel(lm if loss == "model" else _ShiftedLogits(lm))
        step = cc.compile_step(ddp, None if loss == "model" else nn.CrossEntropyLoss(),
                               torch.optim.SGD(ddp.parameters(), lr=0.5), backend="eager", micro_batches=micro_batches)
        per = 8 // world
        losses = []
        for batch in _padded_llama_batches():
            half = {k: v[rank * per:(rank + 1) * per] for k, v in batch.items()}
            losses.append(step(**half) if loss == "model" else
                          step(half["input_ids"], half["attention_mask"], half["labels"][:, 1:]))
        torch.save({"params": [p.detach() for p in lm.parameters()], "losses": losses}, f"{out}.{rank}")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
@pytest.mark.parametrize("micro_batches,loss", [(1, "model"), (2, "model"), (2, "loss_fn")])
def test_compile_step_of_a_ddp_transformers_model_trains_on_the_global_batch_s_token_mean(micro_batches, loss,
                                                                                           tmp_path):
    """A transformers model computing its own token-mean loss, under DDP in two processes whose halves of each
    padded batch hold different numbers of label tokens (12 against 55): compile_step (at 1 and 2
    micro-batches) counts every process's tokens, as the transformers Trainer does, so both processes end
    with the parameters of one process's eager SGD steps on the whole batch, and each process's call returns
    its own half's token mean (1e-6: transformers computes the loss in float32 even for a float64 model).  The
    mean of the two halves' token means, DDP's plain average, is another gradient.  The same loss as a loss_fn
    (nn.CrossEntropyLoss of the shifted logits and labels) counts the same tokens; its reference is that loss in
    float64 too (against the model's own float32 loss a parameter once differed by 1.3e-9, past the bound)."""
    pytest.importorskip("transformers")
    out = str(tmp_path / "tokens")
    spawn(_token_mean_worker, args=(2, _free_port(), out, micro_batches, loss), nprocs=2)
    results = [torch.load(f"{out}.{r}") for r in range(2)]
    model = _llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def reference(batch: dict) -> torch.Tensor:
        if loss == "model":
            return model(**batch).loss
        logits = _ShiftedLogits(model)(batch["input_ids"], batch["attention_mask"])
        return nn.functional.cross_entropy(logits, batch["labels"][:, 1:])

    for step, batch in enumerate(_padded_llama_batches()):
        for r, half in enumerate((slice(0, 4), slice(4, 8))):
            with torch.no_grad():
                want = reference({k: v[half] for k, v in batch.items()})
            torch.testing.assert_close(results[r]["losses"][step], want, rtol=1e-6, atol=0, check_dtype=False)
        reference(batch).backward()
        opt.step()
        opt.zero_grad()
    for r in range(2):
        for p, q in zip(results[r]["params"], model.parameters()):
            torch.testing.assert_close(p, q.detach(), rtol=1e-6, atol=1e-9)


def _written_token_mean(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A token mean written out, as users write one: 0/0 on rows holding only -100."""
    mask = y.ne(-100)
    return (nn.functional.cross_entropy(logits, y.clamp_min(0), reduction="none") * mask).sum() / mask.sum()


def _tokenless_batches(empty: str) -> tuple[torch.Tensor, torch.Tensor]:
    """STEPS batches of 8 rows for two processes, whose first process's first micro-batch (rows 0-1) or whole
    half (rows 0-3) holds only -100 targets."""
    g = torch.Generator().manual_seed(4)
    xs, ys = torch.randn(STEPS, 8, 64, generator=g, dtype=torch.float64), torch.randint(0, 5, (STEPS, 8), generator=g)
    ys[:, :2 if empty == "micro-batch" else 4] = -100
    ys[:, 6] = -100
    return xs, ys


def _tokenless_worker(rank: int, world: int, port: int, out: str, micro_batches: int, empty: str) -> None:
    import comera_compile as cc

    with _process_group(rank, world, port):
        model = _model().double()
        ddp = nn.parallel.DistributedDataParallel(model)
        step = cc.compile_step(ddp, _written_token_mean, torch.optim.SGD(ddp.parameters(), lr=0.5), backend="eager",
                               micro_batches=micro_batches, micro_batch_weights="tokens")
        for x, y in zip(*_tokenless_batches(empty)):
            step(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
        torch.save([p.detach() for p in model.parameters()], f"{out}.{rank}")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
@pytest.mark.parametrize("micro_batches,empty", [(1, "process"), (2, "process"), (2, "micro-batch")])
def test_a_process_or_micro_batch_without_tokens_trains_a_written_out_token_mean_as_one_process(
        micro_batches, empty, tmp_path):
    """A hand-written token mean (0/0 where a part holds no token) weighed by tokens under DDP: a process whose
    rows, or one of whose micro-batches, hold no token still joins the step, with nothing of its own, and both
    replicas end at one process's eager SGD steps on the whole batch (float64).  It used to send the part's
    NaN into every replica."""
    out = str(tmp_path / "tokenless")
    spawn(_tokenless_worker, args=(2, _free_port(), out, micro_batches, empty), nprocs=2)
    model = _model().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for x, y in zip(*_tokenless_batches(empty)):
        _written_token_mean(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for r in range(2):
        for p, q in zip(torch.load(f"{out}.{r}"), model.parameters()):
            torch.testing.assert_close(p, q.detach(), rtol=1e-9, atol=1e-12)


def _deep_llama() -> nn.Module:
    """A 12-layer Llama at small widths, tensorized at the defaults but for its size (float32: torch 2.11's
    compiled CPU attention backward refuses float64)."""
    import transformers

    import comera_compile as cc

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=12, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32))
    return cc.tensorize(model, rank=6, min_features=32)


def _deep_tokenless_worker(rank: int, world: int, port: int, out: str) -> None:
    import comera_compile as cc

    with _process_group(rank, world, port):
        lm = _deep_llama()
        ddp = nn.parallel.DistributedDataParallel(_ShiftedLogits(lm))
        step = cc.compile_step(ddp, _written_token_mean, torch.optim.SGD(ddp.parameters(), lr=0.5),
                               micro_batches=2, micro_batch_weights="tokens")
        for batch in _padded_llama_batches()[:2]:
            labels = batch["labels"][:, 1:].clone()
            labels[:4] = -100   # the first process's rows: no token at all
            half = slice(rank * 4, (rank + 1) * 4)
            step(batch["input_ids"][half], batch["attention_mask"][half], labels[half])
        torch.save([p.detach() for p in lm.parameters()], f"{out}.{rank}")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
@pytest.mark.slow   # its small model's variants (above) run in the default tier
def test_a_12_layer_decoder_s_process_without_tokens_trains_as_one_process(tmp_path):
    """The same on a 12-layer transformers Llama whose blocks compile_step compiles (backend "comera"): the
    process whose rows hold no label token runs its micro-batches with nothing of their own, and both end at
    one process's eager steps on the whole batch."""
    pytest.importorskip("transformers")
    out = str(tmp_path / "deep")
    spawn(_deep_tokenless_worker, args=(2, _free_port(), out), nprocs=2)
    model = _ShiftedLogits(_deep_llama())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for batch in _padded_llama_batches()[:2]:
        labels = batch["labels"][:, 1:].clone()
        labels[:4] = -100
        _written_token_mean(model(batch["input_ids"], batch["attention_mask"]), labels).backward()
        opt.step()
        opt.zero_grad()
    for r in range(2):
        for p, q in zip(torch.load(f"{out}.{r}"), model.lm.parameters()):
            assert torch.isfinite(p).all()
            torch.testing.assert_close(p, q.detach(), rtol=1e-4, atol=1e-5)   # compiled vs eager, float32


def _full_batches() -> list[torch.Tensor]:
    """STEPS batches of 8 unpadded rows of 12 tokens: both halves hold as many label tokens, so DDP's average
    of the two token means is the whole batch's."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, 96, (8, 12), generator=g) for _ in range(STEPS)]


def _sgd_on_shares(model, params, rank: int = 0, world: int = 1) -> None:
    """SGD (lr 0.5) on this process's share of each of _full_batches (the whole batch for one process), with
    the causal LM's own loss."""
    opt = torch.optim.SGD(params, lr=0.5)
    per = 8 // world
    for ids in _full_batches():
        ids = ids[rank * per:(rank + 1) * per]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def _siblings_worker(rank: int, world: int, port: int, out: str) -> None:
    """A Llama under DDP with buckets small enough that dynamo's DDP optimizer splits each graph at them,
    compiled by "comera" with the sibling pass on (CUDA's default); what each run of the pass shared."""
    import comera_compile.passes.fx.siblings as siblings

    shared = []
    original = siblings.batch_siblings
    siblings.batch_siblings = lambda gm, inputs=None: (lambda r: shared.append(r.count) or r)(original(gm, inputs))
    # buckets of 16 KiB: the tiny model's parameters fill three, as a large model's fill 25 MiB ones (torch
    # wants the first bucket no larger than the rest, and its default first bucket holds a MiB)
    dist._DEFAULT_FIRST_BUCKET_BYTES = 16384
    with _process_group(rank, world, port):
        ddp = nn.parallel.DistributedDataParallel(_llama().float(), bucket_cap_mb=16384 / 2**20)
        compiled = torch.compile(ddp, backend="comera", options={"batch_siblings": True})
        _sgd_on_shares(compiled, ddp.parameters(), rank, world)
        torch.save({"params": [p.detach() for p in ddp.module.parameters()], "shared": shared}, f"{out}.{rank}")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
@pytest.mark.slow   # about 3 min
def test_ddp_split_graphs_with_shared_sibling_gemms_train_like_one_eager_process(tmp_path):
    """Dynamo's DDP optimizer cuts the graph at the gradient buckets and the backend rewrites each piece:
    siblings share their GEMMs only where they fall in one piece, and two processes, each on half of every
    (unpadded) batch, end where one eager process ends on the whole batch.  float32 through Inductor."""
    pytest.importorskip("transformers")
    out = str(tmp_path / "siblings")
    spawn(_siblings_worker, args=(2, _free_port(), out), nprocs=2)
    results = [torch.load(f"{out}.{r}") for r in range(2)]
    for r in results:
        # the graph cut into pieces, and the siblings (and alike layers) of a piece still share
        assert len(r["shared"]) >= 3 and sum(r["shared"]) > 0, r["shared"]
    assert all(torch.equal(p, q) for p, q in zip(results[0]["params"], results[1]["params"]))
    model = _llama().float()
    _sgd_on_shares(model, model.parameters())
    for p, q in zip(results[0]["params"], model.parameters()):
        assert (p - q.detach()).norm() <= 1e-4 * q.norm() + 1e-6


LATE_STEPS, LATE_SAVE = 40, 29


def _late_stage_worker(rank: int, world: int, port: int, out: str, mode: str, ckpt: str) -> None:
    """DDP with RankAdaptive's late stage, each process fed its own loss of very different data (rank 0's rows
    one class, rank 1's random labels), so the processes' own loss averages differ; half of every bond is
    switched off at step 3, so the check at step 5 cuts.  mode "full" trains all
    steps; "save" stops at LATE_SAVE and saves through the DDP wrapper; "load" loads through a wrapper built on
    a fresh model (the callback rebuilds it: no rewrap by hand) and trains the rest."""
    import comera_compile as cc

    with _process_group(rank, world, port):
        torch.manual_seed(0)
        dense = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64), nn.Tanh(), nn.Linear(64, 5))
        model = cc.tensorize(dense, rank=6, min_features=32)
        opt = torch.optim.AdamW(cc.param_groups(model, lr=1e-2))
        ra = cc.RankAdaptive(model, optimizer=opt, cut_every=5, target_ratio=0.5, late_stage_at=12,
                             target_loss=0.7)
        ddp = nn.parallel.DistributedDataParallel(model)

        def rewrap(_: cc.RankAdaptive) -> None:
            nonlocal ddp
            ddp = nn.parallel.DistributedDataParallel(model)

        ra.on_reallocate(rewrap)
        if mode == "load":
            cc.load_checkpoint(ckpt, ddp, opt, ra)
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(16, 64, generator=g), torch.randint(0, 5, (16,), generator=g)) for _ in range(LATE_STEPS)]
        checks = []
        for i in range(ra.steps, LATE_SAVE if mode == "save" else LATE_STEPS):
            x, y = data[i]
            x, y = x[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8]
            if rank == 0:
                y = torch.zeros_like(y)
            loss = nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if i == 3:   # half of every bond switched off (the same on both): the first check re-allocates
                with torch.no_grad():
                    for layer in ra.layers.values():
                        for gate in layer.gates:
                            gate[: gate.numel() // 2] = 0.0
            ra.step(loss)
            if ra.steps % 5 == 0:
                checks.append((ra.steps, ra._loss_ema, [p.detach().clone() for p in model.parameters()]))
        if mode == "save":
            cc.save_checkpoint(ckpt, ddp, opt, ra)
        torch.save({"checks": checks, "cuts": ra.cuts, "ranks": ra.ranks(),
                    "params": [p.detach().clone() for p in model.parameters()]}, f"{out}.{rank}")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_the_late_stage_decides_on_the_processes_mean_loss_and_resumes_to_the_bit(tmp_path):
    """Processes whose own losses differ take the late stage's decisions on their mean (the whole batch's loss
    average), so the replicas hold the same gates at every check, not rank 0's masks over another process's
    gates; a checkpoint saved and loaded through the DDP wrapper (its layers named as in the bare model) at a
    point where a cut has happened resumes with the callback rebuilding the wrapper, to the bit."""
    ckpt = str(tmp_path / "ckpt")
    full, first, rest = (_two_processes(_late_stage_worker, str(tmp_path / mode), mode, ckpt)
                         for mode in ("full", "save", "load"))
    assert full[0]["cuts"] >= 1 and first[0]["cuts"] >= 1   # the checkpoint holds cut ranks
    for (step, ema0, params0), (_, ema1, params1) in zip(full[0]["checks"], full[1]["checks"]):
        assert ema0 == ema1, step
        assert all(torch.equal(a, b) for a, b in zip(params0, params1)), step
    assert rest[0]["ranks"] == full[0]["ranks"]
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(rest[r]["params"], full[r]["params"]))


def _two_processes(worker, out: str, *args) -> list[dict]:
    """Run worker(rank, 2, port, out, *args) in two gloo processes; each process's saved result."""
    spawn(worker, args=(2, _free_port(), out, *args), nprocs=2)
    return [torch.load(f"{out}.{r}") for r in range(2)]


def _compile_step_cut_worker(rank: int, world: int, port: int, out: str) -> None:
    """cc.compile_step(DDP(model), ..., rank_adaptive=ra) over a re-allocation at step 5: kept as it is, its
    next call is compile_step's error; rebuilt in ra.on_reallocate as the README shows, it trains on with the
    replicas identical."""
    import comera_compile as cc

    with _process_group(rank, world, port):
        result: dict = {}
        for rebuild in (False, True):
            model = _model()
            opt = torch.optim.AdamW(cc.param_groups(model, lr=1e-2))
            ra = cc.RankAdaptive(model, optimizer=opt, cut_every=5)

            def make() -> object:
                return cc.compile_step(nn.parallel.DistributedDataParallel(model), nn.functional.cross_entropy,
                                       opt, rank_adaptive=ra)

            step = make()
            if rebuild:
                def again(_: cc.RankAdaptive) -> None:
                    nonlocal step
                    step = make()

                ra.on_reallocate(again)
            calls = []

            def switch_off(*_: object) -> None:   # after the 5th optimizer step (the check next): half of every bond
                calls.append(1)
                if len(calls) == 5:
                    for layer in ra.layers.values():
                        for gate in layer.gates:
                            gate.detach()[: gate.numel() // 2] = 0.0

            opt.register_step_post_hook(switch_off)
            g = torch.Generator().manual_seed(1)
            try:
                for i in range(8):
                    x, y = torch.randn(16, 64, generator=g), torch.randint(0, 5, (16,), generator=g)
                    step(x[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8])
                result[rebuild] = {"cuts": ra.cuts, "params": [p.detach().clone() for p in model.parameters()]}
            except RuntimeError as e:
                result[rebuild] = {"cuts": ra.cuts, "error": str(e)}
            torch._dynamo.reset()
        torch.save(result, f"{out}.{rank}")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_compile_step_on_a_ddp_wrapper_says_to_rebuild_it_after_a_reallocation(tmp_path):
    a, b = _two_processes(_compile_step_cut_worker, str(tmp_path / "cut"))
    for r in (a, b):
        assert r[False]["cuts"] == 1 and "build the step again on a new wrapper" in r[False]["error"]
        assert r[True]["cuts"] >= 1 and "error" not in r[True], r[True].get("error")
    assert all(torch.equal(p, q) for p, q in zip(a[True]["params"], b[True]["params"]))


def _train_on_noise(model: nn.Module, opt: torch.optim.Optimizer, ra, steps: int) -> None:
    """`steps` steps of the plain loop with RankAdaptive on random inputs and labels (each process its own)."""
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(torch.randn(8, 64)), torch.randint(0, 5, (8,)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ra.step(loss)


def _own_models_worker(rank: int, world: int, port: int, out: str) -> None:
    """Each process trains a model of its own (another seed, no DDP), RankAdaptive checking every 2 steps:
    with the default group the first check finds 'replicas' that differ; with a group of one per process
    each trains on, its model its own, and rank 0 alone training a model while rank 1 waits does not hang."""
    import comera_compile as cc

    with _process_group(rank, world, port):
        own, _ = dist.new_subgroups(1)
        result: dict = {}
        for group in ("default", "own"):
            torch.manual_seed(rank)
            model = cc.tensorize(nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 5)), rank=6,
                                 min_features=32)
            opt = torch.optim.AdamW(cc.param_groups(model, lr=1e-2))
            ra = cc.RankAdaptive(model, optimizer=opt, cut_every=2, process_group=own if group == "own" else None)
            try:
                _train_on_noise(model, opt, ra, 4)
                result[group] = [p.detach().clone() for p in model.parameters()]
            except RuntimeError as e:
                result[group] = str(e)
        # replicas whose parameters do not even count alike (rank 1 keeps a layer dense): the same error,
        # not a collective of mismatched sizes (gloo aborted the process; NCCL would hang)
        model = cc.tensorize(nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64), nn.Tanh(),
                                           nn.Linear(64, 5)), rank=6, min_features=32,
                             exclude=["2"] if rank == 1 else None)
        opt = torch.optim.AdamW(cc.param_groups(model, lr=1e-2))
        try:
            _train_on_noise(model, opt, cc.RankAdaptive(model, optimizer=opt, cut_every=2), 4)
            result["layers"] = "trained"
        except RuntimeError as e:
            result["layers"] = str(e)
        if rank == 0:   # rank 0 alone: its checks talk to no other process
            ra = cc.RankAdaptive(model, optimizer=opt, cut_every=1, process_group=own)
            ra.step(torch.tensor(1.0))
        dist.barrier()
        torch.save(result, f"{out}.{rank}")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_processes_that_each_train_their_own_model_say_so_with_a_group_of_one(tmp_path):
    a, b = _two_processes(_own_models_worker, str(tmp_path / "own"))
    for r in (a, b):
        assert "process_group=torch.distributed.new_subgroups(1)[0]" in r["default"], r["default"]
        assert "hold different parameters" in r["layers"], r["layers"]
    assert not all(torch.equal(p, q) for p, q in zip(a["own"], b["own"]))   # each kept its own model


def _callback_save_worker(rank: int, world: int, port: int, out: str) -> None:
    """The Trainer's callback saving a checkpoint while the processes' own loss averages differ (as each
    process's loss does): every process goes on with their mean, and the one file holds it."""
    import os
    from types import SimpleNamespace

    import comera_compile as cc

    with _process_group(rank, world, port):
        model = _model()
        ra = cc.RankAdaptive(model, optimizer=torch.optim.AdamW(cc.param_groups(model, lr=1e-2)))
        ra._loss_ema = float(rank + 1)
        args, state = SimpleNamespace(output_dir=out), SimpleNamespace(global_step=3, is_world_process_zero=rank == 0)
        os.makedirs(os.path.join(out, "checkpoint-3"), exist_ok=True)
        dist.barrier()
        ra.trainer_callback().on_save(args, state, None)
        dist.barrier()
        saved = torch.load(os.path.join(out, "checkpoint-3", "rank_adaptive.pt"), weights_only=False)
        torch.save({"ema": ra._loss_ema, "saved": saved["loss_ema"]}, f"{out}.{rank}")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_the_trainer_callback_saves_the_processes_mean_loss_average(tmp_path):
    pytest.importorskip("transformers")
    results = _two_processes(_callback_save_worker, str(tmp_path / "run"))
    assert [r["ema"] for r in results] == [1.5, 1.5] and [r["saved"] for r in results] == [1.5, 1.5]


def _trainer_worker(rank: int, world: int, port: int, out: str) -> None:
    """transformers' Trainer across the processes (it builds the process group and the DDP wrapper from the
    launcher's environment), with RankAdaptive's callback: at its defaults (re-allocations mid-training), then
    with realloc_at=None and a quarter of every gate switched off at step 5."""
    import os

    import transformers

    import comera_compile as cc

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)

    class Regressor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
            out = self.net(x)
            return {"loss": nn.functional.cross_entropy(out, labels), "logits": out}

    class SwitchOff(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs) -> None:   # before RankAdaptive's (listed first)
            if state.global_step == 5:
                with torch.no_grad():
                    for layer in ra.layers.values():
                        for gate in layer.gates:
                            gate[: gate.numel() // 4] = 0.0

    g = torch.Generator().manual_seed(1)
    data = [{"x": x, "labels": y} for x, y in zip(torch.randn(256, 64, generator=g),
                                                  torch.randint(0, 5, (256,), generator=g))]
    result: dict = {}
    try:
        for realloc_at in (2.0, None):
            model = Regressor()
            ra = cc.RankAdaptive(model, cut_every=5, realloc_at=realloc_at)
            args = transformers.TrainingArguments(
                output_dir=f"{out}-run{rank}", max_steps=15, per_device_train_batch_size=8, learning_rate=1e-3,
                report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True,
                ddp_backend="gloo")
            trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                           callbacks=[SwitchOff(), ra.trainer_callback()])
            try:
                trainer.train()
            except ValueError as e:
                result[realloc_at] = (str(e), trainer.state.global_step)
                continue
            result[realloc_at] = {"params": [p.detach().clone() for p in model.parameters()],
                                  "ranks": ra.allocated_ranks(), "steps": ra.steps,
                                  "wrapper": type(trainer.model_wrapped).__name__}
    finally:
        torch.save(result, f"{out}.{rank}")
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_the_trainer_across_two_processes_refuses_mid_run_reallocations_and_cuts_replicas_alike(tmp_path):
    """Under the Trainer's DDP wrapper, which it never rebuilds, a re-allocation would leave the wrapper syncing
    the old cores while the replicas drift apart: RankAdaptive's default is an error before the first step.
    With realloc_at=None both processes train identical replicas and cut the same slices at the end."""
    pytest.importorskip("transformers")
    out = str(tmp_path / "trainer")
    results = _two_processes(_trainer_worker, out)
    for r in results:
        message, step = r[2.0]
        assert "realloc_at=None" in message and step == 0, (message, step)
    a, b = (r[None] for r in results)
    assert a["wrapper"] == "DistributedDataParallel" and a["steps"] == b["steps"] == 15
    assert a["ranks"] == b["ranks"]
    assert all(max(r[1:-1]) < 6 for r in a["ranks"].values()), a["ranks"]   # the switched-off quarter is cut out
    assert max((p - q).abs().max().item() for p, q in zip(a["params"], b["params"])) == 0.0


def _groups_of_one_worker(rank: int, world: int, port: int, out: str) -> None:
    """Each process in a group of its own: a DDP wrapper over it counts a token mean's tokens in that group
    only, and a RankAdaptive of that group saves and loads the process's own checkpoint."""
    import comera_compile as cc
    from comera_compile.micro_batches import averaging_group, averaging_processes, tokens_everywhere

    with _process_group(rank, world, port):
        own, _ = dist.new_subgroups(1)
        model = _model()
        ddp = nn.parallel.DistributedDataParallel(model, process_group=own)
        tokens = torch.tensor(3 + 4 * rank)
        result: dict = {"processes": averaging_processes(ddp),
                        "tokens": int(tokens_everywhere(tokens, averaging_group(ddp)))}
        torch.manual_seed(rank)
        with torch.no_grad():
            for p in model.parameters():   # each process its own model
                p.add_(0.1 * torch.randn_like(p))
        opt = torch.optim.AdamW(cc.param_groups(model, lr=1e-2))
        ra = cc.RankAdaptive(model, optimizer=opt, cut_every=2, process_group=own)
        _train_on_noise(model, opt, ra, 2)
        cc.save_checkpoint(f"{out}-ckpt{rank}", model, opt, ra)
        fresh = _model()
        fresh_opt = torch.optim.AdamW(cc.param_groups(fresh, lr=1e-2))
        cc.load_checkpoint(f"{out}-ckpt{rank}", fresh, fresh_opt, cc.RankAdaptive(fresh, optimizer=fresh_opt,
                                                                                  process_group=own))
        result["loaded"] = all(torch.equal(p, q) for p, q in zip(fresh.parameters(), model.parameters()))
        dist.barrier()
        torch.save(result, f"{out}.{rank}")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_a_group_of_one_counts_its_own_tokens_and_checkpoints_its_own_model(tmp_path):
    """Tokens were summed over the default group whatever group DDP averaged over (at two groups of two, each
    group's gradients came out about half size); every process's checkpoint was planned over the default group
    (one folder held the metadata of both)."""
    for rank, result in enumerate(_two_processes(_groups_of_one_worker, str(tmp_path / "own"))):
        assert result["processes"] == 1 and result["tokens"] == 3 + 4 * rank
        assert result["loaded"]


def _stale_after_load_worker(rank: int, world: int, port: int, out: str, ckpt: str) -> None:
    """compile_step(DDP(model), rank_adaptive=ra), then load_checkpoint cuts the model to a checkpoint's
    ranks: the step's next call is its error (it ran one unaveraged backward, then DDP's own error)."""
    import comera_compile as cc

    with _process_group(rank, world, port):
        saved = _model()
        opt = torch.optim.AdamW(cc.param_groups(saved, lr=1e-2))
        ra = cc.RankAdaptive(saved, optimizer=opt, cut_every=1)
        with torch.no_grad():
            for layer in ra.layers.values():
                for gate in layer.gates:
                    gate[: gate.numel() // 2] = 0.0
        ra.step()
        assert ra.cuts == 1
        cc.save_checkpoint(ckpt, saved, opt, ra)
        model = _model()
        opt = torch.optim.AdamW(cc.param_groups(model, lr=1e-2))
        ra = cc.RankAdaptive(model, optimizer=opt)
        step = cc.compile_step(nn.parallel.DistributedDataParallel(model), nn.functional.cross_entropy, opt,
                               rank_adaptive=ra, backend="eager")
        x, y = torch.randn(8, 64), torch.randint(0, 5, (8,))
        step(x, y)
        cc.load_checkpoint(ckpt, model, ra=ra)
        try:
            step(x, y)
            result = "no error"
        except RuntimeError as e:
            result = str(e)
        torch.save(result, f"{out}.{rank}")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_a_compiled_ddp_step_is_stale_after_a_checkpoint_cut_its_cores(tmp_path):
    for result in _two_processes(_stale_after_load_worker, str(tmp_path / "stale"), str(tmp_path / "ckpt")):
        assert "build the step again on a new wrapper" in result, result


def _tempo_worker(rank: int, world: int, port: int, out: str) -> None:
    """DDP over a tensorized Llama after cc.tempo (its norms and gated MLPs swapped for the Tempo ops), an eager
    loop on this process's half of each unpadded batch."""
    import warnings

    import comera_compile as cc

    with _process_group(rank, world, port):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # tempo's "cannot trace" (it swaps modules instead)
            lm = cc.tempo(_llama())
        ddp = nn.parallel.DistributedDataParallel(lm)
        _sgd_on_shares(ddp, ddp.parameters(), rank, world)
        torch.save({"params": [p.detach() for p in lm.parameters()], "counts": lm.tempo_summary.counts(),
                    "keys": list(lm.state_dict())}, f"{out}.{rank}")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_ddp_over_a_tempo_decoder_trains_like_the_untouched_model_in_one_process(tmp_path):
    """The Tempo ops keep less for backward and compute the same gradients: under DDP the replicas of a
    tempo'd Llama end with the parameters of one process's SGD steps on the whole batch with the untouched
    model, to float64 rounding (a Tempo norm's backward rebuilds its input from its output: 1.4e-13 apart
    relative, where the steps moved a parameter by up to 0.11)."""
    pytest.importorskip("transformers")
    results = _two_processes(_tempo_worker, str(tmp_path / "tempo"))
    model = _llama()
    assert results[0]["counts"] == {"rms_norm": 5, "swiglu": 2} and results[0]["keys"] == list(model.state_dict())
    _sgd_on_shares(model, model.parameters())
    for r in range(2):
        for p, q in zip(results[r]["params"], model.parameters()):
            torch.testing.assert_close(p, q.detach(), rtol=1e-9, atol=1e-12)
