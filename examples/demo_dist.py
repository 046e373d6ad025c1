"""The demo on several processes: the process group torchrun's environment describes, the model wrapped for
data-parallel training (DistributedDataParallel or FSDP2), and the few values every process must agree on.

Every process builds the same data, models and global batches (one seed) and trains on its own rows of each
global batch.  Each row has the same number of masked tokens, so the mean of the processes' losses is the
one-process loss of the whole batch, and data-parallel training follows the one-process run of the same
global batch up to float32 summation order.  The clock that decides the time budget and the evaluation marks
is the slowest process's, so every process takes the same number of steps.

Used by comera_compile.examples.code_mlm (``comera-compile demo --nproc N`` or ``torchrun -m comera_compile
demo``) and demo_train.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

__all__ = ["World", "PARALLEL", "PRECISIONS", "from_env", "shutdown", "wrap", "agree", "budget_checks",
           "placement_checks", "run_in_world", "resolve_precision", "autocast_dtype", "arithmetic", "skipped_in_a_row"]

PARALLEL = ("ddp", "fsdp")
# The training steps' arithmetic: fp32; fp32 with TF32 matmuls (CUDA); bf16 autocast of forward and loss (the
# weights, gradients and optimizer state stay fp32), what the field trains in on GPUs; fp16 autocast with the
# loss scaled (a GradScaler), for GPUs without bf16 arithmetic.
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


@dataclass(frozen=True)
class World:
    """This process's place among the demo's processes (one process: rank 0 of 1)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    parallel: str = "ddp"   # how a model is wrapped when size > 1: "ddp" or "fsdp"
    owns_group: bool = False  # the process group was created here (and is destroyed by shutdown)

    @property
    def main(self) -> bool:
        """The process that logs and writes the outputs."""
        return self.rank == 0

    def rows(self, batch: int) -> slice:
        """This process's rows of a global batch of `batch` rows."""
        per = batch // self.size
        return slice(self.rank * per, (self.rank + 1) * per)

    def device(self, kind: str) -> torch.device:
        """The device this process trains on: its own GPU (torchrun's LOCAL_RANK) for "cuda"."""
        return torch.device("cuda", self.local_rank) if kind == "cuda" else torch.device(kind)

    def describe(self) -> str:
        return "" if self.size == 1 else f", {self.parallel.upper()} x {self.size} processes"


def resolve_precision(precision: str | None, device: str) -> str:
    """The precision asked for, or the default: fp32 on the CPU; on CUDA bf16, or fp16 on a GPU without bf16
    arithmetic of its own (before Ampere: torch emulates bf16 there, and Inductor's bf16 Triton kernels fail
    to assemble for it)."""
    if precision is not None:
        return precision
    if device != "cuda":
        return "fp32"
    native = not torch.cuda.is_available() or torch.cuda.is_bf16_supported(including_emulation=False)
    return "bf16" if native else "fp16"


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype the training step's forward and loss autocast to under `precision`: bf16's or fp16's, else
    none (fp16 steps scale their loss: cc.compile_step makes the GradScaler)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


# Steps in a row a loss scaler may skip before a run counts as diverged: the scale has then halved this often,
# far past what a float16 run's start needs (a few halvings from 65536).
MAX_SKIPPED = 24


def skipped_in_a_row(skipped: bool, before: int, name: str) -> int:
    """The count of steps in a row that the loss scaler skipped (fp16), after one that it did or did not
    skip; past MAX_SKIPPED an error (code_data.DemoError) that says to lower the learning rate."""
    if not skipped:
        return 0
    if before + 1 > MAX_SKIPPED:
        from comera_compile.examples.code_data import DemoError

        raise DemoError(f"{name}: the loss scaler skipped {before + 1} steps in a row (the gradients overflow "
                        f"float16 at every scale): training diverged; lower the learning rate, or use "
                        f"--precision bf16 or fp32")
    return before + 1


@contextlib.contextmanager
def arithmetic(precision: str, device: torch.device) -> Iterator[torch.dtype | None]:
    """Run the training in `precision` (one of PRECISIONS): yields ``autocast_dtype(precision)``.  On CUDA,
    float32 matmuls run in TF32 under tf32 and bf16 ("high") and in full float32 under fp32 ("highest"),
    restored after; the CPU's setting is left as it is."""
    before = torch.get_float32_matmul_precision()
    if device.type == "cuda":
        torch.set_float32_matmul_precision("highest" if precision == "fp32" else "high")
    try:
        yield autocast_dtype(precision)
    finally:
        torch.set_float32_matmul_precision(before)


def budget_checks(resume: bool, out: object, minutes: float | None, steps: int | None, batch: int
                  ) -> list[tuple[bool, str]]:
    """(holds, message) for the run settings every training command checks: --resume with the folder it
    resumes, a budget in minutes or steps (or both), each of them positive, and a batch of at least one."""
    return [
        (not resume or out is not None, "--resume needs --out DIR, the folder of the run to go on with"),
        (minutes is not None or steps is not None,
         "give a budget: --minutes (wall clock per model) or --steps (steps per model)"),
        (minutes is None or 0 < minutes < math.inf,
         f"--minutes must be a positive number (for no time budget, give --steps alone), got {minutes}"),
        (steps is None or steps >= 1, f"--steps must be at least 1, got {steps}"),
        (batch >= 1, f"--batch must be at least 1, got {batch}"),
    ]


def placement_checks(device: str, batch: int, processes: int, precision: str | None = None,
                     micro_batches: int = 1) -> list[tuple[bool, str]]:
    """(holds, message) for the settings every training command checks: a device torch can see, a global
    batch that splits evenly over the processes and each process's rows over the micro-batches, and a
    precision that runs on the device."""
    return [
        (micro_batches >= 1, f"--micro-batches must be at least 1, got {micro_batches}"),
        (micro_batches <= 1 or batch % (processes * micro_batches) == 0,
         f"--batch {batch} over {processes} process(es) and {micro_batches} micro-batch(es) per step leaves "
         f"micro-batches of unequal size; give a --batch that is a multiple of {processes * micro_batches}, or "
         f"another --micro-batches"),
        (precision is None or precision in PRECISIONS,
         f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}"),
        (precision != "tf32" or device == "cuda",
         "--precision tf32 is a mode of CUDA's matrix products; on the CPU use fp32 or bf16"),
        (device in ("cpu", "cuda"), f"--device must be 'cpu' or 'cuda', got {device!r}"),
        (device != "cuda" or torch.cuda.is_available(),
         "--device cuda: no CUDA device is visible to torch; leave --device out to train on the CPU"),
        (batch % processes == 0,
         f"--batch {batch} does not split evenly over {processes} processes; give a global batch that is "
         f"a multiple of the process count (e.g. --batch {-(-batch // processes) * processes})"),
    ]


def from_env(device: str, parallel: str = "ddp") -> World:
    """The World of this process: the process group already initialized, or one made from the environment
    torchrun sets (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR/PORT): gloo on CPU, nccl on CUDA.  A process
    that torchrun did not start is one process on its own."""
    import torch.distributed as dist

    if parallel not in PARALLEL:
        raise ValueError(f"parallel must be one of {', '.join(PARALLEL)}, got {parallel!r}")
    owns = False
    if not (dist.is_available() and dist.is_initialized()):
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size <= 1:
            return World(parallel=parallel)
        if not dist.is_available():
            raise RuntimeError("WORLD_SIZE > 1 but this torch is built without torch.distributed")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device == "cuda":
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
        owns = True
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    return World(dist.get_rank(), dist.get_world_size(), local, parallel, owns)


def shutdown(world: World, clean: bool = True) -> None:
    """Destroy the process group from_env made; after a clean run, after a barrier (no process leaves while a
    peer still talks to it); after an error, at once (its peers may never reach a barrier)."""
    if world.owns_group:
        import torch.distributed as dist

        if clean:
            dist.barrier()
        dist.destroy_process_group()


def run_in_world(cfg: Any, world: World, body: Callable[[Any, World, Callable[[str], None]], Any],
                 log: Callable[[str], None]) -> Any:
    """``body(cfg, world, log)`` on every process of `world` (the config checked for its size; only the first
    process logs), then the process group shut down, cleanly when the body returned."""
    clean = False
    try:
        cfg.check(world.size)
        result = body(cfg, world, log if world.main else (lambda _: None))
        clean = True
        return result
    finally:
        shutdown(world, clean)


def wrap(model: nn.Module, world: World) -> nn.Module:
    """The module a training step calls: `model` itself on one process; under FSDP2 the same `model`, each
    encoder layer and then the root sharded with ``fully_shard`` in place (call before compiling the layers);
    under DDP a ``DistributedDataParallel`` around it (build it again after each RankAdaptive re-allocation)."""
    if world.size == 1:
        return model
    if world.parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    device_ids = [world.local_rank] if next(model.parameters()).is_cuda else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


def agree(world: World, step_s: float, loss: float) -> tuple[float, float]:
    """The step's time on the slowest process and the mean loss over the processes (the global batch's)."""
    if world.size == 1:
        return step_s, loss
    import torch.distributed as dist

    mine = torch.tensor([step_s, loss], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        mine = mine.cuda()
    every = [torch.empty_like(mine) for _ in range(world.size)]
    dist.all_gather(every, mine)
    every = torch.stack(every).cpu()
    return float(every[:, 0].max()), float(every[:, 1].mean())
