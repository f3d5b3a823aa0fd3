"""Who runs what: the one interface the trainer drives, whatever the placement.

    placement.start(start_step, sampler_state, saved)   # where the run starts (a resumed run's saved state)
    made = placement.rollouts(step, timer)              # the step's scored rollouts, and how they were made
    metrics = placement.validate(step)                  # validation of the weights as they are now
    state = placement.checkpoint_state()                # what a checkpoint must hold to resume this placement
    placement.shutdown()

Colocated (`megarl.placement.colocated`): every rank trains and, between updates, generates on the
engine replica it shares memory with. Split (`megarl.placement.split`): the last ranks of the world
only generate, while the others train on batches at most `trainer.max_staleness` versions old.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

import torch

from megarl.generation.rollouts import Rollouts
from megarl.resharding.executor import SyncStats
from megarl.tracking.timing import PhaseTimer


@dataclass
class StepRollouts:
    """A step's scored rollouts, as the placement made them."""

    rollouts: Rollouts
    """Every sequence's scores and lengths; a response is held where the placement made it, not yet where it trains."""
    move: Callable[[Rollouts, list[list[int]]], None]
    """`move(rollouts, wanted)` makes trainer rank r hold the responses of sequences `wanted[r]` (every trainer
    rank calls it): from the colocated engine replicas that generated them, or from the rollout ranks."""
    metrics: dict[str, float] = field(default_factory=dict)
    """How they were made: filter rounds, the weight sync before them, staleness."""
    greedy_baseline_B: torch.Tensor | None = None
    """ReMax: the reward of a greedy response to each sequence's prompt; None when the estimator needs none."""


class Placement(ABC):
    @abstractmethod
    def start(self, start_step: int, sampler_state: dict, saved: dict) -> None:
        """The run starts at `start_step`, with the training sampler at `sampler_state` and this placement's
        `checkpoint_state()` of the checkpoint resumed (rank 0's, which the checkpoint holds: empty on the other
        ranks and on a fresh start)."""

    @abstractmethod
    def rollouts(self, step: int, timer: PhaseTimer) -> StepRollouts:
        """The rollouts step `step` trains on: the sampler's next batch of prompts, sampled and scored."""

    @abstractmethod
    def validate(self, step: int) -> dict[str, float]:
        """Validation metrics (`val/...`) of the training weights as they are after step `step`."""

    @abstractmethod
    def checkpoint_state(self) -> dict:
        """What a checkpoint of this step must hold for `start` to resume the placement exactly (rank 0's is
        written, `placement.pt`)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the engines."""


def sync_metrics(sync: SyncStats | None) -> dict[str, float]:
    """A weight sync's metrics; none when the step reused the engine's weights (synced by the validation before it)."""
    if sync is None:
        return {}
    return {"sync/seconds": sync.seconds, "sync/bytes_received": float(sync.bytes_received),
            "sync/bytes_over_lower_bound": sync.bytes_received / max(sync.lower_bound, 1)}
