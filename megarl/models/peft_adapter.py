"""LoRA adapters in and out as PEFT adapter directories (`adapter_config.json` + `adapter_model.safetensors`).

PEFT names an adapter's pair `base_model.model.model.layers.<i>.<self_attn|mlp>.<target>.lora_A.weight` (r x in) and
`...lora_B.weight` (out x r). Export gathers each pair whole: the split half over the TP ranks (B's rows of a column-
parallel linear, A's columns of a row-parallel one, `megarl.models.lora`), the layers over the pipeline stages;
import slices the whole tensors into this rank's shards.

A mixture-of-experts layer's routed experts are one PEFT pair per fused weight of the layer (`target_parameters`,
`...mlp.experts.lora_A.weight`), every expert's pair in it: lora_A is (E * R, in) with expert e's A in rows [e * R,
(e + 1) * R), lora_B (out, R * E) with its B in columns e, e + E, ... (PEFT reshapes it (out, R, E)). PEFT nests one
wrapper per targeted weight in the experts module's order of its parameters (whatever the order of
`target_parameters`), the first innermost: gate_up_proj's pair is under `base_layer.` when down_proj is targeted too.
Export gathers the experts over the EP ranks.

A value model (critic) trains its head whole besides the adapters; its adapter is written as PEFT writes a
token-classification model's (task_type TOKEN_CLS), the head kept whole (`modules_to_save`) as
`base_model.model.score.{weight,bias}`: for the base loaded with `AutoModelForTokenClassification` (num_labels=1).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from megarl.distributed import collectives
from megarl.distributed.layout import ParallelLayout
from megarl.models.lora import EXPERT_TARGETS, MLP_TARGETS, LoRAAdapter, LoRASettings

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PLAIN_LORA = {"use_rslora": False, "use_dora": False, "bias": "none", "lora_bias": False}
"""The adapter config's settings of plain LoRA, the only kind megarl's adapters are: scaled alpha / r (rsLoRA:
alpha / sqrt(r)), no magnitude vectors (DoRA), no trained biases. An adapter with others is refused, not loaded
without them."""
VALUE_HEAD = "score"
"""HF's name of a token-classification model's head (one label for a value model), which megarl's value head is."""


def peft_name(layer: int, target: str, matrix: str) -> str:
    """PEFT's name of `matrix` ("A" or "B") of `target`'s adapter in decoder layer `layer`."""
    block = "mlp" if target in MLP_TARGETS else "self_attn"
    return f"base_model.model.model.layers.{layer}.{block}.{target}.lora_{matrix}.weight"


def peft_expert_name(layer: int, weight: str, weights: list[str], matrix: str) -> str:
    """PEFT's name of `matrix` of the routed experts' adapter on fused weight `weight` of `weights` (the targeted
    ones, `_expert_weights`)."""
    nesting = "base_layer." * (len(weights) - 1 - weights.index(weight))
    return f"base_model.model.model.layers.{layer}.mlp.experts.{nesting}lora_{matrix}.weight"


def _expert_weights(settings: LoRASettings) -> list[str]:
    """A routed expert's fused weights `settings` adapts, in the experts module's order of its parameters."""
    return [weight for weight, targets in EXPERT_TARGETS.items() if set(targets) <= set(settings.target_modules)]


def _peft_targets(settings: LoRASettings, experts: bool) -> dict:
    """The adapter config's fields that say what is adapted at which rank, as PEFT writes them: a routed expert's
    weights are `target_parameters`, gate_up_proj at twice the rank and alpha (gate's and up's)."""
    if not experts:
        return {"target_modules": sorted(settings.target_modules), "target_parameters": [], "rank_pattern": {},
                "alpha_pattern": {}}
    weights = _expert_weights(settings)
    doubled = "gate_up_proj" in weights
    return {"target_modules": sorted(set(settings.target_modules) - set(MLP_TARGETS)), "target_parameters": weights,
            "rank_pattern": {r".*\.gate_up_proj": 2 * settings.rank} if doubled else {},
            "alpha_pattern": {r".*\.gate_up_proj": 2.0 * settings.alpha} if doubled else {}}


def _has_experts(adapters: list[LoRAAdapter]) -> bool:
    return any(adapter.expert is not None for adapter in adapters)


def _layered(adapters: list[LoRAAdapter]):
    for adapter in adapters:
        for target in adapter.targets():
            yield adapter, target


def _whole_pairs(adapters: list[LoRAAdapter], settings: LoRASettings, layout: ParallelLayout) -> dict:
    """{PEFT name: whole tensor} of this pipeline stage's adapters."""
    whole, experts = {}, {}
    for adapter, target in _layered(adapters):
        if adapter.expert is not None:
            experts.setdefault((adapter.layer, target), []).append(adapter.pair(target))
            continue
        for matrix, parameter in zip("AB", adapter.pair(target)):
            tensor = parameter.detach()
            if adapter.tp > 1 and getattr(parameter, "tensor_model_parallel", False):  # the split half
                tensor = torch.cat(collectives.all_gather(tensor.contiguous(), group=adapter.group),
                                   parameter.partition_dim)
            whole[peft_name(adapter.layer, target, matrix)] = tensor.cpu()
    weights = _expert_weights(settings)
    for (layer, weight), pairs in experts.items():
        a, b = (torch.cat(collectives.all_gather(torch.stack(local).detach(), group=layout.ep_group)).cpu()
                for local in zip(*pairs))  # (E, R, in), (E, out, R) in global expert order
        whole[peft_expert_name(layer, weight, weights, "A")] = a.flatten(0, 1)
        whole[peft_expert_name(layer, weight, weights, "B")] = b.permute(1, 2, 0).flatten(1)
    return whole


def export_peft(adapters: list[LoRAAdapter], settings: LoRASettings, layout: ParallelLayout, out_dir: str | Path,
                base_path: str, value_head: torch.nn.Linear | None = None) -> None:
    """Write the adapters of every pipeline stage as one PEFT adapter directory (rank 0 writes it); a value model's
    last stage passes its head (`value_head`, trained whole), which makes it a token-classification adapter."""
    stage = _whole_pairs(adapters, settings, layout)
    if value_head is not None:
        stage.update({f"base_model.model.{VALUE_HEAD}.{name}": tensor.detach().cpu()
                      for name, tensor in value_head.named_parameters()})
    stages = collectives.all_gather_object(stage if layout.holds_unique_stage_copy else {}, group=layout.pp_group)
    if dist.get_rank() == 0:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {name: tensor.contiguous() for part in stages for name, tensor in part.items()}
        value_model = f"base_model.model.{VALUE_HEAD}.weight" in tensors  # from the last stage
        save_file(tensors, out / WEIGHTS_FILE)
        (out / CONFIG_FILE).write_text(json.dumps({
            "peft_type": "LORA", "task_type": "TOKEN_CLS" if value_model else "CAUSAL_LM",
            "base_model_name_or_path": base_path, "r": settings.rank, "lora_alpha": settings.alpha,
            "lora_dropout": settings.dropout, **_peft_targets(settings, _has_experts(adapters)), **PLAIN_LORA,
            "fan_in_fan_out": False, "modules_to_save": [VALUE_HEAD] if value_model else None,
            "inference_mode": True}, indent=2))
    dist.barrier()


def check_peft_config(path: str | Path, settings: LoRASettings, experts: bool) -> None:
    """ValueError naming the adapter directory unless it is a plain LoRA adapter (`PLAIN_LORA`) of `settings`' rank,
    alpha and targets (`experts`: the model's routed experts are adapted)."""
    config_file = Path(path) / CONFIG_FILE
    if not config_file.is_file() or not (Path(path) / WEIGHTS_FILE).is_file():
        raise ValueError(f"config key 'actor.lora.adapter_path' = {str(path)!r}: expected a PEFT adapter directory "
                         f"with {CONFIG_FILE} and {WEIGHTS_FILE}")
    config = json.loads(config_file.read_text())
    theirs = (config.get("peft_type"), config.get("r"), float(config.get("lora_alpha", 0)),
              sorted(config.get("target_modules") or []), sorted(config.get("target_parameters") or []),
              config.get("rank_pattern") or {}, {k: float(v) for k, v in (config.get("alpha_pattern") or {}).items()})
    targets = _peft_targets(settings, experts)
    targets["target_parameters"] = sorted(targets["target_parameters"])
    ours = ("LORA", settings.rank, float(settings.alpha), *targets.values())
    if theirs != ours:
        raise ValueError(f"{config_file}: a {theirs[0]} adapter of rank {theirs[1]}, alpha {theirs[2]:g} on "
                         f"{theirs[3] + theirs[4]}{' ranks ' + str(theirs[5]) if theirs[5] else ''}; actor.lora asks "
                         f"for rank {ours[1]}, alpha {ours[2]:g} on {ours[3] + ours[4]}"
                         f"{' ranks ' + str(ours[5]) if ours[5] else ''}")
    unsupported = [f"{key} = {json.dumps(config[key])}" for key, plain in PLAIN_LORA.items()
                   if config.get(key, plain) != plain]
    if config.get("modules_to_save"):  # whole modules beside the adapters (a critic's head): not loaded
        unsupported.append(f"modules_to_save = {json.dumps(config['modules_to_save'])}")
    if unsupported:
        expected = ", ".join(f"{key} = {json.dumps(plain)}" for key, plain in PLAIN_LORA.items())
        raise ValueError(f"{config_file}: {', '.join(unsupported)}, which actor.lora.adapter_path does not support; "
                         f"expected a plain LoRA adapter ({expected}, no modules_to_save)")


@torch.no_grad()
def load_peft(adapters: list[LoRAAdapter], settings: LoRASettings, path: str | Path) -> None:
    """Copy a PEFT adapter's pairs into this rank's adapters (each shard sliced from the whole tensor)."""
    check_peft_config(path, settings, _has_experts(adapters))
    expert_weights = _expert_weights(settings)
    weights_file = Path(path) / WEIGHTS_FILE
    tensors = load_file(weights_file)
    for adapter, target in _layered(adapters):
        for matrix, mine in zip("AB", adapter.pair(target)):
            name = (peft_name(adapter.layer, target, matrix) if adapter.expert is None
                    else peft_expert_name(adapter.layer, target, expert_weights, matrix))
            if name not in tensors:
                raise ValueError(f"{weights_file}: no tensor {name}; expected an adapter of this model")
            whole = tensors[name]
            if adapter.expert is not None:
                whole = _one_expert(whole, matrix, mine.shape[0 if matrix == "A" else 1], adapter.expert)
            elif adapter.tp > 1 and getattr(mine, "tensor_model_parallel", False):  # the split half: this rank's
                dim = mine.partition_dim
                width = whole.shape[dim] // adapter.tp
                whole = whole.narrow(dim, adapter.group.rank() * width, width)
            if whole is None or whole.shape != mine.shape:
                raise ValueError(f"{weights_file}: {name} has shape {tuple(tensors[name].shape)}, which does not fit "
                                 "this model; expected an adapter of this base model")
            mine.copy_(whole)


def _one_expert(whole: torch.Tensor, matrix: str, rank: int, expert: int) -> torch.Tensor | None:
    """Expert `expert`'s A (rank x in) or B (out x rank) out of every expert's; None if `whole` has no such."""
    stacked = whole.shape[0 if matrix == "A" else 1]
    if stacked % rank or expert >= stacked // rank:
        return None
    if matrix == "A":
        return whole.reshape(stacked // rank, rank, -1)[expert]
    return whole.reshape(whole.shape[0], rank, stacked // rank)[:, :, expert]
