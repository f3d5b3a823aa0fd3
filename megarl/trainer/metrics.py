"""The numbers a training step logs, one pure function per source (DESIGN.md, the "log" phase).

    reward/*, response_length/*, rollout/filter_rounds   the step's rollouts and their scores
    sync/*                                               the weight sync into the rollout engine
    actor/*, critic/*                                    the mean over an update's optimizer steps
    rollout/entropy, throughput/tokens_per_s             the scored batch and the step's time
"""

from __future__ import annotations

import math
from statistics import mean

import torch

from megarl.engine.batch import SequenceBatch
from megarl.resharding.executor import SyncStats
from megarl.trainer.rollouts import Rollouts


def rollout_metrics(rollouts: Rollouts, batch: SequenceBatch, scores: torch.Tensor, rounds: int) -> dict[str, float]:
    """Rewards (`scores`: the reward function's plus any reward model's), lengths and reward extras."""
    lengths = batch.response_lengths_B.float()
    metrics = {
        "reward/mean": float(scores.mean()), "reward/max": float(scores.max()), "reward/min": float(scores.min()),
        "reward/function_mean": mean(rollouts.scores),  # before the reward model's score is added
        "reward/errors": float(rollouts.num_reward_errors), "reward/timeouts": float(rollouts.num_reward_timeouts),
        "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": mean(r == "length" for r in rollouts.finish_reasons),
        "rollout/filter_rounds": float(rounds),
    }
    for key, values in rollouts.score_extras.items():
        finite = [v for v in values if not math.isnan(v)]
        if finite:
            metrics[f"reward/{key}"] = mean(finite)
    return metrics


def sync_metrics(sync: SyncStats | None) -> dict[str, float]:
    """None: the step reused the engine's weights (synced by the validation before it)."""
    if sync is None:
        return {}
    return {"sync/seconds": sync.seconds, "sync/bytes_received": float(sync.bytes_received),
            "sync/bytes_over_lower_bound": sync.bytes_received / max(sync.lower_bound, 1)}


def update_metrics(prefix: str, history: list[dict[str, float]]) -> dict[str, float]:
    """Each metric of an update averaged over its optimizer steps; bare names get `prefix/`."""
    return {key if "/" in key else f"{prefix}/{key}": mean(h[key] for h in history)
            for key in (history[0] if history else ())}


def batch_metrics(batch: SequenceBatch, entropy_BR: torch.Tensor, seconds: float) -> dict[str, float]:
    """The policy's entropy on the rollout's tokens, and all tokens of the step per second."""
    mask_BR = batch.response_mask_BR
    return {"rollout/entropy": float((entropy_BR * mask_BR).sum() / mask_BR.sum()),
            "throughput/tokens_per_s": int(batch.sequence_lengths_B.sum()) / max(seconds, 1e-9)}
