"""Validation: held-out prompts, mean score per data source, and pass@k over k samples."""

from __future__ import annotations

from collections import defaultdict

from megarl.generation.rollouts import Rollouts


def pass_at_k(group_ids: list[int], scores: list[float]) -> float:
    """The fraction of prompts (groups of samples) with at least one sample scoring >= 1."""
    solved: dict[int, bool] = defaultdict(bool)
    for group, score in zip(group_ids, scores):
        solved[group] |= score >= 1.0
    return sum(solved.values()) / len(solved)


def validation_metrics(rollouts: Rollouts, k: int) -> dict[str, float]:
    """`val/score/<source>` (mean over all samples), `val/score/mean`, `val/pass@k` when k > 1, and for
    multi-turn rollouts the share of trajectories that called a tool and the mean number of turns."""
    by_source: dict[str, list[float]] = defaultdict(list)
    for prompt, score in zip(rollouts.prompts, rollouts.scores):
        by_source[prompt.data_source].append(score)
    metrics = {f"val/score/{source}": sum(s) / len(s) for source, s in sorted(by_source.items())}
    metrics["val/score/mean"] = sum(rollouts.scores) / len(rollouts.scores)
    if k > 1:
        metrics[f"val/pass@{k}"] = pass_at_k(rollouts.group_ids, rollouts.scores)
    if rollouts.trajectory_stats:  # multi-turn: how often the model calls its tools
        calls = rollouts.trajectory_stats["tool_calls"]
        metrics["val/agent/tool_call_share"] = sum(c > 0 for c in calls) / len(calls)
        metrics["val/agent/turns"] = sum(rollouts.trajectory_stats["turns"]) / len(calls)
    return metrics
