"""A weight update written straight into vLLM's parameters, where the engine's layout allows it.

vLLM's in-place reload serves any model, checkpoint and layout: it moves every layer to the meta
device, buffers each incoming tensor with its loader's bound arguments, materialises the layer once
complete, runs the loaders, processes the layer and copies the result back into the old storage.
For a small model that Python costs several times the copy and the processing themselves (15 of the
22 ms of the quick start's sync). Where each HF tensor has a single place in the engine, all of that
reduces to a copy: an engine at TP 1 (every rank holds every tensor whole) of an unquantized dense
model without LoRA, whose checkpoint names map onto its parameters through the model's own
`hf_to_vllm_mapper`. There an HF tensor is a row range of one parameter: q/k/v of the fused
`qkv_proj`, gate/up of `gate_up_proj` (vLLM's shard ids, placed by the layer's
`output_partition_sizes`), the first rows of a vocabulary padded past them, or a whole parameter.

A layer's tensors are held until all of them arrived, then copied in, and the layer is processed as
a load processes it (`process_weights_after_loading`; on CPU the oneDNN repack of a linear layer,
which drops the weight it was made from, so that weight is allocated again to be copied into). A
load that fails therefore leaves every unfinished layer as it was. A load that leaves every layer
plain (nothing derived from its weights: see below, and CUDA) records where each tensor went; the
next update may then copy into those places itself (`RolloutEngine.weight_places`).

Except for small weights on CPU: there a layer of fewer than `PLAIN_GEMM_MAX_ELEMENTS` weights keeps
its weight and multiplies it as it is (`megarl.kernels.cpu_matmul.linear`: torch's `linear`, as vLLM
itself uses for layers it does not pack, `_cpu_skip_gemm_dispatch`, or oneDNN on the CPUs where that
is twice as fast). vLLM packs once for a model that never changes; an RL engine's weights
change every step, and oneDNN's pack (its primitives made anew, 0.23-0.3 ms a layer even for a
128 x 256 weight) costs more than it saves over a step's rollout below about 2^18 weights: with a
fresh pack and 4 forward passes (a prefill of 384 tokens, 3 decodes of ~30), a 256 x 128 layer took
0.75 ms against torch's 0.41, 512 x 512 5.0 against 3.9, 1024 x 512 6.8 against 11.9 (float32;
bfloat16 favours torch up to 1024 x 512). The quick start's engine thus syncs without repacking.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from megarl.kernels import cpu_matmul

_SHARD_INDEX = {"q": 0, "k": 1, "v": 2}
PLAIN_GEMM_MAX_ELEMENTS = 1 << 18
"""Fewer weights than this: on CPU the layer multiplies its weight as it is (see the module docstring)."""


@dataclass(frozen=True)
class _Destination:
    module: torch.nn.Module
    param: str
    part: int
    """Which of the parameter's row ranges (a fused layer's shard index; 0 for a plain parameter)."""


def supports_direct_load(model: torch.nn.Module, tensor_parallel_size: int, quantized: bool, lora: bool) -> bool:
    """Whether every weight of `model` has one place for its HF tensor (see the module docstring). Any
    layer processed by another method than the unquantized linear and embedding ones (a mixture of
    experts' layer, a quantized one) keeps the whole model on vLLM's generic reload."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    if tensor_parallel_size != 1 or quantized or lora or not hasattr(model, "hf_to_vllm_mapper"):
        return False
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and type(method) not in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
            return False
    return True


class DirectLoader:
    """Loads weight updates into one model (runs on the worker, in the trainer's process)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.destinations: dict[str, _Destination | None] = {}
        # What each parameter owner expects: its parameters (a tied LM head owns none: the
        # embedding's is counted once, where it is registered first) and each one's row ranges.
        self.expected: dict[torch.nn.Module, dict[str, int]] = defaultdict(dict)
        for name, _ in model.named_parameters():
            module_name, _, param = name.rpartition(".")
            module = model.get_submodule(module_name)
            self.expected[module][param] = len(getattr(module, "output_partition_sizes", [None]))
        self.tied = [module for module in model.modules()
                     if getattr(module, "quant_method", None) is not None and module not in self.expected]
        """Layers that multiply another layer's weight (a tied LM head): processed once that one is in."""
        self.places: dict[str, torch.Tensor | None] | None = None
        """After a load that left every layer plain (`_process`): where each HF tensor was copied, by
        name (None: a tensor the engine drops); copying into them is then a whole weight update."""

    def load(self, weights) -> None:
        self.places = None  # a load that fails part-way leaves none
        pending: dict[torch.nn.Module, dict[tuple[str, int], tuple[str, torch.Tensor]]] = defaultdict(dict)
        done, places, plain = set(), {}, True
        for name, tensor in weights:
            destination = self._destination(name)
            if destination is None:
                places[name] = None
                continue
            module = destination.module
            parts = pending[module]
            parts[(destination.param, destination.part)] = (name, tensor)
            if len(parts) == sum(self.expected[module].values()):
                places |= _write(module, parts)
                if getattr(module, "quant_method", None) is not None:
                    plain &= _process(module)
                done.add(module)
                del pending[module]
        missing = [self._name_of(module) for module in self.expected if module not in done]
        if missing:
            raise ValueError(f"weight update left {len(missing)} layers without all their tensors "
                             f"(their old weights would stay in use): {', '.join(missing[:5])}")
        for module in self.tied:
            plain &= _process(module)
        if plain:
            self.places = places

    def _destination(self, name: str) -> _Destination | None:
        """Where the HF tensor `name` goes; None for a tensor vLLM drops (its mapper says so)."""
        if name not in self.destinations:
            # The mapper's own lookup with the shard id (vLLM 0.32); its public `map_name` drops the id.
            mapped = self.model.hf_to_vllm_mapper._map_name_with_shard(name)
            if mapped is None:
                self.destinations[name] = None
                return None
            vllm_name, shard = mapped
            module_name, _, param = vllm_name.rpartition(".")
            try:
                module = self.model.get_submodule(module_name)
            except AttributeError:
                module = None
            if module is None or param not in self.expected.get(module, {}):
                raise ValueError(f"{name!r}: the engine has no parameter {vllm_name!r} to load it into")
            self.destinations[name] = _Destination(module, param, _SHARD_INDEX.get(shard, shard or 0))
        return self.destinations[name]

    def _name_of(self, module: torch.nn.Module) -> str:
        return next(name for name, candidate in self.model.named_modules() if candidate is module)


@torch.no_grad()
def _write(module: torch.nn.Module, parts: dict[tuple[str, int], tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Copy a layer's complete set of HF tensors (name and tensor by parameter and row range) into it;
    returns where each went. Every shape is checked before anything is written."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    targets = {}
    for param in {param for param, _ in parts}:
        target = getattr(module, param)
        if param == "weight" and target.numel() == 0:  # dropped by the CPU kernel's repack
            target = torch.empty(module.output_size_per_partition, module.input_size_per_partition,
                                 dtype=target.dtype, device=target.device)
        targets[param] = target
    sizes = getattr(module, "output_partition_sizes", None)
    places = {}
    for (param, part), (name, tensor) in parts.items():
        place = targets[param] if sizes is None else targets[param].narrow(0, sum(sizes[:part]), sizes[part])
        # Only a vocabulary is padded past the tensor's rows.
        fits = tensor.shape[1:] == place.shape[1:] and (tensor.shape[0] == place.shape[0] or (
            isinstance(module, VocabParallelEmbedding) and tensor.shape[0] < place.shape[0]))
        if not fits:
            raise ValueError(f"{type(module).__name__}.{param}: got a tensor of shape {tuple(tensor.shape)} "
                             f"for a place of shape {tuple(place.shape)}")
        places[name] = place
    for name, tensor in parts.values():
        place = places[name]
        if tensor.shape[0] < place.shape[0]:  # a padded vocabulary: its padding zero, as vLLM's loader leaves it
            place[tensor.shape[0]:].zero_()
            places[name] = place = place[: tensor.shape[0]]
        place.copy_(tensor)
    for param, target in targets.items():
        if target is not getattr(module, param):
            setattr(module, param, torch.nn.Parameter(target, requires_grad=False))
    return places


def _process(module: torch.nn.Module) -> bool:
    """What a load does to a layer once its weights are in, small CPU weights aside (module docstring).
    True where the layer is left plain, multiplying the very tensor loaded into it (nothing derived
    from it to make anew): a small CPU layer, and any layer on CUDA, where vLLM's unquantized methods
    process nothing."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and module.weight.dim() == 2 and module.weight.numel() < PLAIN_GEMM_MAX_ELEMENTS:
        module.cpu_linear = cpu_matmul.linear
        return True
    module.quant_method.process_weights_after_loading(module)
    return current_platform.is_cuda()
