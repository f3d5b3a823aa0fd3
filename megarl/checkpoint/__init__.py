"""Sharded checkpoints that never lose work: atomic publication, exact resume, retention."""

from megarl.checkpoint import safe_metadata
from megarl.checkpoint.checkpointer import Checkpointer
from megarl.checkpoint.directory import CheckpointError

safe_metadata.install()

__all__ = ["CheckpointError", "Checkpointer"]
