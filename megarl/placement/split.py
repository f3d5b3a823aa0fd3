"""Split placement: rollout ranks generate while trainer ranks train, at most `max_staleness` versions behind.

Policy version v is the weights after RL step v (0: the initial weights). Step s trains on batch
B_s, made of the sampler's s-th batch of prompts. The two sides run mirrored loops whose bridge
operations (`megarl.distributed.split_world`) meet in one order:

    trainer, step s                          rollout ranks, step s
    sync to version s-1 (if not held)        sync to version s-1 (if not held)
                                             generate B_s, unless already queued
    receive B_s                              send B_s
    train on B_s                             generate ahead, up to B_(s+k), with version s-1
    [validate: sync to s, receive metrics]   [sync to s, validate, send metrics]
    [save: receive the queue, checkpoint]    [send the queue (first rollout rank -> trainer rank 0)]

so B_j is generated with version max(0, j-1-k) or newer, and no trained-on sample is more than k
versions old (k=0: synchronous, the colocated run's batches; k=1: one-step off-policy). Syncs
happen where both sides know the engine lacks the wanted version, so they always pair up.

A checkpoint of step s holds the batches generated but not yet trained on (the queue, at most k,
with their prompts' dataset indices and versions): they cannot be regenerated, since the weights
that made them are gone. On resume the rollout ranks take back the queue and advance their sampler
past it; the trainer's sampler, saved at step s, checks each received batch's prompts, so a prompt
lost or repeated across a resume stops the run with the step named.

Partial rollouts (`rollout.partial`, `megarl.generation.partial`) make B_s of the first groups to finish,
whichever prompts they came from: the rollout ranks' engines generate continuously, B_s is taken after the
sync to s-1 and, while the trainer trains on it, the engines go on towards B_(s+1) (in place of generating
ahead); before each sync every request leaves the engines, and a response left unfinished continues after it
on the newer weights (with `rollout.keep_kv` the requests stay in the engines through a step's sync, unless a
checkpoint was taken since the last sync, and through none before a validation). A group admitted on version v
is trained by step v + 1 + max_staleness, every token carries its version, and the checkpoint holds the
responses in flight and the rollout ranks' sampler (the trainer's goes unused).

Multi-turn rollouts (`rollout.multi_turn`) run on the rollout ranks, whole or partial; a batch carries each
trajectory's opening (its prompt), loss mask and counts.

A batch crosses from the first rollout rank as a header of every sequence's scalars (broadcast) and, once
the trainer has dealt its DP ranks' shares, each trainer rank's responses as one tensor sent to it alone
(`megarl.placement.batches`): O(share) bytes per trainer rank.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time

import torch

from megarl.config.schema import RunConfig
from megarl.distributed.layout import ParallelLayout
from megarl.distributed.process import freeze_start_up_objects
from megarl.distributed.split_world import SplitWorld
from megarl.generation.collector import RolloutCollector
from megarl.generation.engine import EngineSettings, start_rollout_engine
from megarl.generation.inputs import RunInputs
from megarl.generation.judge import training_rewards
from megarl.generation.partial import PartialRollouts
from megarl.generation.rollouts import Rollouts, move_responses
from megarl.generation.validation import validation_metrics
from megarl.models.architecture import Architecture
from megarl.placement.base import Placement, StepRollouts, sync_metrics
from megarl.placement.batches import BatchBridge, batch_payload
from megarl.resharding.cross_group import CrossGroupSync
from megarl.resharding.executor import SyncStats
from megarl.rewards import RewardFunctionError
from megarl.rollout.base import RolloutEngine
from megarl.tracking.timing import PhaseTimer

logger = logging.getLogger(__name__)


class SplitPlacement(Placement):
    """The trainer side: weights out to the rollout ranks, batches and validations in."""

    def __init__(self, world: SplitWorld, module: torch.nn.Module, arch: Architecture, layout: ParallelLayout,
                 config: RunConfig, inputs: RunInputs):
        self.world, self.config, self.inputs = world, config, inputs
        self.sync = CrossGroupSync(world, config.rollout.tp, config.rollout.bucket_mib << 20,
                                   trainer=(module, arch, layout))
        self.bridge = BatchBridge(world, inputs.train_data, config.rollout.n)
        self.engine_version: int | None = None

    def start(self, start_step: int, sampler_state: dict, saved: dict) -> None:
        """Tell the rollout ranks where the run starts: the trainer's sampler and what they saved (trainer rank 0
        holds it; the other trainer ranks take no part)."""
        if self.world.rank == 0:
            where = (start_step, sampler_state, saved)
            self.world.broadcast_object(where, 0, self.world.rank_0_and_rollout_ranks)

    def rollouts(self, step: int, timer: PhaseTimer) -> StepRollouts:
        self._sync_to(step - 1, timer)
        # Partial rollouts take prompts as groups finish: the rollout ranks' sampler alone knows which.
        expected = None if self.config.rollout.partial else self.inputs.sampler.next_batch()
        rollouts, metrics = self._receive(step, expected, timer)
        return StepRollouts(rollouts, self.bridge.move, {**metrics, "rollout/filter_rounds": 1.0})

    def validate(self, step: int) -> dict[str, float]:
        """The rollout ranks validate, with the weights synced to them first."""
        self._sync_to(step)
        return self.world.broadcast_object(None, root=self.world.first_rollout_rank)

    def checkpoint_state(self) -> dict:
        """The batches generated but not yet trained on (partial rollouts: the responses in flight too), sent to
        trainer rank 0 alone, which writes the checkpoint's own files ({} on the other trainer ranks)."""
        return self.world.recv_object(self.world.first_rollout_rank) if self.world.rank == 0 else {}

    def shutdown(self) -> None:
        pass  # the rollout ranks own the engines

    def _sync_to(self, version: int, timer: PhaseTimer | None = None) -> None:
        """The engines hold `version` afterwards (a sync runs unless they already did)."""
        if version != self.engine_version:
            with timer("reshard") if timer is not None else contextlib.nullcontext():
                self.sync.sync(version)
            self.engine_version = version

    def _receive(self, step: int, expected_indices: list[int] | None, timer: PhaseTimer
                ) -> tuple[Rollouts, dict[str, float]]:
        """B_step, whose prompts must be `expected_indices` (the trainer's sampler; None: any), its responses not
        yet held (`StepRollouts.move`), and the metrics of its making: staleness, the rollout ranks' generation and
        idle time, the sync before it."""
        with timer("wait_for_rollout"):
            header, rollouts = self.bridge.receive()
        if header["error"] is not None:
            raise RewardFunctionError(header["error"])
        if header["step"] != step or expected_indices not in (None, header["indices"]):
            raise RuntimeError(f"step {step}: the rollout ranks generated batch {header['step']} for prompts "
                               f"{header['indices'][:8]}..., the trainer's sampler is at prompts "
                               f"{(expected_indices or [])[:8]}...: a prompt would be lost or repeated")
        staleness = header["staleness"]
        oldest = step - 1 - staleness
        logger.debug("step %d: trains on prompts %s of policy version %d", step, header["indices"], oldest)
        if staleness > self.config.trainer.max_staleness:
            raise RuntimeError(f"step {step}: its batch has tokens of policy version {oldest}, "
                               f"{staleness} versions old; trainer.max_staleness={self.config.trainer.max_staleness}")
        metrics = {"rollout/staleness": float(staleness), "rollout/staleness_mean": header["staleness_mean"],
                   "rollout/multi_version_responses": header["multi_version_responses"],
                   "timing/rollout_generate": header["generate_seconds"],
                   "timing/rollout_idle": header["idle_seconds"], **header["metrics"]}
        if header["sync"] is not None:
            metrics.update(sync_metrics(SyncStats(**header["sync"])))
        return rollouts, metrics


class RolloutWorker:
    """The rollout ranks' program: engines, prompts, rewards and the batches they make (`QueuedBatches` or,
    with partial rollouts, `PartialBatches`)."""

    def __init__(self, config: RunConfig, world: SplitWorld):
        self.config, self.world = config, world
        inputs = RunInputs.open(config)
        self.val_data = inputs.val_data
        rollout = config.rollout
        self.engine = start_rollout_engine(EngineSettings.of_run(config), dummy_weights=True)
        self.sync = CrossGroupSync(world, rollout.tp, rollout.bucket_mib << 20, engine=self.engine)
        rewards = training_rewards(config, inputs.rewards)
        self.collector = RolloutCollector(config, inputs.tokenizer, rewards, inputs.rewards)
        self.batches = (PartialBatches(PartialRollouts(config, inputs.tokenizer, rewards, inputs.train_data,
                                                       inputs.sampler, self.engine))
                        if rollout.partial else
                        QueuedBatches(config, self.collector, self.engine, inputs, world.num_rollout_ranks))
        self.bridge = BatchBridge(world, inputs.train_data, rollout.n)
        self.engine_version: int | None = None
        self.last_sync: SyncStats | None = None
        """The latest sync's statistics, sent with the next batch."""
        self.idle_seconds = self.generate_seconds = 0.0
        """Since the last batch sent."""

    def fit(self) -> None:
        """The rollout ranks' mirror of `RLTrainer.fit` (module docstring)."""
        trainer = self.config.trainer
        start, sampler_state, saved = self.world.broadcast_object(None, 0, self.world.rank_0_and_rollout_ranks)
        self.batches.load_state_dict(sampler_state, saved)
        if self.val_data is not None and trainer.val_before_train and start == 1:
            self._validate(0)
        freeze_start_up_objects()
        saved = False
        for step in range(start, trainer.total_steps + 1):
            # The requests stay in the engines through a step's sync (rollout.keep_kv) unless a checkpoint was
            # taken since the last one: a run resumed from it submits its responses anew, and so does this one.
            self._sync_to(step - 1, keep_requests=self.config.rollout.keep_kv and not saved)
            with self._generating():
                batch = self.batches.take(step, version=step - 1)
            with self._idle():
                self.bridge.send(self._stamped(batch))
            if step < trainer.total_steps:
                with self._generating():
                    self.batches.ahead(step, version=step - 1)
            if self.val_data is not None and (step == trainer.total_steps or
                                              (trainer.test_freq and step % trainer.test_freq == 0)):
                self._validate(step)
            saved = bool(trainer.save_freq) and (step % trainer.save_freq == 0 or step == trainer.total_steps)
            if saved:
                state = self.batches.state_dict()  # every rollout rank: partial rollouts gather their tokens
                if self.world.rank == self.world.first_rollout_rank:
                    with self._idle():
                        self.world.send_object(state, 0)
        self.engine.shutdown()

    @contextlib.contextmanager
    def _generating(self):
        start = time.perf_counter()
        yield
        self.generate_seconds += time.perf_counter() - start

    def _sync_to(self, version: int, keep_requests: bool = False) -> None:
        """The engines hold `version` afterwards; `keep_requests`: the requests in them stay through the sync."""
        if version != self.engine_version:
            self.batches.pause(keep_requests)
            with self._idle():
                self.last_sync = self.sync.sync(version)
            self.engine_version = version

    @contextlib.contextmanager
    def _idle(self):
        start = time.perf_counter()
        yield
        self.idle_seconds += time.perf_counter() - start

    def _stamped(self, payload: dict) -> dict:
        """The batch as sent, with how the rollout ranks spent the time since the previous one."""
        payload = {**payload, "generate_seconds": self.generate_seconds, "idle_seconds": self.idle_seconds,
                   "sync": dataclasses.asdict(self.last_sync) if self.last_sync is not None else None}
        self.idle_seconds = self.generate_seconds = 0.0
        self.last_sync = None
        return payload

    def _validate(self, step: int) -> None:
        self._sync_to(step)
        rollouts = self.collector.validation(self.engine, self.val_data)
        with self._idle():
            self.world.broadcast_object(validation_metrics(rollouts, self.config.rollout.val_n),
                                        root=self.world.first_rollout_rank)


class QueuedBatches:
    """Whole batches: B_step is generated when taken unless it was generated ahead; while the trainer trains
    on B_step, the next ones are, up to `trainer.max_staleness` of them. The queue is saved with every
    checkpoint (its batches cannot be regenerated: the weights that made them are gone)."""

    def __init__(self, config: RunConfig, collector: RolloutCollector, engine: RolloutEngine, inputs: RunInputs,
                 num_rollout_ranks: int):
        self.config, self.collector, self.engine, self.num_rollout_ranks = config, collector, engine, num_rollout_ranks
        self.sampler, self.train_data = inputs.sampler, inputs.train_data
        self.queue: collections.deque[dict] = collections.deque()
        """Payloads of the batches generated ahead, B_(s+1) first while the trainer trains on B_s."""

    def take(self, step: int, version: int) -> dict:
        if not self.queue:
            self.queue.append(self._generate(step, version))
        return self.queue.popleft()

    def pause(self, keep: bool) -> None:
        pass  # the engine runs nothing between batches

    def ahead(self, step: int, version: int) -> None:
        last = min(step + self.config.trainer.max_staleness, self.config.trainer.total_steps)
        while step + 1 + len(self.queue) <= last:
            self.queue.append(self._generate(step + 1 + len(self.queue), version))

    def state_dict(self) -> dict:
        return {"rollout_queue": list(self.queue)}

    def load_state_dict(self, sampler_state: dict, saved: dict) -> None:
        """The trainer's sampler, advanced past the queue the checkpoint holds."""
        self.sampler.load_state_dict(sampler_state)
        for payload in saved.get("rollout_queue", []):
            self.sampler.next_batch()
            self.queue.append(payload)

    def _generate(self, step: int, version: int) -> dict:
        """B_step, generated whole with the engine's weights (`version`)."""
        indices = self.sampler.next_batch()
        prompts = [self.train_data[i] for i in indices]
        rollouts = self.collector.collect(prompts, self.engine, self.collector.sampling(step, validation=False))
        move_responses(rollouts, [list(range(len(rollouts)))] + [[]] * (self.num_rollout_ranks - 1),
                       self.config.rollout.tp)
        rollouts.token_versions = [[version] * length for length in rollouts.response_lengths]
        return batch_payload(rollouts, step, indices, {})


class PartialBatches:
    """Partial rollouts (`megarl.generation.partial`): B_step is the first groups to finish; while the trainer
    trains on it, the engines go on until B_(step+1) is finished too. The checkpoint holds the responses in flight
    and the rollout ranks' sampler (the trainer's goes unused)."""

    def __init__(self, partial: PartialRollouts):
        self.partial = partial

    def take(self, step: int, version: int) -> dict:
        rollouts, indices, metrics = self.partial.take(step, version)
        return batch_payload(rollouts, step, indices, metrics)

    def ahead(self, step: int, version: int) -> None:
        self.partial.fill(step + 1, version)

    def pause(self, keep: bool) -> None:
        self.partial.pause(keep)

    def state_dict(self) -> dict:
        return {"rollout_partial": self.partial.state_dict()}

    def load_state_dict(self, sampler_state: dict, saved: dict) -> None:
        if "rollout_partial" in saved:
            self.partial.load_state_dict(saved["rollout_partial"])
        else:
            self.partial.sampler.load_state_dict(sampler_state)
