"""LoRA adapters in and out as PEFT adapter directories (`adapter_config.json` + `adapter_model.safetensors`).

PEFT names an adapter's pair `base_model.model.model.layers.<i>.<self_attn|mlp>.<target>.lora_A.weight` (r x in)
and `...lora_B.weight` (out x r). Export gathers each pair whole: the split half over the TP ranks (B's rows of a
column-parallel linear, A's columns of a row-parallel one, `megarl.models.lora`), the layers over the pipeline
stages; import slices the whole tensors into this rank's shards.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from megarl.distributed import collectives
from megarl.distributed.layout import ParallelLayout
from megarl.models.lora import ATTENTION_TARGETS, LoRAAdapter, LoRASettings

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def peft_name(layer: int, target: str, matrix: str) -> str:
    """PEFT's name of `matrix` ("A" or "B") of `target`'s adapter in decoder layer `layer`."""
    block = "self_attn" if target in ATTENTION_TARGETS else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{target}.lora_{matrix}.weight"


def _layered(adapters: list[LoRAAdapter]):
    for adapter in adapters:
        for target in adapter.targets():
            yield adapter, target


def export_peft(adapters: list[LoRAAdapter], settings: LoRASettings, layout: ParallelLayout, out_dir: str | Path,
                base_path: str) -> None:
    """Write the adapters of every pipeline stage as one PEFT adapter directory (rank 0 writes it)."""
    stage = {}
    for adapter, target in _layered(adapters):
        for matrix, tensor in zip("AB", adapter.pair(target)):
            whole = tensor.detach()
            if adapter.tp > 1 and getattr(tensor, "tensor_model_parallel", False):  # the split half
                whole = torch.cat(collectives.all_gather(whole.contiguous(), group=adapter.group), tensor.partition_dim)
            stage[peft_name(adapter.layer, target, matrix)] = whole.cpu()
    stages = collectives.all_gather_object(stage if layout.holds_unique_stage_copy else {}, group=layout.pp_group)
    if dist.get_rank() == 0:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file({name: tensor.contiguous() for part in stages for name, tensor in part.items()}, out / WEIGHTS_FILE)
        (out / CONFIG_FILE).write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path, "r": settings.rank,
            "lora_alpha": settings.alpha, "lora_dropout": settings.dropout,
            "target_modules": sorted(settings.target_modules), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "modules_to_save": None, "inference_mode": True}, indent=2))
    dist.barrier()


def check_peft_config(path: str | Path, settings: LoRASettings) -> None:
    """ValueError naming the adapter directory unless it is a LoRA adapter of `settings`' rank, alpha and targets."""
    config_file = Path(path) / CONFIG_FILE
    if not config_file.is_file() or not (Path(path) / WEIGHTS_FILE).is_file():
        raise ValueError(f"config key 'actor.lora.adapter_path' = {str(path)!r}: expected a PEFT adapter directory "
                         f"with {CONFIG_FILE} and {WEIGHTS_FILE}")
    config = json.loads(config_file.read_text())
    theirs = (config.get("peft_type"), config.get("r"), float(config.get("lora_alpha", 0)),
              sorted(config.get("target_modules") or []))
    ours = ("LORA", settings.rank, float(settings.alpha), sorted(settings.target_modules))
    if theirs != ours:
        raise ValueError(f"{config_file}: a {theirs[0]} adapter of rank {theirs[1]}, alpha {theirs[2]:g} on "
                         f"{theirs[3]}; actor.lora asks for rank {ours[1]}, alpha {ours[2]:g} on {ours[3]}")


@torch.no_grad()
def load_peft(adapters: list[LoRAAdapter], settings: LoRASettings, path: str | Path) -> None:
    """Copy a PEFT adapter's pairs into this rank's adapters (each shard sliced from the whole tensor)."""
    check_peft_config(path, settings)
    tensors = load_file(Path(path) / WEIGHTS_FILE)
    for adapter, target in _layered(adapters):
        for matrix, mine in zip("AB", adapter.pair(target)):
            name = peft_name(adapter.layer, target, matrix)
            if name not in tensors:
                raise ValueError(f"{Path(path) / WEIGHTS_FILE}: no tensor {name}; expected an adapter of this model")
            whole = tensors[name]
            if adapter.tp > 1 and getattr(mine, "tensor_model_parallel", False):  # the split half: this rank's slice
                dim = mine.partition_dim
                width = whole.shape[dim] // adapter.tp
                whole = whole.narrow(dim, adapter.group.rank() * width, width)
            if whole.shape != mine.shape:
                raise ValueError(f"{Path(path) / WEIGHTS_FILE}: {name} has shape {tuple(tensors[name].shape)}, "
                                 "which does not fit this model; expected an adapter of this base model")
            mine.copy_(whole)
