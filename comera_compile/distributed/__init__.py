"""torch.distributed for tensorized models: TT layers sharded by FSDP2 (fsdp.py), replicas that must agree
on RankAdaptive's decisions (replicas.py), and distributed checkpoints at any world size (checkpoint.py)."""

from __future__ import annotations

from .checkpoint import checkpoint_ranks, load_checkpoint, resize_ranks, save_checkpoint
from .fsdp import (PlainView, ShardedView, check_resharding, is_sharded, local, local_masks, shard_like, unsharded,
                   view)
from .replicas import agree_on_masks, distributed, replica_mean, synchronize

__all__ = ["is_sharded", "local", "local_masks", "shard_like", "unsharded", "check_resharding", "view", "PlainView",
           "ShardedView", "distributed", "synchronize", "agree_on_masks", "replica_mean", "save_checkpoint",
           "load_checkpoint", "checkpoint_ranks", "resize_ranks"]
