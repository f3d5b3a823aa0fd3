"""Joining the torchrun world: one process per device (GPU) or per CPU worker.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. Without them (a plain
`python script.py`) we run as a world of one. NCCL is used when CUDA is present, gloo otherwise;
on CPU the megatron-core compatibility layer is applied before any megatron model is built.

megarl's loggers write to stderr, prefixed with the rank, at the level MEGARL_LOG_LEVEL (default
WARNING). A torchrun worker dies with its agent: torch elastic starts workers in sessions of their own
(`start_new_session=True`), so killing the agent, or its process group, would otherwise leave them
training and saving checkpoints with nobody to restart or stop them.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import sys

import torch
import torch.distributed as dist

from megarl.distributed.cpu_compat import apply_cpu_compat


def init_process_group() -> None:
    """Initialise the default process group from the torchrun environment (idempotent).

    Collectives time out after MEGARL_COLLECTIVE_TIMEOUT_MINUTES (default 30); the error then
    names the phase of the RL step that was stuck (`megarl.trainer.timing`)."""
    if dist.is_initialized():
        return
    _log_to_stderr(os.environ.get("RANK", "0"))
    if "TORCHELASTIC_RUN_ID" in os.environ:
        exit_with_parent()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        backend = "nccl"
    else:
        apply_cpu_compat()
        backend = "gloo"
    timeout = datetime.timedelta(minutes=float(os.environ.get("MEGARL_COLLECTIVE_TIMEOUT_MINUTES", "30")))
    dist.init_process_group(backend=backend, timeout=timeout)


def _log_to_stderr(rank: str) -> None:
    megarl_logger = logging.getLogger("megarl")
    if megarl_logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s"))
    megarl_logger.addHandler(handler)
    megarl_logger.setLevel(os.environ.get("MEGARL_LOG_LEVEL", "WARNING").upper())


def exit_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent (the torchrun agent) dies (Linux).

    A worker whose agent died before this call cannot join the world: the agent hosts the store
    that `init_process_group` connects to. Children of this process (checkpoint writers) are not
    covered; they finish their write and exit, and only the workers themselves publish a checkpoint."""
    if sys.platform != "linux":
        return
    pr_set_pdeathsig = 1  # from <linux/prctl.h>
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def device() -> torch.device:
    """The device this rank computes on."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
