"""Process groups, the parallel layout, and the process-wide start-up settings (`process.py`: the CPU
compatibility layer for megatron-core, vLLM's environment, the safe checkpoint-metadata unpickler)."""

from megarl.distributed.launch import finish_process
from megarl.distributed.layout import ParallelLayout, init_layout

__all__ = ["ParallelLayout", "finish_process", "init_layout"]
