"""The SPMD RL loop: every rank runs this same program (DESIGN.md, "The loop").

    reshard -> rollout -> reward -> score -> advantage -> update -> log

Models: the actor (trained), an optional reference (KL), an optional critic (GAE), PRIME's implicit
PRM (`megarl.trainer.prime`), an optional teacher (on-policy distillation, `megarl.trainer.teacher`)
and an optional reward model, all megatron-core models on the actor's layout, and one colocated
rollout engine per TP_r ranks. The engines split the step's prompts and score each response once;
every rank learns the scores (`megarl.trainer.rollouts`), and each DP rank then receives its share
of whole groups (the n responses of a prompt), balanced by tokens within every mini-batch
(`megarl.trainer.shares`), and scores, computes advantages and trains on that share alone.
The step's numbers are reduced over DP as tensors (`megarl.trainer.metrics`).

Memory is shared in time: between phases the rollout engine sleeps and the Megatron models are
resident; `RolloutPolicy` (`megarl.trainer.policy`) swaps them around each rollout.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from megarl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdaptiveKLController,
    AdvantageInputs,
    FixedKLController,
    kl_penalty_rewards,
)
from megarl.checkpoint import Checkpointer
from megarl.config.schema import EngineConfig
from megarl.engine.megatron_engine import MegatronEngine
from megarl.rewards import token_level_scores
from megarl.rollout import Sampling
from megarl.tracking import Tracker
from megarl.trainer.contract import check_batch
from megarl.trainer.curves import plot_curves
from megarl.trainer.losses import actor_loss, critic_loss
from megarl.trainer.multi_turn import MultiTurnRollouts
from megarl.trainer.inputs import RunInputs, validation_prompts
from megarl.trainer.metrics import (
    ShareStats,
    batch_stats,
    mismatch_stats,
    rollout_stats,
    run_metrics,
    sync_metrics,
    throughput,
    update_metrics,
)
from megarl.trainer.policy import EngineSettings, RolloutPolicy
from megarl.trainer.prime import ImplicitPRM
from megarl.trainer.rollouts import Rollouts, collect_rollouts, rollout_sampling
from megarl.trainer.scores import first_groups, informative, reward_model_scores, sequence_rewards
from megarl.trainer.shares import sum_over_shares, take_share
from megarl.trainer.split import SplitPolicy
from megarl.trainer.startup import Run, freeze_start_up_objects
from megarl.trainer.teacher import distillation_stats, teacher_engine_config
from megarl.trainer.timing import PhaseTimer
from megarl.trainer.validation import validation_metrics


class RLTrainer:
    def __init__(self, run: Run):
        """Inputs are checked first (data, reward function, the checkpoint to resume): a mistake in
        them fails in seconds, before the models and the rollout engine are built."""
        self.config, self.layout, self.run_dir, self.world = run.config, run.layout, run.run_dir, run.world
        config = self.config
        inputs = RunInputs.open(config)
        self.tokenizer, self.sampler, self.rewards = inputs.tokenizer, inputs.sampler, inputs.rewards
        self.train_data, self.val_data = inputs.train_data, inputs.val_data
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        data = config.data
        if self.layout.rank == 0:
            validation = f"; validation: {self.val_data.describe()}" if self.val_data is not None else ""
            print(f"training data: {self.train_data.describe()}{validation}", flush=True)
        self.multi_turn = (MultiTurnRollouts.from_config(config.rollout, self.tokenizer, data.max_prompt_length,
                                                         data.max_response_length)
                           if config.rollout.multi_turn.enable else None)
        trainer = config.trainer
        self.checkpointer = Checkpointer(Path(trainer.checkpoint_dir) / trainer.experiment_name, config.model.path,
                                         self.run_dir / "config.yaml", trainer.max_ckpt_to_keep, trainer.async_save)
        resume_from = self.checkpointer.find(trainer.resume_mode, trainer.resume_path)
        self.estimator = ADVANTAGE_ESTIMATORS.get(config.algorithm.adv_estimator)
        run.save_config()
        self.actor = self._engine(config.actor, trainable=True, router_replay=config.actor.router_replay)
        uses_reference = config.actor.use_kl_loss or config.algorithm.use_kl_in_reward
        self.reference = self._engine(config.actor, trainable=False) if uses_reference else None
        self.critic = None
        if config.critic.enable:
            self.critic = self._engine(config.critic, trainable=True, path=config.critic.path or None, value=True)
        self.teacher = None
        if config.teacher.path:
            self.teacher = self._engine(teacher_engine_config(config.actor, config.teacher.micro_batch_size_per_rank),
                                        trainable=False, path=config.teacher.path)
        self.prm = self._implicit_prm() if self.estimator.needs_process_rewards else None
        self.reward_model = None
        if config.reward.reward_model_path:
            self.reward_model = self._engine(EngineConfig(), trainable=False, path=config.reward.reward_model_path)
        self.policy = (SplitPolicy(self.world, self.actor.module, self.actor.arch, self.layout, config)
                       if self.world is not None else self._rollout_policy())
        kl = config.algorithm.kl_ctrl
        self.kl_ctrl = (AdaptiveKLController(kl.coef, kl.target_kl, kl.horizon) if kl.type == "adaptive"
                        else FixedKLController(kl.coef))
        self.start_step, run_id, queue = 1, None, []
        if resume_from is not None:
            state = self.checkpointer.load(resume_from, self._trainable())
            self.sampler.load_state_dict(state["sampler"])
            self.kl_ctrl.value = state["kl_coef"]
            self.start_step, run_id = state["step"] + 1, state["mlflow_run_id"]
            queue = state.get("rollout_queue", [])
            if self.layout.rank == 0:
                print(f"resumed from {resume_from} (step {state['step']})", flush=True)
        if self.world is not None:
            self.policy.start(self.start_step, self.sampler.state_dict(), queue)
        self.tracker = Tracker(trainer.loggers, self.run_dir, trainer.experiment_name, trainer.mlflow_tracking_uri,
                               config, is_writer=self.layout.rank == 0, log_freq=trainer.log_freq,
                               last_step=trainer.total_steps, run_id=run_id)

    # ---- set-up -----------------------------------------------------------------------------------

    def _trainable(self) -> dict[str, MegatronEngine]:
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {}),
                **({"prm": self.prm.engine} if self.prm is not None else {})}

    def _optimizer_steps(self, engine_config: EngineConfig) -> int:
        per_step = math.ceil(self.config.data.train_batch_size / engine_config.ppo_mini_batch_size)
        return self.config.trainer.total_steps * engine_config.ppo_epochs * per_step

    def _engine(self, engine_config: EngineConfig, trainable: bool, path: str | None = None,
                value: bool = False, router_replay: bool = False) -> MegatronEngine:
        return MegatronEngine(self.layout, self.config.model, engine_config, model_path=path,
                              total_optimizer_steps=self._optimizer_steps(engine_config) if trainable else None,
                              value_head=value, router_replay=router_replay)

    def _implicit_prm(self) -> ImplicitPRM:
        """PRIME's PRM and its frozen reference: the run's reference model when both start from model.path."""
        prime = self.config.prime
        path = prime.path or self.config.model.path
        engine = self._engine(prime, trainable=True, path=path)
        same_start = self.reference is not None and path == self.config.model.path
        return ImplicitPRM(prime, engine, self.reference if same_start else self._engine(prime, False, path=path))

    def _rollout_policy(self) -> RolloutPolicy:
        config = self.config
        rollout, data = config.rollout, config.data
        settings = EngineSettings(rollout.backend, config.model.path, config.model.dtype, rollout.tp,
                                  data.max_prompt_length + data.max_response_length, rollout.kv_cache_mib << 20,
                                  rollout.gpu_memory_utilization, config.trainer.seed, rollout.bucket_mib << 20)
        # The reference and the teacher follow `actor.offload`; the PRM's reference is the run's or
        # follows `prime.offload`.
        prm = (self.prm.engine, self.prm.reference) if self.prm is not None else ()
        offloading = [engine.memory
                      for engine in dict.fromkeys((self.actor, self.reference, self.critic, self.teacher, *prm))
                      if engine is not None and engine.config.offload]
        return RolloutPolicy(self.actor.module, self.actor.arch, self.layout, settings, offloading, self.actor.memory,
                             weights_version=lambda: self.actor.weights_version)

    def _sampling(self, step: int, validation: bool, draw: int = 0) -> Sampling:
        return rollout_sampling(self.config, self.tokenizer.eos_token_id, step, validation, draw)

    # ---- the loop ---------------------------------------------------------------------------------

    def fit(self) -> dict[str, float]:
        with self.tracker:  # the mlflow run ends FAILED if training stops on an error
            last = self._train()
        if self.world is None:
            self.policy.engine.shutdown()
        return last

    def _train(self) -> dict[str, float]:
        """Validate, train every step left (validating and saving as configured), and leave the curves."""
        trainer = self.config.trainer
        last = {}
        if self.val_data is not None and trainer.val_before_train and self.start_step == 1:
            self.tracker.log(self.validate(step=0), step=0)
        freeze_start_up_objects()
        for step in self.tracker.progress(range(self.start_step, trainer.total_steps + 1)):
            self.checkpointer.poll()
            last = self.step(step)
            if self.val_data is not None and (step == trainer.total_steps or
                                              (trainer.test_freq and step % trainer.test_freq == 0)):
                last.update(self.validate(step))
            self.tracker.log(last, step)
            if trainer.save_freq and (step % trainer.save_freq == 0 or step == trainer.total_steps):
                self.tracker.flush()  # the store holds every step the checkpoint resumes after
                queue = {"rollout_queue": self.policy.queue()} if self.world is not None else {}
                self.checkpointer.save(step, self._trainable(), {
                    "sampler": self.sampler.state_dict(), "kl_coef": self.kl_ctrl.value,
                    "mlflow_run_id": self.tracker.run_id, **queue})
        self.checkpointer.wait()
        if self.layout.rank == 0:
            self.tracker.log_artifact(plot_curves(self.tracker.history, self.run_dir / "curves.png"))
            self.tracker.log_artifact(self.run_dir / "config.yaml")
        return last

    def step(self, step: int) -> dict[str, float]:
        timer = PhaseTimer(step)
        if self.world is not None:  # split placement: the rollout ranks generated the batch
            self.policy.sync_to(step - 1, timer)
            rollouts, generation = self.policy.receive(step, self.train_data, self.sampler.next_batch(), timer)
            rounds, baseline_B, engine_tp = 1, None, None
        else:
            sync = self.policy.enter_rollout(step, timer)
            with timer("rollout"):
                rollouts, rounds = self._generate_training_rollouts(step)
                baseline_B = self._greedy_baseline(rollouts, step) if self.estimator.needs_greedy_baseline else None
            self.policy.leave_rollout(timer)
            generation, engine_tp = sync_metrics(sync), self.config.rollout.tp
        local, share = take_share(rollouts, self.layout, engine_tp, self.config.actor.ppo_mini_batch_size,
                                  self.config.trainer.seed, step)
        group_ids_B, num_groups = share.group_ids_B, share.num_groups
        batch = local.to_batch(self.pad_token_id)
        self._check(batch, "rollout", ("rollout_logprobs",))
        temperature, seed = self.config.rollout.temperature, self.config.trainer.seed
        # A single-step actor update computes the old log-probs in its own forward: no scoring pass
        # (unless the reward's KL or the teacher's needs them first).
        old_from_update = (self.actor.is_single_step(num_groups) and not self.config.algorithm.use_kl_in_reward
                           and self.teacher is None)
        with timer("score"):
            if not old_from_update:
                scored = self.actor.score(batch, temperature)
                batch.response_tensors["old_logprobs"] = scored["logprobs"]
            if self.reference is not None:
                batch.response_tensors["ref_logprobs"] = self.reference.score(batch, temperature)["logprobs"]
            if self.teacher is not None:
                batch.response_tensors["teacher_logprobs"] = self.teacher.score(batch, temperature)["logprobs"]
            if self.critic is not None:
                batch.response_tensors["values"] = self.critic.score(batch)["values"]
            scores = torch.tensor(local.scores)
            if self.reward_model is not None:
                scores = scores + reward_model_scores(self.reward_model.score(batch)["values"],
                                                      batch.response_lengths_B)
        self._check(batch, "score", () if old_from_update else ("old_logprobs",))
        stats = ShareStats()
        prm_history = []
        if self.prm is not None:
            with timer("update_prm"):
                prm_history = self.prm.process_rewards(batch, group_ids_B, num_groups, torch.tensor(local.scores),
                                                       seed, step, stats)
            self._check(batch, "update_prm", ("process_rewards",))
        with timer("advantage"):
            share_baseline_B = baseline_B[share.indices] if baseline_B is not None else None
            self._advantages(batch, group_ids_B, scores, share_baseline_B, stats)
        self._check(batch, "advantage", ("advantages", "returns"))
        with timer("update_actor"):
            loss = actor_loss(self.config.actor, self.config.data.max_response_length)
            actor_history, kept = self.actor.update(batch, group_ids_B, num_groups, loss, seed, step,
                                                    temperature=temperature, keep_outputs=old_from_update)
        if old_from_update:
            scored = kept
            batch.response_tensors["old_logprobs"] = scored["logprobs"]
            self._check(batch, "update_actor", ("old_logprobs",))
        critic_history = []
        if self.critic is not None:
            with timer("update_critic"):
                critic_history, _ = self.critic.update(batch, group_ids_B, num_groups, critic_loss(self.config.critic),
                                                       seed, step)
        tensors = batch.response_tensors
        rollout_stats(stats, local, batch, scores)
        mismatch_stats(stats, tensors["old_logprobs"], tensors["rollout_logprobs"], batch.response_mask_BR)
        batch_stats(stats, batch, scored["entropy"])
        metrics = stats.reduce(self.layout.dp_group).values()
        if self.config.algorithm.use_kl_in_reward:
            self.kl_ctrl.update(metrics["actor/reward_kl"], len(rollouts))
            metrics["actor/reward_kl_coef"] = self.kl_ctrl.value
        timing = timer.metrics()
        return {**metrics, **run_metrics(rollouts, rounds), **generation,
                **update_metrics("actor", actor_history), **update_metrics("critic", critic_history),
                **update_metrics("prime", prm_history), **timing, **throughput(metrics, timing["timing/step"])}

    def _generate_training_rollouts(self, step: int) -> tuple[Rollouts, int]:
        """A batch of prompts; with DAPO's group filtering, more prompts until the batch is full of
        informative groups (or the round limit is hit)."""
        algorithm = self.config.algorithm
        wanted = self.config.data.train_batch_size
        kept, rounds = Rollouts(), 0
        while rounds == 0 or (algorithm.filter_groups and len(set(kept.group_ids)) < wanted
                              and rounds <= algorithm.max_filter_rounds):
            prompts = [self.train_data[i] for i in self.sampler.next_batch()]
            fresh = self._collect(prompts, self._sampling(step, validation=False, draw=rounds))
            kept.extend(informative(fresh) if algorithm.filter_groups else fresh)
            rounds += 1
        if algorithm.filter_groups:
            if not kept.group_ids:
                raise RuntimeError(f"step {step}: every group had equal rewards in {rounds} rounds; "
                                   "raise algorithm.max_filter_rounds or disable algorithm.filter_groups")
            kept = first_groups(kept, wanted)
        return kept, rounds

    def _collect(self, prompts: list, sampling: Sampling) -> Rollouts:
        """Rollouts of `prompts` on the engine replicas (trajectories with `rollout.multi_turn`), scored;
        stops the run if no reward call succeeded."""
        if self.multi_turn is not None:
            rollouts = self.multi_turn.collect(prompts, self.policy.engine, sampling, self.rewards)
        else:
            rollouts = collect_rollouts(prompts, self.policy.engine, sampling, self.config.rollout.tp, self.tokenizer,
                                        self.rewards)
        rollouts.require_rewards()
        return rollouts

    def _greedy_baseline(self, rollouts: Rollouts, step: int) -> torch.Tensor:
        """ReMax's baseline: the reward of a greedy response to each sequence's prompt."""
        groups = sorted(set(rollouts.group_ids))
        prompts = [rollouts.prompts[rollouts.group_ids.index(g)] for g in groups]
        greedy = dataclasses.replace(self._sampling(step, validation=False), n=1, temperature=0.0)
        scores = self._collect(prompts, greedy).scores
        by_group = dict(zip(groups, scores))
        return torch.tensor([by_group[g] for g in rollouts.group_ids])

    def _advantages(self, batch, group_ids_B: torch.Tensor, scores: torch.Tensor, baseline_B: torch.Tensor | None,
                    stats: ShareStats) -> None:
        """Advantages and returns of the share (whole groups, so group estimators need nothing else)."""
        algorithm, tensors = self.config.algorithm, batch.response_tensors
        mask_BR = batch.response_mask_BR
        scores = sequence_rewards(scores, batch.response_lengths_B, self.config.data.max_response_length,
                                  algorithm.overlong_buffer_length, algorithm.overlong_penalty_factor)
        token_rewards_BR = token_level_scores(scores.tolist(), batch.response_lengths_B.tolist())
        if algorithm.use_kl_in_reward:
            token_rewards_BR, kl = kl_penalty_rewards(token_rewards_BR, tensors["old_logprobs"],
                                                      tensors["ref_logprobs"], mask_BR, self.kl_ctrl.value,
                                                      algorithm.kl_penalty)
            stats.means["actor/reward_kl"] = (kl * len(batch), len(batch))  # a mean over sequences
        if "teacher_logprobs" in tensors:
            distillation_stats(stats, tensors["old_logprobs"], tensors["teacher_logprobs"], mask_BR)
        advantages_BR, returns_BR = self.estimator(AdvantageInputs(
            token_rewards_BR=token_rewards_BR, mask_BR=mask_BR, group_ids_B=group_ids_B,
            values_BR=tensors.get("values"), baseline_rewards_B=baseline_B, gamma=algorithm.gamma, lam=algorithm.lam,
            student_logprobs_BR=tensors.get("old_logprobs"), teacher_logprobs_BR=tensors.get("teacher_logprobs"),
            task_reward_weight=self.config.teacher.task_reward_weight,
            process_rewards_BR=tensors.get("process_rewards"), outcome_weight=self.config.prime.outcome_weight,
            process_weight=self.config.prime.process_weight,
            norm_by_std=algorithm.norm_adv_by_std, sum_over_batch=lambda sums: sum_over_shares(sums, self.layout),
        ))
        tensors["advantages"], tensors["returns"] = advantages_BR * mask_BR, returns_BR * mask_BR
        valid = mask_BR.bool()
        if baseline_B is not None:
            stats.add_mean("reward/greedy_baseline_mean", baseline_B)
        stats.add_mean("advantages/mean", advantages_BR[valid])
        stats.add_range("advantages", advantages_BR[valid])
        stats.add_mean("returns/mean", returns_BR[valid])

    def _check(self, batch, phase: str, required: tuple[str, ...]) -> None:
        if self.config.trainer.check_batches:
            check_batch(phase, batch, self.actor.arch.vocab_size, required)

    def validate(self, step: int) -> dict[str, float]:
        """Validation of the weights as they are now: synced first, because after a step the engine
        still holds the weights that step started from (a checkpoint of `step` holds the updated ones).
        The engine keeps these weights asleep: the next step's rollout starts from them, unsynced.
        Under split placement the rollout ranks validate, with the weights synced to them first."""
        if self.world is not None:
            return self.policy.validation(step)
        timer = PhaseTimer(step)
        self.policy.enter_rollout(step, timer)
        prompts = validation_prompts(self.val_data, self.config.data.max_val_samples)
        rollouts = self._collect(prompts, self._sampling(0, validation=True))
        self.policy.leave_rollout(timer, keep_weights=True)
        return validation_metrics(rollouts, self.config.rollout.val_n)

