"""An asynchronous checkpoint writer dies with the worker that forked it: a SIGKILLed job leaves no
process writing behind (megatron forks the writer; `one_after_another` is what it runs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

from tests.conftest import ROOT

# A worker (one-rank gloo world) schedules a save whose write takes a minute, then waits.
WORKER = textwrap.dedent("""
    import os, sys, time
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
    from megarl.checkpoint.checkpointer import one_after_another
    from megarl.distributed.cpu_compat import apply_cpu_compat

    def slow_write(pid_file):
        with open(pid_file, "w") as file:
            file.write(str(os.getpid()))
        time.sleep(60)

    apply_cpu_compat()
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    AsyncCallsQueue().schedule_async_request(one_after_another([AsyncRequest(slow_write, (sys.argv[1],), [])]))
    time.sleep(60)
""")


def test_the_writer_dies_with_its_worker(tmp_path):
    pid_file = tmp_path / "writer.pid"
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(pid_file)], cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore"))
    writer = None
    try:
        deadline = time.time() + 120
        while not (pid_file.is_file() and pid_file.read_text()):
            assert worker.poll() is None and time.time() < deadline, "the worker never started its writer"
            time.sleep(0.05)
        writer = psutil.Process(int(pid_file.read_text()))
        assert writer.ppid() == worker.pid
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        _, alive = psutil.wait_procs([writer], timeout=5)  # its write had a minute left
        assert not alive, "the writer outlived its worker"
    finally:
        worker.kill()
        if writer is not None and writer.is_running():
            writer.kill()
