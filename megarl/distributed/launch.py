"""Joining the torchrun world: one process per device (GPU) or per CPU worker.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. Without them (a plain
`python script.py`) we run as a world of one. NCCL is used when CUDA is present, gloo otherwise;
on CPU the megatron-core compatibility layer is applied before any megatron model is built.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from megarl.distributed.cpu_compat import apply_cpu_compat


def init_process_group() -> None:
    """Initialise the default process group from the torchrun environment (idempotent).

    Collectives time out after MEGARL_COLLECTIVE_TIMEOUT_MINUTES (default 30); the error then
    names the phase of the RL step that was stuck (`megarl.trainer.timing`)."""
    if dist.is_initialized():
        return
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


def device() -> torch.device:
    """The device this rank computes on."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
