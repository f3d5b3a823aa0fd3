"""Start-up shared by the launchers: config, layout check, joining the world, the run directory.

    config, layout, run_dir = start_run(["--config", "configs/x.yaml", "actor.tp=2"], rl=True)

Every user mistake in the config fails here, before any process group or model exists, with a
one-line `ConfigError` naming the dotted key. The trainers then check their other inputs (data,
reward function, the checkpoint to resume) before building any model, and only then write the
resolved config (`Run.save_config`): a run that fails at start-up leaves no config.yaml behind.
A user error is raised alike on every rank; `megarl.messages.exit_on_user_error` prints it once.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from megarl.config import ConfigError, RunConfig, load_config, save_resolved, validate_batches, validate_layout
from megarl.distributed import ParallelLayout, init_layout
from megarl.distributed.split_world import SplitWorld, join_split_world
from megarl.doctor import require


@dataclass(frozen=True)
class Run:
    config: RunConfig
    layout: ParallelLayout | None
    """None on the rollout ranks of split placement, which train nothing."""
    run_dir: Path
    world: SplitWorld | None = None
    """Split placement's world (trainer and rollout ranks); None when colocated."""

    @property
    def is_rollout_rank(self) -> bool:
        return self.world is not None and not self.world.is_trainer

    def save_config(self) -> None:
        """Rank 0 writes the resolved config into the run directory (once the run's inputs are valid)."""
        if self.layout.rank == 0:
            save_resolved(self.config, self.run_dir / "config.yaml")


def parse_config(argv: Sequence[str], rl: bool) -> RunConfig:
    """`--config FILE key=value ...` -> a validated config that fits this torchrun world; `rl` selects
    the batch checks of an RL run (mini-batches of prompts times rollout.n) or of SFT."""
    parser = argparse.ArgumentParser(description="megarl run: a YAML config plus dotted overrides")
    parser.add_argument("--config", help="YAML file under configs/")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.tp=2 trainer.total_steps=5")
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides)
    world_size = trainer_world_size(config, int(os.environ.get("WORLD_SIZE", "1")))
    validate_layout(config, world_size)
    validate_batches(config, world_size, rl)
    check_registered_names(config)
    check_rollout_correction_bounds(config)
    check_old_logprobs_source(config)
    if rl:
        check_estimator_needs(config)
    require(["core", *(["vllm"] if rl and config.rollout.backend == "vllm" else []),  # SFT generates nothing
             *(["mlflow"] if "mlflow" in config.trainer.loggers else [])])
    require_hf_directory("model.path", config.model.path)
    if rl and config.reward.judge.path:
        require_hf_directory("reward.judge.path", config.reward.judge.path)
    if rl and config.teacher.path:
        require_hf_directory("teacher.path", config.teacher.path)
    if rl:
        check_shared_tokenizers(config)
        check_engine_routes_as_trained(config)
    return config


def check_engine_routes_as_trained(config: RunConfig) -> None:
    """Aux-loss-free balancing (`model.moe.expert_bias`) on a family whose checkpoints carry no routing correction
    bias makes megatron route by sigmoid scores plus a bias of its own, which the rollout engine, routing by the
    checkpoint's softmax, never sees: the samples would come from another policy than the one trained."""
    if not config.model.moe.expert_bias:
        return
    from megarl.models.architecture import architecture_from_hf, read_hf_config

    arch = architecture_from_hf(read_hf_config(config.model.path), source=f"{config.model.path}/config.json")
    if arch.is_moe and not arch.router_bias:
        raise ConfigError(f"config key 'model.moe.expert_bias' = True: {arch.family} checkpoints carry no routing "
                          "correction bias, so the trainer would route by sigmoid scores plus a bias that the rollout "
                          "engine, routing by the checkpoint's softmax, ignores; allowed: false in RL, or a family "
                          "with one (DeepSeek-V3, GLM-4.5)")


SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def check_shared_tokenizers(config: RunConfig) -> None:
    """The models that read the policy's token ids (a teacher, a reward model, a critic of its own) share its
    tokenizer: a one-line `ConfigError` naming both paths."""
    others = (("teacher.path", config.teacher.path), ("reward.reward_model_path", config.reward.reward_model_path),
              ("critic.path", config.critic.path if config.critic.enable else ""))
    for key, path in others:
        difference = tokenizer_difference(config.model.path, path) if path else None
        if difference:
            raise ConfigError(f"{key}={path!r} and model.path={config.model.path!r} have different tokenizers "
                              f"({difference}); it reads the policy's token ids, so they must share one tokenizer")


def tokenizer_difference(policy_path: str, other_path: str) -> str | None:
    """The first way the two directories' tokenizers differ, as a user would check it: the same
    token -> id vocabulary (added tokens included) and the same special tokens; None if they agree."""
    from transformers import AutoTokenizer

    policy, other = AutoTokenizer.from_pretrained(policy_path), AutoTokenizer.from_pretrained(other_path)
    policy_vocab, other_vocab = policy.get_vocab(), other.get_vocab()
    if policy_vocab != other_vocab:
        only_policy = sorted(set(policy_vocab) - set(other_vocab))
        only_other = sorted(set(other_vocab) - set(policy_vocab))
        if only_policy or only_other:
            token, owner = (only_policy[0], "the policy's") if only_policy else (only_other[0], "the other's")
            return (f"vocabularies of {len(policy_vocab)} and {len(other_vocab)} tokens; e.g. {token!r} only in "
                    f"{owner}")
        token = next(t for t in sorted(policy_vocab) if policy_vocab[t] != other_vocab[t])
        return f"token {token!r} has id {policy_vocab[token]} in the policy's and {other_vocab[token]} in the other's"
    for name in SPECIAL_TOKENS:
        if getattr(policy, name) != getattr(other, name):
            return f"{name} {getattr(policy, name)!r} in the policy's, {getattr(other, name)!r} in the other's"
    return None


def trainer_world_size(config: RunConfig, world_size: int) -> int:
    """The ranks that train: all of them, or under split placement those before the rollout ranks."""
    if config.trainer.placement == "colocated":
        return world_size
    rollout_ranks = config.rollout.num_ranks
    if rollout_ranks >= world_size:
        raise ConfigError(f"config key 'rollout.num_ranks' = {rollout_ranks} leaves no trainer rank in a world of "
                          f"{world_size}; allowed: 1 .. {world_size - 1}")
    return world_size - rollout_ranks


def require_hf_directory(key: str, path: str) -> None:
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"config key '{key}' = {path!r} has no config.json; expected a HuggingFace model "
                          "directory (make one with checkpoints_tools/make_tiny_model.py)")


def check_registered_names(config: RunConfig) -> None:
    """Names chosen from registries exist (the message lists the registered ones)."""
    from megarl.algorithms import (
        ADVANTAGE_ESTIMATORS,
        KL_ESTIMATORS,
        LOSS_AGGREGATIONS,
        POLICY_LOSSES,
        ROLLOUT_CORRECTIONS,
    )
    from megarl.rollout import ROLLOUT_BACKENDS

    for key, value, registry in (
        ("algorithm.adv_estimator", config.algorithm.adv_estimator, ADVANTAGE_ESTIMATORS),
        ("algorithm.kl_penalty", config.algorithm.kl_penalty, KL_ESTIMATORS),
        ("actor.policy_loss", config.actor.policy_loss, POLICY_LOSSES),
        ("actor.kl_loss_type", config.actor.kl_loss_type, KL_ESTIMATORS),
        ("actor.loss_agg_mode", config.actor.loss_agg_mode, LOSS_AGGREGATIONS),
        ("rollout.backend", config.rollout.backend, ROLLOUT_BACKENDS),
        ("algorithm.rollout_correction.preset", config.algorithm.rollout_correction.preset, ROLLOUT_CORRECTIONS),
    ):
        if value not in registry.names():
            raise ConfigError(f"config key '{key}' = {value!r} is not registered; registered: "
                              f"{', '.join(registry.names())}")


def check_rollout_correction_bounds(config: RunConfig) -> None:
    """A rollout-correction bound that is set is one its preset reads: a cap needs weights, a band needs
    rejection (their ranges are the loader's to check)."""
    from megarl.algorithms import ROLLOUT_CORRECTIONS

    correction = config.algorithm.rollout_correction
    preset = ROLLOUT_CORRECTIONS.get(correction.preset)
    for name, value, read in (("cap", correction.cap, preset.weights != "none"),
                              ("lower", correction.lower, preset.rejection != "none"),
                              ("upper", correction.upper, preset.rejection != "none")):
        if value is not None and not read:
            raise ConfigError(f"config key 'algorithm.rollout_correction.{name}' = {value} is not read by preset "
                              f"{correction.preset!r}; allowed: null, or a preset that "
                              f"{'weights' if name == 'cap' else 'rejects'}")


def check_old_logprobs_source(config: RunConfig) -> None:
    """The engine's log-probs as the old policy's leave a rollout correction nothing to correct."""
    preset = config.algorithm.rollout_correction.preset
    if not config.actor.recompute_old_logprobs and preset != "none":
        raise ConfigError(f"config key 'algorithm.rollout_correction.preset' = {preset!r} needs the trainer's old "
                          "log-probs, and actor.recompute_old_logprobs=false uses the engine's (the ratio to the "
                          "engine is then 1); allowed: none, or actor.recompute_old_logprobs=true")


def check_estimator_needs(config: RunConfig) -> None:
    """The rollout and models give the advantage estimator what it declares it needs (`register_estimator`)."""
    from megarl.algorithms import ADVANTAGE_ESTIMATORS

    name = config.algorithm.adv_estimator
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    if estimator.needs_groups and config.rollout.n < 2:
        raise ConfigError(f"config key 'rollout.n' = {config.rollout.n}: algorithm.adv_estimator={name!r} compares "
                          "each response with the others to the same prompt; expected rollout.n >= 2")
    if estimator.needs_values and not config.critic.enable:
        raise ConfigError(f"config key 'algorithm.adv_estimator' = {name!r} needs a critic; set critic.enable=true "
                          "or choose an estimator without values (e.g. grpo)")
    teacher = config.teacher.path
    if estimator.needs_greedy_baseline and config.trainer.placement == "split":
        raise ConfigError(f"config key 'algorithm.adv_estimator' = {name!r} needs greedy rollouts beside the "
                          "sampled ones, which trainer.placement=split does not make; allowed: colocated placement")
    shaping = [key for key, value in (("reward.reward_model_path", config.reward.reward_model_path),
                                      ("algorithm.overlong_buffer_length", config.algorithm.overlong_buffer_length))
               if value]
    if estimator.needs_greedy_baseline and shaping:
        raise ConfigError(f"config key '{shaping[0]}' is set, and algorithm.adv_estimator={name!r} scores its greedy "
                          "baseline with the reward function alone (the baseline would leave that part of the reward "
                          f"out); allowed: an empty {shaping[0]}, or another estimator")
    if estimator.needs_teacher and not teacher:
        raise ConfigError(f"config key 'teacher.path' is empty: algorithm.adv_estimator={name!r} distills from a "
                          "teacher; expected a HuggingFace model directory")
    if teacher and not estimator.needs_teacher:
        raise ConfigError(f"config key 'teacher.path' = {teacher!r} is set but algorithm.adv_estimator={name!r} "
                          "uses no teacher; expected an estimator that does (opd) or an empty teacher.path")
    check_reward_components(config, name, estimator.needs_reward_components)


def check_reward_components(config: RunConfig, name: str, needed: bool) -> None:
    """An estimator built from the reward's components (gdpo) has them named, and nothing else of the reward
    that it would leave out; no other estimator is given components it would ignore."""
    components = config.algorithm.reward_components
    if needed and not components:
        raise ConfigError(f"config key 'algorithm.reward_components' is empty: algorithm.adv_estimator={name!r} "
                          "normalises each reward component separately; expected the numeric keys of the reward "
                          "function's dict beside 'score', e.g. [correct, format]")
    if components and not needed:
        raise ConfigError(f"config key 'algorithm.reward_components' = {list(components)} is set but "
                          f"algorithm.adv_estimator={name!r} uses no components; expected an estimator that does "
                          "(gdpo) or an empty list")
    left_out = (("algorithm.use_kl_in_reward", config.algorithm.use_kl_in_reward),
                ("reward.reward_model_path", config.reward.reward_model_path),
                ("algorithm.overlong_buffer_length", config.algorithm.overlong_buffer_length))
    for key, value in left_out if needed else ():
        if value:
            raise ConfigError(f"config key '{key}' = {value!r}: algorithm.adv_estimator={name!r} takes its "
                              "advantages from algorithm.reward_components alone, which leave this out; expected "
                              "it off (a KL penalty can be actor.use_kl_loss)")


def start_run(argv: Sequence[str], rl: bool) -> Run:
    """Parse the config and join the torchrun world at the actor's layout (under split placement, the
    trainer ranks' world; the rollout ranks join theirs and get no layout)."""
    config = parse_config(argv, rl)
    run_dir = Path(config.trainer.output_dir) / config.trainer.experiment_name
    world = join_split_world(config.rollout.num_ranks) if config.trainer.placement == "split" else None
    if world is not None and not world.is_trainer:
        return Run(config, None, run_dir, world)
    actor = config.actor
    layout = init_layout(tp=actor.tp, pp=actor.pp, cp=actor.cp, ep=actor.ep, etp=actor.etp, seed=config.trainer.seed)
    return Run(config, layout, run_dir, world)
