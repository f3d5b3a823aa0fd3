"""Router replay (R3) and routing agreement: the rollout's expert choices inside megatron's routers.

A mixture-of-experts policy routes each token by a top-k over its router's scores. The rollout
engine and megatron compute those scores with different kernels, so a near tie can go either way
and the trainer then scores (and trains) a token through experts the rollout never used: the
largest source of train/inference mismatch for MoE RL. With replay, every router takes the
rollout's expert ids for each token (`SequenceBatch.routed_experts_BTLK`) and only weighs them by
its own scores, so gradients still reach the router. Tokens the rollout did not route (each
sequence's last token, padding) keep the router's own choice, as without replay.

megatron-core's `RouterReplay` is the hook: a router holding one calls its `get_replay_topk` in
place of its own top-k. megatron creates one per router from `moe_enable_routing_replay`; the engine
attaches its own subclass to the routers of the model it loaded (`RoutingReplay`). Each also
computes the router's own top-k, for the agreement metric: the share of (token, layer) pairs the
rollout recorded whose top-k expert *sets* equal what the router would pick itself (with or
without replay, so the runs compare).

Which ids a forward uses: each micro-batch's forward step hands every router its rows
(`set_micro_batch`; megatron's `set_target_indices` keeps the newest and queues each). A forward
takes the newest; a full-recompute pass (megatron's checkpointing runs a layer's forward without
grad, then again with grad in the backward) takes the queue's oldest, since backwards run in the
order of their forwards under every pipeline schedule (megatron's REPLAY_FORWARD and
REPLAY_BACKWARD). Agreement counts the first pass only.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay

from megarl import device
from megarl.distributed import collectives
from megarl.distributed.layout import ParallelLayout


class RoutingReplay:
    """The rollout's routing in one model's routers: replayed (`replay`) or only compared."""

    def __init__(self, routers: list[TopKRouter], replay: bool, recomputes: bool, sequence_parallel_rank: int,
                 sequence_parallel_size: int):
        """Hook `routers` (those of this rank's pipeline stage). `recomputes`: layers are fully
        recomputed in the backward; with sequence parallelism each TP rank's routers see its
        `sequence_parallel_rank`-th of every micro-batch's tokens."""
        self.replay, self.recomputes = replay, recomputes
        self.sequence_parallel = (sequence_parallel_rank, sequence_parallel_size)
        self.active = False
        self.recorded_N: torch.Tensor | None = None
        self.counts = torch.zeros(2, dtype=torch.float64, device=device.compute_device())  # (agreeing, recorded)
        self.layers: list[_LayerReplay] = []
        for router in routers:
            assert not router.config.moe_router_fusion, "megatron's fused top-k never consults RouterReplay"
            router.router_replay = _LayerReplay(self, router.layer_number - 1)  # routing has a row per layer
            self.layers.append(router.router_replay)

    def begin(self, has_routing: bool) -> None:
        """Start a pass over micro-batches (and its agreement counts); without rollout routing the
        routers route on their own."""
        self.active = has_routing
        self.counts.zero_()

    def set_micro_batch(self, ids_NLK: torch.Tensor, recorded_N: torch.Tensor) -> None:
        """The next micro-batch's (N, L, k) expert ids and (N,) recorded mask in router order
        (`megarl.engine.packing.router_rows`), all of the model's layers."""
        rank, size = self.sequence_parallel
        ids_NLK, recorded_N = ids_NLK.chunk(size)[rank], recorded_N.chunk(size)[rank]
        self.recorded_N = recorded_N.to(self.counts.device)
        # -1: no rollout routing; the router's own choice stands (`_LayerReplay.get_replay_topk`).
        ids_NLK = ids_NLK.to(device=self.counts.device, dtype=torch.long)
        ids_NLK = ids_NLK.masked_fill(~self.recorded_N[:, None, None], -1)
        for layer in self.layers:
            layer.set_target_indices(ids_NLK[:, layer.layer].contiguous())

    def end(self) -> None:
        """Forget the pass's ids (the backward is over)."""
        self.active = False
        for layer in self.layers:
            layer.clear_indices()

    def count(self, own_Nk: torch.Tensor, rollout_Nk: torch.Tensor) -> None:
        agree_N = (own_Nk.sort(-1).values == rollout_Nk.sort(-1).values).all(-1) & self.recorded_N
        self.counts += torch.stack([agree_N.sum(), self.recorded_N.sum()]).to(self.counts.dtype)

    def metrics(self, weight: float, layout: ParallelLayout) -> dict[str, float]:
        """`moe/routing_agreement` of the pass (collective over the TP ranks that split its tokens,
        the pipeline stages, which hold different layers, and the DP ranks); `weight` 0: a DP rank's
        stand-in, which counts nothing."""
        counts = self.counts * weight
        groups = ([layout.tp_group] if self.sequence_parallel[1] > 1 else []) + [layout.pp_group, layout.dp_group]
        for group in groups:
            collectives.all_reduce(counts, group=group)
        agreeing, recorded = counts.tolist()
        return {"moe/routing_agreement": agreeing / recorded} if recorded else {}


class _LayerReplay(RouterReplay):
    """One router's replay (megatron calls `get_replay_topk` in place of its top-k)."""

    def __init__(self, owner: RoutingReplay, layer: int):
        super().__init__()
        # megatron also lists every instance process-wide for its static setters; each engine drives
        # its own routers (an actor and a reference may both be MoE), so ours stay out of that list.
        RouterReplay.global_router_replay_instances.remove(self)
        self.owner, self.layer = owner, layer

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        own_probs, own_Nk = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if not self.owner.active:
            return own_probs, own_Nk
        recomputing = self.owner.recomputes and torch.is_grad_enabled()
        target_Nk = self.replay_backward_list.pop(0) if recomputing else self.target_topk_idx
        if not recomputing:
            self.owner.count(own_Nk, target_Nk)
        if not self.owner.replay:
            return own_probs, own_Nk
        replayed_Nk = torch.where(target_Nk >= 0, target_Nk, own_Nk)
        return scores.gather(1, replayed_Nk), replayed_Nk  # as megatron's REPLAY_FORWARD / REPLAY_BACKWARD
