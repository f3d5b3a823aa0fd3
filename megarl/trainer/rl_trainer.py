"""The SPMD RL loop: every training rank runs this same program (DESIGN.md, "The loop").

    rollout -> score -> reward -> advantage -> update -> log

Models: the actor (trained), an optional reference (KL), an optional critic (GAE), PRIME's implicit
PRM (`megarl.trainer.prime`), an optional teacher (on-policy distillation, `megarl.trainer.teacher`)
and an optional reward model, all megatron-core models on the actor's layout.

The step's scored rollouts come from the placement (`megarl.placement`): colocated engine replicas that
share the training ranks' memory, or rollout ranks of their own (split); it also validates, and says
what a checkpoint must hold to resume it. The trainer never asks which. Each DP rank then receives its
share of whole groups (the n responses of a prompt), balanced by tokens within every mini-batch
(`megarl.trainer.shares`), and scores, rewards, computes advantages and trains on that share alone.
The step's numbers are reduced over DP as tensors (`megarl.trainer.metrics`).
"""

from __future__ import annotations

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
from megarl.distributed.process import freeze_start_up_objects
from megarl.engine.megatron_engine import BaseModel, MegatronEngine
from megarl.engine.memory import MemoryPhases
from megarl.engine.prompt_sharing import PromptGroups
from megarl.generation.inputs import RunInputs
from megarl.placement import make_placement
from megarl.rewards import token_level_scores
from megarl.tracking import Tracker
from megarl.tracking.timing import PhaseTimer
from megarl.trainer.curves import plot_curves
from megarl.trainer.losses import actor_loss, critic_loss
from megarl.trainer.metrics import (
    ShareStats,
    batch_stats,
    mismatch_stats,
    reward_call_metrics,
    rollout_stats,
    throughput,
    update_metrics,
)
from megarl.trainer.prime import ImplicitPRM
from megarl.trainer.reward import reward_components, sequence_rewards
from megarl.trainer.shares import sum_over_shares, take_share
from megarl.trainer.startup import Run
from megarl.trainer.teacher import distillation_stats, teacher_engine_config


class RLTrainer:
    def __init__(self, run: Run):
        """Inputs are checked first (data, reward function, the checkpoint to resume): a mistake in
        them fails in seconds, before the models and the rollout engine are built."""
        self.config, self.layout, self.run_dir = run.config, run.layout, run.run_dir
        config = self.config
        self.inputs = inputs = RunInputs.open(config)
        self.sampler, self.val_data = inputs.sampler, inputs.val_data
        tokenizer = inputs.tokenizer
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        if self.layout.rank == 0:
            validation = f"; validation: {self.val_data.describe()}" if self.val_data is not None else ""
            print(f"training data: {inputs.train_data.describe()}{validation}", flush=True)
        trainer = config.trainer
        self.checkpointer = Checkpointer(Path(trainer.checkpoint_dir) / trainer.experiment_name, config.model.path,
                                         self.run_dir / "config.yaml", trainer.max_ckpt_to_keep, trainer.async_save)
        resume_from = self.checkpointer.find(trainer.resume_mode, trainer.resume_path)
        self.estimator = ADVANTAGE_ESTIMATORS.get(config.algorithm.adv_estimator)
        run.save_config()
        self.actor = self._engine(config.actor, trainable=True, router_replay=config.actor.router_replay)
        self.reference = None
        if config.actor.use_kl_loss or config.algorithm.use_kl_in_reward:  # LoRA: the actor's own base
            self.reference = BaseModel(self.actor) if self.actor.adapters else self._engine(config.actor, False)
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
        self.placement = make_placement(config, run.world, inputs, self.actor, self._offloading(),
                                        self.estimator.needs_greedy_baseline)
        kl = config.algorithm.kl_ctrl
        self.kl_ctrl = (AdaptiveKLController(kl.coef, kl.target_kl, kl.horizon) if kl.type == "adaptive"
                        else FixedKLController(kl.coef))
        self.start_step, run_id, placement_state = 1, None, {}
        if resume_from is not None:
            state = self.checkpointer.load(resume_from, self._trainable())
            self.sampler.load_state_dict(state["sampler"])
            self.kl_ctrl.value = state["kl_coef"]
            self.start_step, run_id, placement_state = state["step"] + 1, state["mlflow_run_id"], state["placement"]
            if self.layout.rank == 0:
                print(f"resumed from {resume_from} (step {state['step']})", flush=True)
        self.placement.start(self.start_step, self.sampler.state_dict(), placement_state)
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
                              value_head=value, router_replay=router_replay, groups=PromptGroups.of_run(self.config))

    def _implicit_prm(self) -> ImplicitPRM:
        """PRIME's PRM and its frozen reference: the run's reference model when both start from model.path."""
        prime = self.config.prime
        path = prime.path or self.config.model.path
        engine = self._engine(prime, trainable=True, path=path)
        same_start = self.reference is not None and path == self.config.model.path
        return ImplicitPRM(prime, engine, self.reference if same_start else self._engine(prime, False, path=path))

    def _offloading(self) -> list[MemoryPhases]:
        """The models that leave the device while a colocated engine generates: those with `offload` set (the
        reference and the teacher follow `actor.offload`; the PRM's reference is the run's or follows
        `prime.offload`)."""
        prm = (self.prm.engine, self.prm.reference) if self.prm is not None else ()
        models = (self.actor, self.reference, self.critic, self.teacher, *prm)
        return list(dict.fromkeys(model.memory for model in models if model is not None and model.config.offload))

    # ---- the loop ---------------------------------------------------------------------------------

    def fit(self) -> dict[str, float]:
        with self.tracker:  # the mlflow run ends FAILED if training stops on an error
            last = self._train()
        self.placement.shutdown()
        return last

    def _train(self) -> dict[str, float]:
        """Validate, train every step left (validating and saving as configured), and leave the curves."""
        trainer = self.config.trainer
        last = {}
        if self.val_data is not None and trainer.val_before_train and self.start_step == 1:
            self.tracker.log(self.placement.validate(step=0), step=0)
        freeze_start_up_objects()
        for step in self.tracker.progress(range(self.start_step, trainer.total_steps + 1)):
            self.checkpointer.poll()
            last = self.step(step)
            if self.val_data is not None and (step == trainer.total_steps or
                                              (trainer.test_freq and step % trainer.test_freq == 0)):
                last.update(self.placement.validate(step))
            self.tracker.log(last, step)
            if trainer.save_freq and (step % trainer.save_freq == 0 or step == trainer.total_steps):
                self.tracker.flush()  # the store holds every step the checkpoint resumes after
                self.checkpointer.save(step, self._trainable(), {
                    "sampler": self.sampler.state_dict(), "kl_coef": self.kl_ctrl.value,
                    "mlflow_run_id": self.tracker.run_id}, self.placement.checkpoint_state())
        self.checkpointer.wait()
        if self.layout.rank == 0:
            self.tracker.log_artifact(plot_curves(self.tracker.history, self.run_dir / "curves.png"))
            self.tracker.log_artifact(self.run_dir / "config.yaml")
        return last

    def step(self, step: int) -> dict[str, float]:
        timer = PhaseTimer(step)
        made = self.placement.rollouts(step, timer)
        local, share = take_share(made.rollouts, self.layout, made.move, self.config.actor.ppo_mini_batch_size,
                                  self.config.trainer.seed, step)
        group_ids_B, num_groups = share.group_ids_B, share.num_groups
        batch = local.to_batch(self.pad_token_id)
        tensors, temperature, seed = batch.response_tensors, self.config.rollout.temperature, self.config.trainer.seed
        # The old log-probs: the engine's (actor.recompute_old_logprobs=false), or the trainer's, which a
        # single-step actor update computes in its own forward: no scoring pass (unless the reward's KL or the
        # teacher's needs them first).
        recompute = self.config.actor.recompute_old_logprobs
        old_from_update = (recompute and self.actor.is_single_step(num_groups)
                           and not self.config.algorithm.use_kl_in_reward and self.teacher is None)
        reward_model_scores_B, scored = None, None
        if not recompute:
            tensors.old_logprobs_BR = tensors.rollout_logprobs_BR
        with timer("score"):
            if recompute and not old_from_update:
                scored = self.actor.score(batch, temperature)
                tensors.old_logprobs_BR = scored["logprobs"]
            if self.reference is not None:
                tensors.ref_logprobs_BR = self.reference.score(batch, temperature)["logprobs"]
            if self.teacher is not None:
                tensors.teacher_logprobs_BR = self.teacher.score(batch, temperature)["logprobs"]
            if self.critic is not None:
                tensors.values_BR = self.critic.score(batch)["values"]
            if self.reward_model is not None:
                reward_model_scores_B = self.reward_model.score(batch)["last_values"]
        stats = ShareStats()
        with timer("reward"):
            scores_B, token_rewards_BR = self._rewards(batch, local.scores, reward_model_scores_B, stats)
        prm_history = []
        if self.prm is not None:
            with timer("update_prm"):
                prm_history = self.prm.process_rewards(batch, group_ids_B, num_groups, torch.tensor(local.scores),
                                                       seed, step, stats)
        with timer("advantage"):
            baseline_B = made.greedy_baseline_B[share.indices] if made.greedy_baseline_B is not None else None
            components_BK = reward_components(local.score_extras, self.config.algorithm.reward_components)
            self._advantages(batch, group_ids_B, token_rewards_BR, baseline_B, components_BK, stats)
        with timer("update_actor"):
            loss = actor_loss(self.config.actor, self.config.algorithm.rollout_correction,
                              self.config.data.max_response_length)
            actor_history, kept = self.actor.update(batch, group_ids_B, num_groups, loss, seed, step,
                                                    temperature=temperature, keep_outputs=old_from_update)
        if old_from_update:
            scored = kept
            tensors.old_logprobs_BR = scored["logprobs"]
        critic_history = []
        if self.critic is not None:
            with timer("update_critic"):
                critic_history, _ = self.critic.update(batch, group_ids_B, num_groups, critic_loss(self.config.critic),
                                                       seed, step)
        rollout_stats(stats, local, batch, scores_B)
        if recompute:
            mismatch_stats(stats, tensors.old_logprobs_BR, tensors.rollout_logprobs_BR, batch.response_mask_BR)
        batch_stats(stats, batch, scored["entropy"] if scored is not None else None)
        metrics = stats.reduce(self.layout.dp_group).values()
        if self.config.algorithm.use_kl_in_reward:
            self.kl_ctrl.update(metrics["actor/reward_kl"], len(made.rollouts))
            metrics["actor/reward_kl_coef"] = self.kl_ctrl.value
        timing = timer.metrics()
        return {**metrics, **reward_call_metrics(made.rollouts), **made.metrics,
                **update_metrics("actor", actor_history), **update_metrics("critic", critic_history),
                **update_metrics("prime", prm_history), **timing, **throughput(metrics, timing["timing/step"])}

    def _rewards(self, batch, function_scores: list[float], reward_model_scores_B: torch.Tensor | None,
                 stats: ShareStats) -> tuple[torch.Tensor, torch.Tensor]:
        """The reward phase: each response's score (the reward function's, plus the reward model's), and the
        (B, R) token rewards the estimator takes: the score, less DAPO's overlong penalty, on the last token,
        less the KL penalty against the reference on every token (`algorithm.use_kl_in_reward`)."""
        algorithm, tensors = self.config.algorithm, batch.response_tensors
        scores_B = torch.tensor(function_scores)
        if reward_model_scores_B is not None:
            scores_B = scores_B + reward_model_scores_B
        penalized_B = sequence_rewards(scores_B, batch.response_lengths_B, self.config.data.max_response_length,
                                       algorithm.overlong_buffer_length, algorithm.overlong_penalty_factor)
        token_rewards_BR = token_level_scores(penalized_B.tolist(), batch.response_lengths_B.tolist())
        if algorithm.use_kl_in_reward:
            token_rewards_BR, kl = kl_penalty_rewards(token_rewards_BR, tensors.old_logprobs_BR,
                                                      tensors.ref_logprobs_BR, batch.response_mask_BR,
                                                      self.kl_ctrl.value, algorithm.kl_penalty)
            stats.means["actor/reward_kl"] = (kl * len(batch), len(batch))  # a mean over sequences
        return scores_B, token_rewards_BR

    def _advantages(self, batch, group_ids_B: torch.Tensor, token_rewards_BR: torch.Tensor,
                    baseline_B: torch.Tensor | None, components_BK: torch.Tensor | None, stats: ShareStats) -> None:
        """Advantages and returns of the share (whole groups, so group estimators need nothing else)."""
        algorithm, tensors = self.config.algorithm, batch.response_tensors
        mask_BR = batch.response_mask_BR
        if tensors.teacher_logprobs_BR is not None:
            distillation_stats(stats, tensors.old_logprobs_BR, tensors.teacher_logprobs_BR, mask_BR)
        advantages_BR, returns_BR = self.estimator(AdvantageInputs(
            token_rewards_BR=token_rewards_BR, mask_BR=mask_BR, group_ids_B=group_ids_B,
            values_BR=tensors.values_BR, baseline_rewards_B=baseline_B, gamma=algorithm.gamma, lam=algorithm.lam,
            student_logprobs_BR=tensors.old_logprobs_BR, teacher_logprobs_BR=tensors.teacher_logprobs_BR,
            task_reward_weight=self.config.teacher.task_reward_weight,
            process_rewards_BR=tensors.process_rewards_BR, outcome_weight=self.config.prime.outcome_weight,
            process_weight=self.config.prime.process_weight, reward_components_BK=components_BK,
            norm_by_std=algorithm.norm_adv_by_std, sum_over_batch=lambda sums: sum_over_shares(sums, self.layout),
        ))
        tensors.advantages_BR, tensors.returns_BR = advantages_BR * mask_BR, returns_BR * mask_BR
        valid = mask_BR.bool()
        if baseline_B is not None:
            stats.add_mean("reward/greedy_baseline_mean", baseline_B)
        stats.add_mean("advantages/mean", advantages_BR[valid])
        stats.add_range("advantages", advantages_BR[valid])
        stats.add_mean("returns/mean", returns_BR[valid])
