"""The parallel layout: one object holding TP/PP/CP/EP/DP sizes, this rank's coordinates and groups.

Mixture-of-experts layers are split their own way (megatron's): their experts are spread over
EP ranks carved out of the data-parallel ranks, and each expert is split over ETP ranks
(expert tensor parallelism, by default as many as TP). Everything else follows TP x PP x DP.

megatron-core keeps its process groups in module globals (`parallel_state`); we initialise them
once from the layout and read them back here, so the rest of megarl receives groups explicitly
from a `ParallelLayout` instead of reaching for globals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megarl.distributed.launch import init_process_group


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    etp: int
    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int
    ep_rank: int
    etp_rank: int
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    ep_group: dist.ProcessGroup
    """The ranks that together hold every expert of a layer (each its own experts)."""
    etp_group: dist.ProcessGroup
    """The ranks that split each of their experts' weights (expert tensor parallelism)."""

    @property
    def holds_unique_stage_copy(self) -> bool:
        """True on the one rank per pipeline stage that speaks for its (merged) TP shards."""
        return self.tp_rank == 0 and self.dp_rank == 0 and self.cp_rank == 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def __str__(self) -> str:
        experts = (f"xEP{self.ep}" if self.ep > 1 else "") + (f"xETP{self.etp}" if self.etp != self.tp else "")
        return f"TP{self.tp}xPP{self.pp}xDP{self.dp}" + (f"xCP{self.cp}" if self.cp > 1 else "") + experts


def init_layout(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int = 0, seed: int = 1) -> ParallelLayout:
    """Join the torchrun world, initialise megatron-core's groups for this layout and seed its RNGs.

    `etp` is the expert tensor-parallel size; 0 means the same as `tp`.
    Ranks are ordered tp-cp-ep-dp-pp (megatron's default): TP neighbours are adjacent ranks.
    Layouts that do not fit the world are rejected by `megarl.config.validate_layout` at start-up.
    """
    init_process_group()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp or tp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ParallelLayout(
        tp=tp,
        pp=pp,
        dp=parallel_state.get_data_parallel_world_size(),
        cp=cp,
        ep=ep,
        etp=etp or tp,
        rank=dist.get_rank(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        cp_rank=parallel_state.get_context_parallel_rank(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        pp_group=parallel_state.get_pipeline_model_parallel_group(),
        dp_group=parallel_state.get_data_parallel_group(),
        ep_group=parallel_state.get_expert_model_parallel_group(),
        etp_group=parallel_state.get_expert_tensor_parallel_group(),
    )
