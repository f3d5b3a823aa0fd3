"""Where this process computes, over which collectives, and which GPU-only features are on.

The one place that decides (DESIGN.md, "Packages and what each owns"); everything else asks it
and never calls `torch.cuda.is_available()` itself. The policy:

- **Device and backend.** With a CUDA device visible to torch, each rank computes on
  `cuda:LOCAL_RANK` and collectives use NCCL for CUDA tensors and gloo for CPU tensors (the step's
  bookkeeping: scores, token counts, metrics). Otherwise ranks compute on the CPU, collectives use
  gloo, and megatron-core needs the CPU compatibility layer (`megarl.distributed.cpu_compat`).
- **GPU-only features** are on only with CUDA *and* their package importable:
  Transformer Engine layers (with packed THD micro-batches) when `transformer_engine.pytorch`
  imports (`import transformer_engine` alone succeeds even when its PyTorch extension failed to
  build); NVIDIA Apex's fused kernels (used by megatron-core itself); gradient-accumulation fusion
  when Apex's `fused_weight_gradient_mlp_cuda` extension imports (a plain `pip install` of Apex
  has none); the Triton log-prob kernel. Each probe keeps why it failed, and on CUDA every feature
  that is off is reported once at start-up by name (`unavailable_gpu_features`), never swallowed.
- **Memory sharing**: vLLM's sleep mode (weights and KV cache freed while Megatron trains) is on
  with CUDA and a no-op on CPU; before the engine wakes, PyTorch's allocator hands its cached
  blocks back (`release_cached_memory`). Offloading Megatron's state during rollouts
  (`actor.offload`) runs the same code everywhere (`megarl.engine.memory`); on CPU host and device
  are one memory.

Package probes (`*_unavailable`: why a package does not work here, None when it does) are cached
(a package does not appear mid-run); the CUDA answer is not, so tests patch this module's answers
(`monkeypatch.setattr(device, "cuda", ...)`) or torch's.
Callers import the module (`from megarl import device`) and call `device.cuda()`, so that a
patched answer reaches them. It imports torch alone: `megarl.doctor` uses it before megatron-core
is known to be installed.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from pathlib import Path

import torch


def cuda() -> bool:
    """Whether this process computes on a CUDA device."""
    return torch.cuda.is_available()


def backend() -> str:
    """The torch.distributed backend: NCCL for CUDA tensors beside gloo for CPU tensors on CUDA (a
    plain "nccl" group takes no CPU tensor), gloo on CPU."""
    return "cuda:nccl,cpu:gloo" if cuda() else "gloo"


def select_local_device() -> None:
    """Bind this rank to its GPU (`LOCAL_RANK`), before any CUDA work; nothing to do on CPU."""
    if cuda():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def compute_device() -> torch.device:
    """The device this rank computes on."""
    return torch.device("cuda", torch.cuda.current_device()) if cuda() else torch.device("cpu")


def _import_failure(module: str) -> str | None:
    """Why `module` does not import here: "not installed", or the error its import raised; None when it imports."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return "not installed"
    try:
        importlib.import_module(module)
    except Exception as error:  # a failed extension build raises ImportError, OSError or RuntimeError
        return f"{type(error).__name__}: {error}"
    return None


@functools.cache
def transformer_engine_unavailable() -> str | None:
    """Why Transformer Engine's PyTorch extension does not import, None when it does (the Python package
    alone is not enough)."""
    return _import_failure("transformer_engine.pytorch")


@functools.cache
def nvidia_apex_unavailable() -> str | None:
    """Why NVIDIA Apex is absent, None when present. The unrelated PyPI project called apex has no
    `apex/normalization` package."""
    spec = importlib.util.find_spec("apex")
    if spec is None:
        return "not installed"
    if not any((Path(p) / "normalization").is_dir() for p in spec.submodule_search_locations or ()):
        return "the PyPI project 'apex' is installed, not NVIDIA Apex"
    return None


@functools.cache
def gradient_fusion_extension_unavailable() -> str | None:
    """Why Apex's `fused_weight_gradient_mlp_cuda` extension does not import, None when it does. megatron's
    own linear layers need it for gradient-accumulation fusion (even beside Transformer Engine's: the
    output layer is one); only a source build of Apex with `--cuda_ext` makes it."""
    return _import_failure("fused_weight_gradient_mlp_cuda")


@functools.cache
def triton_unavailable() -> str | None:
    return _import_failure("triton")


def transformer_engine() -> bool:
    """Transformer Engine layers (and packed micro-batches) can be used here."""
    return cuda() and transformer_engine_unavailable() is None


def apex() -> bool:
    return cuda() and nvidia_apex_unavailable() is None


def gradient_accumulation_fusion() -> bool:
    """Weight gradients are accumulated straight into megatron's fp32 `main_grad` buffers by fused
    GEMMs; megatron refuses to build a model that asks for it without Apex's extension."""
    return cuda() and gradient_fusion_extension_unavailable() is None


def triton() -> bool:
    """The log-prob kernel runs its Triton variant."""
    return cuda() and triton_unavailable() is None


def unavailable_gpu_features() -> dict[str, str]:
    """Each GPU-only feature that is off although CUDA is present, by name, with why: reported at
    start-up, since a missing one makes a run slower (or a config that asks for it fail) without
    saying so. None without CUDA, where they are off by design."""
    if not cuda():
        return {}
    apex = nvidia_apex_unavailable()
    reasons = {
        "transformer_engine": transformer_engine_unavailable(),
        "apex": apex,
        # Apex's extension is named apart only where Apex is there without it (a plain pip install of Apex).
        "fused_weight_gradient_mlp_cuda": None if apex else gradient_fusion_extension_unavailable(),
        "triton": triton_unavailable(),
    }
    return {name: why for name, why in reasons.items() if why is not None}


def release_cached_memory() -> None:
    """Hand the blocks PyTorch's CUDA allocator keeps cached (freed tensors, kept for reuse) back to the
    driver, so that another allocator in this process (vLLM's, waking up) can map them; nothing to
    do on CPU."""
    if cuda():
        torch.cuda.empty_cache()


def sleep_mode() -> bool:
    """The rollout engine frees its weights and KV cache while Megatron trains."""
    return cuda()

