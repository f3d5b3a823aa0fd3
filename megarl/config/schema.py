"""Typed schema of a megarl run: one dataclass per section, a docstring under every field.

YAML files and dotted CLI overrides are merged onto these dataclasses by `megarl.config.loader`;
everything below the loader receives instances of these classes, never raw dictionaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

DTYPES = ("float32", "bfloat16", "float16")
LAYER_SPECS = ("auto", "local", "transformer_engine")


@dataclass
class ModelConfig:
    path: str = MISSING
    """HuggingFace model directory holding config.json and the *.safetensors weights."""

    dtype: str = "float32"
    """Parameter and compute dtype; one of DTYPES."""

    make_vocab_size_divisible_by: int = 128
    """The embedding is padded to a multiple of this value times TP, as in Megatron."""

    layer_spec: str = "auto"
    """Transformer layer implementation, one of LAYER_SPECS; "auto" picks Transformer Engine
    when it is importable and CUDA is present, the local (pure PyTorch) layers otherwise."""


@dataclass
class ParallelConfig:
    """Model-parallel sizes; DP is derived as world_size // (tp * pp * cp)."""

    tp: int = 1
    """Tensor-parallel size."""

    pp: int = 1
    """Pipeline-parallel size."""

    cp: int = 1
    """Context-parallel size (the sequence is split across this many ranks)."""

    ep: int = 1
    """Expert-parallel size; expert groups are carved out of the DP * CP ranks."""


@dataclass
class ActorConfig(ParallelConfig):
    """The policy being trained; its parallel sizes sit directly on it (`actor.tp=2`)."""


@dataclass
class TrainerConfig:
    experiment_name: str = "megarl"
    """Name of the run; outputs go to <output_dir>/<experiment_name>."""

    output_dir: str = "outputs"
    """Root directory of run directories."""

    seed: int = 1
    """Seed for every random number generator of the run."""

    total_steps: int = 1
    """Number of RL steps (rollout plus update) to run."""


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to start from."""

    actor: ActorConfig = field(default_factory=ActorConfig)
    """The policy being trained and its parallel layout."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The training loop: length, seed, where outputs go."""
