"""Process groups, the parallel layout and the CPU compatibility layer for megatron-core."""

from megarl.distributed.layout import ParallelLayout, init_layout

__all__ = ["ParallelLayout", "init_layout"]
