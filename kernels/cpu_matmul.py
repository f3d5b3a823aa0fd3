"""float32 matrix products on CPU through oneDNN, on the CPUs where torch's own path runs at half speed.

torch multiplies float32 CPU matrices with MKL, which on x86 CPUs of other vendors than Intel runs its
AVX2 kernels whatever the CPU offers: on an AMD EPYC with AVX-512 (one thread, the shapes of the
quick start's model, 448 x 128 @ 128 x 768 and alike) 100-110 GFLOP/s, against 230-250 from oneDNN,
which torch ships for its bfloat16 products and which multiplies the same dense tensors as they are
(no packed weight to make anew when the weights change, as they do every RL step). There `linear` and
`matmul` send a float32 product of at least `MIN_ROWS` rows to oneDNN; fewer rows (a decode step of a
handful of sequences) stay with torch, whose per-call cost is lower (8 x 128 @ 128 x 768: 22 us
against 26). Everything else (other dtypes, Intel CPUs, where MKL uses all the CPU has, and CPUs without
AVX-512, where oneDNN has no wider kernels than MKL's: on an AMD EPYC exposing AVX2 only, 448 x 128 @
128 x 768 1.34 ms against 1.42, 64 x 128 @ 128 x 384 198 us against 118) is torch's.

Used by megatron's linear layers on CPU (`megarl.distributed.cpu_compat`) and by the colocated vLLM
engine's small layers (`megarl.rollout.vllm_direct_load`). The two kernels round differently (each to
float32's precision), so a product's bytes depend on the kernel, which depends on the CPU and the row count.
"""

from __future__ import annotations

import functools

import torch

MIN_ROWS = 16
"""Rows (the product of the leading dimensions) from which oneDNN is faster than torch's own path."""


@functools.cache
def onednn_faster() -> bool:
    """Whether float32 products go to oneDNN on this machine: an x86 CPU with AVX-512 not made by Intel,
    and a torch built with oneDNN."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.cpu.get_cpu_capability().startswith("AVX512")):
        return False
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            vendor = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("vendor_id")), "")
    except OSError:
        return False
    return vendor not in ("", "GenuineIntel")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) by oneDNN: float32 CPU tensors, any strides, no autograd."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _takes_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x @ weight.T goes to oneDNN (which records nothing for autograd, and refuses empty products)."""
    return (onednn_faster() and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.device.type == "cpu" and x.dim() >= 2 and weight.dim() == 2 and x.shape[-1] > 0
            and weight.shape[0] > 0 and x.numel() >= MIN_ROWS * x.shape[-1]
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`torch.nn.functional.linear`, through oneDNN where it is faster (module docstring) and nothing
    needs its gradient."""
    if _takes_onednn(x, weight):
        return onednn_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def matmul(a: torch.Tensor, b: torch.Tensor, **kwargs) -> torch.Tensor:
    """`torch.matmul`, through oneDNN for a product by a float32 matrix where it is faster (module
    docstring) and nothing needs its gradient."""
    if not kwargs and b.dim() == 2 and _takes_onednn(a, b.t()):
        return onednn_linear(a, b.t())
    return torch.matmul(a, b, **kwargs)
