"""The colocated vLLM engine: created in-process on every rank, inside our torchrun world.

vLLM joins the existing process group (`external_launcher`) and builds its own groups on top, so
it must be created after ours. Creating it has process-wide side effects that we undo: it reseeds
the python/numpy/torch RNGs, replaces `torch.set_num_threads` with a no-op and freezes the GC.
Logprobs are the *processed* ones (after temperature), the distribution tokens were sampled from.
On GPU the engine sleeps while the trainer runs (KV cache and weights freed) and wakes for sync.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
from typing import Iterable

import numpy as np
import torch

from megarl.rollout.base import ROLLOUT_BACKENDS, RolloutOutput, Sampling, WeightUpdateGuard


@contextlib.contextmanager
def _preserve_process_state():
    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
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
        gc.unfreeze()


@ROLLOUT_BACKENDS.register("vllm")
class VLLMRollout:
    def __init__(self, model_dir: str, dtype: str, tensor_parallel_size: int, max_model_len: int,
                 kv_cache_bytes: int, gpu_memory_utilization: float, seed: int):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process
        with _preserve_process_state():
            from vllm import LLM

            memory = (
                {"gpu_memory_utilization": gpu_memory_utilization, "enable_sleep_mode": True}
                if torch.cuda.is_available() else {"kv_cache_memory_bytes": kv_cache_bytes}
            )
            self.llm = LLM(
                model=model_dir, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
                distributed_executor_backend="external_launcher", enforce_eager=not torch.cuda.is_available(),
                max_model_len=max_model_len, seed=seed, logprobs_mode="processed_logprobs", **memory,
            )
        self.guard = WeightUpdateGuard()

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> RolloutOutput:
        from vllm import SamplingParams, TokensPrompt

        self.guard.check()
        params = [
            SamplingParams(
                n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                max_tokens=sampling.max_tokens, stop_token_ids=list(sampling.stop_token_ids),
                seed=sampling.seed + i, logprobs=0,
            )
            for i in range(len(prompts))
        ]
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        result = RolloutOutput()
        for request_output in self.llm.generate(requests, params, use_tqdm=False):
            for completion in sorted(request_output.outputs, key=lambda c: c.index):
                ids = list(completion.token_ids)
                result.response_ids.append(ids)
                result.logprobs.append([step[token].logprob for step, token in zip(completion.logprobs, ids)])
                result.finish_reasons.append("length" if completion.finish_reason == "length" else "stop")
        return result

    def begin_weight_update(self, step: int) -> None:
        self.guard.begin(step)
        if torch.cuda.is_available():
            self.llm.wake_up(tags=["weights"])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights)})

    def end_weight_update(self) -> None:
        if torch.cuda.is_available():
            self.llm.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        self.guard.end()

    def sleep(self) -> None:
        if torch.cuda.is_available():
            self.llm.sleep(level=2)  # weights are overwritten by the next sync: drop them too

    def wake_up(self) -> None:
        if torch.cuda.is_available():
            self.llm.wake_up()
