"""LoRA adapters on megatron-core's tensor-parallel linear layers, in HuggingFace PEFT's terms.

A targeted HF projection W (out x in) computes y = W x + (alpha / r) B A x, with A (r x in) and B (out x r)
trained and W frozen (Hu et al. 2021, arXiv:2106.09685). Targets are named as PEFT names them and sit in
megatron's fused linears:

    megatron linear   HF targets               split    A of each target            B of each target
    linear_qkv        q_proj, k_proj, v_proj   column   whole (r, in)               this TP rank's rows (heads)
    linear_proj       o_proj                   row      this TP rank's columns      whole (out, r)
    linear_fc1        gate_proj, up_proj       column   whole                       this TP rank's rows
    linear_fc2        down_proj                row      this TP rank's columns      whole

(mixture-of-experts layers: attention only, for now). Column-parallel: every TP
rank computes h = A x, then its rows B_r h; in backward the gradient of h is summed over TP
(`copy_to_tensor_model_parallel_region`), so A gets the whole gradient on every rank. Row-parallel: h is the
sum over TP of A_r x_r (`reduce_from_tensor_model_parallel_region`), then B h. The fused layouts are kept:
linear_qkv's output is, per local query group g, [q_g; k_g; v_g], linear_fc1's [gate; up]; a target left out
contributes zeros. The adapter is a module of the transformer layer (`decoder.layers.<i>.lora_<linear>`, so that
its sharded checkpoint entries get the layer's pipeline offset), added to the linear's output by a forward hook:
the base weights keep their names.

A starts as PEFT starts it (uniform in +-1/sqrt(in), drawn for the whole tensor from a seed of the layer and
target, then sliced, so every layout starts from the same adapter) and B at zero: training starts at the base
model. `merged_weight` gives W + (alpha / r) B A in the linear's own layout: what the rollout engine serves.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Iterator

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

from megarl.models.architecture import Architecture
from megarl.seeding import derive_seed

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
ADAPTER_PREFIX = "lora_"
"""An adapter's name in its layer: `lora_` and its linear's path (`lora_self_attention_linear_qkv`); its parameters
`A_<target>` and `B_<target>`."""


@dataclass(frozen=True)
class LoRASettings:
    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class _Part:
    """One target's slot in a fused linear: its rows of the output (column) or its input (row)."""

    target: str
    in_features: int
    """The whole A's input width (row-parallel: all TP ranks' columns)."""
    out_features: int
    """The whole B's output height (column-parallel: all TP ranks' rows)."""


class LoRAAdapter(torch.nn.Module):
    def __init__(self, linear: torch.nn.Module, linear_path: str, kind: str, parts: list[_Part],
                 settings: LoRASettings, layer: int, seed: int, groups: int = 1):
        """`kind`: "column" or "row"; `parts`: the fused linear's targets in its order, those not in
        `settings.target_modules` left out of the sum; `groups`: linear_qkv's query groups (its output
        interleaves the parts per group)."""
        super().__init__()
        if getattr(linear, "sequence_parallel", False):
            raise ValueError("actor.lora with sequence parallelism (Transformer Engine's layers at TP>1) is not "
                             "supported; set model.layer_spec=local")
        self.linear_path, self.kind, self.parts, self.settings, self.groups = linear_path, kind, parts, settings, groups
        self.layer = layer
        """The decoder layer's number in the whole model (HF's `model.layers.<layer>`)."""
        self.group = linear.tp_group
        tp, tp_rank = self.group.size(), self.group.rank()
        self.tp = tp
        self.enabled = True
        self.dropout = torch.nn.Dropout(settings.dropout) if settings.dropout else torch.nn.Identity()
        weight = linear.weight
        for part in parts:
            if part.target not in settings.target_modules:
                continue
            generator = torch.Generator().manual_seed(derive_seed(seed, f"lora {part.target}", step=layer))
            bound = 1 / math.sqrt(part.in_features)
            a = (torch.rand(settings.rank, part.in_features, generator=generator) * 2 - 1) * bound
            if kind == "row":
                width = part.in_features // tp
                a = a[:, tp_rank * width:(tp_rank + 1) * width]
                b = torch.zeros(part.out_features, settings.rank)
            else:
                b = torch.zeros(part.out_features // tp, settings.rank)
            a = torch.nn.Parameter(a.to(weight.device, weight.dtype).contiguous())
            b = torch.nn.Parameter(b.to(weight.device, weight.dtype))
            # The split half is a tensor-parallel shard (its `partition_dim` says along which dim; gradient norms
            # sum it over TP); the other is replicated.
            split, dim = (a, 1) if kind == "row" else (b, 0)
            set_tensor_model_parallel_attributes(split, is_parallel=True, dim=dim, stride=1)
            self.register_parameter(f"A_{part.target}", a)
            self.register_parameter(f"B_{part.target}", b)

    def targets(self) -> list[str]:
        return [part.target for part in self.parts if part.target in self.settings.target_modules]

    def pair(self, target: str) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (A, B) of `target`."""
        return getattr(self, f"A_{target}"), getattr(self, f"B_{target}")

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """(alpha / r) B A x in the linear's output layout (this TP rank's rows for column-parallel)."""
        x = self.dropout(x)
        outputs = {}
        for target in self.targets():
            a, b = self.pair(target)
            h = x @ a.t()
            if self.tp > 1:
                h = (copy_to_tensor_model_parallel_region(h, group=self.group) if self.kind == "column"
                     else reduce_from_tensor_model_parallel_region(h, group=self.group))
            outputs[target] = h @ b.t()
        return self._assemble(outputs, x.shape[:-1], dim=-1) * self.settings.scaling

    def weight_delta(self) -> torch.Tensor:
        """(alpha / r) B A as the linear's own weight shard (out_local x in_local), in float32."""
        deltas = {target: self.pair(target)[1].float() @ self.pair(target)[0].float() for target in self.targets()}
        return self._assemble(deltas, (), dim=0) * self.settings.scaling

    def _assemble(self, pieces: dict[str, torch.Tensor], lead: tuple, dim: int) -> torch.Tensor:
        """The parts' outputs (dim=-1) or weight rows (dim=0) in the fused linear's layout; zeros for parts
        without an adapter."""
        if self.kind == "row":
            return pieces[self.parts[0].target]
        like = next(iter(pieces.values()))
        local = [part.out_features // self.tp for part in self.parts]
        width = like.shape[1] if dim == 0 else None
        blocks = []
        for part, rows in zip(self.parts, local):
            if part.target in pieces:
                piece = pieces[part.target]
            else:
                shape = (rows, width) if dim == 0 else (*lead, rows)
                piece = torch.zeros(shape, dtype=like.dtype, device=like.device)
            blocks.append(piece)
        if self.groups == 1:
            return torch.cat(blocks, dim=dim)
        # linear_qkv: per local query group, its q rows, then its k and v rows.
        groups = self.groups // self.tp
        if dim == 0:
            split = [block.reshape(groups, -1, width) for block in blocks]
            return torch.cat(split, dim=1).reshape(-1, width)
        split = [block.reshape(*lead, groups, -1) for block in blocks]
        return torch.cat(split, dim=-1).reshape(*lead, -1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Checkpoint entries: the split half of each pair sharded over TP, the other replicated."""
        entries = {}
        for name, parameter in self.named_parameters():
            key = f"{prefix}{name}"
            if getattr(parameter, "tensor_model_parallel", False):
                entries[key] = make_tp_sharded_tensor_for_checkpoint(parameter, key, parameter.partition_dim,
                                                                     prepend_offsets=sharded_offsets)
            else:
                entries[key] = make_sharded_tensor_for_checkpoint(parameter, key, prepend_offsets=sharded_offsets)
        return entries


def _add_delta(adapter: LoRAAdapter, linear: torch.nn.Module, args: tuple, output: tuple) -> tuple:
    if not adapter.enabled:
        return output
    result, bias = output
    return result + adapter.delta(args[0]), bias


def apply_lora(model: torch.nn.Module, arch: Architecture, settings: LoRASettings, seed: int = 0) -> list[LoRAAdapter]:
    """Attach adapters to the targeted linears of this rank's model stage and freeze everything else (but a value
    model's head). `seed` draws the A matrices (the same adapters at every layout)."""
    if arch.mla is not None and set(settings.target_modules) & set(ATTENTION_TARGETS):
        raise ValueError(f"config key 'actor.lora.target_modules' = {list(settings.target_modules)}: LoRA on "
                         "multi-latent attention is not supported; allowed: gate_proj, up_proj, down_proj")
    for name, parameter in model.named_parameters():
        # A value model's head (`output_layer.score`, new on a causal LM's backbone) trains whole, as PEFT's
        # modules_to_save keeps a classifier head.
        parameter.requires_grad_(arch.value_model and name.startswith("output_layer.score."))
    adapters = []
    d, hidden = arch.head_dim, arch.hidden_size
    for layer in model.decoder.layers:
        number = layer.layer_number - 1
        linears = []
        if arch.mla is None:
            q_rows, kv_rows = arch.num_attention_heads * d, arch.num_kv_heads * d
            qkv = [_Part("q_proj", hidden, q_rows), _Part("k_proj", hidden, kv_rows), _Part("v_proj", hidden, kv_rows)]
            linears += [("self_attention.linear_qkv", "column", qkv, arch.num_kv_heads),
                        ("self_attention.linear_proj", "row", [_Part("o_proj", q_rows, hidden)], 1)]
        if not arch.is_moe_layer(number):
            ffn = arch.ffn_hidden_size
            gate_up = [_Part("gate_proj", hidden, ffn), _Part("up_proj", hidden, ffn)]
            linears += [("mlp.linear_fc1", "column", gate_up, 1),
                        ("mlp.linear_fc2", "row", [_Part("down_proj", ffn, hidden)], 1)]
        elif set(settings.target_modules) & set(MLP_TARGETS):
            raise ValueError(f"config key 'actor.lora.target_modules' = {list(settings.target_modules)}: LoRA on "
                             "the experts of mixture-of-experts layers is not supported yet; allowed on "
                             f"{arch.family}: {', '.join(ATTENTION_TARGETS)}")
        for path, kind, parts, groups in linears:
            if any(part.target in settings.target_modules for part in parts):
                linear = layer.get_submodule(path)
                adapter = LoRAAdapter(linear, path, kind, parts, settings, number, seed, groups)
                layer.add_module(ADAPTER_PREFIX + path.replace(".", "_"), adapter)
                linear.register_forward_hook(functools.partial(_add_delta, adapter))
                adapters.append(adapter)
    return adapters


def adapters_of(model: torch.nn.Module) -> dict[str, LoRAAdapter]:
    """The model's adapters by the name of the linear they add to (`decoder.layers.0.self_attention.linear_qkv`)."""
    return {f"{name.rsplit('.', 1)[0]}.{module.linear_path}": module for name, module in model.named_modules()
            if isinstance(module, LoRAAdapter)}


def is_adapter_parameter(name: str) -> bool:
    return f".{ADAPTER_PREFIX}" in name


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model: every adapter off inside the block."""
    adapters = list(adapters_of(model).values())
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True


@torch.no_grad()
def merged_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{parameter name of an adapted linear's weight: W + (alpha / r) B A}, in this rank's shard: summed in float32,
    then rounded once to W's dtype (in bf16 an update below half of W's last place is lost: served separately,
    as vLLM's LoRA path does, it would not be)."""
    merged = {}
    for name, adapter in adapters_of(model).items():
        weight = model.get_submodule(name).weight
        merged[f"{name}.weight"] = (weight.float() + adapter.weight_delta()).to(weight.dtype)
    return merged
