"""What tensorize puts on a transformers model in place of its own methods, so that they keep working on
TT layers: ``save_pretrained`` (the TT layout travels with the checkpoint, comera_compile.checkpoint),
``resize_token_embeddings`` (a TT table is made dense to be resized) and, after tied='untie',
``tie_weights`` (the untied layers stay apart).  ``attach`` is tensorize's last stage.  And the
``TrainerCallback`` that runs RankAdaptive inside ``transformers.Trainer`` (``trainer_callback``).
transformers itself is imported only where a function needs it.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from comera_compile.checkpoint import save_pretrained
from comera_compile.layers import TTLayer

if TYPE_CHECKING:
    from comera_compile.passes.module.select import TensorizeSummary

__all__ = ["attach", "resize_token_embeddings", "trainer_callback", "RA_STATE_NAME"]


def attach(model: nn.Module, summary: "TensorizeSummary") -> None:
    """Put comera's save_pretrained, resize_token_embeddings and tie_weights on a tensorized transformers
    model (one with a config and these methods); nothing on a GraphModule (summary.traced) or another model."""
    if summary.traced:
        return
    if hasattr(model, "config") and callable(getattr(model, "save_pretrained", None)):
        # Its own save_pretrained would write TT weights that the dense class then "loads" with fresh layers;
        # this one records the layout for cc.from_pretrained instead.
        model.save_pretrained = functools.partial(save_pretrained, model)
    if callable(getattr(model, "resize_token_embeddings", None)) and callable(
            getattr(model, "get_input_embeddings", None)):
        model.resize_token_embeddings = functools.partial(resize_token_embeddings, model)
    if summary.untied and callable(getattr(model, "tie_weights", None)):
        model.tie_weights = functools.partial(_tie_weights, model)


def _tie_weights(model: nn.Module, *args: Any, **kwargs: Any) -> None:
    """transformers' ``tie_weights`` on a model tensorize untied (tied='untie'): its config still names the
    pairs to tie, but each member is now its own layer, and a TT layer has no ``weight`` to share; tying would
    fail, or, once a resize has made them dense again, quietly replace one trained layer by the other.  The
    model stays untied, as the user asked; with no TT layer left, transformers' own tying runs."""
    if any(isinstance(m, TTLayer) for m in model.modules()) or getattr(model, "_comera_resized", False):
        return None
    return type(model).tie_weights(model, *args, **kwargs)


def resize_token_embeddings(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    """transformers' ``model.resize_token_embeddings(...)`` on a tensorized model (tensorize puts this in its
    place): a TT input embedding or output head is first made the dense layer it represents (exactly, its
    gates folded in), so transformers resizes it as usual -- old rows unchanged, new rows initialised as
    transformers does -- and it stays dense afterwards, with the reason in ``comera_summary`` and a warning.
    A TT factorization of the resized table would change the old rows at any rank below full; call
    ``cc.tensorize(model)`` again to compress the new table.  Returns what transformers returns."""
    from comera_compile.passes.module.select import TensorizeError

    names = {id(m): n for n, m in model.named_modules()}
    summary = getattr(model, "comera_summary", None)
    ends = {names.get(id(getattr(model, get)())) for get in ("get_input_embeddings", "get_output_embeddings")
            if callable(getattr(model, get, None))}
    for group in (summary.untied if summary is not None else []):
        members = group.split(" and ")
        others = [m for m in members if m not in ends]
        if others and len(others) < len(members):
            # e.g. T5: set_input_embeddings puts the one resized table in encoder and decoder as well
            raise TensorizeError(f"resize_token_embeddings would make {group} one layer again (transformers "
                                 f"resizes the input embedding and shares it), replacing {', '.join(others)}, "
                                 f"which tensorize(tied='untie') gave layers of their own. Resize the dense model "
                                 f"before tensorize, or tensorize with tied='keep'")
    made_dense = []
    for get, put in (("get_input_embeddings", "set_input_embeddings"),
                     ("get_output_embeddings", "set_output_embeddings")):
        layer = getattr(model, get)() if callable(getattr(model, get, None)) else None
        if isinstance(layer, TTLayer) and callable(getattr(model, put, None)):
            name = names.get(id(layer), get[4:])
            getattr(model, put)(layer.to_dense_module())
            made_dense.append(name)
            if summary is not None:
                summary.rewritten.pop(name, None)
                summary.kept_dense[name] = ("made dense by resize_token_embeddings (a TT form of the resized "
                                            "table would change its old rows); cc.tensorize(model) compresses it again")
    if made_dense:
        model._comera_resized = True   # no re-tying of what tensorize untied (_tie_weights)
        warnings.warn(f"resize_token_embeddings: {', '.join(made_dense)} made dense to be resized (old rows exact); "
                      f"call cc.tensorize(model) to compress again", stacklevel=2)
    return type(model).resize_token_embeddings(model, *args, **kwargs)


RA_STATE_NAME = "rank_adaptive.pt"   # RankAdaptive's state, in each of the Trainer's checkpoint folders


def trainer_callback(ra: Any) -> Any:
    """A ``TrainerCallback`` running `ra` (a RankAdaptive) inside ``Trainer``: ``ra.step()`` after every
    optimizer step (the Trainer's optimizer attached when training begins), ``ra.cut(share=False)`` when training
    ends.  Each checkpoint the Trainer writes gets ``ra.state_dict()`` as RA_STATE_NAME, and a run resumed
    from one (``trainer.train(resume_from_checkpoint=...)``) takes it back at the start, so rank adaptation
    goes on as if never stopped; with ``load_best_model_at_end`` the best checkpoint's is taken back before
    the final cut.  With a late stage (``late_stage_at``) each step's task loss feeds its loss average: the
    loss the model returns in training (a forward hook; callbacks are not given the loss), its micro-batches'
    shares added where the Trainer passed ``num_items_in_batch``, else averaged.  With several processes
    build RankAdaptive with ``realloc_at=None``: the Trainer's DDP wrapper cannot be rebuilt mid-training, so
    switched-off slices stay allocated as zeros until the final cut."""
    import os

    import torch
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    def folder(args: Any, state: Any) -> str:
        return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")

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
            if state.global_step > ra.steps:   # resumed (else a fresh run, or ra's state already loaded)
                load(folder(args, state), f"the Trainer resumes at step {state.global_step} and RankAdaptive is "
                                          f"at step {ra.steps}")
            if ra.optimizer is None and optimizer is not None:
                ra.attach(optimizer)   # before the first step: a float16 overflow there is seen and skipped
            if args.torch_compile and model is not None and any(
                    m.__dict__.get("_comera_compiled_block") for m in model.modules()):
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

        def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
            if ra.optimizer is None and optimizer is not None:
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
            if state.is_world_process_zero and os.path.isdir(folder(args, state)):
                torch.save(ra.state_dict(), os.path.join(folder(args, state), RA_STATE_NAME))

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            best = state.best_model_checkpoint
            if args.load_best_model_at_end and best is not None:   # the Trainer loaded that one's weights
                load(best, f"the Trainer loaded the best checkpoint's weights ({best})")
            ra.cut(share=False)
            if self.hook is not None:
                self.hook.remove()
                self.hook = None

    return RankAdaptiveCallback()
