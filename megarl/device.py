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
  build); NVIDIA Apex's fused kernels (used by megatron-core itself); the Triton log-prob kernel.
- **Memory sharing**: vLLM's sleep mode (weights and KV cache freed while Megatron trains) is on
  with CUDA and a no-op on CPU. Offloading Megatron's state during rollouts (`actor.offload`) runs
  the same code everywhere (`megarl.engine.memory`); on CPU host and device are one memory.

Package probes are cached (a package does not appear mid-run); the CUDA answer is not, so tests
patch this module's answers (`monkeypatch.setattr(device, "cuda", ...)`) or torch's.
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


@functools.cache
def transformer_engine_importable() -> bool:
    """Transformer Engine's PyTorch extension imports (not just its Python package)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception:  # a failed extension build raises ImportError, OSError or RuntimeError
        return False
    return True


@functools.cache
def nvidia_apex_importable() -> bool:
    """NVIDIA Apex, not the unrelated PyPI project called apex: it has an `apex/normalization` package."""
    spec = importlib.util.find_spec("apex")
    return spec is not None and any((Path(p) / "normalization").is_dir() for p in spec.submodule_search_locations or ())


@functools.cache
def triton_importable() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def transformer_engine() -> bool:
    """Transformer Engine layers (and packed micro-batches) can be used here."""
    return cuda() and transformer_engine_importable()


def apex() -> bool:
    return cuda() and nvidia_apex_importable()


def triton() -> bool:
    """The log-prob kernel runs its Triton variant."""
    return cuda() and triton_importable()


def sleep_mode() -> bool:
    """The rollout engine frees its weights and KV cache while Megatron trains."""
    return cuda()

