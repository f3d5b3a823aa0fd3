"""Generation across the colocated engines: the step's responses, scored once, and where they live.

Engines are replicas of TP_r consecutive ranks; replica k of K generates for the k-th of K
contiguous blocks of the step's prompts. A prompt's samples are seeded by its position in the step
(request i of a call samples with `Sampling.seed + i`, and a block starting at prompt s calls with
seed + s), so they do not depend on the number of replicas: DP1 and DP2 generate the same responses.
The replica's first rank alone decodes and scores them, so the reward function sees every response
once whatever TP_r is.

Every rank then learns each response's score, extra reward metrics, length and finish reason from
one all-reduce of a (B, 3 + extras) table: O(B) numbers, enough for group filtering, baselines,
validation and deciding who trains on what. The responses themselves (token ids and the engine's
log-probs, and for mixture-of-experts models the experts each token was routed to) stay on the
ranks of the replica that generated them until `move_responses` sends each to the ranks that need
it, in one all-to-all of tensors (`pack_responses`). Nothing pickles the batch: only the
extra metrics' names and the first reward failure's message travel as objects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

import torch
import torch.distributed as dist

from megarl.config.schema import RunConfig
from megarl.data.dataset import Prompt
from megarl.distributed import collectives
from megarl.engine.batch import ResponseTensors, SequenceBatch, right_pad
from megarl.rewards.manager import RewardFunctionError, RewardManager, RewardResult, ScoringItem
from megarl.rollout.base import RolloutEngine, RolloutOutput, Sampling
from megarl.seeding import derive_seed


def column():
    """A per-sequence column of `Rollouts` (one value per sequence; left empty when the run has none of it)."""
    return field(default_factory=list, metadata={"per_sequence": "column"})


def named_columns():
    """Per-sequence columns by name (a reward function's extra metrics, multi-turn counts)."""
    return field(default_factory=dict, metadata={"per_sequence": "named"})


@dataclass
class Rollouts:
    """The sequences of a step (or a validation): per-sequence columns, and counts over all of them."""

    prompts: list[Prompt] = column()
    """The prompt of each sequence (each prompt appears n times, consecutively)."""
    group_ids: list[int] = column()
    """Sequences of the same prompt share a group id (GRPO's groups)."""
    replicas: list[int] = column()
    """The engine replica that generated each sequence (whose ranks hold its response)."""
    response_lengths: list[int] = column()
    response_ids: list[list[int] | None] = column()
    """None where this rank does not hold the response (`move_responses`)."""
    rollout_logprobs: list[list[float] | None] = column()
    routed_experts: list[torch.Tensor | None] = column()
    """Mixture-of-experts models: the (P + R - 1, L, k) experts the engine routed each sequence's
    tokens to (`RolloutOutput.routed_experts`); None where not held; empty for dense models."""
    routed_experts_shape: tuple[int, int] | None = None
    """(L, k) of `routed_experts`; None for dense models."""
    finish_reasons: list[str] = column()
    scores: list[float] = column()
    score_extras: dict[str, list[float]] = named_columns()
    num_reward_errors: int = 0
    num_reward_timeouts: int = 0
    first_reward_failure: str | None = None
    """One line describing the first reward call that failed or timed out."""
    loss_masks: list[list[int] | None] = column()
    """Multi-turn rollouts (`megarl.generation.multi_turn`): 1 on each response's model tokens, 0 on its
    environment's; None where not held; empty for single-turn rollouts."""
    openings: list[list[int] | None] = column()
    """Multi-turn rollouts: each trajectory's opening (its environment's first messages, rendered), which its
    response continues in place of its prompt's `prompt_ids`; held with the response (None where not held);
    empty for single-turn rollouts."""
    opening_lengths: list[int] = column()
    """Multi-turn rollouts: the length of every trajectory's opening, on every rank."""
    messages: list[list[dict] | None] = column()
    """Multi-turn rollouts: each trajectory's conversation, held by its replica's first rank (None
    elsewhere); empty for single-turn rollouts."""
    trajectory_stats: dict[str, list[float]] = named_columns()
    """Multi-turn rollouts: per-trajectory counts (turns, tool calls, tool errors, model tokens) on every rank."""
    token_versions: list[list[int] | None] = column()
    """Split placement: the policy version that sampled each response token (v: the weights after RL step v,
    0 the initial ones; a partial rollout's response may span several); empty where the engine always holds
    the trainer's current weights (colocated)."""

    def __len__(self) -> int:
        return len(self.group_ids)

    def select(self, indices: list[int]) -> Rollouts:
        """The sequences at `indices`, in that order, every column following."""
        picked = {}
        for name, kind in _columns():
            values = getattr(self, name)
            picked[name] = ({key: [column[i] for i in indices] for key, column in values.items()} if kind == "named"
                            else [values[i] for i in indices] if values else [])
        return replace(self, **picked)

    def extend(self, other: Rollouts) -> None:
        """`other`'s sequences after these, in new groups: every column concatenated (a named column one part
        lacks reads NaN there), the counts added."""
        length, offset = len(self), max(self.group_ids, default=-1) + 1
        for name, kind in _columns():
            mine, theirs = getattr(self, name), getattr(other, name)
            setattr(self, name, _aligned(mine, theirs, length, len(other)) if kind == "named" else mine + theirs)
        self.group_ids[length:] = [g + offset for g in other.group_ids]
        self.routed_experts_shape = self.routed_experts_shape or other.routed_experts_shape
        self.num_reward_errors += other.num_reward_errors
        self.num_reward_timeouts += other.num_reward_timeouts
        self.first_reward_failure = self.first_reward_failure or other.first_reward_failure

    def require_rewards(self) -> None:
        """Raise when no reward call succeeded: training on all-zero rewards teaches nothing, and a
        reward function that fails on every response is broken, not unlucky."""
        if len(self) and self.num_reward_errors + self.num_reward_timeouts == len(self):
            raise RewardFunctionError(f"all {len(self)} reward calls failed ({self.num_reward_errors} errors, "
                                      f"{self.num_reward_timeouts} timeouts); first: {self.first_reward_failure}")

    def prompt_ids(self, index: int) -> list[int]:
        """The tokens sequence `index`'s response continues: its trajectory's opening, or its prompt's."""
        return self.openings[index] if self.openings else self.prompts[index].prompt_ids

    def prompt_length(self, index: int) -> int:
        """`len(self.prompt_ids(index))`, on every rank."""
        return self.opening_lengths[index] if self.opening_lengths else len(self.prompts[index].prompt_ids)

    def to_batch(self, pad_token_id: int) -> SequenceBatch:
        """Prompt + response token sequences, right-padded, with the engine's log-probs aligned, its
        routing and the loss masks of multi-turn rollouts, if any (all responses must be held here)."""
        tensors = ResponseTensors(rollout_logprobs_BR=right_pad(self.rollout_logprobs, 0.0, torch.float32))
        return SequenceBatch.from_sequences([self.prompt_ids(i) for i in range(len(self))], self.response_ids,
                                            pad_token_id, tensors, self.routed_experts or None, self.loss_masks or None)


def rollout_sampling(config: RunConfig, eos_token_id: int | None, step: int, validation: bool,
                     draw: int = 0) -> Sampling:
    """Sampling of one engine call of a run; `draw` numbers the calls of one step (DAPO's filter rounds)."""
    rollout, seed = config.rollout, config.trainer.seed
    stop = (eos_token_id,) if eos_token_id is not None else ()
    if validation:
        return Sampling(n=rollout.val_n, temperature=rollout.val_temperature, top_p=rollout.top_p,
                        top_k=rollout.top_k, max_tokens=config.data.max_response_length,
                        stop_token_ids=stop, seed=derive_seed(seed, "validation"))
    return Sampling(n=rollout.n, temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                    max_tokens=config.data.max_response_length, stop_token_ids=stop,
                    seed=derive_seed(seed, "rollout", step=step, draw=draw))


def collect_rollouts(prompts: list[Prompt], engine: RolloutEngine, sampling: Sampling, engine_tp: int,
                     tokenizer, rewards: RewardManager) -> Rollouts:
    """Generate and score `sampling.n` responses per prompt on the engine replicas. Every rank
    returns every sequence's scores; the responses are held by their replica's ranks."""
    rank, n = dist.get_rank(), sampling.n
    rollouts, (start, stop) = unfilled_rollouts(prompts, n, engine_tp)
    rollouts.routed_experts_shape = engine.routed_experts_shape
    num_sequences = len(rollouts)
    if engine.routed_experts_shape is not None:
        rollouts.routed_experts = [None] * num_sequences
    output, result = RolloutOutput(), None
    if stop > start:
        output = engine.generate([p.prompt_ids for p in prompts[start:stop]],
                                 replace(sampling, seed=sampling.seed_of(start)))
        rollouts.response_ids[start * n : stop * n] = output.response_ids
        rollouts.rollout_logprobs[start * n : stop * n] = output.logprobs
        if engine.routed_experts_shape is not None:
            rollouts.routed_experts[start * n : stop * n] = output.routed_experts
        if rank % engine_tp == 0:  # the replica's other ranks hold the same responses
            result = score_generated(prompts[start:stop], output, n, tokenizer, rewards)
    share_scores(rollouts, output, result, start * n)
    return rollouts


def score_generated(prompts: list[Prompt], output: RolloutOutput, n: int, tokenizer,
                    rewards: RewardManager) -> RewardResult:
    """`output`'s responses (`n` per prompt of `prompts`, prompt-major) decoded and scored."""
    texts = tokenizer.batch_decode(output.response_ids, skip_special_tokens=True)
    prompt_texts = tokenizer.batch_decode([p.prompt_ids for p in prompts], skip_special_tokens=True)
    return score_responses(rewards, [p for p in prompts for _ in range(n)], texts,
                           [text for text in prompt_texts for _ in range(n)])


def score_responses(rewards: RewardManager, prompts: list[Prompt], texts: list[str],
                    prompt_texts: list[str] | None = None) -> RewardResult:
    """Each response text scored against its prompt's ground truth (a failure names the prompt's file and row);
    `prompt_texts`: the prompts' texts, for a judge (multi-turn rollouts pass none: a judge is refused there)."""
    prompt_texts = prompt_texts or [""] * len(prompts)
    return rewards.score([ScoringItem(prompt.data_source, text, prompt.ground_truth, prompt.extra_info, prompt.origin,
                                      prompt_text) for prompt, text, prompt_text in zip(prompts, texts, prompt_texts)])


def unfilled_rollouts(prompts: list[Prompt], n: int, engine_tp: int) -> tuple[Rollouts, tuple[int, int]]:
    """The step's sequences before generation (no response held), and the block of prompts
    [start, stop) this rank's replica generates."""
    blocks = replica_blocks(len(prompts), engine_tp)
    num_sequences = len(prompts) * n
    rollouts = Rollouts(prompts=[p for p in prompts for _ in range(n)],
                        group_ids=[i for i in range(len(prompts)) for _ in range(n)],
                        replicas=[k for k, (first, end) in enumerate(blocks) for _ in range((end - first) * n)],
                        response_ids=[None] * num_sequences, rollout_logprobs=[None] * num_sequences)
    return rollouts, blocks[dist.get_rank() // engine_tp]


def replica_blocks(count: int, engine_tp: int) -> list[tuple[int, int]]:
    """[start, stop) of each engine replica's contiguous block of `count` items, replica k the k-th."""
    num_replicas = dist.get_world_size() // engine_tp
    return [(k * count // num_replicas, (k + 1) * count // num_replicas) for k in range(num_replicas)]


def share_scores(rollouts: Rollouts, output: RolloutOutput, result: RewardResult | None, first: int,
                  trajectory_stats: dict[str, list[float]] | None = None) -> None:
    """Every sequence's score, length, finish reason, extras (and multi-turn counts) onto every rank:
    each replica's scoring rank fills its rows of a zero table, and one all-reduce sums them."""
    stat_keys = sorted(trajectory_stats or {})
    summary = (sorted(result.extra), result.first_error) if result is not None else ([], None)
    summaries = collectives.all_gather_object(summary)
    keys = sorted({key for names, _ in summaries for key in names})
    # score, length, truncated, extras, multi-turn counts
    table = torch.zeros(len(rollouts), 3 + len(keys) + len(stat_keys), dtype=torch.float64)
    counts = torch.zeros(2, dtype=torch.float64)
    if result is not None:
        rows = slice(first, first + len(result.scores))
        table[rows, 0] = torch.tensor(result.scores, dtype=torch.float64)
        table[rows, 1] = torch.tensor([len(ids) for ids in output.response_ids], dtype=torch.float64)
        table[rows, 2] = torch.tensor([reason == "length" for reason in output.finish_reasons], dtype=torch.float64)
        for column, key in enumerate(keys, start=3):
            values = result.extra.get(key, [math.nan] * len(result.scores))
            table[rows, column] = torch.tensor(values, dtype=torch.float64)
        for column, key in enumerate(stat_keys, start=3 + len(keys)):
            table[rows, column] = torch.tensor(trajectory_stats[key], dtype=torch.float64)
        counts[:] = torch.tensor([result.num_errors, result.num_timeouts])
    collectives.all_reduce(table)
    collectives.all_reduce(counts)
    rollouts.scores = table[:, 0].tolist()
    rollouts.response_lengths = table[:, 1].long().tolist()
    rollouts.finish_reasons = ["length" if truncated else "stop" for truncated in table[:, 2].tolist()]
    rollouts.score_extras = {key: table[:, column].tolist() for column, key in enumerate(keys, start=3)}
    rollouts.trajectory_stats = {key: table[:, column].tolist()
                                 for column, key in enumerate(stat_keys, start=3 + len(keys))}
    rollouts.num_reward_errors, rollouts.num_reward_timeouts = map(int, counts.tolist())
    rollouts.first_reward_failure = next((failure for _, failure in summaries if failure), None)


def move_responses(rollouts: Rollouts, wanted: list[list[int]], engine_tp: int) -> None:
    """Make rank r hold the responses of sequences `wanted[r]`, in place, in one all-to-all.

    Sequence i is sent to rank r by the rank of its replica at r's position in TP_r (r mod TP_r),
    which spreads the sending over the replica. Every rank knows every length, so no sizes are exchanged."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def sender(index: int, receiver: int) -> int:
        return rollouts.replicas[index] * engine_tp + receiver % engine_tp

    sent, send_splits = [], []
    for receiver in range(world):
        rows = [i for i in wanted[receiver] if sender(i, receiver) == rank]
        sent.append(pack_responses(rollouts, rows))
        send_splits.append(len(sent[-1]))
    incoming = [[i for i in wanted[rank] if sender(i, rank) == source] for source in range(world)]
    recv_splits = [packed_size(rollouts, rows) for rows in incoming]
    received = torch.empty(sum(recv_splits), dtype=torch.float64)
    collectives.all_to_all(received, torch.cat(sent), recv_splits, send_splits)
    unpack_responses(rollouts, [i for rows in incoming for i in rows], received)


def packed_size(rollouts: Rollouts, rows: list[int]) -> int:
    """The length of `pack_responses(rollouts, rows)`, from the lengths every rank knows."""
    return sum(_packed_size(rollouts, i) for i in rows)


def pack_responses(rollouts: Rollouts, rows: list[int]) -> torch.Tensor:
    """The responses of sequences `rows` (held here) as one float64 tensor, sequence after sequence: token
    ids, log-probs, a multi-turn rollout's loss mask and opening, and a mixture-of-experts model's routing (all
    exact)."""
    parts = []
    for i in rows:
        parts += [torch.tensor(rollouts.response_ids[i], dtype=torch.float64),
                  torch.tensor(rollouts.rollout_logprobs[i], dtype=torch.float64)]
        if rollouts.loss_masks:
            parts += [torch.tensor(rollouts.loss_masks[i], dtype=torch.float64),
                      torch.tensor(rollouts.openings[i], dtype=torch.float64)]
        if rollouts.routed_experts_shape is not None:
            parts.append(rollouts.routed_experts[i].flatten().double())
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def unpack_responses(rollouts: Rollouts, rows: list[int], packed: torch.Tensor) -> None:
    """Hold the responses of sequences `rows` from `pack_responses(rollouts, rows)` made elsewhere, in place."""
    offset = 0
    for i in rows:
        length, size = rollouts.response_lengths[i], _packed_size(rollouts, i)
        rollouts.response_ids[i] = packed[offset : offset + length].long().tolist()
        rollouts.rollout_logprobs[i] = packed[offset + length : offset + 2 * length].tolist()
        routing_start = offset + 2 * length
        if rollouts.loss_masks:
            opening = routing_start + length
            rollouts.loss_masks[i] = packed[routing_start:opening].long().tolist()
            rollouts.openings[i] = packed[opening : opening + rollouts.opening_lengths[i]].long().tolist()
            routing_start = opening + rollouts.opening_lengths[i]
        if rollouts.routed_experts_shape is not None:
            routing = packed[routing_start : offset + size]
            rollouts.routed_experts[i] = routing.view(-1, *rollouts.routed_experts_shape).to(torch.int16)
        offset += size


def _packed_size(rollouts: Rollouts, index: int) -> int:
    length = rollouts.response_lengths[index]
    size = 3 * length + rollouts.opening_lengths[index] if rollouts.loss_masks else 2 * length
    if rollouts.routed_experts_shape is None:
        return size
    layers, top_k = rollouts.routed_experts_shape
    return size + (rollouts.prompt_length(index) + length - 1) * layers * top_k


def _columns() -> list[tuple[str, str]]:
    """(name, "column" or "named") of every per-sequence field of `Rollouts`."""
    return [(f.name, f.metadata["per_sequence"]) for f in fields(Rollouts) if "per_sequence" in f.metadata]


def _aligned(first: dict[str, list[float]], second: dict[str, list[float]], first_length: int,
             second_length: int) -> dict[str, list[float]]:
    """Two parts' named columns concatenated, NaN for the sequences of a part that lacks a name."""
    return {key: first.get(key, [math.nan] * first_length) + second.get(key, [math.nan] * second_length)
            for key in sorted(first.keys() | second.keys())}
