"""Joining and leaving the torchrun world: one process per device (GPU) or per CPU worker.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. Without them (a plain
`python script.py`) we run as a world of one. `megarl.device` picks the backend (NCCL with CUDA,
gloo without); the process-wide settings (`megarl.distributed.process`: the CPU compatibility
layer, vLLM's environment, the safe checkpoint unpickler) are applied here, before any megatron
model, engine or checkpoint exists.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

import torch.distributed as dist

from megarl import device
from megarl.distributed.process import configure_process
from megarl.distributed.timeouts import collective_timeout


def init_process_group() -> None:
    """Initialise the default process group from the torchrun environment (idempotent).

    Collectives time out after MEGARL_COLLECTIVE_TIMEOUT_MINUTES (default 30); the error then
    names the phase of the RL step that was stuck (`megarl.tracking.timing`)."""
    if dist.is_initialized():
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    configure_process()
    device.select_local_device()
    dist.init_process_group(backend=device.backend(), timeout=collective_timeout())


def finish_process(status: int = 0) -> NoReturn:
    """End the process of a run that got to its end on every rank: wait for the others, destroy the
    process groups, flush the console and exit at once with `status` (nonzero where a check the run
    made failed), without the interpreter's teardown.

    By now everything the run leaves is written (checkpoints waited for, the tracker closed, the rollout
    engine's shared memory removed). The teardown is skipped for two reasons. It would garbage-collect
    the million-odd objects torch, megatron-core and vLLM create on import: 3-4 s of every launch (a
    2-step quick start over 2 processes: 17.5 and 18.2 s against 20.9 and 22.6 s with it). And it can
    abort a process whose work is done ("terminate called without an active exception"): megatron's
    parallel state and the trainer's objects keep gloo's groups alive past `destroy_process_group`, and
    a gloo worker thread that frees a tensor during the teardown is stopped inside C++ code that may not
    be left that way."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
