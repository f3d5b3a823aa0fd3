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
from megarl.generation.rollouts import (Rollouts, replica_blocks, rollout_sampling, score_generated, share_scores,
                                        unfilled_rollouts)
from megarl.rewards import RewardManager
from megarl.rollout.base import RolloutEngine, RolloutOutput
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
        self.config, self.tokenizer, self.rewards, self.dataset = config, tokenizer, rewards, dataset
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

    def take(self, step: int, version: int) -> tuple[Rollouts, list[int], dict[str, float]]:
        """B_step, scored (every rollout rank holds every response), its prompts' dataset indices and how it
        was made; rounds run with the engine's weights (`version`) until enough groups are finished."""
        self.fill(step, version)
        batch, self.finished = self.finished[:self.batch_size], self.finished[self.batch_size:]
        metrics = {"rollout/rounds": float(self.rounds), "rollout/restarted_groups": float(self.restarted)}
        self.rounds = self.restarted = 0
        return self._scored(batch), [group.index for group in batch], metrics

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

    def _restart_older_than(self, version: int) -> None:
        """Groups with a token older than `version` start again from their prompts (in their order)."""
        def stale(group: Group) -> bool:
            return group.oldest_version is not None and group.oldest_version < version

        again = [group.index for group in self.finished + self.in_flight if stale(group)]
        self.finished = [group for group in self.finished if not stale(group)]
        self.in_flight = [group for group in self.in_flight if not stale(group)]
        self.waiting[:0] = again
        self.restarted += len(again)

    def _admit(self) -> None:
        while len(self.in_flight) < self.groups_in_flight:
            if not self.waiting:
                self.waiting = self.sampler.next_batch()
            self.in_flight.append(Group(self.waiting.pop(0), self.admitted, [Response() for _ in range(self.n)]))
            self.admitted += 1

    def run_round(self, version: int) -> None:
        """Every unfinished response of the groups in flight, at most `rollout.partial_tokens` tokens further."""
        self._admit()
        limit, segment = self.config.data.max_response_length, self.config.rollout.partial_tokens
        seed = self.config.trainer.seed
        requests = [(group, j, response) for group in self.in_flight for j, response in enumerate(group.responses)
                    if response.finish_reason is None]
        output = self._generate(
            [self.dataset[group.index].prompt_ids + response.ids for group, _, response in requests],
            seeds=[derive_seed(seed, "partial_rollout", step=group.admission, replica=j, draw=response.segments)
                   for group, j, response in requests],
            max_tokens=[min(segment, limit - len(response.ids)) for _, _, response in requests])
        for (_, _, response), ids, logprobs, reason in zip(requests, output.response_ids, output.logprobs,
                                                           output.finish_reasons):
            response.ids += ids
            response.logprobs += logprobs
            response.versions += [version] * len(ids)
            response.segments += 1
            if reason == "stop" or len(response.ids) >= limit:
                response.finish_reason = reason
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
            output = self.engine.generate(prompts[start:stop], sampling)
        blocks = collectives.all_gather_object(
            (output.response_ids, output.logprobs, output.finish_reasons) if rank % engine_tp == 0 else None)
        gathered = RolloutOutput()
        for block in filter(None, blocks):
            gathered.response_ids += block[0]
            gathered.logprobs += block[1]
            gathered.finish_reasons += block[2]
        return gathered

    def _scored(self, batch: list[Group]) -> Rollouts:
        """The batch's responses as `Rollouts` held by every rank, each replica's first rank scoring its block."""
        prompts = [self.dataset[group.index] for group in batch]
        rollouts, (start, stop) = unfilled_rollouts(prompts, self.n, self.config.rollout.tp)
        responses = [response for group in batch for response in group.responses]
        rollouts.response_ids = [response.ids for response in responses]
        rollouts.rollout_logprobs = [response.logprobs for response in responses]
        rollouts.token_versions = [response.versions for response in responses]
        rollouts.replicas = [0] * len(rollouts)
        n = self.n
        block = RolloutOutput(response_ids=rollouts.response_ids[start * n:stop * n],
                              finish_reasons=[r.finish_reason for r in responses[start * n:stop * n]])
        result = None
        if stop > start and dist.get_rank() % self.config.rollout.tp == 0:
            result = score_generated(prompts[start:stop], block, n, self.tokenizer, self.rewards)
        share_scores(rollouts, block, result, start * n)
        return rollouts


def _groups(values: list[dict]) -> list[Group]:
    return [Group(v["index"], v["admission"], [Response(**r) for r in v["responses"]]) for v in values]
