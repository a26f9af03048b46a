"""Checkpoints that cannot lie: atomic files, a checksummed manifest, rotation, safe loads, sharded folders.

The engine talks to :class:`~gputrain.checkpoint.checkpointer.Checkpointer` alone. Inside, lowest first:
:mod:`~gputrain.checkpoint.files` (durable temporaries, atomic writes, what may go into a file),
:mod:`~gputrain.checkpoint.manifest` (sizes and CRCs, checks of a file against them or its own),
:mod:`~gputrain.checkpoint.store` (a run's folder: names, crash order, rotation, ``last.pt``/``best.pt``),
:mod:`~gputrain.checkpoint.load` (safe reads), :mod:`~gputrain.checkpoint.snapshot` (the background writer),
:mod:`~gputrain.checkpoint.sharded` (DCP folders) and :mod:`~gputrain.checkpoint.state` (what a checkpoint holds).
The names below are the ones users call.
"""

from gputrain.checkpoint.files import atomic_save, remove_stale_temporaries
from gputrain.checkpoint.load import load_checkpoint, model_weights, verify
from gputrain.checkpoint.store import CheckpointStore

__all__ = ["CheckpointStore", "atomic_save", "load_checkpoint", "model_weights", "remove_stale_temporaries", "verify"]
