"""Compiling inside a training budget fairly: each run compiles every graph itself, in a cache of its own,
after the process's one-time compiler start-up has been paid outside every budget.

Used by comera_compile.examples.code_mlm (`comera-compile demo`) and lm_pretrain (`comera-compile pretrain`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch

__all__ = ["own_compile_cache", "warm_up_compiler"]


@contextlib.contextmanager
def own_compile_cache() -> Iterator[None]:
    """Inside: dynamo's and Inductor's caches empty, Inductor's on-disk cache (FX graphs, AOTAutograd entries,
    kernels) a new temporary folder, removed after.  A method trained inside compiles every graph itself,
    however much of it (GaLore's model is dense's) an earlier method or an earlier run compiled."""
    from torch._inductor import utils

    fresh = getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache   # the older name, kept as an alias
    torch._dynamo.reset()
    try:
        with fresh():
            yield
    finally:
        torch._dynamo.reset()


def warm_up_compiler(device: torch.device) -> float:
    """Compile and run a small function's forward and backward with Inductor on `device`, in a cache of its
    own, so that the process's one-time costs (importing Inductor and AOTAutograd, the C++ or Triton
    toolchain's checks: about 20 s on a 2-core CPU) fall on no method's budget.  Returns the seconds taken."""
    t0 = time.perf_counter()
    with own_compile_cache():
        x = torch.randn(8, 16, device=device)
        w = torch.randn(16, 16, device=device, requires_grad=True)
        fn = torch.compile(lambda x, w: torch.nn.functional.silu(x @ w).pow(2).mean(), backend="inductor")
        fn(x, w).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return time.perf_counter() - t0
