"""The numbers a training step logs, one pure function per source (DESIGN.md, the "log" phase).

    reward/*, response_length/*                          the step's rollouts and their scores
    agent/*                                              multi-turn trajectories: turns, tool calls and
                                                         errors, the share that called a tool, tokens by
                                                         source (model, environment)
    actor/*, critic/*                                    the mean over an update's optimizer steps
                                                         (with actor/moe/*: expert load, router losses,
                                                         routing agreement with the rollout engine)
    mismatch/*                                           trainer vs. rollout engine log-probs
    rollout/entropy, throughput/tokens                   the scored batch (throughput/tokens_per_s: its
                                                         tokens over the step's wall clock, `throughput`)

(The placement adds how the rollouts were made: sync/*, rollout/filter_rounds, rollout/staleness.)

Each DP rank holds its share of the batch, so the batch's numbers are gathered as `ShareStats`
(sums, means as sum and count, maxima, minima) and combined over DP in three all-reduces; the TP
and PP ranks of a DP rank hold the same share, so a reduction over the DP group counts it once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import mean

import torch
import torch.distributed as dist

from megarl.algorithms.importance import rollout_mismatch_tokens
from megarl.distributed import collectives
from megarl.engine.batch import SequenceBatch
from megarl.generation.rollouts import Rollouts


@dataclass
class ShareStats:
    sums: dict[str, float] = field(default_factory=dict)
    means: dict[str, tuple[float, float]] = field(default_factory=dict)
    """name -> (sum, count): the mean over all shares' values; left out when no share has a value."""
    maxima: dict[str, float] = field(default_factory=dict)
    minima: dict[str, float] = field(default_factory=dict)

    def add_mean(self, name: str, values: torch.Tensor) -> None:
        self.means[name] = (float(values.double().sum()), float(values.numel()))

    def add_range(self, name: str, values: torch.Tensor) -> None:
        """`name`/max and `name`/min."""
        self.maxima[f"{name}/max"] = float(values.max()) if values.numel() else -math.inf
        self.minima[f"{name}/min"] = float(values.min()) if values.numel() else math.inf

    def reduce(self, group: dist.ProcessGroup) -> ShareStats:
        """The statistics of all DP ranks' shares together (the same on every rank)."""
        totals = torch.tensor([*self.sums.values(), *(v for pair in self.means.values() for v in pair)],
                              dtype=torch.float64)
        maxima = torch.tensor(list(self.maxima.values()), dtype=torch.float64)
        minima = torch.tensor(list(self.minima.values()), dtype=torch.float64)
        for tensor, op in ((totals, dist.ReduceOp.SUM), (maxima, dist.ReduceOp.MAX), (minima, dist.ReduceOp.MIN)):
            collectives.all_reduce(tensor, op=op, group=group)
        totals = totals.tolist()
        sums, pairs = totals[: len(self.sums)], totals[len(self.sums) :]
        return ShareStats(dict(zip(self.sums, sums)),
                          {name: (pairs[2 * i], pairs[2 * i + 1]) for i, name in enumerate(self.means)},
                          dict(zip(self.maxima, maxima.tolist())), dict(zip(self.minima, minima.tolist())))

    def values(self) -> dict[str, float]:
        means = {name: total / count for name, (total, count) in self.means.items() if count}
        return {**self.sums, **means, **self.maxima, **self.minima}


def rollout_stats(stats: ShareStats, rollouts: Rollouts, batch: SequenceBatch, scores: torch.Tensor) -> None:
    """Rewards (`scores`: the reward function's plus any reward model's), lengths and reward extras."""
    stats.add_mean("reward/mean", scores)
    stats.add_range("reward", scores)
    stats.add_mean("reward/function_mean", torch.tensor(rollouts.scores))  # before the reward model's score
    lengths = batch.response_lengths_B.float()
    stats.add_mean("response_length/mean", lengths)
    stats.maxima["response_length/max"] = float(lengths.max())
    stats.add_mean("response_length/clip_ratio", torch.tensor([r == "length" for r in rollouts.finish_reasons]))
    for key, values in rollouts.score_extras.items():
        values = torch.tensor(values)
        stats.add_mean(f"reward/{key}", values[~values.isnan()])  # NaN: a reward call without that extra
    if rollouts.trajectory_stats:
        trajectory_stats(stats, rollouts, batch)


def trajectory_stats(stats: ShareStats, rollouts: Rollouts, batch: SequenceBatch) -> None:
    """Means per trajectory of turns, tool calls, tool errors and tokens by source."""
    for key, values in rollouts.trajectory_stats.items():
        stats.add_mean(f"agent/{key}", torch.tensor(values))
    stats.add_mean("agent/tool_call_share", torch.tensor(rollouts.trajectory_stats["tool_calls"]) > 0)
    model_tokens_B = batch.response_mask_BR.sum(1)
    stats.add_mean("agent/model_tokens", model_tokens_B)
    stats.add_mean("agent/environment_tokens", batch.response_lengths_B - model_tokens_B)


def reward_call_metrics(rollouts: Rollouts) -> dict[str, float]:
    """The whole step's failed reward calls (the same on every rank)."""
    return {"reward/errors": float(rollouts.num_reward_errors), "reward/timeouts": float(rollouts.num_reward_timeouts)}


def mismatch_stats(stats: ShareStats, train_logprobs_BR: torch.Tensor, rollout_logprobs_BR: torch.Tensor,
                   mask_BR: torch.Tensor) -> None:
    """`mismatch/*` (`megarl.algorithms.importance`): the trainer's log-probs against the engine's."""
    tokens = rollout_mismatch_tokens(train_logprobs_BR, rollout_logprobs_BR, mask_BR)
    stats.add_mean("mismatch/logprob_abs_diff_mean", tokens["abs_diff"])
    abs_diff = tokens["abs_diff"]
    stats.maxima["mismatch/logprob_abs_diff_max"] = float(abs_diff.max()) if abs_diff.numel() else 0.0
    stats.add_mean("mismatch/kl", tokens["kl"])


def batch_stats(stats: ShareStats, batch: SequenceBatch, entropy_BR: torch.Tensor | None) -> None:
    """The policy's entropy on the rollout's tokens (None: not computed), and the share's prompt + response
    tokens (summed over the shares: the step's)."""
    if entropy_BR is not None:
        stats.add_mean("rollout/entropy", entropy_BR[batch.response_mask_BR > 0])
    stats.sums["throughput/tokens"] = int(batch.sequence_lengths_B.sum())


def throughput(metrics: dict[str, float], seconds: float) -> dict[str, float]:
    """The step's tokens per second of its wall clock."""
    return {"throughput/tokens_per_s": metrics["throughput/tokens"] / max(seconds, 1e-9)}


def update_metrics(prefix: str, history: list[dict[str, float]]) -> dict[str, float]:
    """Each metric of an update averaged over its optimizer steps, named `prefix/...` (the engine's own,
    e.g. `grad_norm` or `moe/z_loss`, get the prefix; the loss function's carry it already)."""
    return {key if key.startswith(f"{prefix}/") else f"{prefix}/{key}": mean(h[key] for h in history)
            for key in (history[0] if history else ())}
