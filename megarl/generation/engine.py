"""The one way a rollout engine is built: from a run's config, for the trainer's colocated engines,
split placement's rollout ranks and `launchers/generate.py` alike.

    engine = start_rollout_engine(EngineSettings.of_run(config), dummy_weights=True)
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config.schema import RunConfig
from megarl.rollout import ROLLOUT_BACKENDS, RolloutEngine


@dataclass(frozen=True)
class EngineSettings:
    backend: str
    """A name in ROLLOUT_BACKENDS."""
    model_path: str
    """HF directory with the config and tokenizer (and the weights, unless the engine starts with dummy ones)."""
    dtype: str
    tp: int
    max_model_len: int
    kv_cache_bytes: int
    gpu_memory_utilization: float
    seed: int
    bucket_bytes: int
    """Weight-sync bucket size."""
    prefix_caching: bool = True
    """Off where requests outlive a weight update (`rollout.keep_kv`): a cached prefix would outlive its weights."""

    @classmethod
    def of_run(cls, config: RunConfig, model_path: str | None = None) -> EngineSettings:
        """The engine `config.rollout` describes for `config.model` (or the HF directory `model_path`)."""
        rollout, data = config.rollout, config.data
        return cls(rollout.backend, model_path or config.model.path, config.model.dtype, rollout.tp,
                   data.max_prompt_length + data.max_response_length, rollout.kv_cache_mib << 20,
                   rollout.gpu_memory_utilization, config.trainer.seed, rollout.bucket_mib << 20,
                   prefix_caching=not rollout.keep_kv)


    @classmethod
    def of_judge(cls, config: RunConfig) -> EngineSettings:
        """The judge's engine (`reward.judge`): the rollout's backend and TP, the judge's own model and memory
        share, long enough for its longest prompt and verdict."""
        judge, rollout = config.reward.judge, config.rollout
        return cls(rollout.backend, judge.path, config.model.dtype, rollout.tp,
                   judge.max_prompt_length + judge.max_tokens, judge.kv_cache_mib << 20, judge.gpu_memory_utilization,
                   config.trainer.seed, rollout.bucket_mib << 20)


def start_rollout_engine(settings: EngineSettings, dummy_weights: bool) -> RolloutEngine:
    """An engine replica of `settings.tp` consecutive ranks (collective over the world). `dummy_weights`:
    start with placeholder weights, for a weight sync to fill (reading the checkpoint would be wasted)."""
    return ROLLOUT_BACKENDS.get(settings.backend)(
        settings.model_path, dtype=settings.dtype, tensor_parallel_size=settings.tp,
        max_model_len=settings.max_model_len, kv_cache_bytes=settings.kv_cache_bytes,
        gpu_memory_utilization=settings.gpu_memory_utilization, seed=settings.seed, dummy_weights=dummy_weights,
        prefix_caching=settings.prefix_caching)
