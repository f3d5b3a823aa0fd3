"""Process-wide settings, applied at one named point: `configure_process()`.

Some settings change the whole process rather than one object, so they are made explicitly, once,
before any model, engine or checkpoint exists, instead of on import or in a constructor:

- megatron-core's compatibility layer (`cpu_compat`): its CUDA assumptions bridged where `megarl.device`
  says CUDA is absent, and on every device what it lacks without Transformer Engine or Apex;
- on CUDA, one warning line per host naming each GPU feature that is off and why
  (`megarl.device.unavailable_gpu_features`): a missing Transformer Engine must not pass unnoticed;
- vLLM's environment for an engine colocated in this process: `VLLM_ENABLE_V1_MULTIPROCESSING=0`
  (the engine lives in this process, not in a child) and `VLLM_DIST_IDENT` (names vLLM's CPU
  shared-memory segments; unique per job, from its rendezvous port, so jobs on one host never clash);
- torch's checkpoint-metadata reads go through the restricted unpickler (`safe_metadata`);
- on CPU, malloc's thresholds are fixed (`steady_malloc`): memory a step frees is kept for the next;
- megarl's loggers write to stderr, prefixed with the rank, at the level MEGARL_LOG_LEVEL (default
  WARNING; DEBUG logs the start of every phase of every step);
- a torchrun worker dies with its agent: torch elastic starts workers in sessions of their own
  (`start_new_session=True`), so killing the agent, or its process group, would otherwise leave them
  training and saving checkpoints with nobody to restart or stop them.

`init_process_group` calls it: every megarl program (launchers, tools, benchmarks, the tests' worker
scripts) joins its torchrun world through it. Settings the user already made in the environment win.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import sys

from megarl import device
from megarl.distributed import safe_metadata
from megarl.distributed.cpu_compat import apply_cpu_compat


def configure_process() -> None:
    """Apply every process-wide setting (idempotent). Needs MASTER_PORT set (torchrun's rendezvous)."""
    _log_to_stderr(os.environ.get("RANK", "0"))
    if "TORCHELASTIC_RUN_ID" in os.environ:
        exit_with_parent()
    apply_cpu_compat()
    report_unavailable_gpu_features()
    if not device.cuda():
        steady_malloc()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_DIST_IDENT", f"megarl{os.environ['MASTER_PORT']}")
    safe_metadata.install()


def _log_to_stderr(rank: str) -> None:
    megarl_logger = logging.getLogger("megarl")
    if megarl_logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s"))
    megarl_logger.addHandler(handler)
    megarl_logger.setLevel(os.environ.get("MEGARL_LOG_LEVEL", "WARNING").upper())


def report_unavailable_gpu_features() -> None:
    """Log "GPU features off: transformer_engine (ImportError: ...), apex (not installed)" once per
    host (local rank 0): the features are the machine's, the same on each of its ranks. Nothing on
    CPU, where they are off by design."""
    off = device.unavailable_gpu_features()
    if off and os.environ.get("LOCAL_RANK", "0") == "0":
        logging.getLogger("megarl").warning(
            "GPU features off: " + ", ".join(f"{name} ({why})" for name, why in off.items()))


MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters, from <malloc.h>


def steady_malloc() -> None:
    """Fix glibc malloc's thresholds where on CPU they are the device allocator's: blocks up to 32 MiB come
    from the heap, and up to 64 MiB of it freed stays mapped for the next step (no-op without glibc, or
    where the user set MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_).

    By default each process moves its thresholds with its own history of frees, so two ranks of one job
    settle on different ones: in a 2-process step of the quick start's model (8 prompts x 8 samples) one
    rank took 100-170 page faults a step, the other 190-1,400, each a fresh page the kernel zeroes (most
    in the update's activations and gradients), and the first waited for the second. Fixed at the values
    glibc's own scheme tops out at, the ranks took 68-72 and 37 a step, and the step was 2.5% faster at
    the median of 8 alternating pairs of 200 steps (from 2% slower to 10% faster, 2026-11-28). On CUDA the
    device memory has torch's caching allocator; host memory keeps glibc's defaults."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return
    mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)


def exit_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent (the torchrun agent) dies (Linux).

    A worker whose agent died before this call cannot join the world: the agent hosts the store
    that `init_process_group` connects to. The setting is not inherited: a process this one forks
    (a checkpoint writer) calls this itself to die with it."""
    if sys.platform != "linux":
        return
    pr_set_pdeathsig = 1  # from <linux/prctl.h>
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def freeze_start_up_objects() -> None:
    """Take every object made so far out of the garbage collector's sight, before the first step.

    A run's start-up leaves about a million tracked objects (megatron-core, vLLM, transformers and
    their modules; 0.97 M on the quick start's ranks), and each full collection walks all of them:
    540-740 ms on a 2-core CPU host, a pause of several steps whenever the objects a run keeps (its
    metrics' history, the tracker's) have grown by a quarter of that. A collection walks only the
    objects not frozen yet: called again, this walks only what was made since (the vLLM engine's
    creation calls it first, `megarl.rollout.vllm_backend`). Frozen objects are still freed when their
    last reference goes."""
    gc.collect()
    gc.freeze()
