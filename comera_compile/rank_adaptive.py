"""Rank-adaptive training (the "RA" of CoMERA): rank gates, a two-stage multi-objective schedule, and rank
slices cut out of the cores for real.  (About 600 lines: one class, and the rule it follows stated here in
full; the optimizer side is in optim.py, the gauges in gauge.py.)

Between consecutive TT cores sits diag(g); training minimises (task loss L, model size S(g)).

The rule. Every few optimizer steps (BALANCE_EVERY), each layer is put in a balanced gauge (a change of the
cores' and gates' scales that leaves the layer's function exactly as it was): for every bond, the left half of
the train has unit-norm columns and the right half rows of equal norm, so a gate entry is the Frobenius norm
of its rank slice's term in W relative to the bond's strongest term (the largest gate of a bond is 1). The l1
penalty on gates in this gauge is the factored (variational) form of the nuclear norm of the bond's unfolding
-- equal to it when the slices are the singular directions, above it otherwise -- the convex stand-in for its
rank; after every optimizer step it acts through a proximal step, soft-thresholding every gate by ``gamma``
times the gate's learning rate (as structured-sparsity methods do for a group lasso, rather than adding a
small gradient to the loss).  Under Adam, whose steps are normalised per entry, a gate moves by about its
learning rate per step when the task needs it and much less when its gradient is noise, so ``gamma`` (a
fraction of that step) means the same for a 64- or a 4096-wide layer and for 1 or 100 layers: a slice survives
while the task pulls it harder than gamma, and the others reach exactly zero. Being scale-invariant, the gauge
also closes the trap of an l1 penalty on raw gates (gates shrink while the cores grow).  The l1 penalty pulls
every surviving slice toward zero too, as hard as the ones it removes (the lasso's bias): under noisy
gradients the kept slices sit well below what the task wants.  So the default penalty (``penalty="mcp"``) is
the minimax concave penalty, whose pull fades linearly with the gate and is gone at ``pull_below`` (0.15) of
the bond's strongest slice: a gate g is shrunk by gamma x lr x max(0, 1 - |g| / pull_below), the full l1
step for a slice near zero, none for one carrying at least 15% of its bond's strongest term.  Unneeded
slices (a few hundredths of the strongest on benchmarks/ra_teachers.py) still reach exactly zero; a slice
that strong is the task's alone.  Fading the pull over the whole range instead (pull_below = 1) pulls every
slice but the strongest for as long as the run goes, and a task with no natural rank never settles: on the
demo's masked-language task every slice is worth a little, and its long preset (rank 32, 3,000 steps) fell
by half over the last quarter, toward rank 1 in longer runs, at a held-out loss 0.05 above the unadapted
model's.  With 0.15 the same run settles (7% over the last quarter) at 0.7x the size and a loss below
the unadapted model's, and the teachers' ranks are found as before (docs/method.md has the figures).
``penalty="l1"`` is the plain soft threshold. Every ``cut_every`` steps each bond is rotated to its singular
basis (TT rounding), so that redundant slices, which a random start spreads over every slice, become zero
gates for the proximal step (the cores' Adam moments restart, and the gates' first moments, as
``gauge._restart_moments`` says; the proximal step then pauses for REBUILD_STEPS while those first moments
rebuild, since a weak slice the task still needs sits at a small gate right after a rounding and would meet
the full penalty without Adam's pull); gates it has driven to zero (below ``tau``) are then switched off.
Small gates are not switched off for being small: gradient descent learns a factorized map's directions
strongest first, and a weak direction still being learned sits in a small gate that the task keeps pulling.

Late stage (optional, ``target_ratio`` and ``late_stage_at``): toward the point (target loss, target_ratio x
size at the switch).  At every cut interval, when the size is further from its target than the loss from its
own (the achievement scalarization's choice), the least useful active slices are switched off first -- the
smallest contribution to their layer's weight (as magnitude-based budget allocation does), a quarter of the
remaining gap at a time.

Cuts.  Switched-off slices are zeros in the cores; they leave the allocation (new, smaller Parameters, the
optimizer state cut alike) when the allocated TT parameters reach ``realloc_at`` times the active ones, so
a run re-allocates about log2(compression) times: under torch.compile each re-allocation costs one
recompile and a mask costs none; under DDP ``step()`` returns True and the loop re-wraps the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import distributed as _dist
from .gauge import balance, canonicalize, frobenius_norm
from .layers import DEFAULT_TAU
from .optim import prefer_fast_implementation, retire, tt_layers

__all__ = ["RankAdaptive"]

# A layer whose weight's norm grows by more than this between two cut checks has diverged.
DIVERGED_GROWTH = 1e3

# Steps between re-balancings of the gauge (it drifts little in a few optimizer steps; each costs a few
# small einsums per bond).
BALANCE_EVERY = 10

# Steps after a rounding without the proximal step (at most a tenth of cut_every): the rounding restarts the
# gates' first moments at zero, and Adam's pull on a gate takes about 1 / (1 - beta1) steps to rebuild.
REBUILD_STEPS = 10


@dataclass
class _Record:
    step: int
    stage: str
    size: int
    ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    loss: float | None = None


class RankAdaptive:
    """The rank-adaptive training hook for a tensorized model.

    ``loss = ra.loss(task_loss)`` returns the objective of the current stage (its penalty term carries no
    gradient: the penalty acts through the proximal update in ``step()``); call ``ra.step()`` after
    ``optimizer.step()``.  Give the optimizer with ``optimizer=`` (or ``ra.attach(opt)``): its learning rate
    sets the proximal step, and cuts cut its state too.  ``step()`` returns True when the cores were
    re-allocated (new Parameters): a DistributedDataParallel wrapper must then be rebuilt.  Reports:
    ``ranks()``, ``allocated_ranks()``, ``size()``, ``compression()``, ``report()``, ``history``.

    Defaults are meant to be left alone, with the learning rates of ``param_groups(model, lr)``: gamma = 0.1 (a
    tenth of an Adam step per step toward zero, for a gate near zero; ``penalty="mcp"`` fades the pull to none at
    ``pull_below`` = 0.15 of its bond's strongest, ``"l1"`` keeps it), tau = 1e-6 (gates the proximal step zeroed
    are off), a rounding and cut check every 100 steps, and a re-allocation when at least half the allocated TT
    parameters are switched off (``realloc_at``; None keeps the allocation until an explicit ``cut()``, for
    wrappers that cannot be rebuilt mid-training, such as the transformers Trainer's; under FSDP2 a re-allocation
    re-shards in place, see distributed.py). ``prox_lr`` is the gate learning rate the proximal step assumes
    while no optimizer is attached. ``share_allocation`` (default) re-allocates layers of equal shape at equal
    ranks (the largest active rank among them, bond by bond; the rest of a layer's extra slices stay switched
    off), so repeated blocks keep sharing one compiled graph and a re-allocation costs one recompile, not one per
    block; False allocates every layer at its own active ranks.
    """

    def __init__(self, model: nn.Module, tau: float = DEFAULT_TAU, gamma: float = 0.1,
                 target_ratio: float | None = None, target_loss: float | None = None,
                 late_stage_at: int | None = None, cut_every: int = 100,
                 optimizer: torch.optim.Optimizer | None = None, realloc_at: float | None = 2.0,
                 prox_lr: float = 1e-3, share_allocation: bool = True, penalty: str = "mcp",
                 pull_below: float = 0.15) -> None:
        if not (isinstance(tau, (int, float)) and tau > 0):
            raise ValueError(f"tau must be a positive number (gates below it switch off), got {tau!r}")
        if not (isinstance(gamma, (int, float)) and gamma >= 0):
            raise ValueError(f"gamma must be a non-negative number, got {gamma!r}")
        if target_ratio is not None and not 0 < target_ratio <= 1:
            raise ValueError(f"target_ratio must be in (0, 1] (the late stage's size target as a fraction of "
                             f"the size at its start), got {target_ratio!r}")
        if late_stage_at is not None and target_ratio is None:
            raise ValueError("late_stage_at needs target_ratio: the late stage steers toward a size target")
        if not isinstance(cut_every, int) or cut_every < 1:
            raise ValueError(f"cut_every must be a positive int (steps between cuts), got {cut_every!r}")
        if penalty not in ("mcp", "l1"):
            raise ValueError(f"penalty must be 'mcp' (default: no pull on a bond's strongest slice) or 'l1' (the "
                             f"same pull on every slice), got {penalty!r}")
        if not (isinstance(pull_below, (int, float)) and 0 < pull_below <= 1):
            raise ValueError(f"pull_below must be in (0, 1] (the fraction of its bond's strongest slice from which a "
                             f"gate feels no pull under penalty='mcp'), got {pull_below!r}")
        if realloc_at is not None and not realloc_at >= 1:
            raise ValueError(f"realloc_at must be >= 1 (allocated / active TT parameters that triggers a "
                             f"re-allocation) or None (only explicit cut()), got {realloc_at!r}")
        self.layers = tt_layers(model)
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no TT layers; tensorize it first "
                             f"(model = comera_compile.tensorize(model))")
        self.model, self.tau, self.gamma = model, float(tau), float(gamma)
        self.target_ratio, self.target_loss, self.late_stage_at = target_ratio, target_loss, late_stage_at
        self.cut_every, self.optimizer, self.realloc_at = cut_every, optimizer, realloc_at
        if optimizer is not None:
            prefer_fast_implementation(optimizer)
        self.prox_lr, self.share_allocation = float(prox_lr), bool(share_allocation)
        self.penalty_kind, self.pull_below = penalty, float(pull_below)
        self.steps, self.stage, self.cuts = 0, "early", 0
        self.size_target: float | None = None
        self.loss_target: float | None = None
        self._last_loss: float | None = None
        self._loss_ema: float | None = None
        self.dense_params = sum(p.numel() for p in model.parameters()) + sum(
            m.dense_params() - m.tt_params() for m in self.layers.values())
        first = next(iter(self.layers.values())).gates[0]
        device = _dist.local(first).device
        self._size_t = torch.zeros((), dtype=torch.float64, device=device)
        self._penalty_t = torch.ones((), dtype=first.dtype, device=device)  # penalty() after the last step
        self.masks = {name: [torch.ones(g.shape, dtype=torch.bool, device=device) for g in m.gates]
                      for name, m in self.layers.items()}
        # FSDP2: the gates are DTensors; per-step work runs on each process's shard (masks cut to match)
        self._sharded = any(_dist.is_sharded(p) for m in self.layers.values() for p in m.parameters())
        if self._sharded:
            _dist.check_resharding(model, self.layers)
        self._local_masks: dict[str, list[torch.Tensor]] = {}
        self._importance: dict[str, list[torch.Tensor]] = {}
        self._norms: dict[str, tuple[int, float]] = {}   # each layer's weight norm at the last check
        self.history: list[_Record] = []
        self._update_size()

    # -- objective ------------------------------------------------------------------------------------
    def penalty(self) -> torch.Tensor:
        """R: the mean penalty over the active gate entries of every TT layer, in the balanced gauge: |g|
        for l1, m - m**2 / (2 a) for mcp, m = min(|g|, a), a = pull_below (its derivative is the proximal
        step's pull).
        Tensor ops only, so it also runs inside a compiled region without a graph break (FSDP2-sharded gates:
        each process sums its shard, then one all-reduce)."""
        total, active = None, None
        for name, layer in self.layers.items():
            masks = self._local_masks[name] if self._sharded else self.masks[name]
            for g, m in zip(layer.gates, masks):
                a = _dist.local(g).abs()
                if self.penalty_kind == "mcp":
                    a = a.clamp_max(self.pull_below)
                    a = a - a * a / (2 * self.pull_below)
                term, n = (a * m).sum(), m.sum()
                total = term if total is None else total + term
                active = n if active is None else active + n
        if self._sharded:
            import torch.distributed as dist

            both = torch.stack([total.to(torch.float64), active.to(torch.float64)])
            dist.all_reduce(both, group=self.layers[next(iter(self.layers))].gates[0].device_mesh.get_group())
            return (both[0] / both[1].clamp_min(1)).to(total.dtype)
        return total / active.clamp_min(1)

    def loss(self, task_loss: torch.Tensor) -> torch.Tensor:
        """The objective of the current stage for this step's task loss.  The penalty (as of the last step())
        is added as a value without gradient: step()'s proximal update applies it."""
        if self.late_stage_at is not None and not torch.compiler.is_compiling():
            self._last_loss = float(task_loss.detach())
        r = self._penalty_t.to(task_loss.dtype)
        if self.stage == "early":
            return task_loss + self.gamma * r
        size = self._size_t.to(task_loss.dtype)
        size_gap = (size - self.size_target) / size
        loss_gap = (task_loss.detach() - self.loss_target) / task_loss.detach()
        lam = (loss_gap < size_gap).to(task_loss.dtype)
        return task_loss + (0.01 + lam) * r

    # -- schedule -------------------------------------------------------------------------------------
    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer whose learning rates set the proximal step and whose state is cut with the cores."""
        self.optimizer = optimizer
        prefer_fast_implementation(optimizer)

    def trainer_callback(self) -> Any:
        """A transformers ``TrainerCallback`` that runs this hook inside ``Trainer``: ``step()`` after every
        optimizer step (the Trainer's optimizer attached at the first), ``cut()`` when training ends.  With
        several processes, build RankAdaptive with ``realloc_at=None``: the Trainer's DDP wrapper cannot be
        rebuilt mid-training, so switched-off slices stay allocated as zeros until the final cut."""
        from transformers import TrainerCallback

        ra = self

        class RankAdaptiveCallback(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                            **kwargs: Any) -> None:
                if ra.optimizer is None and optimizer is not None:
                    ra.attach(getattr(optimizer, "optimizer", optimizer))  # accelerate wraps the optimizer
                ra.step()

            def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                ra.cut(share=False)

        return RankAdaptiveCallback()

    def _gate_lrs(self) -> dict[int, float]:
        if self.optimizer is None:
            return {}
        return {id(p): float(g["lr"]) for g in self.optimizer.param_groups for p in g["params"]}

    @torch.no_grad()
    def step(self) -> bool:
        """After optimizer.step(): shrink the gates (proximal step, in the balanced gauge) and advance the
        schedule; every cut_every steps round every bond to its singular basis, switch off the gates under
        tau, prune toward the late stage's target and re-allocate when due.  Returns True when the cores
        were re-allocated (new Parameters)."""
        self.steps += 1
        if self._last_loss is not None:
            self._loss_ema = self._last_loss if self._loss_ema is None else (
                0.9 * self._loss_ema + 0.1 * self._last_loss)
        # In the late stage the size target is the goal: once reached, no further slice is shrunk.
        shrinking = self.gamma > 0 and (self.stage == "early" or self.size() > self.size_target)
        since_rounding = (self.steps - 1) % self.cut_every
        if self.steps > self.cut_every and since_rounding < min(REBUILD_STEPS, self.cut_every // 10):
            shrinking = False  # the gates' first moments are rebuilding after the last rounding
        if self._sharded and not self._local_masks:
            self._local_masks = self._cut_masks()
        if (self.steps - 1) % BALANCE_EVERY == 0:
            # FSDP2: whole tensors here, the optimizer's state too (balance carries the gates' moments)
            with _dist.unsharded(self.model, self.layers, self.optimizer):
                state = self.optimizer.state if self.optimizer is not None else None
                for name, layer in self.layers.items():
                    self._importance[name] = balance(layer, state)
        params = [g for layer in self.layers.values() for g in layer.gates]
        # FSDP2: this process's shards (the update is elementwise)
        gates = [_dist.local(g) for g in params] if self._sharded else params
        if shrinking:  # shrink every gate by gamma x its lr x the penalty's pull, as multi-tensor ops
            lrs = self._gate_lrs()
            magnitude = torch._foreach_abs(gates)
            steps = [self.gamma * lrs.get(id(g), self.prox_lr) for g in params]
            if self.penalty_kind == "mcp":
                pull = torch._foreach_div(magnitude, -self.pull_below)
                torch._foreach_add_(pull, 1.0)
                torch._foreach_clamp_min_(pull, 0.0)
                torch._foreach_mul_(pull, steps)
                torch._foreach_sub_(magnitude, pull)
            else:
                torch._foreach_sub_(magnitude, steps)
            torch._foreach_clamp_min_(magnitude, 0.0)
            torch._foreach_mul_(magnitude, torch._foreach_sign(gates))
            torch._foreach_copy_(gates, magnitude)
        masks = self._local_masks if self._sharded else self.masks
        for name, k in self._masked:
            gates_k = self.layers[name].gates[k]
            (_dist.local(gates_k) if self._sharded else gates_k).mul_(masks[name][k].to(gates[0].dtype))
        self._penalty_t.copy_(self.penalty())
        if self.late_stage_at is not None and self.stage == "early" and self.steps >= self.late_stage_at:
            self.stage = "late"
            self.size_target = self.target_ratio * self.size()
            if self.target_loss is not None:
                self.loss_target = self.target_loss
            else:
                self.loss_target = self._loss_ema if self._loss_ema is not None else 0.0
        reallocated = False
        if self.steps % self.cut_every == 0:
            with _dist.unsharded(self.model, self.layers, self.optimizer):  # FSDP2: whole tensors here
                self._check_finite()
                self._synchronize()
                state = self.optimizer.state if self.optimizer is not None else None
                for name, layer in self.layers.items():
                    canonicalize(layer, state)
                    # canonicalize left the gates' moments in the balanced scale (first ones restarted, second
                    # ones averaged), not in the singular values' scale it leaves the gates in: nothing to carry
                    self._importance[name] = balance(layer)
                self._switch_off()
                if self.stage == "late":
                    self._prune_toward_target()
                self._agree_on_masks()
                allocated = sum(m.spec.core_params() for m in self.layers.values())
                needed = sum(self._core_params_at(name, r) for name, r in self._allocation().items())
                if self.realloc_at is not None and allocated >= self.realloc_at * max(needed, 1):
                    reallocated = self._cut(None) > 0
            if self._sharded:
                self._local_masks = self._cut_masks()
        self.history.append(_Record(self.steps, self.stage, self.size(), self.ranks(), self._last_loss))
        return reallocated

    @torch.no_grad()
    def _switch_off(self) -> None:
        """Mask the gates under tau (between checks a gate the proximal step zeroed can still come back, when
        the task pulls it harder than the penalty).  In the late stage, only until the size target is met."""
        off = []
        for name, layer in self.layers.items():
            for k, (g, m) in enumerate(zip(layer.gates, self.masks[name])):
                for j in torch.nonzero(m & (g.abs() < self.tau)).flatten().tolist():
                    off.append((float(g[j].abs()), name, k, j))
        for _, name, k, j in sorted(off):
            if self.stage == "late" and self.size() <= self.size_target:
                break
            self._switch(name, k, j)
        self._update_size()

    def _switch(self, name: str, k: int, j: int) -> None:
        """Switch off slice j of bond k of a layer, keeping the cached ranks and size current; a bond's last
        active slice stays (a rank-0 bond would remove the layer)."""
        m = self.masks[name][k]
        if not m[j] or self._ranks[name][k + 1] <= 1:
            return
        m[j] = False
        self.layers[name].gates[k][j] = 0.0
        shapes = self.layers[name].spec.core_shapes
        r = self._ranks[name]
        self._size -= math.prod(shapes[k][1:-1]) * r[k] + math.prod(shapes[k + 1][1:-1]) * r[k + 2]
        self._ranks[name] = (*r[:k + 1], r[k + 1] - 1, *r[k + 2:])

    def _prune_toward_target(self) -> None:
        """Switch off the least useful active slices (smallest share of their layer's weight) until the size
        has closed a quarter of its gap to the target, when the size is relatively further from its target
        than the loss from its own."""
        size = self.size()
        if size <= self.size_target:
            return
        if self._loss_ema is not None and self.loss_target is not None and self._loss_ema > 0:
            if (self._loss_ema - self.loss_target) / self._loss_ema >= (size - self.size_target) / size:
                return
        goal = size - max(1.0, 0.25 * (size - self.size_target))
        candidates = []
        for name in self.layers:
            for k, (imp, m) in enumerate(zip(self._importance.get(name, []), self.masks[name])):
                if int(m.sum()) <= 1:
                    continue
                order = [j for j in imp.argsort().tolist() if m[j]]
                candidates += [(float(imp[j]), name, k, j) for j in order[:-1]]  # never the bond's last
        for _, name, k, j in sorted(candidates):
            if self.size() <= goal:
                break
            self._switch(name, k, j)
        self._update_size()

    def _check_finite(self) -> None:
        """Rounding a layer whose cores hold NaN or inf would fail deep inside an eigensolver (or, across
        processes, look like replicas that disagree): say what happened instead.  A layer whose weight's
        norm grew more than DIVERGED_GROWTH-fold since the last check has diverged too, while still finite:
        its outputs are orders of magnitude off, and the loss never comes back; say so rather than train on."""
        bad = [f"{name}.{pname}" for name, layer in self.layers.items() for pname, p in layer.named_parameters()
               if not bool(torch.isfinite(p).all())]
        if bad:
            raise FloatingPointError(
                f"RankAdaptive at step {self.steps}: {len(bad)} TT parameter(s) hold NaN or inf ({bad[0]}, ...): "
                f"training diverged.  Lower the learning rate (param_groups(model, lr=...) sets cores at 2x and "
                f"gates at 20x it) or clip gradients")
        for name, layer in self.layers.items():
            norm = frobenius_norm(layer)
            step, before = self._norms.get(name, (self.steps, norm))
            if before > 0 and norm > DIVERGED_GROWTH * before:
                raise FloatingPointError(
                    f"RankAdaptive at step {self.steps}: the weight of TT layer {name or '(the model)'} grew "
                    f"{norm / before:.3g}-fold since step {step} (Frobenius norm {before:.3g} -> {norm:.3g}): "
                    f"training diverged.  Lower the learning rate (param_groups(model, lr=...) sets cores at 2x "
                    f"and gates at 20x it) or clip gradients")
            self._norms[name] = (self.steps, norm)

    @staticmethod
    def _distributed() -> bool:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _cut_masks(self) -> dict[str, list[torch.Tensor]]:
        """FSDP2: each mask cut to its gate's shard on this process."""
        return {name: _dist.local_masks(self.masks[name], list(layer.gates)) for name, layer in self.layers.items()}

    def _agree_on_masks(self) -> None:
        """Under torch.distributed: every process takes rank 0's masks (its decision of what to switch off)."""
        if not self._distributed():
            return
        import torch.distributed as dist

        masks = torch.cat([m.to(torch.uint8) for ms in self.masks.values() for m in ms])
        dist.broadcast(masks, 0)
        offset = 0
        for name, ms in self.masks.items():
            for k, m in enumerate(ms):
                m.copy_(masks[offset:offset + m.numel()] > 0)
                offset += m.numel()
                self.layers[name].gates[k].mul_(m.to(self.layers[name].gates[k].dtype))
        self._update_size()

    def _synchronize(self) -> None:
        """Under torch.distributed: check that the replicas still hold the same model (the parameters each
        process holds whole; FSDP2's shards have one owner each), then take rank 0's TT parameters and masks,
        so every process cuts the same slices."""
        import torch.distributed as dist

        if not self._distributed():
            return
        params = [p for p in self.model.parameters() if not _dist.is_sharded(p)]
        fp = torch.stack([torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
                          for p in params]).flatten() if params else torch.zeros(2, dtype=torch.float64)
        hi, lo = fp.clone(), -fp
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MAX)
        if not torch.allclose(hi, -lo, rtol=1e-6, atol=1e-9):
            raise RuntimeError(
                "RankAdaptive: the data-parallel replicas hold different parameters.  After ra.step() returns "
                "True the cores are new Parameters: rebuild the wrapper (ddp = DistributedDataParallel(model, "
                "...)) before the next forward, or pass realloc_at=None to keep the allocation until the end")
        tensors = [p for layer in self.layers.values() for p in (*layer.cores, *layer.gates)]
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        masks = torch.cat([m.to(flat.dtype) for ms in self.masks.values() for m in ms])
        dist.broadcast(flat, 0)
        dist.broadcast(masks, 0)
        offset = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].reshape(t.shape))
                offset += t.numel()
        offset = 0
        for ms in self.masks.values():
            for m in ms:
                m.copy_(masks[offset:offset + m.numel()] > 0.5)
                offset += m.numel()
        self._update_size()

    def _active_core_params(self) -> int:
        total = 0
        for name, layer in self.layers.items():
            r = self._ranks[name]
            for k, shape in enumerate(layer.spec.core_shapes):
                total += math.prod(shape[1:-1]) * r[k] * r[k + 1]
        return total

    def _allocation(self, share: bool | None = None) -> dict[str, tuple[int, ...]]:
        """The ranks a cut allocates each layer at: its active ranks, or when sharing (default:
        ``share_allocation``) the largest active ranks among the layers of its shape (bond by bond)."""
        if not (self.share_allocation if share is None else share):
            return dict(self._ranks)
        groups: dict[tuple, list[str]] = {}
        for name, layer in self.layers.items():
            s = layer.spec
            groups.setdefault((type(layer), s.kind, s.in_features, s.out_features, s.in_modes, s.out_modes),
                              []).append(name)
        out = {}
        for names in groups.values():
            ranks = tuple(max(rs) for rs in zip(*(self._ranks[n] for n in names)))
            out.update((n, ranks) for n in names)
        return out

    def _core_params_at(self, name: str, ranks: tuple[int, ...]) -> int:
        shapes = self.layers[name].spec.core_shapes
        return sum(math.prod(shape[1:-1]) * ranks[k] * ranks[k + 1] for k, shape in enumerate(shapes))

    @torch.no_grad()
    def cut(self, share: bool | None = None) -> int:
        """Cut switched-off rank slices out of the cores (and the optimizer's state) now: new, smaller
        Parameters.  Returns the number of parameters removed.  An optimizer that still holds a replaced
        Parameter raises at its next step.  When sharing (default: ``share_allocation``) a layer keeps as
        many slices as the largest active rank among the layers of its shape, its extra ones still switched
        off; ``share=False`` (the end of training: the smallest model) keeps only the active ones.  Under
        FSDP2 the cut cores are re-sharded in place, as a re-allocation in ``step()`` does (call it on every
        process)."""
        with _dist.unsharded(self.model, self.layers, self.optimizer):  # FSDP2: whole tensors here
            removed = self._cut(share)
        if self._sharded:
            self._local_masks = self._cut_masks()
        return removed

    def _cut(self, share: bool | None) -> int:
        before = sum(m.tt_params() for m in self.layers.values())
        state = self.optimizer.state if self.optimizer is not None else {}
        retired: list[torch.Tensor] = []
        allocation = self._allocation(share)
        for name, layer in self.layers.items():
            keep = []
            for k, (g, m) in enumerate(zip(layer.gates, self.masks[name])):
                idx = torch.nonzero(m).flatten()
                if idx.numel() == 0:
                    idx = g.abs().argmax().reshape(1)
                extra = allocation[name][k + 1] - idx.numel()
                if extra > 0:  # switched-off slices kept (zero gates, masked) so equal shapes stay equal
                    idx = torch.cat([idx, torch.nonzero(~m).flatten()[:extra]]).sort().values
                keep.append(None if idx.numel() == g.numel() else idx)
            replaced: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
            for old, new, dim, idx in layer.prune_ranks(keep):
                first = id(old) not in replaced
                replaced.setdefault(id(old), (old, new))
                st = state.pop(old, None) if first else state.pop(replaced[id(old)][1], None)
                if st is not None:  # cut the optimizer's per-element state (AdamW's moments) alike
                    for key, value in st.items():
                        if isinstance(value, torch.Tensor) and value.dim() == new.dim() and value.dim() > 0:
                            st[key] = value.index_select(dim, idx.to(value.device)).contiguous()
                    state[new] = st
            if self.optimizer is not None and replaced:
                swap = {id(old): new for old, new in replaced.values()}
                for group in self.optimizer.param_groups:
                    group["params"] = [swap.get(id(p), p) for p in group["params"]]
            retired += [old for old, _ in replaced.values()]
            self.masks[name] = [m[k] if k is not None else m for m, k in zip(self.masks[name], keep)]
            if name in self._importance:
                self._importance[name] = [v[k] if k is not None else v
                                          for v, k in zip(self._importance[name], keep)]
        retire(retired)
        self._update_size()
        removed = before - sum(m.tt_params() for m in self.layers.values())
        if removed:
            self.cuts += 1
        return removed

    # -- reports --------------------------------------------------------------------------------------
    def _update_size(self) -> None:
        """Refresh what follows from the masks (size, ranks, the masked bonds) after they change."""
        self._ranks = {name: (1, *(int(m.sum()) for m in self.masks[name]), 1) for name in self.layers}
        self._masked = [(name, k) for name in self.layers for k, m in enumerate(self.masks[name])
                        if int(m.sum()) < m.numel()]
        self._size = self._active_core_params()
        self._size_t.fill_(float(self._size))

    def ranks(self) -> dict[str, tuple[int, ...]]:
        """Active ranks per layer (boundary 1s included)."""
        return dict(self._ranks)

    def allocated_ranks(self) -> dict[str, tuple[int, ...]]:
        """Ranks the cores are allocated at (>= the active ranks until the next re-allocation)."""
        return {name: layer.spec.ranks for name, layer in self.layers.items()}

    def size(self) -> int:
        """S(g): sum over layers and cores of size_k * nnz(g_{k-1}) * nnz(g_k)."""
        return self._size

    def model_params(self) -> int:
        """Parameters of the whole model as it is allocated now."""
        return sum(p.numel() for p in self.model.parameters())

    def compression(self) -> float:
        """Dense parameter count of the model over its current active parameter count."""
        active = self.model_params() - sum(m.spec.core_params() for m in self.layers.values()) + self.size()
        return self.dense_params / max(active, 1)

    def report(self) -> str:
        lines = [f"step {self.steps} ({self.stage} stage), {self.cuts} cuts; TT size {self.size():,} "
                 f"(active), model {self.model_params():,} parameters allocated "
                 f"({self.model_params() * 4 / 2**20:.2f} MiB in float32), {self.compression():.1f}x vs dense"]
        alloc = self.allocated_ranks()
        for name, r in self.ranks().items():
            lines.append(f"  {name}: ranks {','.join(map(str, r))} active / {','.join(map(str, alloc[name]))}")
        return "\n".join(lines)

    # -- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "stage": self.stage, "cuts": self.cuts, "size_target": self.size_target,
                "loss_target": self.loss_target, "last_loss": self._last_loss, "loss_ema": self._loss_ema,
                "masks": {n: [m.clone() for m in ms] for n, ms in self.masks.items()},
                "history": [vars(r).copy() for r in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = set(self.layers) ^ set(state["masks"])
        if missing:
            raise ValueError(f"the checkpoint's TT layers differ from the model's: {sorted(missing)}")
        for n, ms in state["masks"].items():
            have = tuple(g.numel() for g in self.layers[n].gates)
            if tuple(m.numel() for m in ms) != have:
                raise ValueError(
                    f"the RankAdaptive state was saved with {n} allocated at bond ranks "
                    f"{tuple(m.numel() for m in ms)}, the model has {have}: load the model's checkpoint first "
                    f"(comera_compile.load_checkpoint re-allocates the layers, then loads this state)")
        self.steps, self.stage, self.cuts = state["steps"], state["stage"], state["cuts"]
        self.size_target, self.loss_target = state["size_target"], state["loss_target"]
        self._last_loss, self._loss_ema = state["last_loss"], state.get("loss_ema")
        self.masks = {n: [m.clone().to(_dist.local(self.layers[n].gates[k]).device) for k, m in enumerate(ms)]
                      for n, ms in state["masks"].items()}
        self.history = [_Record(**r) for r in state["history"]]
        self._importance = {}  # recomputed (balance) before its next use
        self._update_size()
        if self._sharded:
            self._local_masks = self._cut_masks()
        with torch.no_grad():
            self._penalty_t.copy_(self.penalty())  # loss() adds it: as after the saved run's last step
