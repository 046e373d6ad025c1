"""RankAdaptive, what users construct: rank gates shrunk by a proximal step in the balanced gauge after every
optimizer step, every bond rounded to its singular basis and zero gates switched off every ``cut_every``
steps, an optional late stage toward a size target, and re-allocations that cut switched-off slices out of
the cores for real.  docs/method.md section 4 states the rule and the measurements behind its defaults."""

from __future__ import annotations

import math
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import distributed as _dist
from ..distributed.checkpoint import state_dict_layers
from ..gauge import balance_layers, canonicalize_layers
from ..graphs import capturing
from ..layers import DEFAULT_TAU, TTLayer, tt_layers
from ..optim import (check_holds, learning_rates, prefer_fast_implementation, skipped_step, unwrapped,
                     watch_overflow)
from ..optim_state import rescale_all, restart_all
from ..regional import drop_stale_graphs
from . import cuts
from .allocation import Allocation, gates_of
from .divergence import check_finite
from .penalty import KINDS, flat_penalty, penalty, proximal_step
from .reports import Reports

__all__ = ["RankAdaptive", "BALANCE_EVERY", "REBUILD_STEPS", "rank_adaptive_of", "host_state"]

# Each model's RankAdaptive (the latest made for it), for a captured training step that must know its stage.
_BY_MODEL: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def rank_adaptive_of(model: nn.Module) -> "RankAdaptive | None":
    """The RankAdaptive last constructed on ``model``, if it is still alive."""
    ref = _BY_MODEL.get(model)
    return ref() if ref is not None else None


def host_state(ra: "RankAdaptive") -> tuple:
    """What ``ra.loss()`` reads on the host (the stage, its weights and targets, which tensors): a step
    captured as a CUDA graph is captured anew when it changes (once, at the late stage)."""
    return (ra.stage, ra.gamma, ra.size_target, ra.loss_target, id(ra._penalty_t), id(ra._alloc.size_t))

# Steps between re-balancings of the gauge (it drifts little in a few optimizer steps; each costs a few
# small einsums per bond).
BALANCE_EVERY = 10

# Steps after a rounding without the proximal step (at most a tenth of cut_every): the rounding restarts the
# gates' first moments at zero, and Adam's pull on a gate takes about 1 / (1 - beta1) steps to rebuild.
REBUILD_STEPS = 10


def _follow_the_model(ra: "RankAdaptive") -> None:
    """Keep the masks at the model's ranks.  Weights of other ranks loaded into the model (a TT layer takes a
    checkpoint's ranks) before RankAdaptive's first step: its masks start afresh there, as if it were built
    after the load.  After that, its state must come with those weights: an error that says so."""
    stale = ra._alloc.stale()
    if stale is None:
        return
    if ra.steps == 0 and ra.cuts == 0:
        ra._alloc = Allocation(ra.layers, ra._alloc.size_t.device)
        ra._view.refresh(ra._alloc.masks)
        with torch.no_grad():
            ra._penalty_t.copy_(ra.penalty())
        return
    raise RuntimeError(
        f"RankAdaptive at step {ra.steps}: TT layer {stale or '(the model)'} is at ranks "
        f"{ra.layers[stale].spec.ranks}, not the {(1, *(m.numel() for m in ra._alloc.masks[stale]), 1)} it "
        f"holds masks for: weights of other ranks were loaded into the model.  Load the RankAdaptive state saved with them (ra.load_state_dict"
        f"(...)), or build a new RankAdaptive after loading the model")


def _balance_all(ra: "RankAdaptive", carry: bool) -> None:
    """Balance every layer (layers of one shape together), keep each slice's importance, and with `carry` the
    gates' optimizer moments carried into their new scale."""
    scales: dict[int, torch.Tensor] = {}
    for (name, layer), (importance, factors) in zip(ra.layers.items(), balance_layers(list(ra.layers.values()))):
        ra._alloc.importance[name] = importance
        scales.update((id(g), f) for g, f in zip(gates_of(layer), factors))
    if carry:
        rescale_all(ra.optimizer, [g for layer in ra.layers.values() for g in gates_of(layer) if id(g) in scales],
                    scales)


@dataclass
class _Record:
    step: int
    stage: str
    size: int
    ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    loss: float | None = None


def _check_arguments(tau: Any, gamma: Any, target_ratio: Any, late_stage_at: Any, cut_every: Any, penalty: Any,
                     pull_below: Any, realloc_at: Any) -> None:
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
    if penalty not in KINDS:
        raise ValueError(f"penalty must be 'mcp' (default: no pull on a bond's strongest slice) or 'l1' (the "
                         f"same pull on every slice), got {penalty!r}")
    if not (isinstance(pull_below, (int, float)) and 0 < pull_below <= 1):
        raise ValueError(f"pull_below must be in (0, 1] (the fraction of its bond's strongest slice from which a "
                         f"gate feels no pull under penalty='mcp'), got {pull_below!r}")
    if realloc_at is not None and not realloc_at >= 1:
        raise ValueError(f"realloc_at must be >= 1 (allocated / active TT parameters that triggers a "
                         f"re-allocation) or None (only explicit cut()), got {realloc_at!r}")


def _trainable_layers(model: nn.Module) -> dict[str, TTLayer]:
    """The TT layers RankAdaptive adapts: every one whose cores and gates all train.  A layer with a frozen
    core or gate (requires_grad=False; its bias may train, as in bias-only fine-tuning) is the user's to keep
    as it is: the gauge steps and cuts would change its weight (a warning names them)."""
    every = state_dict_layers(model)   # named without DDP's or torch.compile's wrapper: its checkpoints load
    if not every:                      # into the bare model
        raise ValueError(f"{type(model).__name__} has no TT layers; tensorize it first "
                         f"(model = comera_compile.tensorize(model))")
    layers = {n: m for n, m in every.items() if all(p.requires_grad for p in [*m.cores, *m.gates])}
    frozen = [n for n in every if n not in layers]
    if not layers:
        raise ValueError(f"every TT layer of {type(model).__name__} is frozen (a core or gate with "
                         f"requires_grad=False): nothing for RankAdaptive to adapt; unfreeze the layers it should "
                         f"adapt")
    if frozen:
        warnings.warn(f"RankAdaptive leaves {len(frozen)} frozen TT layer(s) at their ranks "
                      f"({', '.join(frozen[:4])}{', ...' if len(frozen) > 4 else ''}): a core or gate with "
                      f"requires_grad=False, its weight kept as it is", stacklevel=3)
    return layers


class RankAdaptive(Reports):
    """The rank-adaptive training hook for a tensorized model.  The loop: ``optimizer.step()``, then
    ``ra.step(loss)`` (as an LR scheduler's step); ``ra.loss(task_loss)`` gives the current stage's objective
    where its value is wanted (its penalty term carries no gradient: the penalty acts in ``step()``).

    Give the optimizer (``optimizer=`` or ``ra.attach(opt)``): its gate learning rates set the proximal step
    (``prox_lr`` stands in without one), re-allocations cut its state too, and it raises if it ever steps a
    retired Parameter.  A re-allocation replaces the cores with new Parameters: ``step()`` returns True and
    callbacks registered with ``on_reallocate`` run (a DistributedDataParallel wrapper is rebuilt there; under
    FSDP2 the new Parameters are re-sharded in place).  Reports: ``ranks()``, ``allocated_ranks()``,
    ``size()``, ``compression()``, ``report()``, ``history``.

    Defaults are meant to be left alone with ``param_groups(model, lr)``'s learning rates: ``gamma`` 0.1 (a
    tenth of an Adam step per step toward zero, for a gate near zero), ``penalty="mcp"`` (the pull fades to
    none at ``pull_below`` = 0.15 of the bond's strongest slice; ``"l1"`` keeps it), ``tau`` 1e-6 (gates the
    proximal step zeroed switch off), a rounding and cut check every ``cut_every`` = 100 steps, and a
    re-allocation when the allocated TT parameters reach ``realloc_at`` = 2 times the active ones (None: only
    an explicit ``cut()``, for wrappers that cannot be rebuilt mid-training).  ``share_allocation`` allocates
    layers of equal shape at equal ranks, so repeated blocks keep sharing one compiled graph.  The late stage
    (``target_ratio``, ``late_stage_at``, ``target_loss``) steers toward a size target.  ``process_group``: the
    model's replicas (DDP's; default all); a model per process: ``torch.distributed.new_subgroups(1)[0]``."""

    def __init__(self, model: nn.Module, tau: float = DEFAULT_TAU, gamma: float = 0.1,
                 target_ratio: float | None = None, target_loss: float | None = None,
                 late_stage_at: int | None = None, cut_every: int = 100,
                 optimizer: torch.optim.Optimizer | None = None, realloc_at: float | None = 2.0,
                 prox_lr: float = 1e-3, share_allocation: bool = True, penalty: str = "mcp",
                 pull_below: float = 0.15, process_group: Any = None) -> None:
        _check_arguments(tau, gamma, target_ratio, late_stage_at, cut_every, penalty, pull_below, realloc_at)
        self.layers = _trainable_layers(model)
        self.model, self.tau, self.gamma = model, float(tau), float(gamma)
        self.target_ratio, self.target_loss, self.late_stage_at = target_ratio, target_loss, late_stage_at
        self.cut_every, self.realloc_at, self.process_group = cut_every, realloc_at, process_group
        self.optimizer: torch.optim.Optimizer | None = None
        self._stepper: Any = None   # the object attached: the optimizer or its wrapper
        if optimizer is not None:
            self.attach(optimizer)
        self.prox_lr, self.share_allocation = float(prox_lr), bool(share_allocation)
        self.penalty_kind, self.pull_below = penalty, float(pull_below)
        self.steps, self.stage, self.cuts, self._warned_unattached_cut = 0, "early", 0, False
        self.size_target: float | None = None
        self.loss_target: float | None = None
        self._last_loss: float | None = None
        self._loss_ema: float | None = None
        self.dense_params = sum(p.numel() for p in model.parameters()) + sum(
            m.dense_params() - m.tt_params() for m in tt_layers(model).values())
        self._view = _dist.view(model, self.layers)   # plain or FSDP2-sharded: per-process gates and masks
        first = next(iter(self.layers.values())).gates[0]
        device = self._view.local(first).device
        self._alloc = Allocation(self.layers, device)
        self._penalty_t = torch.ones((), dtype=first.dtype, device=device)  # penalty() after the last step
        self._norms: dict[str, tuple[int, float]] = {}   # each layer's weight norm at the last check
        self._on_reallocate: OrderedDict[int, Callable[[RankAdaptive], Any]] = OrderedDict()
        self.history: list[_Record] = []
        _BY_MODEL[model] = weakref.ref(self)

    @property
    def masks(self) -> dict[str, list[torch.Tensor]]:
        """Each layer's masks, one boolean per gate entry (False: switched off)."""
        return self._alloc.masks

    # -- objective ------------------------------------------------------------------------------------
    def penalty(self) -> torch.Tensor:
        """R: the mean penalty over the active gate entries of every TT layer, in the balanced gauge."""
        masks = self._view.masks(self._alloc.masks)
        return penalty([self._view.local(g) for layer in self.layers.values() for g in gates_of(layer)],
                       [m for name in self.layers for m in masks[name]], self.penalty_kind, self.pull_below,
                       self._view.mean)

    def loss(self, task_loss: torch.Tensor) -> torch.Tensor:
        """The current stage's objective for this step's task loss, the penalty (as of the last step()) added
        as a value without gradient.  Needed only where that value is wanted: ``step(loss)`` records the task
        loss for the late stage as this does (and works where this cannot, inside a compiled region)."""
        if self.late_stage_at is not None and not torch.compiler.is_compiling() and not capturing():
            self._last_loss = float(task_loss.detach())
        r = self._penalty_t.to(task_loss.dtype)
        if self.stage == "early":
            return task_loss + self.gamma * r
        size = self._alloc.size_t.to(task_loss.dtype)
        size_gap = (size - self.size_target) / size
        loss_gap = (task_loss.detach() - self.loss_target) / task_loss.detach()
        lam = (loss_gap < size_gap).to(task_loss.dtype)
        return task_loss + (0.01 + lam) * r

    # -- schedule -------------------------------------------------------------------------------------
    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer whose learning rates set the proximal step and whose state is cut with the cores (in
        accelerate's wrapper, the one inside; a step it or a fused one's GradScaler skipped skips here, one a
        scaler never called cannot: README, float16).  It takes its fast implementation; attached twice, once.
        An optimizer that does not hold the TT layers' trainable cores (built before cc.tensorize) is an error."""
        if optimizer is not self._stepper:
            cores = {f"{name}.cores.{i}": c for name, layer in self.layers.items() for i, c in enumerate(layer.cores)}
            check_holds(optimizer, self.model, cores, "RankAdaptive")
            self._stepper, self.optimizer = optimizer, unwrapped(optimizer)
            prefer_fast_implementation(self.optimizer, self.model)
            watch_overflow(self.optimizer)

    def on_reallocate(self, fn: Callable[[RankAdaptive], Any]) -> RemovableHandle:
        """Call ``fn(ra)`` after every re-allocation (from ``step()`` or ``cut()``), when the cores are new
        Parameters: rebuild a DistributedDataParallel wrapper there.  Returns a handle; ``.remove()`` it."""
        handle = RemovableHandle(self._on_reallocate)
        self._on_reallocate[handle.id] = fn
        return handle

    def trainer_callback(self) -> Any:
        """A transformers ``TrainerCallback`` running this hook inside ``Trainer`` (huggingface.py)."""
        from .trainer import trainer_callback

        return trainer_callback(self)

    @torch.no_grad()
    def step(self, loss: torch.Tensor | float | None = None) -> bool:
        """After optimizer.step(): shrink the gates (proximal step, in the balanced gauge) and advance the
        schedule; every cut_every steps round every bond, switch off the zeroed gates, prune toward the late
        stage's target and re-allocate when due.  `loss` (this step's task loss, tensor or float) feeds the
        late stage's moving average.  Returns True when the cores were re-allocated (new Parameters;
        ``on_reallocate`` callbacks have run).  An optimizer step skipped is none (which ones: ``attach``)."""
        if skipped_step(self._stepper):
            return False
        _follow_the_model(self)
        if loss is not None and self.late_stage_at is not None:
            self._last_loss = float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        self.steps += 1
        if self._last_loss is not None and math.isfinite(self._last_loss):   # an overflowed step's loss is none
            self._loss_ema = self._last_loss if self._loss_ema is None else (
                0.9 * self._loss_ema + 0.1 * self._last_loss)
        # In the late stage the size target is the goal: once reached, no further slice is shrunk.
        shrinking = self.gamma > 0 and (self.stage == "early" or self.size() > self.size_target)
        if self.steps > self.cut_every and (self.steps - 1) % self.cut_every < min(REBUILD_STEPS,
                                                                                   self.cut_every // 10):
            shrinking = False  # the gates' first moments are rebuilding after the last rounding
        alloc, view = self._alloc, self._view
        if (self.steps - 1) % BALANCE_EVERY == 0:
            with view.unsharded(self.optimizer):
                _balance_all(self, carry=True)
        params = [g for layer in self.layers.values() for g in gates_of(layer)]
        gates = [view.local(g) for g in params]   # the update is elementwise: this process's part
        steps = None
        if shrinking:
            lrs = self.__dict__.pop("_step_lrs", None) or learning_rates(self.optimizer)
            steps = [self.gamma * lrs.get(id(g), self.prox_lr) for g in params]
        masks = view.masks(alloc.masks)
        flat, mask = proximal_step(gates, [m for name in self.layers for m in masks[name]], steps,
                                   self.penalty_kind, self.pull_below)   # and the switched-off entries zeroed
        self._penalty_t.copy_(flat_penalty(flat, mask, self.penalty_kind, self.pull_below, view.mean))
        if self.late_stage_at is not None and self.stage == "early" and self.steps >= self.late_stage_at:
            self.stage, self._loss_ema = "late", _dist.replica_mean(self._loss_ema, self._penalty_t.device,
                                                                   self.process_group)
            self.size_target = self.target_ratio * self.size()
            self.loss_target = self.target_loss if self.target_loss is not None else (
                self._loss_ema if self._loss_ema is not None else 0.0)
        reallocated = self._check() if self.steps % self.cut_every == 0 else False
        self.history.append(_Record(self.steps, self.stage, self.size(), self.ranks(), self._last_loss))
        if reallocated:
            self._reallocated()
        return reallocated

    def _check(self) -> bool:
        """The check every cut_every steps, on whole tensors; returns whether it re-allocated."""
        alloc = self._alloc
        removed = 0
        with self._view.unsharded(self.optimizer):
            check_finite(self.layers, self._norms, self.steps)
            if _dist.synchronize(self.model, self.layers, alloc.masks, self.process_group):
                alloc.update()
                self._loss_ema = _dist.replica_mean(self._loss_ema, self._penalty_t.device, self.process_group)
            canonicalize_layers(list(self.layers.values()))
            restart_all(self.optimizer, [p for layer in self.layers.values() for p in (*layer.cores, *layer.gates)])
            # the gates' moments stay in the balanced scale (first ones restarted, second ones averaged), not the
            # singular values' scale the rounding left the gates in: nothing to carry
            _balance_all(self, carry=False)
            alloc.switch_off(self.tau, self.size_target if self.stage == "late" else None)
            if self.stage == "late":
                self._prune_toward_target()
            if _dist.agree_on_masks(self.layers, alloc.masks, self.process_group):
                alloc.update()
            if alloc.reallocation_due(self.realloc_at, self.share_allocation):
                if self.optimizer is None:
                    raise RuntimeError(
                        f"RankAdaptive at step {self.steps}: a re-allocation is due but no optimizer is attached, "
                        f"and one built on the old cores would go on training tensors the model no longer uses.  "
                        f"Give it (RankAdaptive(model, optimizer=opt) or ra.attach(opt)), or pass "
                        f"realloc_at=None and cut() at the end.  Nothing was cut")
                removed = self._cut(self.share_allocation)
        self._view.refresh(alloc.masks)
        return removed > 0

    def _prune_toward_target(self) -> None:
        """In the late stage: prune toward the size target when the size is relatively further from its target
        than the averaged loss from its own (the achievement scalarization's choice)."""
        size = self.size()
        if size <= self.size_target:
            return
        if self._loss_ema is not None and self.loss_target is not None and self._loss_ema > 0:
            if (self._loss_ema - self.loss_target) / self._loss_ema >= (size - self.size_target) / size:
                return
        self._alloc.prune_toward(self.size_target)

    @torch.no_grad()
    def cut(self, share: bool | None = None) -> int:
        """Cut switched-off rank slices out of the cores (and the attached optimizer's state) now: new, smaller
        Parameters.  Returns the number of parameters removed.  ``share`` (default: ``share_allocation``)
        keeps as many slices as the largest active rank among layers of equal shape; ``share=False`` (the end
        of training) only the active ones.  Under FSDP2 call it on every process.  With no optimizer attached
        it warns once: an optimizer built before the cut must be rebuilt."""
        with self._view.unsharded(self.optimizer):
            removed = self._cut(self.share_allocation if share is None else share)
        self._view.refresh(self._alloc.masks)
        if removed and self.optimizer is None and not self._warned_unattached_cut:
            self._warned_unattached_cut = True
            warnings.warn("RankAdaptive.cut() replaced TT cores and gates with no optimizer attached: an optimizer "
                          "built before the cut would train tensors the model no longer uses; build it anew (or "
                          "ra.attach(opt) before cutting)", stacklevel=2)
        if removed:
            self._reallocated()
        return removed

    def _cut(self, share: bool) -> int:
        removed = cuts.cut(self._alloc, self.optimizer, share)
        self.cuts += int(removed > 0)
        return removed

    def _reallocated(self) -> None:
        drop_stale_graphs(self.model)   # the old shapes' graphs would count toward dynamo's recompile limit
        for fn in list(self._on_reallocate.values()):
            fn(self)

    # -- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "stage": self.stage, "cuts": self.cuts, "size_target": self.size_target,
                "loss_target": self.loss_target, "last_loss": self._last_loss, "loss_ema": self._loss_ema,
                "masks": {n: [m.clone() for m in ms] for n, ms in self._alloc.masks.items()},
                "history": [vars(r).copy() for r in self.history], "norms": dict(self._norms)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._alloc.load(state["masks"], {n: [self._view.local(g).device for g in layer.gates]
                                          for n, layer in self.layers.items()})
        self.steps, self.stage, self.cuts = state["steps"], state["stage"], state["cuts"]
        self.size_target, self.loss_target = state["size_target"], state["loss_target"]
        self._last_loss, self._loss_ema = state["last_loss"], state.get("loss_ema")
        self.history, self._norms = [_Record(**r) for r in state["history"]], dict(state.get("norms", {}))
        self._view.refresh(self._alloc.masks)
        with torch.no_grad():
            self._penalty_t.copy_(self.penalty())  # loss() adds it: as after the saved run's last step
