"""One model of a checkpoint (the actor, or the critic as a value model) without its training state.

For the tools that use a trained model rather than resume training: HF export and generation. The
architecture comes from the checkpoint's `hf/config.json`; the shards load at any layout, each rank
reading only its own (megatron-core dist checkpoints are layout-independent). A model trained with LoRA
gets its adapters back (the run's `<model>.lora` in the checkpoint's config.yaml), so that export and
generation see the trained model (`served_tensors` merges them), not its base.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import yaml
from megatron.core import dist_checkpointing

from megarl.checkpoint.directory import CheckpointError, problem_with
from megarl.distributed.layout import ParallelLayout
from megarl.models.architecture import Architecture, architecture_from_hf, read_hf_config
from megarl.models.builder import build_model
from megarl.models.lora import LoRASettings, apply_lora


def model_problem(directory: Path, name: str) -> str | None:
    """Why `directory` is not a complete checkpoint holding model `name`, or None when it is."""
    if not directory.is_dir():
        return "no such directory"
    problem = problem_with(directory)
    if problem is None and not (directory / name).is_dir():
        problem = f"missing {name}/"
    return problem


@torch.no_grad()
def load_model(directory: Path, name: str, layout: ParallelLayout,
               dtype: str = "float32") -> tuple[torch.nn.Module, Architecture]:
    """Build this rank's stage of the checkpoint's `name` model ("actor" or "critic") at `layout` and
    load its shards. Collective: every rank calls it."""
    problem = model_problem(directory, name)
    if problem:
        raise CheckpointError(f"{directory}: not a usable checkpoint with a {name!r} model: {problem}")
    arch = architecture_from_hf(read_hf_config(str(directory / "hf")), source=str(directory / "hf/config.json"))
    if name == "critic":  # hf/ holds the actor's config; the critic is that backbone with a value head
        arch = dataclasses.replace(arch, value_model=True, tie_word_embeddings=False)
    model = build_model(arch, layout, dtype)
    lora = _lora_settings(directory, name)
    if lora is not None:
        apply_lora(model, arch, lora)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(directory / name))
    model.load_state_dict(loaded["model"])
    return model, arch


def _lora_settings(directory: Path, name: str) -> LoRASettings | None:
    """The LoRA adapters model `name` was trained with (its run's config in the checkpoint), None without."""
    config_file = directory / "config.yaml"
    if not config_file.is_file():
        return None
    lora = (yaml.safe_load(config_file.read_text()).get(name) or {}).get("lora") or {}
    if not lora.get("rank"):
        return None
    return LoRASettings(lora["rank"], lora["alpha"], lora["dropout"], tuple(lora["target_modules"]))
