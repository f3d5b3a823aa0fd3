"""Run configuration: typed dataclass schema, YAML + CLI override loading, validation."""

from megarl.config.loader import (
    ConfigError,
    load_config,
    save_resolved,
    validate,
    validate_batches,
    validate_layout,
)
from megarl.config.schema import ActorConfig, ModelConfig, ParallelConfig, RunConfig, TrainerConfig

__all__ = [
    "ActorConfig",
    "ConfigError",
    "ModelConfig",
    "ParallelConfig",
    "RunConfig",
    "TrainerConfig",
    "load_config",
    "save_resolved",
    "validate",
    "validate_batches",
    "validate_layout",
]
