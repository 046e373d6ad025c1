"""A tensorized model sharded with FSDP2 (fully_shard on each encoder layer, then the root) in two gloo
processes on CPU: it trains like one process on the whole batch, eager and with the layers compiled by
backend "comera"; RankAdaptive at its defaults cuts ranks under it with every process agreeing; and
distributed checkpoints taken after cuts resume at another world size as the uninterrupted run goes on."""

from __future__ import annotations

import datetime
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers import spawn

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed gloo")

TIMEOUT = datetime.timedelta(seconds=120)  # a stuck collective fails the test instead of hanging it
BATCH, SEQ, WIDTH = 8, 5, 64


def _rendezvous() -> str:
    """A path for a file the processes meet at (no port to pick: a port found free can be taken again
    before the store binds it, one run after another)."""
    handle, path = tempfile.mkstemp(prefix="comera-fsdp-rdzv-")
    os.close(handle)
    os.remove(path)  # the store creates it
    return path


def _encoder() -> nn.Module:
    """BERT's encoder layer at reduced width (64, 4 heads, feed-forward 128), two of them, tensorized."""
    import comera_compile as cc

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(WIDTH, 4, dim_feedforward=128, dropout=0.0, batch_first=True,
                                       activation="gelu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cc.tensorize(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), rank=8, min_features=32)


class _Stack(nn.Module):
    """Two encoder layers of user code (the demo's, not torch's built-in layer class)."""

    def __init__(self) -> None:
        from comera_compile.examples.six_encoder import EncoderLayer, SixEncoderConfig

        super().__init__()
        c = SixEncoderConfig(d_model=WIDTH, heads=4, ffn=128, layers=2, dropout=0.0)
        self.layers = nn.ModuleList([EncoderLayer(c) for _ in range(c.layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, None)
        return x


def _user_encoder() -> nn.Module:
    import comera_compile as cc

    torch.manual_seed(0)
    return cc.tensorize(_Stack(), rank=8, min_features=32)


def _shard(model: nn.Module, compiled: bool) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    if compiled:
        for block in model.layers:
            block.compile(backend="comera")
    return model


def _batches(steps: int, start: int = 0):
    """The global batches of steps start..steps-1 (the same on every process and in every run)."""
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(WIDTH, 2, generator=g) @ torch.randn(2, WIDTH, generator=g) / 8
    for step in range(steps):
        x = torch.randn(BATCH, SEQ, WIDTH, generator=g)
        if step >= start:
            yield step, x, x @ teacher


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def _run(rank: int, world: int, fn, *args) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{args[0]}", rank=rank, world_size=world,
                                timeout=TIMEOUT)
    try:
        fn(rank, world, *args[1:])
        if world > 1:
            dist.barrier()  # no process tears its connections down while a peer still talks to it
    finally:
        if world > 1:
            dist.destroy_process_group()


def _spawn(fn, world: int, *args) -> None:
    if world == 1:
        _run(0, 1, fn, None, *args)
    else:
        path = _rendezvous()
        try:
            spawn(_run, args=(world, fn, path, *args), nprocs=world)
        finally:
            if os.path.exists(path):
                os.remove(path)


# -- training like one process ---------------------------------------------------------------------------
STEPS = 20


def _train(rank: int, world: int, out: str, compiled: bool) -> None:
    """STEPS of SGD with momentum (Adam would turn the exactly-zero gradient of attention's key bias into
    noise-driven steps that differ between any two runs), each process on its share of the batch.  Sharded
    and not compiled, the steps are cc.compile_step's (backend "eager") in two micro-batches: gradients
    accumulated unsharded, reduce-scattered once."""
    import comera_compile as cc

    model = _encoder()
    if world > 1:
        _shard(model, compiled)
    elif compiled:
        for block in model.layers:
            block.compile(backend="comera")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    accumulated = world > 1 and not compiled
    step = cc.compile_step(model, nn.functional.mse_loss, opt, backend="eager", micro_batches=2) if accumulated \
        else None
    per = BATCH // world
    for _, x, y in _batches(STEPS):
        sl = slice(rank * per, (rank + 1) * per)
        if step is not None:
            step(x[sl], y[sl])
            continue
        nn.functional.mse_loss(model(x[sl]), y[sl]).backward()
        opt.step()
        opt.zero_grad()
    params = _full(model)  # a collective: every process gathers
    if rank == 0:
        torch.save(params, out)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fsdp2_trains_like_one_process_on_the_whole_batch(tmp_path, compiled):
    """20 steps: every parameter within 1e-5 relative (float32; the two runs sum the gradient in a different
    order: each process its half, then a reduce-scatter).  The sharded eager run accumulates two micro-batches
    per step (cc.compile_step(..., micro_batches=2))."""
    _spawn(_train, 2, str(tmp_path / "fsdp"), compiled)
    torch._dynamo.reset()
    _spawn(_train, 1, str(tmp_path / "one"), compiled)
    sharded, single = torch.load(tmp_path / "fsdp"), torch.load(tmp_path / "one")
    assert len(sharded) == len(single)
    for p, q in zip(sharded, single):
        assert p.shape == q.shape
        assert (p - q).norm() <= 1e-5 * q.norm() + 1e-7


def _written_token_mean(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A token mean over the outputs' WIDTH classes, written out as users write one: 0/0 without tokens."""
    mask = y.ne(-100)
    ce = nn.functional.cross_entropy(out.transpose(1, 2), y.clamp_min(0), reduction="none")
    return (ce * mask).sum() / mask.sum()


def _tokenless_steps(rank: int, world: int, out: str) -> None:
    """Three steps of a written-out token mean, whose first process's first micro-batch holds no token: two
    micro-batches a step, sharded (every process runs both, their all-gathers paired), else the whole batch
    eagerly."""
    import comera_compile as cc

    model = _shard(_encoder(), compiled=False) if world > 1 else _encoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = cc.compile_step(model, _written_token_mean, opt, backend="eager", micro_batches=2,
                           micro_batch_weights="tokens") if world > 1 else None
    g = torch.Generator().manual_seed(5)
    per = BATCH // world
    for _, x, _ in _batches(3):
        y = torch.randint(0, WIDTH, (BATCH, SEQ), generator=g)
        y[:2], y[5, 2:] = -100, -100
        if step is not None:
            step(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
            continue
        _written_token_mean(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    params = _full(model)
    if rank == 0:
        torch.save(params, out)


def test_a_micro_batch_without_tokens_on_one_process_trains_as_one_process(tmp_path):
    """Under FSDP2 every process runs as many forwards (each an all-gather) as the others: a micro-batch without
    tokens on one process only is run with nothing of its own, not left out (which left its peer waiting on an
    all-gather until the collective timed out), and the step is one process's on the whole batch."""
    _spawn(_tokenless_steps, 2, str(tmp_path / "fsdp"))
    _spawn(_tokenless_steps, 1, str(tmp_path / "one"))
    for p, q in zip(torch.load(tmp_path / "fsdp"), torch.load(tmp_path / "one")):
        assert torch.isfinite(p).all() and (p - q).norm() <= 1e-5 * q.norm() + 1e-7


def _float16_steps(rank: int, world: int, out: str) -> None:
    """compile_step at float16 autocast (its own GradScaler) on the sharded encoder: step 0 trains, step 1
    overflows on process 0 only (its rows scaled by 1e6), step 2 trains.  Rank 0 saves the full parameters
    after each step and both processes' scales."""
    import comera_compile as cc

    model = _shard(_encoder(), compiled=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = cc.compile_step(model, nn.functional.mse_loss, opt, backend="eager", autocast=torch.float16)
    per = BATCH // world
    saved = []
    for i, x, y in _batches(3):
        sl = slice(rank * per, (rank + 1) * per)
        step(x[sl] * (1e6 if i == 1 and rank == 0 else 1.0), y[sl])
        scales = [None] * world
        dist.all_gather_object(scales, step.scaler.get_scale())
        saved.append((_full(model), scales))
    if rank == 0:
        torch.save(saved, out)


def test_a_step_that_overflows_on_one_process_is_skipped_on_every_process(tmp_path):
    """float16 under FSDP2: process 0's rows overflow, process 1's do not; both skip that step (the sharded
    gradients' overflow check is one for all), their scales halve alike, and the step after it trains."""
    _spawn(_float16_steps, 2, str(tmp_path / "fp16"))
    (p0, s0), (p1, s1), (p2, s2) = torch.load(tmp_path / "fp16")
    assert s0[0] == s0[1] and s1 == [s0[0] / 2] * 2 and s2 == s1
    assert all(torch.equal(a, b) for a, b in zip(p0, p1)), "the overflowing step changed a parameter"
    assert any(not torch.equal(a, b) for a, b in zip(p1, p2)), "the step after it did not train"


# -- rank adaptation -------------------------------------------------------------------------------------
@torch.no_grad()
def _zero_leading_halves(ra) -> None:
    """Zero the leading half of every bond's gates (sharded or not), as the proximal step would in time."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for layer in ra.layers.values():
        for gate in layer.gates:
            keep = torch.ones(gate.shape, dtype=gate.dtype)
            keep[: gate.numel() // 2] = 0
            sharded = isinstance(gate, DTensor)
            gate.mul_(distribute_tensor(keep, gate.device_mesh, gate.placements) if sharded else keep)


def _adaptive_step(model: nn.Module, opt, ra, x: torch.Tensor, y: torch.Tensor, rank: int, world: int,
                   zero: bool) -> tuple[float, bool]:
    """One step on this process's rows, RankAdaptive after the optimizer (the leading half of every bond's
    gates zeroed first when `zero`): the whole batch's loss, and whether RankAdaptive re-allocated."""
    per = BATCH // world
    sl = slice(rank * per, (rank + 1) * per)
    loss = nn.functional.mse_loss(model(x[sl]), y[sl])
    ra.loss(loss).backward()
    opt.step()
    opt.zero_grad()
    if zero:
        _zero_leading_halves(ra)
    reallocated = ra.step()
    loss = loss.detach()
    if world > 1:
        dist.all_reduce(loss)
        loss /= world
    return float(loss), reallocated


RA_STEPS, RA_EVERY = 105, 35


def _adapt(rank: int, world: int, out: str) -> None:
    """RankAdaptive at its defaults but a check every RA_EVERY steps (not 100: a shorter run) with CoMERA's
    AdamW groups at lr 1e-4 (at 1e-3 Adam amplifies the two runs' float32 summation-order differences
    tenfold every ~10 steps, cuts or not, and the one-process comparison would measure that); before each
    check the leading half of every bond's gates is zeroed (as the proximal step would, by hand so that the
    run is short), so the checks at steps 35 and 70 switch them off and re-allocate."""
    import comera_compile as cc

    model = _encoder()
    if world > 1:
        _shard(model, compiled=False)
    opt = torch.optim.AdamW(cc.param_groups(model, lr=1e-4))
    ra = cc.RankAdaptive(model, optimizer=opt, cut_every=RA_EVERY)
    result: dict = {"losses": [], "cuts": [], "snapshots": []}
    for step, x, y in _batches(RA_STEPS):
        loss, reallocated = _adaptive_step(model, opt, ra, x, y, rank, world, zero=step + 1 in (RA_EVERY, 2 * RA_EVERY))
        result["losses"].append(loss)
        if reallocated:
            result["cuts"].append(step + 1)
            result["snapshots"].append([local.detach().clone() for local in
                                        (p.to_local() if hasattr(p, "to_local") else p for p in model.parameters())])
            result.setdefault("full", []).append(_full(model))
    result["ranks"] = ra.allocated_ranks()
    torch.save(result, f"{out}.{rank}")


def test_rank_adaptive_under_fsdp2_cuts_alike_everywhere_and_matches_one_process(tmp_path):
    """Two re-allocations inside the run: after each, the whole model gathered on each process is the same
    to the bit, every TT layer smaller; the loss of every step matches the one-process run's."""
    _spawn(_adapt, 2, str(tmp_path / "fsdp"))
    a, b = (torch.load(tmp_path / f"fsdp.{r}") for r in range(2))
    assert a["cuts"] == b["cuts"] == [RA_EVERY, 2 * RA_EVERY]
    for full_a, full_b in zip(a["full"], b["full"]):
        assert max((p - q).abs().max().item() for p, q in zip(full_a, full_b)) == 0.0
    _spawn(_adapt, 1, str(tmp_path / "one"))
    one = torch.load(tmp_path / "one.0")
    assert one["cuts"] == a["cuts"] and one["ranks"] == a["ranks"]
    assert all(max(r) < 8 for r in a["ranks"].values()), a["ranks"]  # every layer was cut (tensorized at 8)
    for p, q in zip(a["full"][-1], one["full"][-1]):
        assert p.shape == q.shape
    diff = max(abs(x - y) / abs(y) for x, y in zip(a["losses"], one["losses"]))
    assert diff < 1e-4, diff
    losses = a["losses"]
    for cut in a["cuts"]:  # training goes on: the loss falls again after each cut (mean of 10 steps, 20 apart)
        assert sum(losses[cut + 20:cut + 30]) < sum(losses[cut:cut + 10])


def _adapt_compiled(rank: int, world: int, out: str, compiled: bool = True) -> None:
    """The blocks compiled by backend "comera" (unless not `compiled`: the reference), a re-allocation at
    step 5 (half of every bond zeroed just before), then training on the cut cores: the recompile must see the
    new ranks as constants (dynamo does not specialize the ints of modules FSDP2 manages, so a rank read as an
    int would turn symbolic)."""
    import comera_compile as cc

    model = _user_encoder()
    if world > 1:
        _shard(model, compiled=False)
    for block in model.layers if compiled else ():
        block.compile(backend="comera", fullgraph=True)  # a graph break would be an error
    opt = torch.optim.AdamW(cc.param_groups(model, lr=1e-4))
    ra = cc.RankAdaptive(model, optimizer=opt, cut_every=5)
    losses, reallocated = [], []
    for step, x, y in _batches(10):
        loss, cut = _adaptive_step(model, opt, ra, x, y, rank, world, zero=step == 4)
        losses.append(loss)
        if cut:
            reallocated.append(step + 1)
    if rank == 0:
        torch.save({"losses": losses, "reallocated": reallocated, "ranks": ra.allocated_ranks()}, out)


@pytest.mark.slow   # about 3 min: the eager FSDP2 cut and the compiled FSDP2 run are in the default tier
def test_rank_adaptive_under_fsdp2_with_compiled_blocks_recompiles_at_the_new_ranks(tmp_path):
    """Two FSDP2 processes, their blocks compiled, against one eager process: the same cut at the same step,
    the same ranks, every step's loss within 1e-4."""
    _spawn(_adapt_compiled, 2, str(tmp_path / "fsdp"))
    _spawn(_adapt_compiled, 1, str(tmp_path / "one"), False)
    sharded, one = torch.load(tmp_path / "fsdp"), torch.load(tmp_path / "one")
    assert sharded["reallocated"] == one["reallocated"] == [5]
    assert sharded["ranks"] == one["ranks"]
    for x, y in zip(sharded["losses"], one["losses"]):
        assert abs(x - y) <= 1e-4 * abs(y)


# -- distributed checkpoints -----------------------------------------------------------------------------
CKPT_AT, CKPT_STEPS = 10, 20


def _resumable(rank: int, world: int, out: str, mode: str, ckpt: str) -> None:
    """mode "full": CKPT_STEPS steps; "save": the first CKPT_AT, then a checkpoint; "load": restore it and
    run the rest.  RankAdaptive checks every 5 steps and half of every bond is zeroed at step 3, so the
    checkpoint holds cut ranks.  No dropout: the runs must see the same numbers."""
    import comera_compile as cc

    model = _encoder()
    if world > 1:
        _shard(model, compiled=False)
    opt = torch.optim.AdamW(cc.param_groups(model, lr=1e-4))
    ra = cc.RankAdaptive(model, optimizer=opt, cut_every=5)
    start = 0
    if mode == "load":
        cc.load_checkpoint(ckpt, model, opt, ra)
        start = ra.steps
    losses = [_adaptive_step(model, opt, ra, x, y, rank, world, zero=step == 3)[0]
              for step, x, y in _batches(CKPT_AT if mode == "save" else CKPT_STEPS, start)]
    if mode == "save":
        assert ra.cuts >= 1
        cc.save_checkpoint(ckpt, model, opt, ra)
    params = _full(model)
    with torch.no_grad():
        probe = model(torch.randn(2, SEQ, WIDTH, generator=torch.Generator().manual_seed(7)))
    if rank == 0:
        torch.save({"losses": losses, "params": params, "probe": probe, "ranks": ra.allocated_ranks(),
                    "steps": ra.steps}, out)


@pytest.mark.parametrize("save_world,load_world", [(2, 1), pytest.param(2, 2, marks=pytest.mark.slow),
                                                  pytest.param(1, 2, marks=pytest.mark.slow)],
                         ids=["2to1", "2to2", "1to2"])   # 2to1, which reshards, in the default tier; the rest slow
def test_distributed_checkpoint_resumes_at_any_world_size(tmp_path, save_world, load_world):
    """Save at step 10 (after a cut) on save_world processes, resume on load_world: the next 10 steps'
    losses and the final model match the uninterrupted run on save_world processes: to the bit when the
    world size is the same; otherwise the losses and the model's output on a probe batch within 1e-5
    relative (float32 sums in another order)."""
    ckpt = str(tmp_path / "ckpt")
    _spawn(_resumable, save_world, str(tmp_path / "full"), "full", "")
    _spawn(_resumable, save_world, str(tmp_path / "first"), "save", ckpt)
    _spawn(_resumable, load_world, str(tmp_path / "rest"), "load", ckpt)
    full, rest = torch.load(tmp_path / "full"), torch.load(tmp_path / "rest")
    assert rest["steps"] == full["steps"] == CKPT_STEPS and rest["ranks"] == full["ranks"]
    assert len(rest["losses"]) == CKPT_STEPS - CKPT_AT
    if save_world == load_world:
        assert rest["losses"] == full["losses"][CKPT_AT:]
        assert all(torch.equal(p, q) for p, q in zip(rest["params"], full["params"]))
    else:
        for x, y in zip(rest["losses"], full["losses"][CKPT_AT:]):
            assert abs(x - y) <= 1e-5 * abs(y)
        # the function, not the parameters: rounding (an SVD) may choose other signs for a bond's singular
        # vectors when its input differs in the last bits, which changes the cores but not the layer
        assert (rest["probe"] - full["probe"]).norm() <= 1e-5 * full["probe"].norm()


def test_a_checkpoint_does_not_load_into_smaller_ranks(tmp_path):
    """A model built at ranks below the checkpoint's cannot hold it: a clear error, the model untouched."""
    import comera_compile as cc

    ckpt = str(tmp_path / "ckpt")
    cc.save_checkpoint(ckpt, _encoder())
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(WIDTH, 4, dim_feedforward=128, dropout=0.0, batch_first=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        small = cc.tensorize(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), rank=4, min_features=32)
    before = [p.detach().clone() for p in small.parameters()]
    with pytest.raises(ValueError, match="cannot grow"):
        cc.load_checkpoint(ckpt, small)
    assert all(torch.equal(p, q) for p, q in zip(before, small.parameters()))


def _cut_mlp(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    import comera_compile as cc

    torch.manual_seed(seed)
    model = cc.tensorize(nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64)), rank=6, min_features=32)
    opt = torch.optim.AdamW(cc.param_groups(model, lr=1e-2))
    return model, opt, cc.RankAdaptive(model, optimizer=opt, cut_every=5)


def test_a_checkpoint_without_the_optimizer_gives_the_cut_cores_to_rank_adaptive_s_optimizer(tmp_path):
    """Saved after a cut without the optimizer, by a RankAdaptive built on a torch.compile wrapper: loading it
    with an optimizer is an error before anything is cut; loading it without one into the bare model cuts the
    cores into RankAdaptive's optimizer (it went on training the old cores, the new ones never), and the next
    step of the resumed model equals the saved model's own next step."""
    import comera_compile as cc

    model, opt, _ = _cut_mlp()
    ra = cc.RankAdaptive(torch.compile(model), optimizer=opt, cut_every=5)   # names without _orig_mod
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)) for _ in range(7)]

    def step(m, o, r, x, y, zero=False):
        loss = nn.functional.mse_loss(m(x), y)
        loss.backward()
        o.step()
        o.zero_grad()
        if zero:   # half of every bond switched off before the check: it cuts
            with torch.no_grad():
                for layer in r.layers.values():
                    for gate in layer.gates:
                        gate[: gate.numel() // 2] = 0.0
        r.step(loss)

    for i, (x, y) in enumerate(data[:5]):
        step(model, opt, ra, x, y, zero=i == 4)
    assert ra.cuts == 1
    ckpt = str(tmp_path / "ckpt")
    cc.save_checkpoint(ckpt, model, ra=ra)
    fresh, fresh_opt, fresh_ra = _cut_mlp(seed=3)
    ranks = [m.spec.ranks for m in fresh_ra.layers.values()]
    with pytest.raises(ValueError, match="holds no optimizer state"):
        cc.load_checkpoint(ckpt, fresh, fresh_opt, fresh_ra)
    assert [m.spec.ranks for m in fresh_ra.layers.values()] == ranks   # nothing cut
    cc.load_checkpoint(ckpt, fresh, ra=fresh_ra)
    held = {id(p) for group in fresh_opt.param_groups for p in group["params"]}
    assert all(id(p) in held for p in fresh.parameters())
    for (name, p), q in zip(fresh.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name
    # the saved model's next step from a fresh optimizer state, as the resumed one's (no optimizer saved)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        o.state.clear()
    step(model, opt, ra, *data[5])
    step(fresh, fresh_opt, fresh_ra, *data[5])
    for (name, p), q in zip(fresh.named_parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def _submesh_cut(rank: int, world: int, out: str) -> None:
    """Each process shards its own model over a mesh of its own (a sweep of independent runs): a cut of
    switched-off slices leaves each model's function as it was."""
    import comera_compile as cc
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("run", "shard"))["shard"]
    torch.manual_seed(rank)   # each run its own model
    model = cc.tensorize(nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64)), rank=6, min_features=32)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(cc.param_groups(model, lr=1e-2))
    ra = cc.RankAdaptive(model, optimizer=opt, cut_every=1, gamma=0.0, process_group=mesh.get_group())
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for layer in ra.layers.values():
            for gate in layer.gates:
                gate.to_local()[: gate.numel() // 2] = 0.0
        before = model(x)
    model.reshard()   # the root keeps its parameters unsharded after a forward without backward
    cut = ra.step()   # the check switches the zero gates off and re-allocates
    with torch.no_grad():
        after = model(x)
    torch.save({"cut": cut, "change": float((after - before).norm() / before.norm())}, f"{out}.{rank}")


def test_a_cut_on_a_mesh_of_its_own_keeps_each_process_s_model(tmp_path):
    """The cut cores were broadcast from global rank 0 over the default group: the second run took the first
    run's cores (its output moved by 1e-2 relative), where each mesh's first process should hand them out."""
    _spawn(_submesh_cut, 2, str(tmp_path / "cut"))
    for rank in range(2):
        result = torch.load(f"{tmp_path / 'cut'}.{rank}")
        assert result["cut"] and result["change"] < 1e-5, result


def test_fused_optimizer_choice_falls_back_to_foreach_for_sharded_parameters(tmp_path):
    """param_groups asks for the fused implementation, which DTensor cannot run: sharded groups of an
    optimizer handed to the package get foreach."""
    _spawn(_fused_worker, 2, str(tmp_path / "groups"))
    groups = torch.load(tmp_path / "groups")
    assert groups and all(g["foreach"] and not g.get("fused") for g in groups)


def _fused_worker(rank: int, world: int, out: str) -> None:
    import comera_compile as cc

    model = _shard(_encoder(), compiled=False)
    opt = torch.optim.AdamW(cc.param_groups(model, lr=1e-3))
    cc.RankAdaptive(model, optimizer=opt)
    x = torch.randn(BATCH // world, SEQ, WIDTH)
    model(x).square().mean().backward()
    opt.step()
    if rank == 0:
        torch.save([{k: v for k, v in g.items() if k in ("foreach", "fused")} for g in opt.param_groups], out)


def _submodule_worker(rank: int, world: int, out: str) -> None:
    import comera_compile as cc

    model = _shard(_encoder(), compiled=False)
    try:
        cc.RankAdaptive(model.layers[0].linear1)   # a TT layer inside a sharded block, not the sharded module
    except ValueError as e:
        message = str(e)
    else:
        message = ""
    if rank == 0:
        torch.save(message, out)


def test_rank_adaptive_on_a_part_of_a_sharded_model_says_what_to_give_it(tmp_path):
    """A cut must re-shard through the FSDP2 group that holds the cores; given a submodule below the one
    fully_shard was applied to, RankAdaptive cannot reach that group: a clear error at construction."""
    _spawn(_submodule_worker, 2, str(tmp_path / "message"))
    message = torch.load(tmp_path / "message")
    assert "Give RankAdaptive the module fully_shard was applied to" in message, message


def _wrapped_worker(rank: int, world: int, out: str) -> None:
    """cc.tensorize and cc.tempo given a model already wrapped or sharded: what each raised, and whether the
    model kept its modules and parameters."""
    import comera_compile as cc
    from torch.distributed.fsdp import fully_shard

    def bare() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 128), nn.RMSNorm(128), nn.GELU(), nn.Linear(128, 64))

    result: dict = {}
    for wrap in ("ddp", "fully_shard"):
        model = bare()
        wrapped = nn.parallel.DistributedDataParallel(model) if wrap == "ddp" else fully_shard(model)
        before = [(type(m), [id(p) for p in m.parameters()]) for m in model]
        for call, kwargs in (("tensorize", {}), ("tensorize", {"inplace": True}), ("tempo", {})):
            try:
                warnings.simplefilter("ignore")
                getattr(cc, call)(wrapped, **({"min_features": 32} if call == "tensorize" else {}), **kwargs)
                result[wrap, call, bool(kwargs)] = None
            except Exception as e:
                result[wrap, call, bool(kwargs)] = f"{type(e).__name__}: {e}"
            if call == "tensorize":   # untouched by the refused rewrite
                result[wrap, call, bool(kwargs), "same"] = before == [(type(m), [id(p) for p in m.parameters()])
                                                                     for m in model]
    torch.save(result, f"{out}.{rank}")


def test_a_model_already_wrapped_for_data_parallel_is_refused_untouched(tmp_path):
    """tensorize after DDP or fully_shard swapped in TT layers the wrapper did not hold: their gradients were
    never averaged, and the replicas drifted apart in silence (0.038 after 3 AdamW steps, 2 processes).  Now
    it is an error that says to tensorize first, and the model is left as it was.  cc.tempo, whose swaps keep
    the parameters, works under DDP; under fully_shard (which gathers parameters into the modules it wrapped)
    it is an error before anything changes."""
    out = str(tmp_path / "wrapped")
    _spawn(_wrapped_worker, 2, out)
    for rank in range(2):
        result = torch.load(f"{out}.{rank}")
        for wrap, what in (("ddp", "is a DistributedDataParallel wrapper"),
                           ("fully_shard", "is sharded by fully_shard (FSDP2)")):
            for inplace in (False, True):
                error = result[wrap, "tensorize", inplace]
                assert error is not None and error.startswith("TensorizeError") and what in error, error
                assert "Call cc.tensorize (and cc.tempo) on the bare model, then wrap the result" in error
                assert result[wrap, "tensorize", inplace, "same"]
        assert result["ddp", "tempo", False] is None
        error = result["fully_shard", "tempo", False]
        assert error is not None and error.startswith("ValueError") and "then fully_shard" in error, error
