"""LoRA adapters on megatron-core's tensor-parallel linear layers, in HuggingFace PEFT's terms.

A targeted HF projection W (out x in) computes y = W x + (alpha / r) B A x, with A (r x in) and B (out x r)
trained and W frozen (Hu et al. 2021, arXiv:2106.09685). Targets are named as PEFT names them and sit in
megatron's fused linears:

    megatron linear   HF targets               split    A of each target            B of each target
    linear_qkv        q_proj, k_proj, v_proj   column   whole (r, in)               this TP rank's rows (heads)
    linear_proj       o_proj                   row      this TP rank's columns      whole (out, r)
    linear_fc1        gate_proj, up_proj       column   whole                       this TP rank's rows
    linear_fc2        down_proj                row      this TP rank's columns      whole

Multi-latent attention (DeepSeek-V3) adapts its own projections, each its own linear: q_a_proj (linear_q_down_proj),
q_b_proj (linear_q_up_proj) or q_proj without a query latent (linear_q_proj), kv_a_proj_with_mqa
(linear_kv_down_proj), kv_b_proj (linear_kv_up_proj), all column-parallel, and o_proj (linear_proj, row).

The routed experts of a mixture-of-experts layer adapt as PEFT adapts transformers' fused expert weights
(`target_parameters`): gate_proj and up_proj together are one adapter on each expert's linear_fc1 ([gate; up]) of
twice the rank (PEFT's rank_pattern), down_proj one on its linear_fc2, scaled by alpha / r as the others.

Column-parallel: every TP rank computes h = A x, then its rows B_r h; in backward the gradient of h is summed over TP
(`copy_to_tensor_model_parallel_region`), so A gets the whole gradient on every rank. Row-parallel: h is the
sum over TP of A_r x_r (`reduce_from_tensor_model_parallel_region`), then B h. The fused layouts are kept:
linear_qkv's output is, per local query group g, [q_g; k_g; v_g], linear_fc1's [gate; up]; a target left out
contributes zeros. The adapter is a module of the transformer layer (`decoder.layers.<i>.lora_<linear>`) or of the
routed expert (`...experts.local_experts.<j>.lora_linear_fc1`), so that its sharded checkpoint entries get the
layer's pipeline offset and the expert's index; a forward hook adds it to the linear's output: the base weights
keep their names.

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
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

from megarl.models.architecture import Architecture
from megarl.seeding import derive_seed

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
LATENT_ATTENTION_TARGETS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
"""Multi-latent attention's projections (DeepSeek-V3): q_proj without a query latent, q_a_proj and q_b_proj with."""
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = tuple(dict.fromkeys(ATTENTION_TARGETS + LATENT_ATTENTION_TARGETS + MLP_TARGETS))
EXPERT_TARGETS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
"""A routed expert's adapted weights (transformers' fused names) and the targets that adapt each."""
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
    rank: int


class LoRAAdapter(torch.nn.Module):
    def __init__(self, linear: torch.nn.Module, linear_path: str, kind: str, parts: list[_Part],
                 settings: LoRASettings, layer: int, seed: int, groups: int = 1, expert: int | None = None):
        """`kind`: "column" or "row"; `parts`: the fused linear's targets in its order, those not in
        `settings.target_modules` left out of the sum; `groups`: linear_qkv's query groups (its output
        interleaves the parts per group); `expert`: the routed expert's index in its layer."""
        super().__init__()
        self.linear_path, self.kind, self.parts, self.settings, self.groups = linear_path, kind, parts, settings, groups
        self.layer, self.expert = layer, expert
        """The decoder layer's number in the whole model (HF's `model.layers.<layer>`)."""
        self.group = linear.tp_group
        tp, tp_rank = self.group.size(), self.group.rank()
        self.tp = tp
        self.sequence_parallel = tp > 1 and getattr(linear, "sequence_parallel", False)
        self.enabled = True
        weight = linear.weight
        shard = (sum(part.out_features for part in parts) // tp, parts[0].in_features) if kind == "column" else (
            parts[0].out_features, parts[0].in_features // tp)
        if tuple(weight.shape) != shard:
            # Transformer Engine keeps multi-latent attention's down projections whole on every TP rank.
            raise ValueError(f"actor.lora on {linear_path}: its weight on this rank is {tuple(weight.shape)}, not "
                             f"{shard} (split over TP {tp}); set model.layer_spec=local")
        self.dropout = torch.nn.Dropout(settings.dropout) if settings.dropout else torch.nn.Identity()
        for part in parts:
            if not _targeted(part.target, settings):
                continue
            name = f"lora {part.target}" + ("" if expert is None else f" expert {expert}")
            generator = torch.Generator().manual_seed(derive_seed(seed, name, step=layer))
            bound = 1 / math.sqrt(part.in_features)
            a = (torch.rand(part.rank, part.in_features, generator=generator) * 2 - 1) * bound
            if kind == "row":
                width = part.in_features // tp
                a = a[:, tp_rank * width:(tp_rank + 1) * width]
                b = torch.zeros(part.out_features, part.rank)
            else:
                b = torch.zeros(part.out_features // tp, part.rank)
            a = torch.nn.Parameter(a.to(weight.device, weight.dtype).contiguous())
            b = torch.nn.Parameter(b.to(weight.device, weight.dtype))
            # The split half is a tensor-parallel shard (its `partition_dim` says along which dim; gradient norms
            # sum it over TP); the other is replicated.
            split, dim = (a, 1) if kind == "row" else (b, 0)
            set_tensor_model_parallel_attributes(split, is_parallel=True, dim=dim, stride=1)
            for parameter in (a, b):
                # A routed expert's adapter is reduced over the expert data-parallel ranks, as its linear is.
                parameter.allreduce = getattr(weight, "allreduce", True)
            # Under sequence parallelism the whole half multiplies this rank's part of the sequence: megatron sums
            # its gradient over TP, as it does a norm's.
            (b if kind == "row" else a).sequence_parallel = self.sequence_parallel
            self.register_parameter(f"A_{part.target}", a)
            self.register_parameter(f"B_{part.target}", b)

    def targets(self) -> list[str]:
        return [part.target for part in self.parts if _targeted(part.target, self.settings)]

    def pair(self, target: str) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (A, B) of `target`."""
        return getattr(self, f"A_{target}"), getattr(self, f"B_{target}")

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """(alpha / r) B A x in the linear's output layout (this TP rank's rows for column-parallel). Under
        sequence parallelism a column-parallel linear takes this rank's part of the sequence and gives all of it,
        a row-parallel one the reverse: h = A x (r wide) is gathered or reduce-scattered along the sequence."""
        x = self.dropout(x)
        outputs = {}
        for target in self.targets():
            a, b = self.pair(target)
            h = x @ a.t()
            if self.tp > 1:
                h = self._communicate(h)
            outputs[target] = h @ b.t()
        return self._assemble(outputs, h.shape[:-1], dim=-1) * self.settings.scaling

    def _communicate(self, h: torch.Tensor) -> torch.Tensor:
        if self.kind == "column":
            if self.sequence_parallel:
                return gather_from_sequence_parallel_region(h, group=self.group)
            return copy_to_tensor_model_parallel_region(h, group=self.group)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(h, group=self.group)
        return reduce_from_tensor_model_parallel_region(h, group=self.group)

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
        # The linear's own TP group (a routed expert's: the expert TP group; its experts' layer sets the replicas
        # along the expert data-parallel ranks).
        groups = {"tp_group": self.group, "dp_cp_group": ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"]}
        entries = {}
        for name, parameter in self.named_parameters():
            key = f"{prefix}{name}"
            if getattr(parameter, "tensor_model_parallel", False):
                entries[key] = make_tp_sharded_tensor_for_checkpoint(parameter, key, parameter.partition_dim,
                                                                     prepend_offsets=sharded_offsets, **groups)
            else:
                entries[key] = make_sharded_tensor_for_checkpoint(parameter, key, prepend_offsets=sharded_offsets,
                                                                  **groups)
        return entries


def _add_delta(adapter: LoRAAdapter, linear: torch.nn.Module, args: tuple, output: tuple) -> tuple:
    if not adapter.enabled:
        return output
    result, bias = output
    return result + adapter.delta(_linear_input(linear, args[0])), bias


def _linear_input(linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What `linear`'s weight multiplies: Transformer Engine's LayerNormLinear (linear_qkv and linear_fc1 of its
    layer spec) takes the layer's input and applies the layer's norm itself; the others take it normalized."""
    gamma = getattr(linear, "layer_norm_weight", None)
    if gamma is None:
        return x
    gamma = gamma.float() + 1 if linear.zero_centered_gamma else gamma.float()
    x32 = x.float()
    if linear.normalization == "RMSNorm":
        normalized = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + linear.eps) * gamma
    else:
        bias = linear.layer_norm_bias.float() if linear.layer_norm_bias is not None else None
        normalized = torch.nn.functional.layer_norm(x32, (x.shape[-1],), gamma, bias, linear.eps)
    return normalized.to(x.dtype)


def apply_lora(model: torch.nn.Module, arch: Architecture, settings: LoRASettings, seed: int = 0) -> list[LoRAAdapter]:
    """Attach adapters to the targeted linears of this rank's model stage and freeze everything else (but a value
    model's head). `seed` draws the A matrices (the same adapters at every layout)."""
    _check_targets(arch, settings)
    for name, parameter in model.named_parameters():
        # A value model's head (`output_layer.score`, new on a causal LM's backbone) trains whole, as PEFT's
        # modules_to_save keeps a classifier head.
        parameter.requires_grad_(arch.value_model and name.startswith("output_layer.score."))
    adapters = []
    d, hidden, r = arch.head_dim, arch.hidden_size, settings.rank
    for layer in model.decoder.layers:
        number = layer.layer_number - 1
        linears = []
        if arch.mla is None:
            q_rows, kv_rows = arch.num_attention_heads * d, arch.num_kv_heads * d
            qkv = [_Part("q_proj", hidden, q_rows, r), _Part("k_proj", hidden, kv_rows, r),
                   _Part("v_proj", hidden, kv_rows, r)]
            linears += [(layer, "self_attention.linear_qkv", "column", qkv, arch.num_kv_heads, None),
                        (layer, "self_attention.linear_proj", "row", [_Part("o_proj", q_rows, hidden, r)], 1, None)]
        else:
            linears += [(layer, f"self_attention.{path}", kind, [part], 1, None)
                        for path, kind, part in _latent_attention_linears(arch, r)]
        if not arch.is_moe_layer(number):
            ffn = arch.ffn_hidden_size
            gate_up = [_Part("gate_proj", hidden, ffn, r), _Part("up_proj", hidden, ffn, r)]
            linears += [(layer, "mlp.linear_fc1", "column", gate_up, 1, None),
                        (layer, "mlp.linear_fc2", "row", [_Part("down_proj", ffn, hidden, r)], 1, None)]
        elif set(settings.target_modules) & set(MLP_TARGETS):
            experts = layer.mlp.experts
            if not hasattr(experts, "local_experts"):
                raise ValueError("actor.lora on routed experts needs one linear per expert (megatron's local layers, "
                                 "not Transformer Engine's grouped GEMM); set model.layer_spec=local")
            if experts.tp_group.size() > 1:
                # linear_fc1's shard is [gate_t; up_t]: its rows of the fused B are not one slice.
                raise ValueError("actor.lora on routed experts needs expert tensor parallelism 1; set "
                                 "actor.etp=1 (with actor.ep > 1 when actor.tp > 1)")
            first = layer.mlp.local_expert_indices[0]
            ffn = arch.moe_ffn_hidden_size
            for i, expert in enumerate(experts.local_experts):
                linears += [(expert, "linear_fc1", "column", [_Part("gate_up_proj", hidden, 2 * ffn, 2 * r)], 1,
                             first + i),
                            (expert, "linear_fc2", "row", [_Part("down_proj", ffn, hidden, r)], 1, first + i)]
        for owner, path, kind, parts, groups, expert in linears:
            if any(_targeted(part.target, settings) for part in parts):
                linear = owner.get_submodule(path)
                adapter = LoRAAdapter(linear, path, kind, parts, settings, number, seed, groups, expert)
                owner.add_module(ADAPTER_PREFIX + path.replace(".", "_"), adapter)
                linear.register_forward_hook(functools.partial(_add_delta, adapter))
                adapters.append(adapter)
    return adapters


def _latent_attention_linears(arch: Architecture, r: int) -> list[tuple[str, str, _Part]]:
    """Multi-latent attention's linears (every one column-parallel but the output projection): (path, kind, part)."""
    mla, hidden, heads = arch.mla, arch.hidden_size, arch.num_attention_heads
    query = heads * (mla.nope_head_dim + mla.rope_head_dim)
    if mla.q_lora_rank:
        linears = [("linear_q_down_proj", "column", _Part("q_a_proj", hidden, mla.q_lora_rank, r)),
                   ("linear_q_up_proj", "column", _Part("q_b_proj", mla.q_lora_rank, query, r))]
    else:
        linears = [("linear_q_proj", "column", _Part("q_proj", hidden, query, r))]
    return linears + [
        ("linear_kv_down_proj", "column", _Part("kv_a_proj_with_mqa", hidden, mla.kv_lora_rank + mla.rope_head_dim, r)),
        ("linear_kv_up_proj", "column", _Part("kv_b_proj", mla.kv_lora_rank, heads * (mla.nope_head_dim +
                                                                                     mla.v_head_dim), r)),
        ("linear_proj", "row", _Part("o_proj", heads * mla.v_head_dim, hidden, r))]


def _targeted(target: str, settings: LoRASettings) -> bool:
    return all(name in settings.target_modules for name in EXPERT_TARGETS.get(target, (target,)))


def _check_targets(arch: Architecture, settings: LoRASettings) -> None:
    """ValueError naming `actor.lora.target_modules` for targets this architecture's adapters cannot take."""
    targets = set(settings.target_modules)
    key = f"config key 'actor.lora.target_modules' = {sorted(targets)}"
    attention = ATTENTION_TARGETS
    if arch.mla is not None:
        attention = tuple(part.target for _, _, part in _latent_attention_linears(arch, settings.rank))
    lacking = targets - set(attention) - set(MLP_TARGETS)
    if lacking:
        raise ValueError(f"{key}: {arch.family} has no {', '.join(sorted(lacking))}; allowed: "
                         f"{', '.join(attention + MLP_TARGETS)}")
    if not arch.is_moe or not targets & set(MLP_TARGETS):
        return
    if arch.family == "mixtral" or arch.dense_layers or arch.shared_expert_ffn_hidden_size:
        raise ValueError(f"{key}: LoRA on the MLPs of {arch.family} (dense or shared-expert MLPs beside the routed "
                         f"experts, or Mixtral's w1/w2/w3) is not supported; allowed: {', '.join(attention)}")
    if ("gate_proj" in targets) != ("up_proj" in targets):
        raise ValueError(f"{key}: a routed expert's gate_proj and up_proj are one fused weight (gate_up_proj); "
                         "target both or neither")


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
