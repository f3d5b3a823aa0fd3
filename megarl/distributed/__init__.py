"""Process groups, the parallel layout, and the process-wide start-up settings (`process.py`: the CPU
compatibility layer for megatron-core, vLLM's environment, the safe checkpoint-metadata unpickler)."""

from megarl.distributed.launch import exit_after_success, leave_process_group
from megarl.distributed.layout import ParallelLayout, init_layout

__all__ = ["ParallelLayout", "exit_after_success", "init_layout", "leave_process_group"]
