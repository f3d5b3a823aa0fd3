"""Partial rollouts: responses generated continuously, across weight versions (split placement).

    partial = PartialRollouts(config, tokenizer, rewards, dataset, sampler, engine)
    rollouts, indices, metrics = partial.take(step, version)   # B_step, scored: the engines step until it is ready
    partial.fill(step + 1, version)                             # while the trainer trains: on towards B_(step+1)
    partial.pause(keep)                                         # before a weight sync
    state = partial.state_dict(); partial.load_state_dict(state)

The engines generate continuously (`RolloutEngine.submit` / `step`). `rollout.partial_groups` groups (a
prompt's `rollout.n` responses; default `data.train_batch_size`) are in flight; one that finishes frees its
place for the sampler's next prompt at the next engine step, so the engines' batches stay full through the
long tail and the slowest response no longer sets the step. A response stays in its engine, KV cache and all,
until it ends or new weights come: the rollout ranks pause before every weight sync (each request leaves the
engine with its tokens so far) and afterwards each response continues as a new request of its prompt
followed by those tokens, on the new weights (its KV cache recomputed: a weight update resets the engine's
prefix cache). With `rollout.keep_kv` a pause may keep the requests instead: they stay in the engine through
the sync and go on over their cache (`megarl.placement.split` says which syncs).

Every token keeps the policy version that sampled it and its log-prob under that version: the behaviour
policy the trainer's rollout correction divides by, token by token (`megarl.algorithms.rollout_correction`).

A group admitted on version v has no token older than v: the last step that may train on it, its due step, is
v + 1 + `trainer.max_staleness`. Every group admitted is trained by its due step and none is thrown away: a
prompt is admitted only if batches of `train_batch_size`, the earliest due first, could still take every group
admitted in time, and B_s is the `train_batch_size` finished groups due earliest (the first finished first) once
the groups left can still be taken in time; until then the engines go on and the trainer waits. A group still
running at its due step sets that step, and long responses are trained as often as short ones (keeping the bound
by generating too old groups anew would throw the long ones away and teach the policy to answer short). The
engine's weights are never older than the bound (`megarl.placement.split`), so the steps end.

Engine replicas step in lockstep: a rank appends the tokens of its own replica's requests as they come, and after
each step every rollout rank learns which requests of every replica ended, with their tokens, so all hold the
same finished segments and make the same decisions; a new request goes to the replica running the fewest. The
tokens of requests still running cross only at a pause and before a checkpoint (`state_dict`): a rank's work an
engine step follows its own replica's requests, not everything in flight.

Multi-turn trajectories (`rollout.multi_turn`) advance the same way within their current turn; when a turn
ends the environment answers it and the next turn is submitted (`megarl.generation.partial_turns`).

Deterministic: what the engines are asked depends only on this state and the tokens they return, never on
time; the m-th request of response j of the a-th prompt admitted samples with `derive_seed(seed,
"partial_rollout", step=a, replica=j, draw=m)`; and the state is plain values, saved with every checkpoint
(between two pauses, before the next sync ends every request): a resumed run submits the requests the
uninterrupted run submitted, from the same partial responses.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, replace
from typing import NamedTuple

import torch.distributed as dist

from megarl.config.schema import RunConfig
from megarl.data.prompt_dataset import PromptDataset
from megarl.data.sampler import ResumableSampler
from megarl.distributed import collectives
from megarl.generation.partial_turns import TrajectoryTurns, TurnState
from megarl.generation.rollouts import Rollouts, rollout_sampling, score_generated, share_scores, unfilled_rollouts
from megarl.rewards import RewardManager
from megarl.rollout.base import RolloutEngine, RolloutOutput, Sampling
from megarl.seeding import derive_seed

logger = logging.getLogger(__name__)


@dataclass
class Response:
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """The policy version that sampled each token."""
    segments: int = 0
    """The engine requests that have generated it (a pause or, multi-turn, a turn's end ends one)."""
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
    version: int
    """The engine's policy version when it was admitted: its tokens are no older."""
    responses: list[Response]

    @property
    def finished(self) -> bool:
        return all(response.finish_reason is not None for response in self.responses)


class Request(NamedTuple):
    """A request in an engine: the response it continues, the replica running it, and where in the response its
    tokens begin (every rank holds those before; the replica's ranks hold the rest as they come)."""

    group: Group
    sample: int
    replica: int
    start: int


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
        self.engine_steps = self.restarted = self.kept = 0
        """Since the last batch taken, for its metrics: engine steps, groups generated anew, requests kept
        through a sync (none yet when a checkpoint is taken: a step's syncs come before its batch)."""
        self.responses = (TrajectoryTurns(config, tokenizer, rewards) if config.rollout.multi_turn.enable
                          else SingleTurns(config, tokenizer, rewards))
        """What an engine step's tokens do to each response: single-turn, or multi-turn trajectories."""
        self.running: dict[str, Request] = {}
        """The requests in the engines, by key."""
        self.pending: dict[tuple[int, int], Group] = {}
        """The unfinished responses no engine runs, by (admission, sample): each becomes a request at the next
        engine step. Kept as responses come and go: an engine step costs what it advanced, not a scan of every
        response in flight."""
        engine_tp = config.rollout.tp
        self.replica, self.num_replicas = dist.get_rank() // engine_tp, dist.get_world_size() // engine_tp
        self.load = [0] * self.num_replicas
        """The requests each replica runs."""
        self.leads_replica = dist.get_rank() % engine_tp == 0
        self.sampling = self.responses.sampling(
            replace(rollout_sampling(config, tokenizer.eos_token_id, 0, validation=False), n=1))
        if config.trainer.max_staleness == 1 and dist.get_rank() == 0:
            logger.warning("partial rollouts at trainer.max_staleness=1: every group admitted while a batch fills is "
                           "due at the next step, so the engines generate whole batches, a response at a time; "
                           "trainer.max_staleness >= 2 lets them run ahead (docs/recipes/split_async.md)")

    def take(self, step: int, version: int) -> tuple[Rollouts, list[int], dict[str, float]]:
        """B_step, scored (every rollout rank holds every response), its prompts' dataset indices and how it
        was made; the engines step with their weights (`version`) until it is ready."""
        batch = self.fill(step, version)
        taken = {group.admission for group in batch}
        self.finished = [group for group in self.finished if group.admission not in taken]
        metrics = {"rollout/engine_steps": float(self.engine_steps), "rollout/restarted_groups": float(self.restarted),
                   "rollout/kept_requests": float(self.kept)}
        self.engine_steps = self.restarted = self.kept = 0
        rollouts = self.responses.scored(batch, self.dataset, self.n, self.config.rollout.tp)
        return rollouts, [group.index for group in batch], metrics

    def fill(self, step: int, version: int) -> list[Group]:
        """Step the engines with their weights (`version`) until B_step is ready; it is returned, still waiting."""
        oldest_allowed = step - 1 - self.config.trainer.max_staleness
        if version < oldest_allowed:
            raise RuntimeError(f"step {step}: the engine holds policy version {version}, older than any token "
                               f"step {step} may train on ({oldest_allowed})")
        # groups that can no longer be trained in time: none, unless resumed with a smaller trainer.max_staleness
        self._restart(self._late(self.finished + self.in_flight, step))
        while (batch := self._ready_batch(step)) is None:
            self.advance(step, version)
        return batch

    def pause(self, keep: bool) -> None:
        """Before a weight sync: every request out of the engines, its response to continue as a new request; or,
        `keep`, every request left in its engine, to go on with the new weights over its KV cache."""
        if keep:
            self.kept += len(self.running)
            return
        self.engine.abort([key for key, request in self.running.items() if request.replica == self.replica])
        self._share_running()
        for request in self.running.values():
            self.pending[request.group.admission, request.sample] = request.group
        self.running.clear()
        self.load = [0] * self.num_replicas

    def state_dict(self) -> dict:
        """The whole state, the tokens of requests still running included. Collective: every rollout rank calls it
        at the same point (the tokens of each replica's running requests cross to every rank first)."""
        self._share_running()
        return {"sampler": self.sampler.state_dict(), "waiting": list(self.waiting), "admitted": self.admitted,
                "in_flight": [asdict(group) for group in self.in_flight],
                "finished": [asdict(group) for group in self.finished],
                "engine_steps": self.engine_steps, "restarted": self.restarted}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.waiting, self.admitted = list(state["waiting"]), state["admitted"]
        self.engine_steps, self.restarted = state["engine_steps"], state["restarted"]
        self.in_flight, self.finished = _groups(state["in_flight"]), _groups(state["finished"])
        self.pending = {(group.admission, j): group for group in self.in_flight
                        for j, response in enumerate(group.responses) if response.finish_reason is None}
        self._restart(self.responses.restore(self.in_flight, self.dataset))

    def advance(self, step: int, version: int) -> None:
        """One step of the engines (with their weights, `version`) towards B_step: groups admitted into free
        places and every unfinished response that no engine runs submitted first."""
        self._admit(step, version)
        self._submit()
        advances = self.engine.step()
        self.engine_steps += 1
        advanced, added = [], {}  # added: the tokens this step gave this replica's requests that ended
        for advance in advances:  # this replica's requests
            group, sample, _, _ = self.running[advance.key]
            response = group.responses[sample]
            response.ids += advance.ids
            response.logprobs += advance.logprobs
            response.versions += [version] * len(advance.ids)
            if advance.finish_reason is None:
                advanced.append((group, sample, response, len(advance.ids), None))
            else:
                added[advance.key] = len(advance.ids)
        ended = []
        for key, reason, tokens in self._share_segments([(a.key, a.finish_reason) for a in advances
                                                         if a.finish_reason is not None]):
            group, sample, replica, _ = self.running.pop(key)
            self.load[replica] -= 1
            ended.append((group, sample))
            advanced.append((group, sample, group.responses[sample], added.get(key, tokens), reason))
        self.responses.advanced(advanced, version)  # the ended requests last, in the same order on every rank
        for group, sample in ended:  # a multi-turn trajectory goes on with its next turn
            if group.responses[sample].finish_reason is None:
                self.pending[group.admission, sample] = group
        done = {group.admission for group, _ in ended if group.finished}
        if done:
            self.finished += [group for group in self.in_flight if group.admission in done]
            self.in_flight = [group for group in self.in_flight if group.admission not in done]

    def _due(self, group: Group) -> int:
        """The last step that may train on `group`."""
        return group.version + 1 + self.config.trainer.max_staleness

    def _late(self, groups: list[Group], step: int) -> list[Group]:
        """Those of `groups` that batches of `train_batch_size` from step `step` on, the earliest due first,
        would take after their due steps."""
        order = sorted(groups, key=self._due)
        return [group for i, group in enumerate(order) if step + i // self.batch_size > self._due(group)]

    def _ready_batch(self, step: int) -> list[Group] | None:
        """B_step: the `train_batch_size` finished groups due earliest, the first finished first, if every group
        left can still be taken by its due step; None while not."""
        if len(self.finished) < self.batch_size:
            return None
        batch = sorted(self.finished, key=self._due)[:self.batch_size]
        taken = {group.admission for group in batch}
        left = [group for group in self.finished + self.in_flight if group.admission not in taken]
        return None if self._late(left, step + 1) else batch

    def _restart(self, groups: list[Group]) -> None:
        """`groups` (finished or in flight) are generated anew from their prompts, first of the prompts to admit."""
        again = {group.admission for group in groups}
        self.finished = [group for group in self.finished if group.admission not in again]
        self.in_flight = [group for group in self.in_flight if group.admission not in again]
        ending = {key: request for key, request in self.running.items() if request.group.admission in again}
        self.engine.abort([key for key, request in ending.items() if request.replica == self.replica])
        for key, request in ending.items():
            del self.running[key]
            self.load[request.replica] -= 1
        self.pending = {place: group for place, group in self.pending.items() if place[0] not in again}
        self.waiting[:0] = [group.index for group in groups]
        self.restarted += len(groups)
        self.responses.release(groups)

    def _admit(self, step: int, version: int) -> None:
        """Prompts into the free places, while every group admitted can still be trained by its due step."""
        admitted = []
        held = len(self.finished) + len(self.in_flight)
        room = not self._late(self.finished + self.in_flight, step)
        while room and len(self.in_flight) + len(admitted) < self.groups_in_flight:
            if not self.waiting:
                self.waiting = self.sampler.next_batch()
            group = Group(self.waiting[0], self.admitted, version, [Response() for _ in range(self.n)])
            # No group held is due later (versions only grow), so it would be taken last: late alone or not at all.
            if step + (held + len(admitted)) // self.batch_size > self._due(group):
                break
            admitted.append(group)
            self.waiting.pop(0)
            self.admitted += 1
        self.responses.open(admitted, self.dataset)
        self.in_flight += admitted
        self.pending.update(((group.admission, j), group) for group in admitted for j in range(self.n))

    def _submit(self) -> None:
        """Every unfinished response that no engine runs becomes a request, of the replica running the fewest, in
        the order of admission and sample (what a resumed run, whose every unfinished response waits, repeats)."""
        seed = self.config.trainer.seed
        for (admission, j), group in sorted(self.pending.items(), key=lambda item: item[0]):
            response = group.responses[j]
            replica = min(range(self.num_replicas), key=self.load.__getitem__)
            self.load[replica] += 1
            key = f"{admission}.{j}.{response.segments}"
            self.running[key] = Request(group, j, replica, len(response.ids))
            if replica == self.replica:
                self.engine.submit(key, self.responses.context(group, response), replace(
                    self.sampling, max_tokens=self.responses.max_tokens(response),
                    seed=derive_seed(seed, "partial_rollout", step=admission, replica=j, draw=response.segments)))
            response.segments += 1
        self.pending.clear()

    def _share_segments(self, ending: list[tuple[str, str | None]]) -> list[tuple[str, str | None, int]]:
        """This replica's requests `ending` (key, finish reason) sent with their tokens (key, finish reason, ids,
        log-probs, versions: plain tuples pickle faster than any packing of them tried) to every rollout rank, which
        appends those of the other replicas' to their responses. Every replica's, in replica order: (key, finish
        reason, tokens appended here)."""
        if self.num_replicas == 1:
            return [(key, reason, 0) for key, reason in ending]  # a replica's ranks hold the same
        segments = []
        if self.leads_replica:
            for key, reason in ending:
                group, sample, _, start = self.running[key]
                response = group.responses[sample]
                segments.append((key, reason, response.ids[start:], response.logprobs[start:],
                                 response.versions[start:]))
        shared = []
        for block in collectives.all_gather_object(segments if self.leads_replica else None):
            if block is None:
                continue
            for key, reason, ids, logprobs, versions in block:
                group, sample, replica, _ = self.running[key]
                if replica != self.replica:
                    response = group.responses[sample]
                    response.ids += ids
                    response.logprobs += logprobs
                    response.versions += versions
                shared.append((key, reason, len(ids)))
        return shared

    def _share_running(self) -> None:
        """The tokens of every running request so far on every rollout rank; the requests go on."""
        mine = [(key, None) for key, request in self.running.items() if request.replica == self.replica]
        advanced = []
        for key, _, tokens in self._share_segments(mine):
            group, sample, replica, _ = request = self.running[key]
            response = group.responses[sample]
            self.running[key] = request._replace(start=len(response.ids))
            if replica != self.replica:
                advanced.append((group, sample, response, tokens, None))
        self.responses.advanced(advanced, version=None)  # none ended: no environment answer to stamp


class SingleTurns:
    """Single-turn responses' side of partial rollouts: a response ends with its request. (Multi-turn
    trajectories: `TrajectoryTurns`, with the same methods.)"""

    def __init__(self, config: RunConfig, tokenizer, rewards: RewardManager):
        self.tokenizer, self.rewards = tokenizer, rewards
        self.limit = config.data.max_response_length
        self.prompt_ids: dict[int, list[int]] = {}
        """The prompt of each group in flight, by admission (read from the dataset once, not at every request)."""

    def sampling(self, sampling: Sampling) -> Sampling:
        return sampling

    def open(self, groups: list[Group], dataset: PromptDataset) -> None:
        for group in groups:
            self.prompt_ids[group.admission] = dataset[group.index].prompt_ids

    def context(self, group: Group, response: Response) -> list[int]:
        """The request that continues `response`: its prompt and its tokens so far."""
        return self.prompt_ids[group.admission] + response.ids

    def max_tokens(self, response: Response) -> int:
        return self.limit - len(response.ids)

    def advanced(self, advanced: list[tuple[Group, int, Response, int, str | None]], version: int) -> None:
        """After an engine step (each response it advanced, with its number of new tokens and the engine's finish
        reason: None while its request goes on); a request ends at a stop token or the length limit."""
        for _, _, response, _, reason in advanced:
            response.finish_reason = reason

    def release(self, groups: list[Group]) -> None:
        for group in groups:
            self.prompt_ids.pop(group.admission, None)

    def restore(self, groups: list[Group], dataset: PromptDataset) -> list[Group]:
        self.open(groups, dataset)
        return []  # the saved state is the whole state

    def scored(self, batch: list[Group], dataset: PromptDataset, n: int, engine_tp: int) -> Rollouts:
        """The batch's responses as `Rollouts` held by every rank, each replica's first rank scoring its block."""
        self.release(batch)
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
    return [Group(v["index"], v["admission"], v["version"],
                  [Response(**{**r, "turn": r["turn"] and TurnState(**r["turn"])}) for r in v["responses"]])
            for v in values]
