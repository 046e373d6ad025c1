"""transformers glue: the ``TrainerCallback`` that runs RankAdaptive inside ``transformers.Trainer``
(transformers is imported only when the callback is built)."""

from __future__ import annotations

from typing import Any

__all__ = ["trainer_callback"]


def trainer_callback(ra: Any) -> Any:
    """A ``TrainerCallback`` running `ra` (a RankAdaptive) inside ``Trainer``: ``ra.step()`` after every
    optimizer step (the Trainer's optimizer attached at the first), ``ra.cut(share=False)`` when training
    ends.  With several processes build RankAdaptive with ``realloc_at=None``: the Trainer's DDP wrapper
    cannot be rebuilt mid-training, so switched-off slices stay allocated as zeros until the final cut."""
    from transformers import TrainerCallback

    class RankAdaptiveCallback(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
            if ra.optimizer is None and optimizer is not None:
                ra.attach(getattr(optimizer, "optimizer", optimizer))  # accelerate wraps the optimizer
            ra.step()

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            ra.cut(share=False)

    return RankAdaptiveCallback()
