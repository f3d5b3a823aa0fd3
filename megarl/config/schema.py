"""Typed schema of a megarl run: one dataclass per section, a docstring under every field.

YAML files and dotted CLI overrides are merged onto these dataclasses by `megarl.config.loader`;
everything below the loader receives instances of these classes, never raw dictionaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

DTYPES = ("float32", "bfloat16", "float16")
LAYER_SPECS = ("auto", "local", "transformer_engine")
OPTIMIZERS = ("adam", "sgd")
LR_DECAY_STYLES = ("constant", "linear", "cosine")


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
class OptimizerConfig:
    """megatron-core optimizer and learning-rate schedule (warmup, then constant/linear/cosine)."""

    optimizer: str = "adam"
    """One of OPTIMIZERS; "adam" is AdamW (decoupled weight decay)."""

    lr: float = 1e-6
    """Peak learning rate, reached after the warmup."""

    min_lr: float = 0.0
    """Learning rate at the end of a linear or cosine decay."""

    lr_warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to `lr`."""

    lr_decay_style: str = "constant"
    """One of LR_DECAY_STYLES; the decay spans the run's optimizer steps after warmup."""

    weight_decay: float = 0.0
    """Decoupled weight decay."""

    adam_beta1: float = 0.9
    """Adam's first-moment decay."""

    adam_beta2: float = 0.999
    """Adam's second-moment decay."""

    adam_eps: float = 1e-8
    """Adam's denominator epsilon."""

    clip_grad: float = 1.0
    """Clip the global gradient norm (over all TP/PP/DP ranks) to this value; 0 disables."""


@dataclass
class EngineConfig(ParallelConfig):
    """A Megatron model that is scored and (for actor and critic) trained."""

    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and learning-rate schedule."""

    ppo_mini_batch_size: int = 8
    """Prompts per optimizer step; each contributes its n sampled responses."""

    ppo_epochs: int = 1
    """Passes over each RL batch; every sample is used exactly once per pass."""

    micro_batch_size_per_rank: int = 4
    """Sequences per forward/backward on one DP rank (fixed-size batching)."""

    use_dynamic_batch_size: bool = False
    """Form micro-batches under a token budget (`max_token_len_per_rank`) instead of a fixed size,
    balancing tokens across micro-batches and DP ranks."""

    max_token_len_per_rank: int = 4096
    """Token budget of one micro-batch on one rank when `use_dynamic_batch_size` is set."""

    use_distributed_optimizer: bool = True
    """Shard optimizer state over DP ranks (megatron's distributed optimizer) when DP > 1."""

    recompute_activations: bool = False
    """Recompute each layer's activations in backward instead of storing them."""

    offload: bool = False
    """Move parameters, gradients and optimizer state to host memory while the rollout engine
    runs (GPU); on CPU the phases only report what they would move."""

    logprob_chunk_size: int = 256
    """Rows per chunk of the vocab-parallel log-prob/entropy kernel (peak memory vs. speed)."""


@dataclass
class ActorConfig(EngineConfig):
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
