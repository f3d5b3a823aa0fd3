"""Plain `transformers` generation: the reference for parity tests and a fallback without vLLM.

Sequential and unbatched on purpose (one prompt at a time, no padding): slow, but with nothing
that could make it differ from a textbook forward pass. The model runs on the rank's compute device;
each token is drawn on the CPU from the last position's logits, so that a seed gives the same draws
on every device.

Weights arrive under their checkpoint names. transformers 5 holds a mixture-of-experts layer's
experts stacked (`experts.gate_up_proj` (E, 2 x ffn, h), `experts.down_proj` (E, h, ffn)) and
Mixtral's `block_sparse_moe` as `mlp`, so a checkpoint's per-expert tensor is loaded into its part
of the stacked one (`checkpoint_tensor`).

A mixture-of-experts model records the experts each token was routed to, from the indices its
routers (each layer's `mlp.gate`) return: the prompt's from the prefill, then each fed-back token's.
"""

from __future__ import annotations

import os
import re
from typing import Iterable

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from megarl import device
from megarl.rollout.base import (ROLLOUT_BACKENDS, Advance, RolloutOutput, Sampling, WeightUpdateGuard,
                                 check_none_submitted, check_one_response, routed_experts_shape)


@ROLLOUT_BACKENDS.register("hf")
class HFRollout:
    def __init__(self, model_dir: str, dtype: str, dummy_weights: bool = False, **unused):
        self.model = _load_model(model_dir, getattr(torch, dtype), dummy_weights).to(device.compute_device()).eval()
        eos = self.model.generation_config.eos_token_id  # one id, or several (Llama 3's, Qwen 2.5 instruct's)
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else eos or ())
        """Where every response stops, as vLLM stops on the generation config's EOS ids."""
        self.guard = WeightUpdateGuard(has_weights=not dummy_weights)
        self.submitted: dict[str, _Sequence] = {}
        """The requests `submit` started that have not ended or been aborted, by key."""
        self.places: dict[str, torch.Tensor] | None = None
        """Where the last complete load copied each tensor."""
        self.routed: dict[int, list[torch.Tensor]] = {}  # per MoE layer, the (tokens, k) indices of each forward
        self.routed_experts_shape = routed_experts_shape(self.model.config)
        if self.routed_experts_shape is not None:
            for layer, decoder_layer in enumerate(self.model.model.layers):
                if hasattr(decoder_layer.mlp, "gate"):  # not a dense first layer (DeepSeek-V3, GLM-4.5)
                    self.routed[layer] = []
                    decoder_layer.mlp.gate.register_forward_hook(
                        lambda module, args, output, layer=layer: self.routed[layer].append(output[2]))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: Sampling) -> RolloutOutput:
        self.guard.check()
        check_none_submitted(self.submitted)
        result = RolloutOutput()
        for i, prompt in enumerate(prompts):
            generator = torch.Generator().manual_seed(sampling.seed_of(i))
            for _ in range(sampling.n):
                sequence = _Sequence(prompt, sampling, sampling.max_tokens_of(i), self._stops(sampling), generator)
                while sequence.finish_reason is None:
                    sequence.advance(self.model)
                result.response_ids.append(sequence.ids)
                result.logprobs.append(sequence.logprobs)
                result.finish_reasons.append(sequence.finish_reason)
                if self.routed:
                    result.routed_experts.append(self._take_routing())
        return result

    def submit(self, key: str, prompt: list[int], sampling: Sampling) -> None:
        self.guard.check()
        check_one_response(sampling)
        self.submitted[key] = _Sequence(prompt, sampling, sampling.max_tokens_of(0), self._stops(sampling),
                                        torch.Generator().manual_seed(sampling.seed_of(0)))

    @torch.no_grad()
    def step(self) -> list[Advance]:
        """A token of every submitted request, one after the other."""
        self.guard.check()
        advances = []
        for key, sequence in list(self.submitted.items()):
            sequence.advance(self.model)
            advances.append(Advance(key, sequence.ids[-1:], sequence.logprobs[-1:], sequence.finish_reason))
            if sequence.finish_reason is not None:
                del self.submitted[key]
        for forwards in self.routed.values():
            forwards.clear()  # the routing of interleaved sequences: no response's own
        return advances

    def abort(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.submitted.pop(key, None)

    def _stops(self, sampling: Sampling) -> set[int]:
        return set(sampling.stop_token_ids) | self.eos_token_ids

    def _take_routing(self) -> torch.Tensor:
        """(P + R - 1, L, k) int16 experts of the sequence just sampled (every position it fed)."""
        layers = {layer: torch.cat(forwards) for layer, forwards in self.routed.items()}
        tokens = next(iter(layers.values())).shape[0]
        routing = torch.zeros(tokens, *self.routed_experts_shape, dtype=torch.int16)
        for layer, ids in layers.items():
            routing[:, layer] = ids.short().cpu()
        for forwards in self.routed.values():
            forwards.clear()
        return routing

    takes_partial_loads = True  # each tensor is copied into its own parameter

    def begin_weight_update(self, step: int, partial: bool = False) -> None:
        self.guard.begin(step)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.places = None  # until this load completes
        params, places = self.model.state_dict(), {}
        for name, tensor in weights:
            places[name] = checkpoint_tensor(params, name)
            places[name].copy_(tensor)
        self.places = places

    def weight_places(self) -> dict[str, torch.Tensor] | None:
        return self.places

    def end_weight_update(self) -> None:
        self.guard.end()

    def sleep(self, keep_weights: bool) -> None:
        pass

    def wake_up(self, tags: tuple[str, ...]) -> None:
        pass

    def shutdown(self) -> None:
        pass


class _Sequence:
    """One response being sampled, a token at a time, with its KV cache."""

    def __init__(self, prompt: list[int], sampling: Sampling, max_tokens: int, stops: set[int], generator):
        self.prompt, self.sampling, self.generator = prompt, sampling, generator
        self.max_tokens, self.stops = max_tokens, stops
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.cache = None

    def advance(self, model) -> None:
        """The next token, from the last position's logits (drawn on the CPU)."""
        fed = self.prompt if self.cache is None else self.ids[-1:]
        out = model(torch.tensor([fed], device=model.device), past_key_values=self.cache, use_cache=True)
        self.cache, logits = out.past_key_values, out.logits[0, -1].float().cpu()
        if self.sampling.temperature == 0:
            token = int(logits.argmax())
            log_p = torch.log_softmax(logits, -1)
        else:
            log_p = torch.log_softmax(_filter(logits / self.sampling.temperature, self.sampling), -1)
            token = int(torch.multinomial(log_p.exp(), 1, generator=self.generator))
        self.ids.append(token)
        self.logprobs.append(float(log_p[token]))
        if token in self.stops:
            self.finish_reason = "stop"
        elif len(self.ids) >= self.max_tokens:
            self.finish_reason = "length"


_EXPERT = re.compile(r"(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_GATE, _UP = ("gate_proj", "w1"), ("up_proj", "w3")


def checkpoint_tensor(params: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The tensor (or the view of a stacked one) of `params` (a transformers state dict) that holds
    checkpoint tensor `name`."""
    expert = _EXPERT.fullmatch(name)
    if expert is None:
        return params[name.replace(".block_sparse_moe.", ".mlp.")]
    layer, index, projection = expert.group(1), int(expert.group(2)), expert.group(3)
    if projection in _GATE + _UP:
        gate_up = params[f"{layer}.mlp.experts.gate_up_proj"][index]
        half = gate_up.shape[0] // 2
        return gate_up[:half] if projection in _GATE else gate_up[half:]
    return params[f"{layer}.mlp.experts.down_proj"][index]


def _load_model(model_dir: str, dtype: torch.dtype, dummy_weights: bool) -> torch.nn.Module:
    if not dummy_weights:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
    if os.path.isfile(os.path.join(model_dir, "generation_config.json")):  # its EOS, as from_pretrained reads it
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    return model


def _filter(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering of temperature-scaled logits."""
    if sampling.top_k > 0:
        kth = torch.topk(logits, min(sampling.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, -1) >= sampling.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), -torch.inf)
    return logits
