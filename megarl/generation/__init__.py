"""Turning prompts into scored rollouts, for the trainer's placements, `launchers/generate.py` and
`launchers/evaluate.py`: the run's inputs, the one function that builds a rollout engine, the policy served by
its colocated engine, rollout collection (single- and multi-turn) and validation metrics."""

from megarl.generation.collector import RolloutCollector
from megarl.generation.engine import EngineSettings, start_rollout_engine
from megarl.generation.inputs import RunInputs, prompt_dataset, reward_manager, validation_prompts
from megarl.generation.policy import RolloutPolicy
from megarl.generation.rollouts import Rollouts, collect_rollouts, move_responses, rollout_sampling
from megarl.generation.validation import pass_at_k, validation_metrics

__all__ = ["EngineSettings", "RolloutCollector", "RolloutPolicy", "Rollouts", "RunInputs", "collect_rollouts",
           "move_responses", "pass_at_k", "prompt_dataset", "reward_manager", "rollout_sampling",
           "start_rollout_engine", "validation_metrics", "validation_prompts"]
