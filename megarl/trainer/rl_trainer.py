"""The SPMD RL loop: every rank runs this same program (DESIGN.md, "The loop").

    reshard -> rollout -> reward -> score -> advantage -> update -> log

Models: the actor (trained), an optional reference (KL), an optional critic (GAE) and an optional
reward model, all megatron-core models on the actor's layout, and one colocated rollout engine
per TP_r ranks. Every rank holds the whole batch of the step; the engines split work over DP.

Memory is shared in time. Between phases the rollout engine sleeps and the Megatron models are
resident. Before a rollout, the models with `offload` leave the device (the actor's parameters
last, after the sync has read them), the engine's weights wake before the sync and its KV cache
after it; after the rollout the engine sleeps and the models come back. The engine itself is
created while the models are offloaded, so vLLM's memory check and KV-cache budget see the memory
a rollout will have.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from statistics import mean

import torch
from transformers import AutoTokenizer

from megarl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    NEEDS_GREEDY_BASELINE,
    AdaptiveKLController,
    AdvantageInputs,
    FixedKLController,
    keep_informative_groups,
    kl_penalty_rewards,
    overlong_penalty,
    rollout_mismatch_metrics,
)
from megarl.checkpoint import Checkpointer
from megarl.config.schema import EngineConfig
from megarl.data.dataset import PromptDataset
from megarl.data.sampler import ResumableSampler
from megarl.engine.megatron_engine import MegatronEngine
from megarl.resharding.executor import SyncStats, WeightSync
from megarl.rewards import RewardManager, compute_score, load_function, token_level_scores
from megarl.rollout import ROLLOUT_BACKENDS, Sampling
from megarl.tracking import Tracker
from megarl.trainer.contract import check_batch
from megarl.trainer.curves import plot_curves
from megarl.trainer.losses import actor_loss, critic_loss
from megarl.trainer.rollouts import Rollouts, collect_rollouts
from megarl.trainer.startup import Run
from megarl.trainer.timing import PhaseTimer
from megarl.trainer.validation import validation_metrics


class RLTrainer:
    def __init__(self, run: Run):
        self.config, self.layout, self.run_dir = run.config, run.layout, run.run_dir
        config = self.config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.path)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        data = config.data
        self.train_data = PromptDataset(data.train_files, self.tokenizer, data.max_prompt_length,
                                        data.apply_chat_template)
        self.val_data = (PromptDataset(data.val_files, self.tokenizer, data.max_prompt_length,
                                       data.apply_chat_template) if data.val_files else None)
        self.sampler = ResumableSampler(len(self.train_data), data.train_batch_size, config.trainer.seed,
                                        shuffle=data.shuffle)
        trainer = config.trainer
        self.checkpointer = Checkpointer(Path(trainer.checkpoint_dir) / trainer.experiment_name, config.model.path,
                                         self.run_dir / "config.yaml", trainer.max_ckpt_to_keep, trainer.async_save)
        resume_from = self.checkpointer.find(trainer.resume_mode, trainer.resume_path)
        self.estimator = ADVANTAGE_ESTIMATORS.get(config.algorithm.adv_estimator)
        self.actor = self._engine(config.actor, trainable=True)
        uses_reference = config.actor.use_kl_loss or config.algorithm.use_kl_in_reward
        self.reference = self._engine(config.actor, trainable=False) if uses_reference else None
        self.critic = None
        if config.critic.enable:
            self.critic = self._engine(config.critic, trainable=True, path=config.critic.path or None, value=True)
        self.reward_model = None
        if config.reward.reward_model_path:
            self.reward_model = self._engine(EngineConfig(), trainable=False, path=config.reward.reward_model_path)
        self.rollout = self._rollout_engine()
        self.sync = WeightSync(self.actor.module, self.actor.arch, self.layout, self.rollout, config.rollout.tp,
                               config.rollout.bucket_mib << 20)
        score_fn = (load_function(config.reward.custom_function_path, config.reward.custom_function_name)
                    if config.reward.custom_function_path else compute_score)
        self.rewards = RewardManager(score_fn, config.reward.timeout_seconds)
        kl = config.algorithm.kl_ctrl
        self.kl_ctrl = (AdaptiveKLController(kl.coef, kl.target_kl, kl.horizon) if kl.type == "adaptive"
                        else FixedKLController(kl.coef))
        self.start_step, run_id = 1, None
        if resume_from is not None:
            state = self.checkpointer.load(resume_from, self._trainable())
            self.sampler.load_state_dict(state["sampler"])
            self.kl_ctrl.value = state["kl_coef"]
            self.start_step, run_id = state["step"] + 1, state["mlflow_run_id"]
            if self.layout.rank == 0:
                print(f"resumed from {resume_from} (step {state['step']})", flush=True)
        self.tracker = Tracker(trainer.loggers, self.run_dir, trainer.experiment_name, trainer.mlflow_tracking_uri,
                               config, is_writer=self.layout.rank == 0, run_id=run_id)

    # ---- set-up -----------------------------------------------------------------------------------

    def _trainable(self) -> dict[str, MegatronEngine]:
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    def _optimizer_steps(self, engine_config: EngineConfig) -> int:
        per_step = math.ceil(self.config.data.train_batch_size / engine_config.ppo_mini_batch_size)
        return self.config.trainer.total_steps * engine_config.ppo_epochs * per_step

    def _engine(self, engine_config: EngineConfig, trainable: bool, path: str | None = None,
                value: bool = False) -> MegatronEngine:
        return MegatronEngine(self.layout, self.config.model, engine_config, model_path=path,
                              total_optimizer_steps=self._optimizer_steps(engine_config) if trainable else None,
                              value_head=value)

    def _rollout_engine(self):
        """The engine starts with dummy weights: every generation follows a sync from the actor, so
        reading the checkpoint's weights a second time (minutes for a large model) would be wasted.
        It is created while the models are offloaded (vLLM sizes its KV cache from the free memory
        it sees then) and put to sleep before they return."""
        rollout, data = self.config.rollout, self.config.data
        backend = ROLLOUT_BACKENDS.get(rollout.backend)
        for model in self._offloading():
            model.memory.offload()
        engine = backend(self.config.model.path, dtype=self.config.model.dtype, tensor_parallel_size=rollout.tp,
                         max_model_len=data.max_prompt_length + data.max_response_length,
                         kv_cache_bytes=rollout.kv_cache_mib << 20,
                         gpu_memory_utilization=rollout.gpu_memory_utilization, seed=self.config.trainer.seed,
                         dummy_weights=True)
        engine.sleep()
        for model in self._offloading():
            model.memory.reload()
        return engine

    def _offloading(self) -> list[MegatronEngine]:
        """The models that leave the device during rollouts (the reference follows `actor.offload`)."""
        return [engine for engine in (self.actor, self.reference, self.critic)
                if engine is not None and engine.config.offload]

    def _enter_rollout(self, step: int, timer: PhaseTimer) -> SyncStats:
        """Trainer out, engine in, each part into the memory the previous one freed."""
        with timer("offload"):
            for engine in self._offloading():
                engine.memory.offload(keep_params=engine is self.actor)  # the sync reads them
        with timer("reshard"):
            self.rollout.wake_up(("weights",))
            sync = self.sync.sync(step)
        with timer("offload"):
            if self.actor.config.offload:
                self.actor.memory.offload()
            self.rollout.wake_up(("kv_cache",))
        return sync

    def _leave_rollout(self, timer: PhaseTimer) -> None:
        with timer("reload"):
            self.rollout.sleep()
            for engine in self._offloading():
                engine.memory.reload()

    def _sampling(self, step: int, validation: bool) -> Sampling:
        rollout = self.config.rollout
        stop = (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ()
        if validation:
            return Sampling(n=rollout.val_n, temperature=rollout.val_temperature, top_p=rollout.top_p,
                            top_k=rollout.top_k, max_tokens=self.config.data.max_response_length,
                            stop_token_ids=stop, seed=self.config.trainer.seed)
        return Sampling(n=rollout.n, temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                        max_tokens=self.config.data.max_response_length, stop_token_ids=stop,
                        seed=self.config.trainer.seed * 1_000_003 + step * 65_537)

    # ---- the loop ---------------------------------------------------------------------------------

    def fit(self) -> dict[str, float]:
        trainer = self.config.trainer
        last = {}
        if self.val_data is not None and trainer.val_before_train and self.start_step == 1:
            self.tracker.log(self.validate(step=0), step=0)
        for step in range(self.start_step, trainer.total_steps + 1):
            self.checkpointer.poll()
            last = self.step(step)
            if self.val_data is not None and (step == trainer.total_steps or
                                              (trainer.test_freq and step % trainer.test_freq == 0)):
                last.update(self.validate(step))
            self.tracker.log(last, step)
            if trainer.save_freq and (step % trainer.save_freq == 0 or step == trainer.total_steps):
                self.checkpointer.save(step, self._trainable(), {
                    "sampler": self.sampler.state_dict(), "kl_coef": self.kl_ctrl.value,
                    "mlflow_run_id": self.tracker.run_id})
        self.checkpointer.wait()
        if self.layout.rank == 0:
            self.tracker.log_artifact(plot_curves(self.tracker.history, self.run_dir / "curves.png"))
            self.tracker.log_artifact(self.run_dir / "config.yaml")
        self.tracker.close()
        self.rollout.shutdown()
        return last

    def step(self, step: int) -> dict[str, float]:
        timer = PhaseTimer()
        sync = self._enter_rollout(step, timer)
        with timer("rollout"):
            rollouts, rounds = self._generate_training_rollouts(step)
            baseline_B = (self._greedy_baseline(rollouts, step)
                          if self.config.algorithm.adv_estimator in NEEDS_GREEDY_BASELINE else None)
        self._leave_rollout(timer)
        batch = rollouts.to_batch(self.pad_token_id)
        self._check(batch, "rollout", ("rollout_logprobs",))
        temperature = self.config.rollout.temperature
        # A single-step actor update computes the old log-probs in its own forward: no scoring pass.
        old_from_update = (self.actor.is_single_step(len(batch), self.config.rollout.n)
                           and not self.config.algorithm.use_kl_in_reward)
        with timer("score"):
            if not old_from_update:
                scored = self.actor.score(batch, temperature)
                batch.response_tensors["old_logprobs"] = scored["logprobs"]
            if self.reference is not None:
                batch.response_tensors["ref_logprobs"] = self.reference.score(batch, temperature)["logprobs"]
            if self.critic is not None:
                batch.response_tensors["values"] = self.critic.score(batch)["values"]
            scores = torch.tensor(rollouts.scores)
            if self.reward_model is not None:
                scores = scores + self._reward_model_scores(batch)
        self._check(batch, "score", () if old_from_update else ("old_logprobs",))
        with timer("advantage"):
            advantage_metrics = self._advantages(batch, rollouts, scores, baseline_B)
        self._check(batch, "advantage", ("advantages", "returns"))
        with timer("update_actor"):
            loss = actor_loss(self.config.actor, self.config.data.max_response_length)
            actor_history, kept = self.actor.update(batch, loss, self.config.rollout.n, seed=step,
                                                    temperature=temperature, keep_outputs=old_from_update)
        if old_from_update:
            scored = kept
            batch.response_tensors["old_logprobs"] = scored["logprobs"]
            self._check(batch, "update_actor", ("old_logprobs",))
        critic_history = []
        if self.critic is not None:
            with timer("update_critic"):
                critic_history, _ = self.critic.update(batch, critic_loss(self.config.critic), self.config.rollout.n,
                                                       seed=step)
        return self._metrics(step, batch, rollouts, scores, scored, sync, rounds, timer, advantage_metrics,
                             actor_history, critic_history)

    def _generate_training_rollouts(self, step: int) -> tuple[Rollouts, int]:
        """A batch of prompts; with DAPO's group filtering, more prompts until the batch is full of
        informative groups (or the round limit is hit)."""
        algorithm = self.config.algorithm
        wanted = self.config.data.train_batch_size
        kept, rounds = Rollouts(), 0
        while rounds == 0 or (algorithm.filter_groups and len(set(kept.group_ids)) < wanted
                              and rounds <= algorithm.max_filter_rounds):
            prompts = [self.train_data[i] for i in self.sampler.next_batch()]
            fresh = collect_rollouts(prompts, self.rollout, self._sampling(step * 31 + rounds, validation=False),
                                     self.config.rollout.tp, self.tokenizer, self.rewards)
            if algorithm.filter_groups:
                keep = keep_informative_groups(torch.tensor(fresh.scores), torch.tensor(fresh.group_ids))
                fresh = fresh.select([i for i, k in enumerate(keep.tolist()) if k])
            kept.extend(fresh)
            rounds += 1
        if algorithm.filter_groups:
            if not kept.group_ids:
                raise RuntimeError(f"step {step}: every group had equal rewards in {rounds} rounds; "
                                   "raise algorithm.max_filter_rounds or disable algorithm.filter_groups")
            keep = set(sorted(set(kept.group_ids))[:wanted])
            kept = kept.select([i for i, g in enumerate(kept.group_ids) if g in keep])
        return kept, rounds

    def _greedy_baseline(self, rollouts: Rollouts, step: int) -> torch.Tensor:
        """ReMax's baseline: the reward of a greedy response to each sequence's prompt."""
        groups = sorted(set(rollouts.group_ids))
        prompts = [rollouts.prompts[rollouts.group_ids.index(g)] for g in groups]
        greedy = dataclasses.replace(self._sampling(step, validation=False), n=1, temperature=0.0)
        scores = collect_rollouts(prompts, self.rollout, greedy, self.config.rollout.tp, self.tokenizer,
                                  self.rewards).scores
        by_group = dict(zip(groups, scores))
        return torch.tensor([by_group[g] for g in rollouts.group_ids])

    def _reward_model_scores(self, batch) -> torch.Tensor:
        values_BR = self.reward_model.score(batch)["values"]
        last = (batch.response_lengths_B - 1).clamp(min=0)
        return values_BR.gather(1, last[:, None]).squeeze(1)

    def _advantages(self, batch, rollouts: Rollouts, scores: torch.Tensor,
                    baseline_B: torch.Tensor | None) -> dict[str, float]:
        algorithm, tensors = self.config.algorithm, batch.response_tensors
        mask_BR = batch.response_mask_BR
        if algorithm.overlong_buffer_length:
            scores = scores + overlong_penalty(batch.response_lengths_B, self.config.data.max_response_length,
                                               algorithm.overlong_buffer_length, algorithm.overlong_penalty_factor)
        token_rewards_BR = token_level_scores(scores.tolist(), batch.response_lengths_B.tolist())
        metrics = {}
        if algorithm.use_kl_in_reward:
            token_rewards_BR, kl = kl_penalty_rewards(token_rewards_BR, tensors["old_logprobs"], tensors["ref_logprobs"],
                                                      mask_BR, self.kl_ctrl.value, algorithm.kl_penalty)
            self.kl_ctrl.update(kl, len(batch))
            metrics.update({"actor/reward_kl": kl, "actor/reward_kl_coef": self.kl_ctrl.value})
        advantages_BR, returns_BR = self.estimator(AdvantageInputs(
            token_rewards_BR=token_rewards_BR, mask_BR=mask_BR, group_ids_B=torch.tensor(rollouts.group_ids),
            values_BR=tensors.get("values"), baseline_rewards_B=baseline_B, gamma=algorithm.gamma, lam=algorithm.lam,
            norm_by_std=algorithm.norm_adv_by_std,
        ))
        tensors["advantages"], tensors["returns"] = advantages_BR * mask_BR, returns_BR * mask_BR
        valid = mask_BR.bool()
        metrics.update({"advantages/mean": float(advantages_BR[valid].mean()),
                        "advantages/max": float(advantages_BR[valid].max()),
                        "advantages/min": float(advantages_BR[valid].min()),
                        "returns/mean": float(returns_BR[valid].mean())})
        return metrics

    def _check(self, batch, phase: str, required: tuple[str, ...]) -> None:
        if self.config.trainer.check_batches:
            check_batch(phase, batch, self.actor.arch.vocab_size, required)

    def _metrics(self, step, batch, rollouts, scores, scored, sync, rounds, timer, advantage_metrics,
                 actor_history, critic_history) -> dict[str, float]:
        lengths = batch.response_lengths_B.float()
        mask_BR = batch.response_mask_BR
        tokens = int(batch.sequence_lengths_B.sum())
        metrics = {
            "reward/mean": float(scores.mean()), "reward/max": float(scores.max()), "reward/min": float(scores.min()),
            "reward/errors": float(rollouts.num_reward_errors), "reward/timeouts": float(rollouts.num_reward_timeouts),
            "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": mean(r == "length" for r in rollouts.finish_reasons),
            "rollout/entropy": float((scored["entropy"] * mask_BR).sum() / mask_BR.sum()),
            "rollout/filter_rounds": float(rounds),
            "sync/seconds": sync.seconds, "sync/bytes_received": float(sync.bytes_received),
            "sync/bytes_over_lower_bound": sync.bytes_received / max(sync.lower_bound, 1),
            "throughput/tokens_per_s": tokens / max(sum(timer.seconds.values()), 1e-9),
            **advantage_metrics,
            **rollout_mismatch_metrics(batch.response_tensors["old_logprobs"],
                                       batch.response_tensors["rollout_logprobs"], mask_BR),
            **timer.metrics(),
        }
        for key, values in rollouts.score_extras.items():
            finite = [v for v in values if not math.isnan(v)]
            if finite:
                metrics[f"reward/{key}"] = mean(finite)
        for prefix, history in (("actor", actor_history), ("critic", critic_history)):
            for key in history[0] if history else ():
                metrics[key if "/" in key else f"{prefix}/{key}"] = mean(h[key] for h in history)
        return metrics

    def validate(self, step: int) -> dict[str, float]:
        """Validation of the weights as they are now: synced first, because after a step the engine
        still holds the weights that step started from (a checkpoint of `step` holds the updated ones)."""
        timer = PhaseTimer()
        self._enter_rollout(step, timer)
        limit = self.config.data.max_val_samples or len(self.val_data)
        prompts = [self.val_data[i] for i in range(min(limit, len(self.val_data)))]
        rollouts = collect_rollouts(prompts, self.rollout, self._sampling(0, validation=True), self.config.rollout.tp,
                                    self.tokenizer, self.rewards)
        self._leave_rollout(timer)
        return validation_metrics(rollouts, self.config.rollout.val_n)

