"""What the colocated vLLM engine lets through to the console at start-up."""

from __future__ import annotations

import logging

import megarl.rollout.vllm_backend  # noqa: F401  (installs the filter)

CPU_WORKER = logging.getLogger("vllm.v1.worker.cpu_worker")


def _record(message: str) -> logging.LogRecord:
    return CPU_WORKER.makeRecord(CPU_WORKER.name, logging.WARNING, "cpu_worker.py", 140, message, (), None)


def test_the_cpu_workers_thread_count_notice_is_dropped_and_its_other_warnings_kept():
    notice = "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it."
    assert not CPU_WORKER.filter(_record(notice))
    assert CPU_WORKER.filter(_record("libtcmalloc is not found in LD_PRELOAD."))
