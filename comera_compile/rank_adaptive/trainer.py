"""The ``TrainerCallback`` that runs RankAdaptive inside ``transformers.Trainer`` (``trainer_callback``, which
``RankAdaptive.trainer_callback()`` returns); transformers is imported only when one is made."""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["trainer_callback", "RA_STATE_NAME"]


RA_STATE_NAME = "rank_adaptive.pt"   # RankAdaptive's state, in each of the Trainer's checkpoint folders


def trainer_callback(ra: Any) -> Any:
    """A ``TrainerCallback`` running `ra` (a RankAdaptive) inside ``Trainer``: ``ra.step()`` after every
    optimizer step (the optimizer of the Trainer that trains attached when each ``train()`` begins), a final
    ``ra.cut()`` when training ends: of every inactive slice (``share=False``), or, where ``cc.compile_blocks``
    compiled the model's blocks, at ranks shared by blocks of one shape (``ra.share_allocation``), so that they
    go on sharing one graph in ``evaluate()`` and ``generate()`` (call ``ra.cut(share=False)`` yourself for the
    smallest model, each block then compiling its own graph).  Each checkpoint the Trainer writes gets
    ``ra.state_dict()`` as RA_STATE_NAME, and a run resumed from one
    (``trainer.train(resume_from_checkpoint=...)``, wherever the checkpoint is) takes it back at the start, so
    rank adaptation goes on as if never stopped; with ``load_best_model_at_end`` the best checkpoint's is
    taken back before the final cut.  With a late stage (``late_stage_at``) each step's task loss feeds its
    loss average: the loss the model returns in training (a forward hook; callbacks are not given the loss),
    its micro-batches' shares added where the Trainer passed ``num_items_in_batch``, else averaged.  With
    several processes RankAdaptive must be built with ``realloc_at=None`` (else an error at the start): the
    Trainer's DDP wrapper cannot be rebuilt mid-training, so switched-off slices stay allocated as zeros until
    the final cut."""
    import inspect
    import os

    import torch
    from transformers import TrainerCallback

    from comera_compile.optim import step_learning_rates, unwrapped
    from comera_compile.regional import is_compiled_block
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    def folder(args: Any, state: Any) -> str:
        return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")

    def resume_argument() -> str | None:
        """The checkpoint ``train(resume_from_checkpoint=...)`` resumes from, or None.  transformers hands
        callbacks no path, so it is read from the Trainer's training loop that called this one."""
        frame = inspect.currentframe()
        while frame is not None:
            if frame.f_code.co_name == "_inner_training_loop":
                path = frame.f_locals.get("resume_from_checkpoint")
                return os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
            frame = frame.f_back
        return None

    def plain_gate_groups(ra: Any) -> None:
        """Say where the Trainer's optimizer holds RankAdaptive's gates as it holds any weight (decayed, or at
        the cores' rate): the proximal step then shrinks them by gamma x that rate, a twentieth of CoMERA's."""
        groups = ra.optimizer.param_groups
        gates = {id(g) for layer in ra.layers.values() for g in layer.gates}
        cores = {id(c) for layer in ra.layers.values() for c in layer.cores}
        held = [gr for gr in groups if any(id(p) in gates for p in gr["params"])]
        if any(gr.get("weight_decay", 0) > 0 or any(id(p) in cores for p in gr["params"]) for gr in held):
            warnings.warn("the Trainer's optimizer holds RankAdaptive's gates as it holds any weight (weight decay, "
                          "or the cores' learning rate) where CoMERA runs them undecayed at 20x the rate: pass "
                          "Trainer(..., optimizers=(torch.optim.AdamW(cc.param_groups(model, lr)), None))",
                          stacklevel=2)

    def compiled_blocks(model: Any) -> bool:
        return model is not None and any(is_compiled_block(m) for m in model.modules())

    def load(checkpoint: str, why: str) -> None:
        path = os.path.join(checkpoint, RA_STATE_NAME)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"{why}, but {path} does not exist: load the RankAdaptive state saved with those weights "
                f"(ra.load_state_dict(torch.load('<checkpoint>/{RA_STATE_NAME}'))) before trainer.train(...)")
        ra.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

    class RankAdaptiveCallback(TrainerCallback):
        def __init__(self) -> None:
            self.losses: list[torch.Tensor] = []   # the model's training losses since the step began
            self.shares = False                    # they are shares of the step's loss (num_items_in_batch)
            self.hook: Any = None
            self.warned = False

        def record(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
            if not module.training:
                return
            loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                self.losses.append(loss.detach().reshape(()))
                self.shares = kwargs.get("num_items_in_batch") is not None

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                           **kwargs: Any) -> None:
            if args.world_size > 1 and ra.realloc_at is not None:
                raise ValueError(
                    f"RankAdaptive re-allocates the cores during training (realloc_at={ra.realloc_at}), but the "
                    f"Trainer trains {args.world_size} processes through a data-parallel wrapper it builds once, "
                    f"which would go on syncing the old cores while the replicas drift apart.  Build it with "
                    f"cc.RankAdaptive(model, realloc_at=None, ...): switched-off slices then stay allocated as zeros "
                    f"until this callback cuts them out at the end of training.  Nothing was trained")
            # resumed: from the checkpoint's state, whatever ra holds (a run stopped in this process left it at a
            # later step, or at the step the checkpoint was taken with other ranks and masks)
            resumed = resume_argument()
            if resumed is not None or state.global_step > ra.steps:
                load(resumed or folder(args, state), f"the Trainer resumes at step {state.global_step} and "
                                                     f"RankAdaptive is at step {ra.steps}")
            if optimizer is not None:
                # before the first step (a float16 overflow there is seen and skipped); a second Trainer over the
                # same model brings its own optimizer, which the cuts must update from now on
                ra.attach(optimizer)
                plain_gate_groups(ra)
            if args.torch_compile and compiled_blocks(model):
                warnings.warn(
                    f"TrainingArguments(torch_compile=True) compiles the whole model with backend "
                    f"{args.torch_compile_backend or 'inductor'!r}, which traces through the blocks that "
                    f"cc.compile_blocks compiled (backend 'comera' unless told), so their own backend and comera's "
                    f"graph passes do not run on them.  Leave torch_compile off to train with the compiled blocks",
                    stacklevel=2)
            if ra.late_stage_at is not None and model is not None and self.hook is None:
                self.hook = model.register_forward_hook(self.record, with_kwargs=True)

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.losses.clear()

        def on_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                              **kwargs: Any) -> None:
            # the learning rates of the step just taken: the Trainer steps its scheduler before on_step_end
            step_learning_rates(ra, unwrapped(optimizer) if optimizer is not None else ra.optimizer)

        def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
            if optimizer is not None:
                ra.attach(optimizer)   # accelerate's wrapper: attach takes the torch optimizer inside
            loss = None
            if self.hook is not None and not self.losses and not self.warned:
                self.warned = True
                warnings.warn(
                    f"RankAdaptive's late stage weighs the training loss against the size, but the model returned "
                    f"no loss the Trainer's callback could read at step {state.global_step} (its loss is computed "
                    f"outside the model, or the model returns a tuple); the late stage then prunes toward its size "
                    f"target alone.  Return the loss from the model as transformers' models do (a dict or "
                    f"ModelOutput with 'loss'), or run RankAdaptive in a loop of your own with ra.step(loss)",
                    stacklevel=2)
            if self.losses:
                loss = torch.stack(self.losses).sum() if self.shares else torch.stack(self.losses).mean()
                if self.shares and getattr(args, "average_tokens_across_devices", False):
                    loss = loss * args.world_size   # the shares are of every process's tokens, as the Trainer's
            self.losses.clear()
            ra.step(loss)

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            from comera_compile.distributed.replicas import replica_mean   # every process: a collective

            ra._loss_ema = replica_mean(ra._loss_ema, ra._penalty_t.device, ra.process_group)   # the one copy saved
            if state.is_world_process_zero and os.path.isdir(folder(args, state)):
                torch.save(ra.state_dict(), os.path.join(folder(args, state), RA_STATE_NAME))

        def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            best = state.best_model_checkpoint
            if args.load_best_model_at_end and best is not None:   # the Trainer loaded that one's weights
                load(best, f"the Trainer loaded the best checkpoint's weights ({best})")
            ra.cut(share=None if compiled_blocks(model) else False)
            if self.hook is not None:
                self.hook.remove()
                self.hook = None

    return RankAdaptiveCallback()
