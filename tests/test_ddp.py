"""A tensorized model under DistributedDataParallel, compiled with backend "comera", trains in two
processes (gloo, CPU, rendezvous on 127.0.0.1) exactly like one process on the same global batch."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

STEPS = 5


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


def _worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = nn.parallel.DistributedDataParallel(_model())
        xs, ys = _data()
        params = _train(model, xs, ys, rank, world)
        torch.save(params, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_ddp_two_processes_match_single_process(tmp_path):
    out = str(tmp_path / "params")
    mp.spawn(_worker, args=(2, _free_port(), out), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    for a, b in zip(*ranks):
        assert torch.equal(a, b)
    torch._dynamo.reset()
    xs, ys = _data()
    single = _train(_model(), xs, ys)
    for a, b in zip(ranks[0], single):
        assert (a - b).norm() <= 1e-5 * b.norm() + 1e-7
