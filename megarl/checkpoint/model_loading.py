"""One model of a checkpoint (the actor, or the critic as a value model) without its training state.

For the tools that use a trained model rather than resume training: HF export and generation. The
architecture comes from the checkpoint's `hf/config.json`; the shards load at any layout, each rank
reading only its own (megatron-core dist checkpoints are layout-independent). A model trained with LoRA
(the run's `<model>.lora` in the checkpoint's config.yaml) is its base, read from the HF directory the run
started from, with the checkpoint's adapters on it: a checkpoint holds what training changed alone
(`trained_entries`), and export and generation see the trained model (`served_tensors` merges the adapters).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import yaml
from megatron.core import dist_checkpointing

from megarl.checkpoint.directory import CheckpointError, problem_with
from megarl.distributed.layout import ParallelLayout
from megarl.models.architecture import Architecture, architecture_from_hf, read_hf_config
from megarl.models.builder import build_model
from megarl.models.hf_checkpoint import SafetensorsReader
from megarl.models.hf_interop import load_hf_weights
from megarl.models.lora import LoRASettings, apply_lora


def model_problem(directory: Path, name: str) -> str | None:
    """Why `directory` is not a complete checkpoint holding model `name`, or None when it is."""
    if not directory.is_dir():
        return "no such directory"
    problem = problem_with(directory)
    if problem is None and not (directory / name).is_dir():
        problem = f"missing {name}/"
    return problem or _lora_base_problem(directory, name)


def _lora_base_problem(directory: Path, name: str) -> str | None:
    """Why the base weights of the checkpoint's `name` LoRA adapters cannot be read, or None (or no adapters)."""
    base = lora_base_model(directory, name)
    if base is None:
        return None
    if not (Path(base) / "config.json").is_file():
        return (f"its {name} holds LoRA adapters on the base model {base}, which is gone; expected the HF directory "
                "the run started from there")
    state = json.loads((directory / "trainer_state.json").read_text())
    return lora_base_mismatch(name, base, state, SafetensorsReader(base).fingerprint())


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
    lora = _lora_settings(_run_config(directory), name)
    if lora is not None:
        load_hf_weights(model, arch, layout, lora_base_model(directory, name))
        apply_lora(model, arch, lora)
    loaded = dist_checkpointing.load({"model": trained_entries(model.sharded_state_dict())}, str(directory / name))
    load_trained_entries(model, loaded["model"])
    return model, arch


def trained_entries(sharded_state_dict: dict) -> dict:
    """What a checkpoint holds of a model: every entry but a frozen parameter's (LoRA's base weights, which stay
    those of the HF directory the run started from: a LoRA checkpoint holds the adapters, a value head, and
    buffers training moves, such as routers' correction biases)."""
    return {key: entry for key, entry in sharded_state_dict.items()
            if not (isinstance(getattr(entry, "data", None), torch.nn.Parameter) and not entry.data.requires_grad)}


def load_trained_entries(model: torch.nn.Module, loaded: dict) -> None:
    """Load what a checkpoint holds of `model` (`trained_entries`); whatever it leaves out must be `model`'s frozen
    parameters."""
    result = model.load_state_dict(loaded, strict=False)
    frozen = {name for name, parameter in model.named_parameters() if not parameter.requires_grad}
    missing = sorted(set(result.missing_keys) - frozen)
    if missing or result.unexpected_keys:
        raise CheckpointError(f"the checkpoint's model does not fit: missing {missing[:3]}, unexpected "
                              f"{sorted(result.unexpected_keys)[:3]}")


def _run_config(directory: Path) -> dict:
    """The run's resolved config saved in the checkpoint (empty when it has none)."""
    config_file = directory / "config.yaml"
    return yaml.safe_load(config_file.read_text()) if config_file.is_file() else {}


def _lora_settings(config: dict, name: str) -> LoRASettings | None:
    """The LoRA adapters model `name` was trained with, None without."""
    lora = (config.get(name) or {}).get("lora") or {}
    if not lora.get("rank"):
        return None
    return LoRASettings(lora["rank"], lora["alpha"], lora["dropout"], tuple(lora["target_modules"]))


def lora_base_mismatch(name: str, base: str, trainer_state: dict, fingerprint: str | None) -> str | None:
    """Why the base weights at `base` (their `fingerprint`) are not those the checkpoint's `name` LoRA adapters were
    trained on (recorded at save), or None."""
    saved = trainer_state.get("lora_bases", {}).get(name)
    if saved is None or fingerprint == saved:
        return None
    return (f"its {name}'s LoRA adapters were trained on other base weights than those at {base} now (weights "
            f"fingerprint {saved[:12]} then, {str(fingerprint)[:12]} now); expected the base the run started from")


def lora_base_model(directory: Path, name: str) -> str | None:
    """The HF directory whose weights the LoRA adapters of the checkpoint's model `name` adapt (the one the run
    started from); None when that model holds no adapters."""
    config = _run_config(directory)
    if _lora_settings(config, name) is None:
        return None
    return (name == "critic" and config["critic"].get("path")) or config["model"]["path"]
