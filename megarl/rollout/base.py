"""The rollout interface: generate responses for token-id prompts (a batch at once, or requests advanced an
engine step at a time), load new weights.

Backends register in `ROLLOUT_BACKENDS` and see weights only as HF-named tensors, handed to
them by `megarl.resharding`. A backend whose weight load failed part-way refuses to generate until
a later load succeeds, so a half-loaded engine never serves. One started with `dummy_weights`
(random weights of the config's shapes, for a model directory without weight files) likewise
refuses until its first complete load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sized

import torch

from megarl.registry import Registry


@dataclass(frozen=True)
class Sampling:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables top-k."""
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    """Base seed; request i of a call samples with seed + i * n (identical on every rank of a TP group): vLLM seeds
    a request's sample j with its seed + j, so every (request, sample) of a call has a stream of its own."""
    request_seeds: tuple[int, ...] = ()
    """Multi-turn rollouts: request i samples with request_seeds[i] instead (each trajectory keeps its own
    stream whichever other trajectories are still running); () for seed + i * n."""
    request_max_tokens: tuple[int, ...] = ()
    """Multi-turn rollouts: request i generates at most request_max_tokens[i] tokens (what is left of its
    trajectory's token budget); () for max_tokens."""

    def seed_of(self, request: int) -> int:
        return self.request_seeds[request] if self.request_seeds else self.seed + request * self.n

    def max_tokens_of(self, request: int) -> int:
        return self.request_max_tokens[request] if self.request_max_tokens else self.max_tokens


@dataclass
class RolloutOutput:
    """One entry per (prompt, sample), prompt-major: sample j of prompt i is at i * n + j."""

    response_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    """Log-probability of each sampled token under the engine's (temperature-scaled) distribution."""
    finish_reasons: list[str] = field(default_factory=list)
    """"stop" (a stop token or EOS) or "length"."""
    routed_experts: list[torch.Tensor] = field(default_factory=list)
    """Mixture-of-experts engines: the (P + R - 1, num layers, top-k) int16 expert ids each token
    of prompt + response was routed to (all but the last response token, which the engine never
    ran; zeros in a dense layer's rows); empty for dense models."""


@dataclass
class Advance:
    """What one engine step added to a submitted request (`RolloutEngine.step`)."""

    key: str
    ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    """"stop" or "length" when the request ended with this step; None while it goes on."""


def routed_experts_shape(hf_config) -> tuple[int, int] | None:
    """(layers, experts per token) of the routing an engine records for a model of this HF config (a
    row per decoder layer, dense first layers included, as megatron numbers its routers); None for a
    dense model."""
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    return (hf_config.num_hidden_layers, hf_config.num_experts_per_tok) if experts else None


class RolloutEngine(Protocol):
    routed_experts_shape: tuple[int, int] | None
    """(layers, experts per token) of the routing each output carries; None for dense models."""

    takes_partial_loads: bool
    """Whether `load_weights` takes an update of some of the tensors (`begin_weight_update(partial=True)`),
    keeping the others as they are. Where it does not, a sync that cannot copy into `weight_places` sends
    every tensor."""

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> RolloutOutput:
        """Every response to `prompts`, at once. Refused while submitted requests are in the engine."""

    def submit(self, key: str, prompt: list[int], sampling: Sampling) -> None:
        """Start one response to `prompt` (seeded and capped as `sampling`'s request 0; `sampling.n` must be 1),
        which `step` then advances until it ends or is aborted; `key` names it in the advances."""

    def step(self) -> list[Advance]:
        """One iteration of the engine over the submitted requests: what it added to each request it ran
        (a token; a request ends on a stop token or its max_tokens)."""

    def abort(self, keys: Iterable[str]) -> None:
        """Take submitted requests out of the engine, their tokens so far those the steps returned."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the HF-named tensors of one weight update, all in this one call. `weights` may be a
        generator that receives them as they are consumed (running collectives): consume it whole
        and in order, so that every rank enters its collectives in the same order. A tensor may be a
        view of the trainer's own parameter: copy it, keep no reference."""

    def weight_places(self) -> dict[str, torch.Tensor | None] | None:
        """The engine's own tensors the last `load_weights` copied each HF tensor into, by name (None
        for a tensor it drops), where copying into them is all a load does: a later update may then
        write them itself, between `begin_weight_update` and `end_weight_update`, every one of them.
        None before a complete load, and where a load does more (vLLM's reload, repacked kernels)."""

    def begin_weight_update(self, step: int, partial: bool = False) -> None:
        """Mark the engine as loading: generation is refused until `end_weight_update`. `partial`: the update
        brings some of the weights (LoRA's adapted linears); the others stay as they are."""

    def end_weight_update(self) -> None: ...

    def sleep(self, keep_weights: bool) -> None:
        """Free the KV cache and, unless `keep_weights` (then moved to host memory), the weights
        while the trainer runs (GPU); a no-op on CPU."""

    def wake_up(self, tags: tuple[str, ...]) -> None:
        """Map back what `tags` name (GPU; a no-op on CPU): "weights" before a weight sync,
        "kv_cache" after it, so that each comes back into memory the trainer has just freed."""

    def shutdown(self) -> None:
        """The last call of a job, on every rank, before its processes end (`finish_process`): release
        what would outlive them (shared memory)."""


ROLLOUT_BACKENDS: Registry[type] = Registry("rollout backend")


def check_one_response(sampling: Sampling) -> None:
    """`submit` starts one response, sampled as `sampling`'s request 0: an n of several would have the engine
    sample them all and `step` report one."""
    if sampling.n != 1:
        raise ValueError(f"submit() starts one response: got Sampling with n={sampling.n} (generate() samples n per "
                         "prompt)")


def check_none_submitted(submitted: Sized) -> None:
    """`generate` runs the engine until it is empty: it would finish, and drop, the requests `submit` started."""
    if submitted:
        raise RuntimeError(f"generate() while {len(submitted)} submitted requests are in the engine: abort them first")


class WeightUpdateGuard:
    """Tracks whether the last weight update finished; shared by the backends."""

    def __init__(self, has_weights: bool = True):
        self.pending: str | None = None if has_weights else "started with dummy weights and no weight update yet"

    def begin(self, step: int) -> None:
        self.pending = f"weight update of step {step} did not finish"

    def failed(self, tensor_name: str, step_error: Exception) -> None:
        self.pending = f"{self.pending}: loading {tensor_name!r} failed ({step_error})"

    def end(self) -> None:
        self.pending = None

    def check(self) -> None:
        if self.pending is not None:
            raise RuntimeError(f"rollout engine holds partly loaded weights, refusing to generate: {self.pending}")
