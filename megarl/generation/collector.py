"""Prompts into scored rollouts on the engine replicas, one way for every program that generates: the
placements (training batches and validation) and `launchers/generate.py`.

    collector = RolloutCollector(config, tokenizer, rewards, val_rewards)
    rollouts = collector.collect(prompts, engine, collector.sampling(step, validation=False))
    rollouts = collector.validation(engine, val_data)   # the run's validation prompts and sampling

Single-turn responses (`collect_rollouts`), or with `rollout.multi_turn` trajectories with tools or an
environment (`MultiTurnRollouts`).
"""

from __future__ import annotations

from megarl.config.schema import RunConfig
from megarl.data.dataset import Prompt
from megarl.data.prompt_dataset import PromptDataset
from megarl.generation.inputs import validation_prompts
from megarl.generation.multi_turn import MultiTurnRollouts
from megarl.generation.rollouts import Rollouts, collect_rollouts, rollout_sampling
from megarl.rewards import RewardManager
from megarl.rewards.judge import JudgeRewards
from megarl.rollout import RolloutEngine, Sampling


class RolloutCollector:
    def __init__(self, config: RunConfig, tokenizer, rewards: RewardManager | JudgeRewards,
                 val_rewards: RewardManager | None = None):
        """Built on every rank at once (multi-turn rollouts create the replicas' process groups). `rewards`
        score `collect`'s rollouts, `val_rewards` (default: `rewards`) the validation's: a judge scores
        training rollouts, the reward function validation ones (`megarl.generation.judge`)."""
        self.config, self.tokenizer, self.rewards = config, tokenizer, rewards
        self.val_rewards = val_rewards or rewards
        data = config.data
        self.multi_turn = (MultiTurnRollouts.from_config(config.rollout, tokenizer, data.max_prompt_length,
                                                         data.max_response_length)
                           if config.rollout.multi_turn.enable else None)

    def sampling(self, step: int, validation: bool, draw: int = 0) -> Sampling:
        """The run's sampling of step `step` (`rollout_sampling`)."""
        return rollout_sampling(self.config, self.tokenizer.eos_token_id, step, validation, draw)

    def collect(self, prompts: list[Prompt], engine: RolloutEngine, sampling: Sampling) -> Rollouts:
        """`sampling.n` rollouts of each prompt, scored; every rank learns every score."""
        return self._collect(prompts, engine, sampling, self.rewards)

    def _collect(self, prompts: list[Prompt], engine: RolloutEngine, sampling: Sampling,
                 rewards: RewardManager | JudgeRewards) -> Rollouts:
        if self.multi_turn is not None:
            return self.multi_turn.collect(prompts, engine, sampling, rewards)
        return collect_rollouts(prompts, engine, sampling, self.config.rollout.tp, self.tokenizer, rewards)

    def validation(self, engine: RolloutEngine, val_data: PromptDataset) -> Rollouts:
        """Rollouts of the first `data.max_val_samples` prompts of `val_data` with the validation sampling
        (the same prompts and seeds at every validation)."""
        prompts = validation_prompts(val_data, self.config.data.max_val_samples)
        return self._collect(prompts, engine, self.sampling(0, validation=True), self.val_rewards)
