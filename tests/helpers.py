"""Helpers shared by the test modules (imported as `helpers`: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shlex
import sys
import tempfile
import textwrap
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# An int rank this large is capped at every bond's largest meaningful rank: an exact factorization (TT-SVD).
FULL = 10**9


class Block(nn.Module):
    """A residual MLP block (Linear, LayerNorm, GELU, Linear): the repeated block of BlockNet."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.norm = nn.LayerNorm(2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.norm(self.up(x))))


class BlockNet(nn.Module):
    """16 features in, two repeated blocks (Blocks of width 32 unless told; what regional compilation
    compiles), 5 classes out; ``scale`` multiplies the first layer's output (an input that is not a tensor)."""

    def __init__(self, width: int = 32, block: Callable[[int], nn.Module] = Block) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList(block(width) for _ in range(2))
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        x = self.inp(x) * scale
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def eager_step_with(model: nn.Module, loss_fn: Callable, opt: torch.optim.Optimizer, ra, x: torch.Tensor,
                    y: torch.Tensor) -> torch.Tensor:
    """One step of the plain loop compile_step is checked against: loss, backward, optimizer step, grads
    cleared, then ra.step(loss) (ra may be None); the detached loss."""
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss = loss.detach()
    if ra is not None:
        ra.step(loss)
    return loss


def rel_err(got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | float | None = None) -> float:
    """norm(got - ref) / max(norm(scale or ref), tiny), computed in float64."""
    got, ref = got.detach().double(), ref.detach().double()
    if scale is None:
        denom = float(ref.norm())
    else:
        denom = float(torch.as_tensor(scale).detach().double().norm())
    return float((got - ref).norm()) / max(denom, 1e-300)


def perturb_gates(layer, generator: torch.Generator | int = 1) -> None:
    """Gates start at 1; give them values in [0.5, 1.5) (from `generator`, or a generator seeded with it)
    so gate gradients and gate placement are really tested."""
    if isinstance(generator, int):
        generator = torch.Generator().manual_seed(generator)
    with torch.no_grad():
        for g in layer.gates:
            g.copy_(0.5 + torch.rand(g.shape, generator=generator, dtype=torch.float64).to(g.dtype))


class LargestAllocation(TorchDispatchMode):
    """Records the bytes of the largest storage any aten op returns on a real (non-meta) device, and which
    op returned it (`what`)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.what = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                nbytes = t.untyped_storage().nbytes()
                if nbytes > self.largest:
                    self.largest, self.what = nbytes, f"{func} -> {tuple(t.shape)}"
        return out


# What every spawned test process imports; the fork server imports it once per pytest worker (a process of
# its own pays about 6 s of 2 cores importing these, and about 30 tests start two).
_SPAWN_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "comera_compile", "transformers",
                  "transformers.models.llama.modeling_llama"]
SPAWN_DEADLINE = 900.0   # seconds; a test's processes still running then are killed and the test fails


def _exit_after(rank: int, fn: Callable[..., Any], errors: str, stacks_after: float, *args: Any) -> None:
    """Run fn(rank, *args) in a spawned process and leave it with os._exit, its traceback (if any) in
    errors.RANK: the interpreter's teardown is skipped, where gloo's threads can deadlock the process group's
    destructor (a worker once hung there for ten minutes, another aborted).  For the same reason fn's frame is
    kept, so its locals (a Trainer, a DDP wrapper) are never freed when it returns: a worker once hung in their
    destructors after its last line.  A process still running after stacks_after seconds writes every thread's
    stack to errors.RANK.stacks, for the report of a hang."""
    code = 0
    stacks = open(f"{errors}.{rank}.stacks", "w")
    faulthandler.dump_traceback_later(stacks_after, file=stacks)
    kept: list = []

    def keep_frame(frame, event: str, arg: Any) -> None:   # the first Python call after setprofile is fn's
        if event == "call":
            kept.append(frame)
            sys.setprofile(None)

    try:
        sys.setprofile(keep_frame)
        fn(rank, *args)
    except BaseException:
        Path(f"{errors}.{rank}").write_text(traceback.format_exc())
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawn(fn: Callable[..., Any], args: tuple = (), nprocs: int = 2, deadline: float = SPAWN_DEADLINE) -> None:
    """torch.multiprocessing.spawn(fn, args, nprocs, join=True), its processes forked from a server that has
    imported _SPAWN_PRELOAD and nothing else: fresh processes as spawn's are (nothing compiled, no process
    group; this process's sys.path and folder, but the server's environment, so pass settings as arguments),
    without each importing torch and transformers again.  A process that raises fails the test with its
    traceback; processes still running after `deadline` seconds are killed and the test fails."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(_SPAWN_PRELOAD)   # read when the server starts, at the first call
    with tempfile.TemporaryDirectory(prefix="comera-spawn-") as tmp:
        errors = os.path.join(tmp, "error")
        context = mp.start_processes(_exit_after, args=(fn, errors, max(deadline - 15, 1), *args), nprocs=nprocs,
                                     join=False, start_method="forkserver")
        end = time.monotonic() + deadline
        try:
            while not context.join(timeout=5):
                if time.monotonic() > end:
                    for process in context.processes:
                        process.kill()
                        process.join()
                    stacks = "".join(f"\n-- process {p.name.split('.')[1]}'s threads --\n{p.read_text()}"
                                     for p in sorted(Path(tmp).glob("error.*.stacks")))
                    raise TimeoutError(f"{fn.__name__}'s {nprocs} processes still ran after {deadline:.0f} s; "
                                       f"killed{stacks}")
        except mp.ProcessExitedException as failed:
            found = sorted(p for p in Path(tmp).glob("error.*") if p.suffix != ".stacks")
            if not found:
                raise
            raise AssertionError("a spawned process failed:\n" + "\n".join(
                f"-- process {p.suffix[1:]} --\n{p.read_text()}" for p in found)) from failed


def cli_error(argv: list[str], capsys) -> str:
    """What `comera-compile ARGV` prints on stderr when it fails, run in this process: a SystemExit with a
    nonzero status, as the installed script exits (any other exception is what would print a traceback)."""
    from comera_compile.cli import main

    capsys.readouterr()
    try:
        main(argv)
    except SystemExit as stop:
        code = stop.code
    else:
        raise AssertionError(f"comera-compile {shlex.join(argv)} did not fail")
    assert code not in (0, None), code
    return capsys.readouterr().err + (f"{code}\n" if isinstance(code, str) else "")


def readme_block(section: str, lang: str = "bash", index: int = 0) -> str:
    """The index-th ```lang code block under `## section` in the README (before the next section)."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return body.split(f"```{lang}\n")[index + 1].split("```", 1)[0]


def readme_marked_block(marker: str) -> str:
    """The fenced python block that follows the marker comment (e.g. ``<!-- trainer-lines -->``) in the
    README, dedented (blocks inside list items are indented)."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    start = text.index("```python\n", text.index(marker)) + len("```python\n")
    return textwrap.dedent(text[start:text.index("```", start)])


def readme_commands(section: str) -> list[list[str]]:
    """The shell commands of the first bash block under `section` in the README, continuations joined,
    comments dropped."""
    block = readme_block(section)
    lines = [line.split("  #", 1)[0].strip() for line in block.replace("\\\n", " ").splitlines()]
    return [shlex.split(line) for line in lines if line and not line.startswith("#")]


class StaleReplay(AssertionError):
    pass


_TORCH_DIR = str(Path(torch.__file__).parent)


@contextlib.contextmanager
def host_reads(into: list[str]) -> Iterator[None]:
    """Record, as "file:line: what", each read of a tensor's values on the host (item, bool, int, float, index,
    tolist) and each op whose output shape depends on values (unique, nonzero, masked_select) called from
    code outside torch's own package: what a CUDA graph capture fails on.  torch's internals are left out
    (on the CPU its optimizers read their step counters on the host; on CUDA, made capturable, they don't)."""
    patched = []

    def wrap(owner: Any, name: str) -> None:
        own = name in vars(owner)
        orig = getattr(owner, name)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            frame = sys._getframe(1)
            if not frame.f_code.co_filename.startswith(_TORCH_DIR):
                into.append(f"{frame.f_code.co_filename}:{frame.f_lineno}: {name}")
            return orig(*args, **kwargs)

        setattr(owner, name, recorded)
        patched.append((owner, name, own, orig))

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "unique", "nonzero",
                 "masked_select"):
        wrap(torch.Tensor, name)
    for name in ("unique", "nonzero", "masked_select"):
        wrap(torch, name)
    try:
        yield
    finally:
        for owner, name, own, orig in reversed(patched):
            if own:
                setattr(owner, name, orig)
            else:
                delattr(owner, name)


class SimulatedGraphs:
    """CUDA graph semantics on the CPU, strictly: a capture runs the step and undoes what it did (a real
    capture runs no kernel), keeping its loss tensor as the static output; a replay re-runs the step on the
    tensors the capture saw and writes that tensor.  Before every replay it checks, by its own means, that
    nothing a real graph bakes in has changed (tensor addresses, every value the step reads on the host),
    raising StaleReplay where a real graph would replay stale parameters or settings."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, ra=None) -> None:
        self.model, self.optimizer, self.ra = model, optimizer, ra
        self.captured = 0

    def _params(self):
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _baked(self) -> dict:
        """What a captured graph holds fixed: tensor addresses, and every value the step reads on the host."""
        opt = self.optimizer
        state = [(id(p), sorted((k, id(v), v.data_ptr()) if torch.is_tensor(v) else (k, None, v)
                                for k, v in opt.state[p].items())) for p in self._params() if p in opt.state]
        hyper = [sorted((k, ("tensor", id(v)) if torch.is_tensor(v) else v) for k, v in g.items() if k != "params")
                 for g in opt.param_groups]
        ra = self.ra
        return {"params": [(id(p), p.data_ptr(), tuple(p.shape)) for p in self._params()], "state": state,
                "hyper": hyper, "training": [m.training for m in self.model.modules()],
                "ra": None if ra is None else (ra.stage, ra.gamma, ra.size_target, ra.loss_target)}

    def warmup(self, fn):
        return fn()

    def probe(self, fn):
        reads: list[str] = []
        with host_reads(reads):
            out = fn()
        return out, reads

    def capture(self, fn):
        assert all(p.grad is None for p in self._params()), \
            "captured with gradients set: every replay would add to them"
        reads: list[str] = []
        baked = self._baked()
        opt = self.optimizer
        saved_params = [p.detach().clone() for p in self._params()]
        saved_state = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                       for p, s in opt.state.items()}
        rng = torch.get_rng_state()
        with host_reads(reads):
            out = fn()
        if reads:   # a real capture fails here
            raise RuntimeError(f"operation not permitted when stream is capturing (simulated): {reads[0]}")
        with torch.no_grad():   # a real capture runs no kernel: undo what the step did
            for p, s in zip(self._params(), saved_params):
                p.copy_(s)
            for p in list(opt.state):
                if p not in saved_state:
                    del opt.state[p]
                    continue
                for k, v in saved_state[p].items():
                    if torch.is_tensor(v):
                        opt.state[p][k].copy_(v)
        torch.set_rng_state(rng)
        self.captured += 1
        return {"fn": fn, "out": out, "baked": baked}, out

    def replay(self, graph) -> None:
        now = self._baked()
        for what in now:
            if now[what] != graph["baked"][what]:
                raise StaleReplay(f"a real CUDA graph would replay stale {what}")
        from comera_compile.graphs import _capturing

        with _capturing():   # a replay runs what was captured: the capture's code paths
            out = graph["fn"]()
        with torch.no_grad():
            graph["out"].copy_(out)


def second_compile_from_aot_cache(compiled: Callable[[], Callable], step: Callable[[Callable], Any]) -> Any:
    """Runs step(compiled()) twice with dynamo reset between (as a new run or process would): the second
    compile must be served by AOTAutograd's cache, one hit and no bypass.  Returns the second step's result."""
    from torch._dynamo.utils import counters

    step(compiled())   # compiles, or finds an earlier run's entry
    torch._dynamo.reset()
    counters.clear()
    result = step(compiled())
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1, dict(counters["aot_autograd"])
    assert not counters["aot_autograd"]["autograd_cache_bypass"]
    return result


def capture_every_compiled_step(monkeypatch) -> list[SimulatedGraphs]:
    """Make every ``cc.compile_step`` built from now on capture its whole step (cuda_graphs="step"), with a
    SimulatedGraphs of its own, as on one GPU; returns the simulations, one per step built."""
    import comera_compile as cc
    from comera_compile import graphs
    from comera_compile.rank_adaptive import rank_adaptive_of

    compile_step, sims = cc.compile_step, []

    def whole_step(model, loss_fn, opt, **kwargs):
        sims.append(SimulatedGraphs(model, opt, rank_adaptive_of(model)))
        monkeypatch.setattr(graphs, "CudaGraphs", lambda device: sims[-1])
        return compile_step(model, loss_fn, opt, **{**kwargs, "cuda_graphs": "step"})

    monkeypatch.setattr(cc, "compile_step", whole_step)
    return sims
