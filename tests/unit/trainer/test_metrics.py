"""Step metrics: each source's numbers against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.data.dataset import Prompt
from megarl.engine.batch import SequenceBatch
from megarl.generation.rollouts import Rollouts
from megarl.trainer.metrics import (
    ShareStats,
    batch_stats,
    mismatch_stats,
    reward_call_metrics,
    rollout_stats,
    throughput,
    update_metrics,
)


def _rollouts() -> tuple[Rollouts, SequenceBatch]:
    prompt = Prompt([7, 8], "arithmetic", "3", {}, 0)
    rollouts = Rollouts(prompts=[prompt] * 3, group_ids=[0, 0, 0], replicas=[0, 0, 0], response_lengths=[1, 3, 2],
                        response_ids=[[1], [1, 2, 3], [4, 5]],
                        rollout_logprobs=[[-1.0], [-1.0] * 3, [-1.0] * 2], finish_reasons=["stop", "length", "stop"],
                        scores=[1.0, 0.0, 0.5], score_extras={"acc": [1.0, math.nan, 0.0]}, num_reward_errors=1)
    return rollouts, rollouts.to_batch(pad_token_id=0)


def test_rollout_metrics_by_hand():
    rollouts, batch = _rollouts()
    stats = ShareStats()
    rollout_stats(stats, rollouts, batch, torch.tensor([1.5, 0.5, 1.0]))
    metrics = {**stats.values(), **reward_call_metrics(rollouts)}
    assert metrics["reward/mean"] == 1.0 and metrics["reward/max"] == 1.5 and metrics["reward/min"] == 0.5
    assert metrics["reward/function_mean"] == 0.5 and metrics["reward/errors"] == 1.0
    assert metrics["response_length/mean"] == 2.0 and metrics["response_length/max"] == 3.0
    assert metrics["response_length/clip_ratio"] == 1 / 3
    assert metrics["reward/acc"] == 0.5  # the NaN of a reward call without that extra is left out


def test_sync_update_and_batch_metrics_by_hand():
    history = [{"pg_loss": 1.0, "actor/x": 2.0, "moe/z_loss": 0.5}, {"pg_loss": 3.0, "actor/x": 4.0, "moe/z_loss": 1.5}]
    assert update_metrics("actor", history) == {"actor/pg_loss": 2.0, "actor/x": 3.0, "actor/moe/z_loss": 1.0}
    assert update_metrics("critic", []) == {}
    _, batch = _rollouts()
    entropy_BR = torch.tensor([[1.0, 9.0, 9.0], [2.0, 2.0, 2.0], [4.0, 4.0, 9.0]])  # 9s sit in the padding
    stats = ShareStats()
    batch_stats(stats, batch, entropy_BR)
    metrics = stats.values()
    assert metrics["rollout/entropy"] == (1 + 6 + 8) / 6
    assert metrics["throughput/tokens"] == 3 + 5 + 4
    assert throughput(metrics, seconds=2.0) == {"throughput/tokens_per_s": (3 + 5 + 4) / 2.0}
    # The engine's log-probs 0.5 below the trainer's on every response token (padding differs more).
    train_BR = torch.tensor([[-1.0, 0.0, 0.0], [-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    rollout_BR = train_BR - 0.5 + 5.0 * (1 - batch.response_mask_BR)
    stats = ShareStats()
    mismatch_stats(stats, train_BR, rollout_BR, batch.response_mask_BR)
    metrics = stats.values()
    assert metrics["mismatch/logprob_abs_diff_mean"] == metrics["mismatch/logprob_abs_diff_max"] == 0.5
    assert metrics["mismatch/kl"] == pytest.approx(math.exp(0.5) - 1 - 0.5)  # k3 at log-ratio 0.5
