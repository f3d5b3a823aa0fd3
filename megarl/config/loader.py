"""Load a run config: schema defaults, then a YAML file, then dotted CLI overrides.

Every user mistake becomes a one-line `ConfigError` naming the full dotted key, the bad value and
what is allowed. Unknown keys and non-mapping sections are caught by walking the input against
the schema before merging, so OmegaConf's own errors are left to report only bad scalar values.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from collections.abc import Sequence
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    InterpolationResolutionError,
    KeyValidationError,
    MissingMandatoryValue,
    ValidationError,
)

from megarl.config.schema import (
    DTYPES,
    KL_CONTROLLERS,
    LAYER_SPECS,
    LOGGERS,
    MULTI_TURN_REWARDS,
    LR_DECAY_STYLES,
    OPTIMIZERS,
    PLACEMENTS,
    PRIME_UPDATES,
    RESUME_MODES,
    EngineConfig,
    JudgeConfig,
    MultiTurnConfig,
    RolloutCorrectionConfig,
    RunConfig,
)
from megarl.messages import one_line
from megarl.models.lora import TARGETS as LORA_TARGETS
from megarl.rewards.judge import check_template


class ConfigError(ValueError):
    """A user error in the run configuration; the message is a single line."""


def _schema_keys(cls: type, prefix: str = "") -> dict[str, type]:
    """Every dotted key of a schema dataclass mapped to its type; sections map to their class."""
    keys = {}
    for name, hint in typing.get_type_hints(cls).items():
        keys[prefix + name] = hint
        if dataclasses.is_dataclass(hint):
            keys.update(_schema_keys(hint, f"{prefix}{name}."))
    return keys


_KEY_TYPES = _schema_keys(RunConfig)


def load_config(path: str | None, overrides: Sequence[str] = (), model_required: bool = True) -> RunConfig:
    """Build the validated RunConfig from an optional YAML file and `key=value` overrides. `model_required=False`:
    `model.path` may be left out (a program that reads the run's config but loads no model: `evaluate.py`)."""
    config = OmegaConf.structured(RunConfig)
    if not model_required:
        config.model.path = ""
    if path is not None:
        config = _merge(config, _read_yaml(path), source=f"in {path}")
    for override in overrides:
        config = _merge(config, _parse_override(override), source=f"in override '{override}'")
    try:
        run_config = OmegaConf.to_object(config)
    except MissingMandatoryValue as error:
        raise ConfigError(
            f"config key '{error.full_key}' is required: "
            f"set it in the YAML file or pass {error.full_key}=<value>"
        ) from None
    except ValidationError as error:  # an interpolation resolved to a value of the wrong type
        raise ConfigError(_type_message(error)) from None
    except InterpolationResolutionError as error:
        first_line = str(error).splitlines()[0]
        raise ConfigError(f"config key '{error.full_key}' cannot be resolved: {first_line}") from None
    validate(run_config)
    run_config.algorithm.rollout_correction.preset = _resolved_rollout_correction(run_config)
    return run_config


def validate(config: RunConfig) -> None:
    """Check values that types alone cannot: choices, numeric ranges, features not implemented."""
    _check_choice("model.dtype", config.model.dtype, DTYPES)
    _check_choice("model.layer_spec", config.model.layer_spec, LAYER_SPECS)
    _check_at_least("model.make_vocab_size_divisible_by", config.model.make_vocab_size_divisible_by, 1)
    for name in ("aux_loss_coeff", "z_loss_coeff"):  # a negative weight would reward imbalance
        _check_at_least(f"model.moe.{name}", getattr(config.model.moe, name), 0)
    actor = config.actor
    for name in ("tp", "pp", "ep"):
        _check_at_least(f"actor.{name}", getattr(actor, name), 1)
    _check_at_least("actor.etp", actor.etp, 0)
    if actor.etp not in (0, actor.tp) and actor.ep == 1:
        # megatron reduces the experts' gradients over their expert data-parallel ranks only at EP > 1; at EP1 the
        # TP ranks that hold the same expert (each routing its part of the sequence) would drift apart.
        raise ConfigError(f"config key 'actor.etp' = {actor.etp} differs from actor.tp = {actor.tp} at actor.ep = 1; "
                          f"allowed: actor.etp = 0 or {actor.tp}, or actor.ep > 1")
    # Accepted by megatron-core but not implemented here: nothing splits the sequence over CP ranks
    # (the local attention asserts CP=1).
    _check_supported("actor.cp", actor.cp, "context parallelism is not implemented")
    _check_engine("actor", actor)
    _check_engine("critic", config.critic)
    _check_at_least("teacher.micro_batch_size_per_rank", config.teacher.micro_batch_size_per_rank, 0)
    _check_engine("prime", config.prime)
    _check_choice("prime.update", config.prime.update, PRIME_UPDATES)
    if config.prime.beta <= 0:
        raise ConfigError(f"config key 'prime.beta' = {config.prime.beta} is out of range; allowed: numbers > 0")
    _check_at_least("data.train_batch_size", config.data.train_batch_size, 1)
    _check_at_least("rollout.tp", config.rollout.tp, 1)
    if config.rollout.multi_turn.enable and actor.router_replay:  # multi-turn rollouts record no routing
        raise ConfigError("config key 'actor.router_replay' = True is not supported with rollout.multi_turn.enable; "
                          "allowed: false")
    _check_choice("algorithm.kl_ctrl.type", config.algorithm.kl_ctrl.type, KL_CONTROLLERS)
    _check_rollout_correction(config.algorithm.rollout_correction)
    _check_at_least("trainer.total_steps", config.trainer.total_steps, 1)
    _check_at_least("trainer.log_freq", config.trainer.log_freq, 1)
    _check_multi_turn(config.rollout.multi_turn)
    if config.reward.judge.path:
        _check_judge(config.reward.judge, config)
    for logger in config.trainer.loggers:
        _check_choice("trainer.loggers", logger, LOGGERS)
    _check_choice("trainer.resume_mode", config.trainer.resume_mode, RESUME_MODES)
    if config.trainer.resume_mode == "path" and not config.trainer.resume_path:
        raise ConfigError("config key 'trainer.resume_path' is required when trainer.resume_mode=path")
    _check_placement(config)


def _check_placement(config: RunConfig) -> None:
    """Split placement's sizes, and the features it does not run (each named by its key)."""
    trainer, rollout = config.trainer, config.rollout
    _check_choice("trainer.placement", trainer.placement, PLACEMENTS)
    _check_at_least("trainer.max_staleness", trainer.max_staleness, 0)
    _check_at_least("rollout.partial_groups", rollout.partial_groups, 0)
    if rollout.keep_kv and not rollout.partial:
        raise ConfigError("config key 'rollout.keep_kv' = true needs rollout.partial=true (partial rollouts); "
                          "allowed: false")
    for key, value in (("trainer.save_freq", trainer.save_freq), ("trainer.test_freq", trainer.test_freq)):
        if rollout.keep_kv and value == 1:
            raise ConfigError(f"config key 'rollout.keep_kv' = true keeps no request with {key}=1: every sync then "
                              "follows a checkpoint or precedes a validation, which take the requests out; allowed: "
                              f"false, or {key} of 0 or >= 2")
    if rollout.partial_groups and not rollout.partial:
        raise ConfigError(f"config key 'rollout.partial_groups' = {rollout.partial_groups} needs "
                          "rollout.partial=true (partial rollouts); allowed: 0")
    if trainer.placement == "colocated":
        for key, value in (("rollout.num_ranks", rollout.num_ranks), ("trainer.max_staleness", trainer.max_staleness),
                           ("rollout.partial", rollout.partial)):
            if value:
                raise ConfigError(f"config key '{key}' = {value} needs trainer.placement=split; allowed: "
                                  f"{'false' if isinstance(value, bool) else 0}")
        return
    _check_at_least("rollout.num_ranks", rollout.num_ranks, 1)
    if rollout.num_ranks % rollout.tp:
        raise ConfigError(f"config key 'rollout.num_ranks' = {rollout.num_ranks} is not a multiple of rollout.tp = "
                          f"{rollout.tp}; allowed: whole engine replicas")
    if rollout.partial and trainer.max_staleness < 1:
        raise ConfigError("config key 'rollout.partial' = true needs trainer.max_staleness >= 1: a response "
                          "continued on newer weights is older than the step before; allowed: false (whole "
                          "responses) at trainer.max_staleness=0")
    unsupported = (
        ("algorithm.filter_groups", config.algorithm.filter_groups),
        ("trainer.async_save", trainer.async_save),
        ("actor.router_replay", config.actor.router_replay),
    )
    for key, value in unsupported:
        if value:
            raise ConfigError(f"config key '{key}' = {value} is not supported with trainer.placement=split; "
                              "allowed: false")


def _resolved_rollout_correction(config: RunConfig) -> str:
    """The preset `algorithm.rollout_correction.preset` names, `auto` resolved: truncated token importance
    weights where the engine's weights lag the trainer's by up to trainer.max_staleness steps (split placement),
    nothing where they are the trainer's own, or where the engine's log-probs are the ratio's old ones. Without the
    weights, staleness 2 did not reach the quick start's 50% within 300 steps; with them it did at step 200
    (docs/recipes/split_async.md)."""
    preset = config.algorithm.rollout_correction.preset
    if preset != "auto":
        return preset
    lagging = config.trainer.placement == "split" and config.trainer.max_staleness >= 1
    return "token_tis" if lagging and config.actor.recompute_old_logprobs else "none"


def _check_rollout_correction(correction: RolloutCorrectionConfig) -> None:
    """The bounds that are set lie where they mean something; the preset's name and whether it reads
    them are checked against the presets at start-up (`megarl.trainer.startup`)."""
    prefix = "config key 'algorithm.rollout_correction"
    if correction.cap is not None and not correction.cap >= 1:  # (not >=: NaN fails too)
        raise ConfigError(f"{prefix}.cap' = {correction.cap} is out of range; allowed: numbers >= 1 (a cap below 1 "
                          "would shrink on-policy tokens) or null (the preset's)")
    if correction.lower is not None and not 0 <= correction.lower < 1:
        raise ConfigError(f"{prefix}.lower' = {correction.lower} is out of range; allowed: [0, 1) (a band around "
                          "ratio 1) or null (the preset's)")
    if correction.upper is not None and not correction.upper > 1:
        raise ConfigError(f"{prefix}.upper' = {correction.upper} is out of range; allowed: numbers > 1 (a band "
                          "around ratio 1) or null (the preset's)")
    if not correction.opsm_delta >= 0:
        raise ConfigError(f"{prefix}.opsm_delta' = {correction.opsm_delta} is out of range; allowed: numbers >= 0")


def _check_multi_turn(multi_turn: MultiTurnConfig) -> None:
    _check_at_least("rollout.multi_turn.max_turns", multi_turn.max_turns, 1)
    _check_at_least("rollout.multi_turn.max_tokens_per_turn", multi_turn.max_tokens_per_turn, 0)
    _check_choice("rollout.multi_turn.reward", multi_turn.reward, MULTI_TURN_REWARDS)
    if multi_turn.tool_timeout_seconds <= 0:
        raise ConfigError(f"config key 'rollout.multi_turn.tool_timeout_seconds' = {multi_turn.tool_timeout_seconds} "
                          "is out of range; allowed: numbers > 0")
    _check_at_least("rollout.multi_turn.max_tool_output_chars", multi_turn.max_tool_output_chars, 1)
    for name in ("cpu_seconds", "memory_mib", "max_processes", "max_file_mib"):
        _check_at_least(f"rollout.multi_turn.sandbox.{name}", getattr(multi_turn.sandbox, name), 1)


def _check_judge(judge: JudgeConfig, config: RunConfig) -> None:
    """A judge's rubric, verdict scale and budgets; and what it does not run with (each named by its key)."""
    prefix = "config key 'reward.judge"
    if not judge.template:
        raise ConfigError(f"{prefix}.template' is required with reward.judge.path; allowed: the judge's prompt with "
                          "{prompt}, {response} and {ground_truth}")
    try:
        check_template(judge.template)
    except ValueError as error:
        raise ConfigError(f"{prefix}.template' = {judge.template!r} {error}") from None
    for word, score in judge.choices.items():
        if not word.strip() or not math.isfinite(score):
            raise ConfigError(f"{prefix}.choices' = {{{word!r}: {score}}} is not allowed; allowed: verdict words with "
                              "finite scores")
    if not judge.max_score > 0:
        raise ConfigError(f"{prefix}.max_score' = {judge.max_score} is out of range; allowed: numbers > 0")
    if not 0 <= judge.rule_weight <= 1:
        raise ConfigError(f"{prefix}.rule_weight' = {judge.rule_weight} is out of range; allowed: [0, 1]")
    if not 0 < judge.gpu_memory_utilization < 1:
        raise ConfigError(f"{prefix}.gpu_memory_utilization' = {judge.gpu_memory_utilization} is out of range; "
                          "allowed: (0, 1)")
    for name in ("max_tokens", "max_prompt_length", "kv_cache_mib"):
        _check_at_least(f"reward.judge.{name}", getattr(judge, name), 1)
    # A response is scored on its engine replica's first rank alone; a judge of TP > 1 would need all of them.
    if config.rollout.tp != 1:
        raise ConfigError(f"config key 'rollout.tp' = {config.rollout.tp} is not supported with reward.judge.path "
                          "(the judge engine shares the rollout's TP and judges on one rank); allowed: 1")
    if config.rollout.multi_turn.enable:
        raise ConfigError("config key 'rollout.multi_turn.enable' = True is not supported with reward.judge.path "
                          "(trajectories are scored without their prompts' text); allowed: false")


def validate_layout(config: RunConfig, world_size: int) -> None:
    """Check that the parallel sizes fit `world_size` ranks and every mini-batch splits over DP."""
    assert world_size >= 1, world_size
    actor = config.actor
    model_parallel = actor.tp * actor.pp * actor.cp
    if world_size % model_parallel != 0:
        raise ConfigError(
            f"world size {world_size} is not divisible by actor.tp * actor.pp * actor.cp = "
            f"{model_parallel}; allowed: world sizes that are multiples of {model_parallel}"
        )
    expert_grid = (actor.etp or actor.tp) * actor.ep * actor.pp
    if world_size % expert_grid != 0:
        raise ConfigError(
            f"world size {world_size} is not divisible by actor.etp * actor.ep * actor.pp = {expert_grid}; "
            f"allowed: world sizes that are multiples of {expert_grid} (actor.etp=0 means actor.tp)"
        )
    if config.trainer.placement == "colocated" and world_size % config.rollout.tp != 0:
        raise ConfigError(
            f"config key 'rollout.tp' = {config.rollout.tp} does not divide world size {world_size}; "
            f"allowed: {_divisors(world_size)}"
        )


def validate_batches(config: RunConfig, world_size: int, rl: bool) -> None:
    """Check that every DP rank gets work. An RL step's groups (the `rollout.n` samples of a prompt)
    are owned by DP ranks whole, so a step needs at least one prompt per DP rank; a DP rank may sit
    out a mini-batch (`MegatronEngine.update`). An SFT step splits `data.train_batch_size`
    sequences: evenly with fixed-size micro-batches, at least one per rank with dynamic batching."""
    actor = config.actor
    dp = world_size // (actor.tp * actor.pp * actor.cp)
    batch = config.data.train_batch_size
    if rl and batch < dp:
        raise ConfigError(
            f"config key 'data.train_batch_size' = {batch} gives fewer prompts than the {dp} DP ranks, which "
            f"each own whole groups of a prompt's samples; allowed: at least {dp}"
        )
    if not rl:
        _check_splits("data.train_batch_size", batch, batch, 1, actor.use_dynamic_batch_size, dp)


def _check_splits(key: str, value: int, prompts: int, samples_per_prompt: int, dynamic: bool, dp: int) -> None:
    sequences = prompts * samples_per_prompt
    if sequences >= dp if dynamic else sequences % dp == 0:
        return
    raise ConfigError(
        f"config key '{key}' = {value} gives batches of {prompts} prompts * {samples_per_prompt} samples "
        f"(rollout.n) = {sequences} sequences, which do not split over {dp} DP ranks; allowed: sequences per "
        f"batch {'at least' if dynamic else 'a multiple of'} {dp}"
    )


def save_resolved(config: RunConfig, path: str | Path) -> None:
    """Write the resolved config as YAML; the caller makes sure only rank 0 calls this."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(config)))


def _read_yaml(path: str) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {one_line(error)}") from None
    if data is None:  # an empty file changes nothing
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} holds a {type(data).__name__}; "
            f"allowed: a mapping of sections {_section_keys('')}"
        )
    return data


def _parse_override(override: str) -> dict:
    key, separator, _ = override.partition("=")
    if not separator or not key:
        raise ConfigError(f"malformed override '{override}'; expected the form key=value")
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([override]))
    except yaml.YAMLError as error:
        message = f"override '{override}' has a value that is not valid YAML: {one_line(error)}"
        raise ConfigError(message) from None


def _merge(config: DictConfig, data: dict, source: str) -> DictConfig:
    _check_keys(data, source)
    try:
        return OmegaConf.merge(config, data)
    except ValidationError as error:
        raise ConfigError(f"{_type_message(error)} ({source})") from None
    except KeyValidationError as error:  # YAML reads an unquoted yes/no/on/off key as a boolean
        section = error.full_key.rpartition(".")[0]
        raise ConfigError(f"config key '{section}' has the key {error.key!r} ({type(error.key).__name__}), not a "
                          f"string ({source}); quote it, e.g. \"yes\"") from None


def _check_keys(data: dict, source: str, prefix: str = "") -> None:
    """Reject keys the schema lacks and scalars given where a section belongs."""
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if dotted not in _KEY_TYPES:
            # A high cutoff: the shared section prefix ("actor.") alone scores about 0.7.
            close = difflib.get_close_matches(dotted, _KEY_TYPES, n=1, cutoff=0.8)
            hint = f"did you mean '{close[0]}'?" if close else _valid_keys_hint(prefix)
            raise ConfigError(f"unknown config key '{dotted}' ({source}); {hint}")
        if dataclasses.is_dataclass(_KEY_TYPES[dotted]):
            if not isinstance(value, dict):
                raise ConfigError(
                    f"config key '{dotted}' = {value!r} is not a section ({source}); "
                    f"allowed: a mapping with keys {_section_keys(dotted + '.')}"
                )
            _check_keys(value, source, dotted + ".")


def _section_keys(prefix: str) -> str:
    """Comma-separated names of the keys directly inside the section `prefix` ('' for the top)."""
    names = [key[len(prefix) :] for key in _KEY_TYPES if key.startswith(prefix)]
    return ", ".join(name for name in names if "." not in name)


def _valid_keys_hint(prefix: str) -> str:
    section = f" in '{prefix.rstrip('.')}'" if prefix else ""
    return f"valid keys{section}: {_section_keys(prefix)}"


def _type_message(error: ValidationError) -> str:
    hint = _KEY_TYPES[error.full_key]
    expected = getattr(hint, "__name__", str(hint))  # `float | None` has no name
    return f"config key '{error.full_key}' = {error.value!r} is not a valid {expected}"


def _check_choice(key: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ConfigError(f"config key '{key}' = {value!r} is not allowed; allowed: {', '.join(allowed)}")


def _check_at_least(key: str, value: int | float, minimum: int) -> None:
    if value < minimum:
        kind = "integers" if isinstance(value, int) else "numbers"
        raise ConfigError(f"config key '{key}' = {value} is out of range; allowed: {kind} >= {minimum}")


def _check_engine(section: str, engine: EngineConfig) -> None:
    for name in ("ppo_mini_batch_size", "ppo_epochs", "logprob_chunk_size"):
        _check_at_least(f"{section}.{name}", getattr(engine, name), 1)
    for name in ("micro_batch_size_per_rank", "max_token_len_per_rank"):
        _check_at_least(f"{section}.{name}", getattr(engine, name), 0)
    _check_choice(f"{section}.optim.optimizer", engine.optim.optimizer, OPTIMIZERS)
    _check_choice(f"{section}.optim.lr_decay_style", engine.optim.lr_decay_style, LR_DECAY_STYLES)
    _check_at_least(f"{section}.optim.lr_warmup_steps", engine.optim.lr_warmup_steps, 0)
    _check_at_least(f"{section}.grad_bucket_size", engine.grad_bucket_size, 0)
    lora = engine.lora
    _check_at_least(f"{section}.lora.rank", lora.rank, 0)
    for target in lora.target_modules:
        _check_choice(f"{section}.lora.target_modules", target, LORA_TARGETS)
    if lora.rank and not lora.target_modules:
        raise ConfigError(f"config key '{section}.lora.target_modules' is empty with {section}.lora.rank = "
                          f"{lora.rank}; allowed: some of {', '.join(LORA_TARGETS)}")
    if lora.dropout < 0 or lora.dropout >= 1:
        raise ConfigError(f"config key '{section}.lora.dropout' = {lora.dropout} is out of range; allowed: [0, 1)")


def _check_supported(key: str, value: int, reason: str) -> None:
    if value != 1:
        raise ConfigError(f"config key '{key}' = {value} is not supported: {reason}; allowed: 1")


def _divisors(number: int) -> str:
    return ", ".join(str(d) for d in range(1, number + 1) if number % d == 0)

