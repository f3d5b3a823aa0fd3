"""Loading HuggingFace weights into a megatron-core model at any layout, and exporting them back.

Load: every rank reads only the slices its TP rank and PP stage own (for experts: the slices its
ETP rank owns of its EP rank's experts).
Export: TP shards are gathered within each pipeline stage (experts: over ETP, then their HF
tensors over EP); one rank per stage writes that stage's safetensors shard, so no rank ever holds
more than one stage of the model; rank 0 writes the index and config. The round trip
HF -> megatron -> HF is bit-identical.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil

import torch
import torch.distributed as dist

from megarl.distributed import collectives
from megarl.distributed.layout import ParallelLayout
from megarl.models.architecture import Architecture, architecture_from_hf, read_hf_config
from megarl.models.builder import MoESettings, ScheduleSettings, build_model
from megarl.models.hf_checkpoint import SafetensorsReader, write_index, write_shard
from megarl.models.state_dict_adapter import (
    ParamMapping,
    assemble_shard,
    mapped_tensors,
    merge_shards,
    param_mappings,
    served_tensors,
    tp_split,
)

logger = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def load_hf_model(
    model_dir: str,
    layout: ParallelLayout,
    dtype: str = "float32",
    layer_spec: str = "auto",
    make_vocab_size_divisible_by: int = 128,
    recompute_activations: bool = False,
    value_head: bool = False,
    schedule: ScheduleSettings = ScheduleSettings(),
    moe: MoESettings = MoESettings(),
    shared_prompts: bool = False,
) -> tuple[torch.nn.Module, Architecture]:
    """Build this rank's stage of the HF model in `model_dir` and load its weights (`hf_architecture`'s
    `value_head`; `shared_prompts`: built for the shared-prompt layout, `build_model`)."""
    arch = hf_architecture(model_dir, value_head)
    if arch.mtp_layers and dist.get_rank() == 0:
        first = arch.num_layers
        logger.warning(f"{model_dir}: multi-token-prediction layers model.layers.{first}..{first + arch.mtp_layers - 1}"
                       " not loaded (they serve speculative decoding; RL trains the next-token policy)")
    model = build_model(arch, layout, dtype, layer_spec, make_vocab_size_divisible_by, recompute_activations, schedule,
                        moe, shared_prompts)
    load_hf_weights(model, arch, layout, model_dir)
    return model, arch


def hf_architecture(model_dir: str, value_head: bool = False) -> Architecture:
    """The architecture of the HF model in `model_dir`. With `value_head`, a causal LM checkpoint becomes a
    value model: its backbone is loaded and a new, zero-initialised value head replaces the LM head (the usual
    way to start a critic)."""
    arch = architecture_from_hf(read_hf_config(model_dir), source=f"{model_dir}/config.json")
    if value_head and not arch.value_model:
        arch = dataclasses.replace(arch, value_model=True, tie_word_embeddings=False)
    return arch


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, arch: Architecture, layout: ParallelLayout, model_dir: str) -> None:
    reader = SafetensorsReader(model_dir)
    available = set(reader.names())
    params = mapped_tensors(model, arch)
    for mapping in param_mappings(model, arch):
        param = params[mapping.megatron_name]
        if mapping.megatron_name.startswith("output_layer.score.") and mapping.hf_names[0] not in available:
            param.zero_()  # a new value head on a causal LM backbone
            continue
        shard = assemble_shard(mapping, arch, param.shape, *tp_split(mapping, layout), reader.read)
        param.copy_(shard)


@torch.no_grad()
def gather_hf_state_dict(model: torch.nn.Module, arch: Architecture, layout: ParallelLayout) -> dict[str, torch.Tensor]:
    """This pipeline stage's weights under HF names (complete on every rank of the stage); LoRA adapters merged
    into their linears' weights."""
    params = served_tensors(model, arch)
    # The same parameters as each EP rank names them: its own experts.
    named_by_ep_rank = [param_mappings(model, arch, ep_rank) for ep_rank in range(layout.ep)]
    hf_tensors = {}
    for index, mapping in enumerate(param_mappings(model, arch)):
        if mapping.megatron_name == "output_layer.weight" and arch.tie_word_embeddings:
            continue  # the last stage's copy of the tied embedding; the first stage exports it
        param = params[mapping.megatron_name].detach()
        group = layout.etp_group if mapping.expert else layout.tp_group
        shards = collectives.all_gather(param.contiguous(), group=group)
        merged = merge_shards(mapping, arch, shards)
        if mapping.expert:
            merged = _gather_over_ep(merged, mapping, [named[index] for named in named_by_ep_rank], layout)
        hf_tensors.update(merged)
    return hf_tensors


def _gather_over_ep(merged: dict[str, torch.Tensor], mapping: ParamMapping, as_named_by: list[ParamMapping],
                    layout: ParallelLayout) -> dict[str, torch.Tensor]:
    """Every EP rank's version of one expert weight (each rank holds different experts)."""
    gathered = {}
    for position, name in enumerate(mapping.hf_names):
        tensors = collectives.all_gather(merged[name], group=layout.ep_group)
        gathered.update((named.hf_names[position], tensor) for named, tensor in zip(as_named_by, tensors))
    return gathered


def export_hf(
    model: torch.nn.Module, arch: Architecture, layout: ParallelLayout, out_dir: str, source_dir: str
) -> None:
    """Write `model` as a HF checkpoint into `out_dir`; config and tokenizer come from `source_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    hf_tensors = gather_hf_state_dict(model, arch, layout)
    stage_map = {}
    if layout.holds_unique_stage_copy:
        file = write_shard(hf_tensors, out_dir, layout.pp_rank, layout.pp)
        stage_map = {name: (file, t.numel() * t.element_size()) for name, t in hf_tensors.items()}
    stage_maps = collectives.all_gather_object(stage_map)
    if dist.get_rank() == 0:
        merged = {name: entry for m in stage_maps for name, entry in m.items()}
        write_index({n: f for n, (f, _) in merged.items()}, sum(b for _, b in merged.values()), out_dir)
        _write_config(arch, source_dir, out_dir, next(iter(hf_tensors.values())).dtype)
    dist.barrier()


def _write_config(arch: Architecture, source_dir: str, out_dir: str, dtype: torch.dtype) -> None:
    with open(os.path.join(source_dir, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = [arch.hf_architecture()]
    if arch.value_model:  # one label: the value of each token
        config.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0}, tie_word_embeddings=False)
    config["dtype"] = str(dtype).removeprefix("torch.")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    copy_hf_files(source_dir, out_dir, TOKENIZER_FILES)


def copy_hf_files(source_dir, out_dir, names=("config.json", *TOKENIZER_FILES)) -> None:
    """Copy a model's config and tokenizer files (those present) from one directory to another."""
    for name in names:
        if os.path.isfile(os.path.join(source_dir, name)):
            shutil.copy(os.path.join(source_dir, name), out_dir)
