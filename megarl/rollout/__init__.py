"""Rollout engines behind one interface; importing this package registers the backends."""

from megarl.rollout import hf_backend, vllm_backend  # noqa: F401  (registration)
from megarl.rollout.base import ROLLOUT_BACKENDS, RolloutEngine, RolloutOutput, Sampling

__all__ = ["ROLLOUT_BACKENDS", "RolloutEngine", "RolloutOutput", "Sampling"]
