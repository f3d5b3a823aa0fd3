"""Generation across the colocated engines, and the batch every rank then holds.

Engines are replicas of TP_r consecutive ranks; of K replicas, replica k generates for the k-th of K
contiguous blocks of the step's prompts and scores its responses with the reward function. Prompt g
of the step samples with seed `sampling.seed + g` on whichever replica holds it, so the responses do
not depend on the layout (TP1 and TP2xPP2xDP2 runs of one seed sample the same tokens from the same
weights). One all-gather then gives every rank all responses, in prompt order, n per prompt
(prompt-major).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from megarl.data.dataset import Prompt
from megarl.engine.batch import SequenceBatch, right_pad
from megarl.rewards.manager import RewardFunctionError, RewardManager, ScoringItem
from megarl.rollout.base import RolloutEngine, Sampling


@dataclass
class Rollouts:
    prompts: list[Prompt] = field(default_factory=list)
    """The prompt of each sequence (each prompt appears n times, consecutively)."""
    group_ids: list[int] = field(default_factory=list)
    """Sequences of the same prompt share a group id (GRPO's groups)."""
    response_ids: list[list[int]] = field(default_factory=list)
    rollout_logprobs: list[list[float]] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    score_extras: dict[str, list[float]] = field(default_factory=dict)
    num_reward_errors: int = 0
    num_reward_timeouts: int = 0
    first_reward_failure: str | None = None
    """One line describing the first reward call that failed or timed out."""

    def __len__(self) -> int:
        return len(self.response_ids)

    def select(self, indices: list[int]) -> Rollouts:
        pick = lambda values: [values[i] for i in indices]  # noqa: E731
        return replace(self, prompts=pick(self.prompts), group_ids=pick(self.group_ids),
                       response_ids=pick(self.response_ids), rollout_logprobs=pick(self.rollout_logprobs),
                       finish_reasons=pick(self.finish_reasons), scores=pick(self.scores),
                       score_extras={k: pick(v) for k, v in self.score_extras.items()})

    def extend(self, other: Rollouts) -> None:
        self.score_extras = _aligned_extras([self, other])
        offset = max(self.group_ids, default=-1) + 1
        self.prompts += other.prompts
        self.group_ids += [g + offset for g in other.group_ids]
        self.response_ids += other.response_ids
        self.rollout_logprobs += other.rollout_logprobs
        self.finish_reasons += other.finish_reasons
        self.scores += other.scores
        self.num_reward_errors += other.num_reward_errors
        self.num_reward_timeouts += other.num_reward_timeouts
        self.first_reward_failure = self.first_reward_failure or other.first_reward_failure

    def require_rewards(self) -> None:
        """Raise when no reward call succeeded: training on all-zero rewards teaches nothing, and a
        reward function that fails on every response is broken, not unlucky."""
        if len(self) and self.num_reward_errors + self.num_reward_timeouts == len(self):
            raise RewardFunctionError(f"all {len(self)} reward calls failed ({self.num_reward_errors} errors, "
                                      f"{self.num_reward_timeouts} timeouts); first: {self.first_reward_failure}")

    def to_batch(self, pad_token_id: int) -> SequenceBatch:
        """Prompt + response token sequences, right-padded, with the engine's log-probs aligned."""
        return SequenceBatch.from_sequences([p.prompt_ids for p in self.prompts], self.response_ids, pad_token_id,
                                            {"rollout_logprobs": right_pad(self.rollout_logprobs, 0.0, torch.float32)})


def collect_rollouts(prompts: list[Prompt], engine: RolloutEngine, sampling: Sampling, engine_tp: int,
                     tokenizer, rewards: RewardManager) -> Rollouts:
    """Generate and score `sampling.n` responses per prompt on the engine replicas; all ranks return all."""
    rank, world = dist.get_rank(), dist.get_world_size()
    replica, num_replicas = rank // engine_tp, world // engine_tp
    start = replica * len(prompts) // num_replicas
    mine = list(range(start, (replica + 1) * len(prompts) // num_replicas))
    local = Rollouts()
    if mine:
        # The engine samples request i with seed + i: request i is the step's prompt start + i.
        output = engine.generate([prompts[i].prompt_ids for i in mine], replace(sampling, seed=sampling.seed + start))
        local.prompts = [prompts[i] for i in mine for _ in range(sampling.n)]
        local.group_ids = [i for i in mine for _ in range(sampling.n)]
        local.response_ids, local.rollout_logprobs = output.response_ids, output.logprobs
        local.finish_reasons = output.finish_reasons
        texts = tokenizer.batch_decode(output.response_ids, skip_special_tokens=True)
        result = rewards.score([ScoringItem(p.data_source, text, p.ground_truth, p.extra_info)
                                for p, text in zip(local.prompts, texts)])
        local.scores, local.score_extras = result.scores, result.extra
        local.num_reward_errors, local.num_reward_timeouts = result.num_errors, result.num_timeouts
        local.first_reward_failure = result.first_error
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    return merge_replicas(gathered[::engine_tp])  # one copy per engine replica


def merge_replicas(replicas: list[Rollouts]) -> Rollouts:
    """The replicas' rollouts in one batch, prompt-major (sorted by group id).

    Extra reward metrics one replica's scorer returned and another's did not (a dict key present only
    for some responses) are NaN where absent, so every metric stays aligned with the sequences."""
    extras = _aligned_extras(replicas)
    merged = Rollouts()
    order = sorted((group, k, j) for k, part in enumerate(replicas) for j, group in enumerate(part.group_ids))
    starts = [sum(len(part) for part in replicas[:k]) for k in range(len(replicas))]
    for group, k, j in order:
        part = replicas[k]
        merged.prompts.append(part.prompts[j])
        merged.group_ids.append(group)
        merged.response_ids.append(part.response_ids[j])
        merged.rollout_logprobs.append(part.rollout_logprobs[j])
        merged.finish_reasons.append(part.finish_reasons[j])
        merged.scores.append(part.scores[j])
        for key, values in extras.items():
            merged.score_extras.setdefault(key, []).append(values[starts[k] + j])
    merged.num_reward_errors = sum(p.num_reward_errors for p in replicas)
    merged.num_reward_timeouts = sum(p.num_reward_timeouts for p in replicas)
    merged.first_reward_failure = next((p.first_reward_failure for p in replicas if p.first_reward_failure), None)
    return merged


def _aligned_extras(parts: list[Rollouts]) -> dict[str, list[float]]:
    """The parts' extra metrics concatenated, NaN for the sequences of a part that lacks a key."""
    keys = sorted({key for part in parts for key in part.score_extras})
    return {key: [value for part in parts for value in part.score_extras.get(key, [math.nan] * len(part))]
            for key in keys}
