"""Sharded checkpoints that never lose work: atomic publication, exact resume, retention.

Checkpoint metadata is read through a restricted unpickler, installed when the process joins its
world (`megarl.distributed.process`)."""

from megarl.checkpoint.checkpointer import Checkpointer
from megarl.checkpoint.directory import CheckpointError

__all__ = ["CheckpointError", "Checkpointer"]
