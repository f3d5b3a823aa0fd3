"""vLLM's own C kernels for the RMS norms of an eager engine on CPU.

vLLM's CPU build ships C kernels for RMSNorm, plain and with the residual add fused in, as its GPU builds
do, yet on x86 CPUs runs the norm as 7 torch operators, for torch.compile to fuse: compilation is vLLM's
default on CPU. megarl runs CPU engines eagerly (a compile adds 7-17 s to every engine start, more than it
saves in runs of the quick start's length: bench/README), so there the operators ran one by one: 25-47 us a
norm of 32-256 rows of 128 against 4-13 us for the kernels, and the quick start's engine generated a
2-process share (4 prompts x 8 samples, <= 8 tokens) in 53.0 ms against 57.0, the same tokens (medians of
300 alternating rounds; one process, AVX2 EPYC, 2026-11-29). `use_c_kernels` sends every plain `RMSNorm` of
the engine's model to the kernels, for the calls each computes as the torch operators do: contiguous tensors
(the kernels read a strided view as if it were contiguous, so a Qwen3 head norm of a slice of the fused
q/k/v stays with torch), the weight in the input's dtype, the whole last dimension normalised. Results agree
with torch's to float32's rounding (tests/distributed/test_rollout.py compares the engine's tokens and
log-probs with HF's and the trainer's). vLLM's SiLU-and-multiply kernel stays unused: on the same CPU it
took 2.5-3x the time of torch's two operators from 8 rows up.
"""

from __future__ import annotations

import functools

import torch


def use_c_kernels(worker) -> int:
    """Runs on the engine's worker: its model's plain RMS norms through vLLM's C kernels where a call
    allows (module docstring); how many norms were switched (none where vLLM's build lacks the kernels)."""
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    if not (hasattr(torch.ops._C, "rms_norm") and hasattr(torch.ops._C, "fused_add_rms_norm")):
        return 0
    norms = [module for module in worker.model_runner.model.modules()
             if type(module) is RMSNorm and module.has_weight and module.variance_size_override is None]
    for norm in norms:
        norm._forward_method = functools.partial(_rms_norm, norm, norm._forward_method)
    return len(norms)


def _rms_norm(norm, torch_path, x: torch.Tensor, residual: torch.Tensor | None = None):
    weight = norm.weight.data
    if not (x.is_contiguous() and weight.dtype == x.dtype and (residual is None or residual.is_contiguous())):
        return torch_path(x, residual)
    if residual is None:
        out = torch.empty_like(x)
        torch.ops._C.rms_norm(out, x, weight, norm.variance_epsilon)
        return out
    torch.ops._C.fused_add_rms_norm(x, residual, weight, norm.variance_epsilon)  # in place, as on GPU
    return x, residual
