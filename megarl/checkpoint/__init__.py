"""Sharded checkpoints that never lose work: atomic publication, exact resume, retention."""

from megarl.checkpoint.checkpointer import Checkpointer
from megarl.checkpoint.directory import CheckpointError

__all__ = ["CheckpointError", "Checkpointer"]
