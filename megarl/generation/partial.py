"""Partial rollouts: responses generated a segment at a time, across weight versions (split placement).

    partial = PartialRollouts(config, tokenizer, rewards, dataset, sampler, engine)
    rollouts, indices, metrics = partial.take(step, version)   # B_step, scored: rounds run until it is done
    partial.fill(step + 1, version)                             # while the trainer trains: the next batch's rounds
    state = partial.state_dict(); partial.load_state_dict(state)

A round is one engine call over every unfinished response of the groups in flight: each generates at
most `rollout.partial_tokens` more tokens, as a new request of its prompt followed by its tokens so far,
so a response continues on the weights the engine holds now (its KV cache recomputed: a weight update
resets the engine's prefix cache). `rollout.partial_groups` groups (a prompt's `rollout.n` responses;
default `data.train_batch_size`) are in flight; one that finishes frees its place for the sampler's next
prompt. The slowest response no longer sets the step: it keeps its place across rounds while short ones
come and go around it.

Every token keeps the policy version that sampled it and its log-prob under that version: the behaviour
policy the trainer's rollout correction divides by, token by token (`megarl.algorithms.rollout_correction`).

Finished groups wait in the order they finished. B_s is the first `train_batch_size` of them whose oldest
token is at most `trainer.max_staleness` versions behind version s - 1 (what step s may train on); a group
older than that, waiting or in flight, can never be trained on and is generated anew from its prompt. The
engine's weights are never older than that bound (`megarl.placement.split`), so the rounds end.

Multi-turn trajectories (`rollout.multi_turn`) advance the same way within their current turn; between turns
the environment answers (`megarl.generation.partial_turns`).

Deterministic: a round's requests and seeds depend only on this state (the m-th segment of response j of
the a-th prompt admitted samples with `derive_seed(seed, "partial_rollout", step=a, replica=j, draw=m)`),
and the state is plain values, saved with every checkpoint: a resumed run makes the rounds the
uninterrupted run made, from the same partial responses.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch.distributed as dist

from megarl.config.schema import RunConfig
from megarl.data.prompt_dataset import PromptDataset
from megarl.data.sampler import ResumableSampler
from megarl.distributed import collectives
from megarl.generation.partial_turns import TurnRounds, TurnState
from megarl.generation.rollouts import (Rollouts, replica_blocks, rollout_sampling, score_generated, share_scores,
                                        unfilled_rollouts)
from megarl.rewards import RewardManager
from megarl.rollout.base import RolloutEngine, RolloutOutput, Sampling
from megarl.seeding import derive_seed


@dataclass
class Response:
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """The policy version that sampled each token."""
    segments: int = 0
    finish_reason: str | None = None
    """"stop" or "length" once finished; None while it is generated."""
    loss_mask: list[int] = field(default_factory=list)
    """Multi-turn: 1 on the model's tokens, 0 on the environment's; empty for single-turn responses."""
    turn: TurnState | None = None
    """Multi-turn: the trajectory's opening, current turn and conversation (`megarl.generation.partial_turns`)."""


@dataclass
class Group:
    index: int
    """The prompt's index in the dataset."""
    admission: int
    """How many prompts were admitted before this one (seeds its responses)."""
    responses: list[Response]

    @property
    def finished(self) -> bool:
        return all(response.finish_reason is not None for response in self.responses)

    @property
    def oldest_version(self) -> int | None:
        """The version of its oldest token; None before its first round."""
        return min((r.versions[0] for r in self.responses if r.versions), default=None)


class PartialRollouts:
    def __init__(self, config: RunConfig, tokenizer, rewards: RewardManager, dataset: PromptDataset,
                 sampler: ResumableSampler, engine: RolloutEngine):
        self.config, self.tokenizer, self.dataset = config, tokenizer, dataset
        self.sampler, self.engine = sampler, engine
        self.batch_size, self.n = config.data.train_batch_size, config.rollout.n
        self.groups_in_flight = config.rollout.partial_groups or self.batch_size
        self.waiting: list[int] = []
        """Prompts to admit before the sampler's next ones (groups generated anew)."""
        self.in_flight: list[Group] = []
        self.finished: list[Group] = []
        self.admitted = 0
        self.rounds = self.restarted = 0
        """Since the last batch taken, for its metrics."""
        self.responses = (TurnRounds(config, tokenizer, rewards) if config.rollout.multi_turn.enable
                          else ResponseRounds(config, tokenizer, rewards))
        """What a round does to each response: single-turn, or multi-turn trajectories."""

    def take(self, step: int, version: int) -> tuple[Rollouts, list[int], dict[str, float]]:
        """B_step, scored (every rollout rank holds every response), its prompts' dataset indices and how it
        was made; rounds run with the engine's weights (`version`) until enough groups are finished."""
        self.fill(step, version)
        batch, self.finished = self.finished[:self.batch_size], self.finished[self.batch_size:]
        metrics = {"rollout/rounds": float(self.rounds), "rollout/restarted_groups": float(self.restarted)}
        self.rounds = self.restarted = 0
        rollouts = self.responses.scored(batch, self.dataset, self.n, self.config.rollout.tp)
        return rollouts, [group.index for group in batch], metrics

    def fill(self, step: int, version: int) -> None:
        """Run rounds with the engine's weights (`version`) until `train_batch_size` finished groups are young
        enough for step `step`."""
        oldest_allowed = step - 1 - self.config.trainer.max_staleness
        if version < oldest_allowed:
            raise RuntimeError(f"step {step}: the engine holds policy version {version}, older than any token "
                               f"step {step} may train on ({oldest_allowed})")
        while True:
            self._restart_older_than(oldest_allowed)
            if len(self.finished) >= self.batch_size:
                return
            self.run_round(version)

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "waiting": list(self.waiting), "admitted": self.admitted,
                "in_flight": [asdict(group) for group in self.in_flight],
                "finished": [asdict(group) for group in self.finished],
                "rounds": self.rounds, "restarted": self.restarted}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.waiting, self.admitted = list(state["waiting"]), state["admitted"]
        self.rounds, self.restarted = state["rounds"], state["restarted"]
        self.in_flight, self.finished = _groups(state["in_flight"]), _groups(state["finished"])
        self._restart(self.responses.restore(self.in_flight, self.dataset))

    def _restart_older_than(self, version: int) -> None:
        """Groups with a token older than `version` start again from their prompts (in their order)."""
        def stale(group: Group) -> bool:
            return group.oldest_version is not None and group.oldest_version < version

        self._restart([group for group in self.finished + self.in_flight if stale(group)])

    def _restart(self, groups: list[Group]) -> None:
        """`groups` (finished or in flight) are generated anew from their prompts, first of the prompts to admit."""
        again = {group.admission for group in groups}
        self.finished = [group for group in self.finished if group.admission not in again]
        self.in_flight = [group for group in self.in_flight if group.admission not in again]
        self.waiting[:0] = [group.index for group in groups]
        self.restarted += len(groups)
        self.responses.release(groups)

    def _admit(self) -> None:
        admitted = []
        while len(self.in_flight) + len(admitted) < self.groups_in_flight:
            if not self.waiting:
                self.waiting = self.sampler.next_batch()
            admitted.append(Group(self.waiting.pop(0), self.admitted, [Response() for _ in range(self.n)]))
            self.admitted += 1
        self.responses.open(admitted, self.dataset)
        self.in_flight += admitted

    def run_round(self, version: int) -> None:
        """Every unfinished response of the groups in flight, at most `rollout.partial_tokens` tokens further."""
        self._admit()
        segment, seed = self.config.rollout.partial_tokens, self.config.trainer.seed
        requests = [(group, j, response) for group in self.in_flight for j, response in enumerate(group.responses)
                    if response.finish_reason is None]
        output = self._generate(
            [self.responses.context(group, response, self.dataset) for group, _, response in requests],
            seeds=[derive_seed(seed, "partial_rollout", step=group.admission, replica=j, draw=response.segments)
                   for group, j, response in requests],
            max_tokens=[self.responses.max_tokens(response, segment) for _, _, response in requests])
        for (_, _, response), ids, logprobs in zip(requests, output.response_ids, output.logprobs):
            response.ids += ids
            response.logprobs += logprobs
            response.versions += [version] * len(ids)
            response.segments += 1
        self.responses.advanced([(*request, len(ids), reason) for request, ids, reason
                                 in zip(requests, output.response_ids, output.finish_reasons)], version)
        self.finished += [group for group in self.in_flight if group.finished]
        self.in_flight = [group for group in self.in_flight if not group.finished]
        self.rounds += 1

    def _generate(self, prompts: list[list[int]], seeds: list[int], max_tokens: list[int]) -> RolloutOutput:
        """One response per prompt, the prompts dealt to the engine replicas in contiguous blocks; every rank
        returns all of them."""
        rank, engine_tp = dist.get_rank(), self.config.rollout.tp
        start, stop = replica_blocks(len(prompts), engine_tp)[rank // engine_tp]
        output = RolloutOutput()
        if stop > start:
            sampling = replace(rollout_sampling(self.config, self.tokenizer.eos_token_id, 0, validation=False), n=1,
                               request_seeds=tuple(seeds[start:stop]), request_max_tokens=tuple(max_tokens[start:stop]))
            output = self.engine.generate(prompts[start:stop], self.responses.sampling(sampling))
        blocks = collectives.all_gather_object(
            (output.response_ids, output.logprobs, output.finish_reasons) if rank % engine_tp == 0 else None)
        gathered = RolloutOutput()
        for block in filter(None, blocks):
            gathered.response_ids += block[0]
            gathered.logprobs += block[1]
            gathered.finish_reasons += block[2]
        return gathered


class ResponseRounds:
    """Single-turn responses' side of a round: a response ends at a stop token or the length limit. (Multi-turn
    trajectories: `TurnRounds`, with the same methods.)"""

    def __init__(self, config: RunConfig, tokenizer, rewards: RewardManager):
        self.tokenizer, self.rewards = tokenizer, rewards
        self.limit = config.data.max_response_length

    def sampling(self, sampling: Sampling) -> Sampling:
        return sampling

    def open(self, groups: list[Group], dataset: PromptDataset) -> None:
        pass  # a response's prompt is its sample's

    def context(self, group: Group, response: Response, dataset: PromptDataset) -> list[int]:
        """The request that continues `response`: its prompt and its tokens so far."""
        return dataset[group.index].prompt_ids + response.ids

    def max_tokens(self, response: Response, segment: int) -> int:
        return min(segment, self.limit - len(response.ids))

    def advanced(self, advanced: list[tuple[Group, int, Response, int, str]], version: int) -> None:
        """After a round (each response with its number of new tokens and the engine's finish reason)."""
        for _, _, response, _, reason in advanced:
            if reason == "stop" or len(response.ids) >= self.limit:
                response.finish_reason = reason

    def release(self, groups: list[Group]) -> None:
        pass

    def restore(self, groups: list[Group], dataset: PromptDataset) -> list[Group]:
        return []  # the saved state is the whole state

    def scored(self, batch: list[Group], dataset: PromptDataset, n: int, engine_tp: int) -> Rollouts:
        """The batch's responses as `Rollouts` held by every rank, each replica's first rank scoring its block."""
        prompts = [dataset[group.index] for group in batch]
        rollouts, (start, stop) = unfilled_rollouts(prompts, n, engine_tp)
        responses = [response for group in batch for response in group.responses]
        rollouts.response_ids = [response.ids for response in responses]
        rollouts.rollout_logprobs = [response.logprobs for response in responses]
        rollouts.token_versions = [response.versions for response in responses]
        rollouts.replicas = [0] * len(rollouts)
        block = RolloutOutput(response_ids=rollouts.response_ids[start * n:stop * n],
                              finish_reasons=[r.finish_reason for r in responses[start * n:stop * n]])
        result = None
        if stop > start and dist.get_rank() % engine_tp == 0:
            result = score_generated(prompts[start:stop], block, n, self.tokenizer, self.rewards)
        share_scores(rollouts, block, result, start * n)
        return rollouts


def _groups(values: list[dict]) -> list[Group]:
    return [Group(v["index"], v["admission"],
                  [Response(**{**r, "turn": r["turn"] and TurnState(**r["turn"])}) for r in v["responses"]])
            for v in values]
