"""README's training loops, run as written: the quick start (the blocks compiled by "comera"), the same model
carried on by `cc.compile_step(..., rank_adaptive=ra)`, and the DistributedDataParallel and FSDP2 loops on two
gloo processes.  Each is compared with the same training computed another way (eagerly, or on one process
over the whole batch).  The Trainer's lines run in tests/test_regional.py."""

from __future__ import annotations

import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from helpers import readme_marked_block, spawn

STEPS = 3


def _exec(marker: str, names: dict) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(readme_marked_block(marker), "README.md", "exec"), names)
    return names


def _six_encoder_data() -> list:
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(STEPS):
        ids = torch.randint(0, 30522, (2, 16), generator=g)
        data.append(((ids, torch.zeros_like(ids), torch.ones_like(ids)), torch.randint(0, 3, (2,), generator=g)))
    return data


def _quick_start(monkeypatch, compiled: bool) -> dict:
    """The quick start's block with dropout off (compiled dropout draws other bits than eager's), blocks
    compiled as written or left eager."""
    import comera_compile as cc
    from comera_compile.examples import six_encoder

    build = six_encoder.build
    monkeypatch.setattr(six_encoder, "build", lambda **kw: build(dropout=0.0, **kw))
    if not compiled:
        monkeypatch.setattr(cc, "compile_blocks", lambda model, **kw: [], raising=False)
    torch.manual_seed(0)
    names = {"data": _six_encoder_data(), "task_loss": F.cross_entropy}
    _exec("<!-- quickstart-lines -->", names)
    monkeypatch.undo()
    return names


def test_the_readme_quick_start_and_compile_step_train_as_an_eager_loop_does(monkeypatch, capsys, fresh_dynamo):
    compiled = _quick_start(monkeypatch, compiled=True)
    eager = _quick_start(monkeypatch, compiled=False)
    assert "ranks" in capsys.readouterr().out   # explain() and report() printed
    assert compiled["ra"].steps == eager["ra"].steps == STEPS
    for p, q in zip(compiled["model"].parameters(), eager["model"].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-5)
    # carried on: compile_step with the RankAdaptive (as written) against the eager loop of the quick start
    _exec("<!-- compile-step-lines -->", compiled)
    model, opt, ra = eager["model"], eager["opt"], eager["ra"]
    for inputs, target in eager["data"]:
        loss = F.cross_entropy(model(*inputs), target)
        loss.backward(); opt.step(); opt.zero_grad()
        ra.step(loss)
    assert compiled["ra"].steps == ra.steps == 2 * STEPS
    torch.testing.assert_close(compiled["loss"], loss.detach(), rtol=1e-3, atol=1e-5)
    for p, q in zip(compiled["model"].parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-5)


# -- several processes -------------------------------------------------------------------------------------
WIDTH, BATCH = 256, 8


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _global_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)) for _ in range(steps)]


def _share(batches: list, rank: int, world: int) -> list:
    n = BATCH // world
    return [(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]) for x, y in batches]


def _ddp_names(world: int, rank: int) -> dict:
    """model, opt, ra, data and loss_fn for the README's DDP lines: a re-allocation after the second step
    (half of every bond switched off, a cut check every 2 steps)."""
    import comera_compile as cc

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cc.tensorize(_Blocks(), rank=8)
    opt = torch.optim.AdamW(cc.param_groups(model, lr=1e-3))
    ra = cc.RankAdaptive(model, optimizer=opt, cut_every=2, realloc_at=1.0)
    with torch.no_grad():
        for layer in ra.layers.values():
            for g in layer.gates:
                g[: g.numel() // 2] = 0.0
    return {"model": model, "opt": opt, "ra": ra, "data": _share(_global_batches(4), rank, world),
            "loss_fn": F.mse_loss, "DistributedDataParallel": nn.parallel.DistributedDataParallel}


def _fsdp_names(world: int, rank: int) -> dict:
    import comera_compile as cc   # imported as the quick start does

    torch.manual_seed(0)
    return {"cc": cc, "torch": torch, "model": _Blocks(), "data": _share(_global_batches(4), rank, world), "loss_fn": F.mse_loss}


def _function(model: nn.Module) -> list[torch.Tensor]:
    """What the model computes: its output on a fixed batch and every layer's dense weight (a rounding's
    bases of equal singular values, and their signs, are arbitrary, so the cores themselves may differ)."""
    import comera_compile as cc

    with torch.no_grad():
        out = model(torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(2)))
        dense = cc.densify(model) if not any(hasattr(p, "full_tensor") for p in model.parameters()) else None
    weights = [] if dense is None else [p.detach().clone() for p in dense.parameters()]
    return [out.detach().clone(), *weights]


def _worker(rank: int, world: int, rendezvous: str, out: str, kind: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        if kind == "ddp":
            names = _exec("<!-- ddp-lines -->", _ddp_names(world, rank))
            ddp, model = names["ddp"], names["model"]
            result = {"cuts": names["ra"].cuts, "rewrapped": [id(p) for p in ddp.module.parameters()] == [
                id(p) for p in model.parameters()] and ddp.module is model}
        else:
            names = _exec("<!-- fsdp-lines -->", _fsdp_names(world, rank))
            model = names["model"]
            result = {"cuts": names["ra"].cuts, "rewrapped": True}
        result.update(function=_function(model), steps=names["ra"].steps)
        torch.save(result, f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _one_process(kind: str, monkeypatch) -> dict:
    """The same lines on one process over the whole batch, without the wrapper."""
    if kind == "ddp":
        names = _ddp_names(1, 0)
        names["DistributedDataParallel"] = lambda model: model
    else:
        import torch.distributed.fsdp as fsdp

        monkeypatch.setattr(fsdp, "fully_shard", lambda module: module)
        names = _fsdp_names(1, 0)
    _exec(f"<!-- {kind}-lines -->", names)
    return names


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_the_readme_distributed_loops_train_as_one_process_on_the_whole_batch(kind, tmp_path, monkeypatch):
    handle, rendezvous = tempfile.mkstemp(prefix="comera-readme-rdzv-")
    os.close(handle)
    os.remove(rendezvous)
    out = str(tmp_path / kind)
    try:
        spawn(_worker, args=(2, rendezvous, out, kind), nprocs=2)
    finally:
        if os.path.exists(rendezvous):  # the store leaves its file behind
            os.remove(rendezvous)
    results = [torch.load(f"{out}.{rank}") for rank in range(2)]
    one = _one_process(kind, monkeypatch)
    for r in results:
        assert r["steps"] == 4 and r["rewrapped"]
        assert r["cuts"] == one["ra"].cuts
        for p, q in zip(r["function"], _function(one["model"])):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    if kind == "ddp":
        assert results[0]["cuts"] >= 1   # the wrapper was rebuilt after a re-allocation
    for p, q in zip(results[0]["function"], results[1]["function"]):
        assert torch.equal(p, q)
