"""Split placement's weight sync: training shards on the trainer ranks -> the engines on the rollout ranks.

The trainer ranks of one DP replica (the one of trainer rank 0; for mixture-of-experts models the
routed experts from its expert replica) are the sources, the first engine replica's ranks the
needs: the same plan as a colocated sync (`plan_for_rank`, with the rollout ranks as receivers),
so each rank of that replica receives exactly the bytes its engine shard holds, in messages over
the bridge (`megarl.distributed.split_world`). The other engine replicas need the same slices: each
engine TP position's ranks form a group, and its first replica's rank broadcasts each received
tensor over it, a broadcast tree (the backend's) rather than one send per replica from the trainers.

Weights move in buckets of whole layers (`layer_buckets`), sized by their HF tensors' bytes, so
every rank derives the same buckets: a rollout rank holds one bucket of its engine shards at a time,
and hands each bucket to its engine's loader before the next one arrives.

    sync = CrossGroupSync(world, tp_r, bucket_bytes, trainer=(module, arch, layout))  # trainer ranks
    sync = CrossGroupSync(world, tp_r, bucket_bytes, engine=engine)                   # rollout ranks
    stats = sync.sync(step)                                                           # all ranks, together
"""

from __future__ import annotations

import math
import time
from typing import Collection, Iterator

import torch

from megarl import device
from megarl.distributed.layout import ParallelLayout
from megarl.distributed.split_world import SplitWorld
from megarl.models.architecture import Architecture
from megarl.models.state_dict_adapter import mapped_tensors
from megarl.resharding.engine_layout import engine_needs
from megarl.resharding.executor import SyncStats, gather_replica, hf_shapes_from, layer_buckets, local_sources
from megarl.resharding.plan import Need, Transfer, plan_for_rank
from megarl.resharding.tensor_shard import TensorShard
from megarl.rollout.base import RolloutEngine


class CrossGroupSync:
    def __init__(self, world: SplitWorld, engine_tp: int, bucket_bytes: int,
                 trainer: tuple[torch.nn.Module, Architecture, ParallelLayout] | None = None,
                 engine: RolloutEngine | None = None):
        """Collective over the whole world: trainer ranks pass `trainer`, rollout ranks `engine`."""
        self.world, self.engine, self.rank = world, engine, world.rank
        self.trainer_tensors = mapped_tensors(*trainer[:2]) if trainer is not None else {}
        described = _describe_sources(*trainer) if trainer is not None else None
        arch, dense, experts, shapes, dtypes = world.broadcast_object(described, root=0)
        self.hf_shapes, self.hf_dtypes = shapes, dtypes
        first = world.first_rollout_rank
        self.replica_ranks = range(first, first + engine_tp)
        """The engine replica fed by the trainers; the others receive by broadcast from it."""

        def needs_of(rank: int, names: Collection[str] | None) -> list[Need]:
            if rank not in self.replica_ranks:
                return []
            return engine_needs(rank, rank - first, engine_tp, shapes, arch, names)

        itemsize = max(dtype.itemsize for dtype in dtypes.values())
        self.plan = plan_for_rank(self.rank, dense, needs_of, shapes, itemsize, experts, self.replica_ranks)
        position = (self.rank - first) % engine_tp  # in its engine replica: what it needs depends on this alone
        self.needs = {} if world.is_trainer else {
            need.hf_name: need for need in engine_needs(self.rank, position, engine_tp, shapes, arch)}
        full_bytes = {name: math.prod(shape) * dtypes[name].itemsize for name, shape in shapes.items()}
        self.buckets = layer_buckets(full_bytes, bucket_bytes)
        bucket_of = {name: index for index, names in enumerate(self.buckets) for name in names}
        self.bucket_transfers: list[list[Transfer]] = [[] for _ in self.buckets]
        for t in sorted(self.plan.transfers, key=lambda t: (t.hf_name, t.src, t.dst, t.start)):
            self.bucket_transfers[bucket_of[t.hf_name]].append(t)
        self.position_group = None
        """The rollout ranks at this rank's engine TP position, first replica first (over which it broadcasts)."""
        if not world.is_trainer and world.num_rollout_ranks > engine_tp:
            self.position_group = world.bridge_group(tuple(range(first + position, first + world.num_rollout_ranks,
                                                                 engine_tp)))

    @torch.no_grad()
    def sync(self, step: int) -> SyncStats:
        """Trainer ranks send, rollout ranks receive and load; every rank of the world calls this."""
        start = time.perf_counter()
        if self.world.is_trainer:
            sent = sum(self._send_bucket(transfers) for transfers in self.bucket_transfers)
            return SyncStats(time.perf_counter() - start, 0.0, 0, sent, 0, 0)
        received, peak = [0], [0]
        self.engine.begin_weight_update(step)
        try:
            self.engine.load_weights(self._buckets_in(received, peak))
        except Exception as error:
            raise RuntimeError(f"cross-group weight sync of step {step} failed; the rollout engine refuses to "
                               f"generate until a sync succeeds: {error}") from error
        self.engine.end_weight_update()
        needed = sum(math.prod(self._shard_shape(need)) * self.hf_dtypes[name].itemsize
                     for name, need in self.needs.items())
        seconds = time.perf_counter() - start
        return SyncStats(seconds, seconds, received[0], 0, needed, peak[0])

    def _send_bucket(self, transfers: list[Transfer]) -> int:
        works, sent = [], 0
        for t in transfers:
            piece = t.of_shard(self.trainer_tensors[t.megatron_name].detach()).contiguous()
            works.append(self.world.bridge.send([piece], t.dst, 0))
            sent += piece.numel() * piece.element_size()
        for work in works:
            work.wait()
        return sent

    def _shard_shape(self, need: Need) -> list[int]:
        shape = list(self.hf_shapes[need.hf_name])
        shape[need.dim] = need.stop - need.start
        return shape

    def _buckets_in(self, received: list[int], peak: list[int]) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's engine shards, bucket by bucket: received from the trainers (first replica) or
        broadcast from the first replica's rank at the same engine TP position (the others)."""
        on = device.compute_device()  # the bridge's backend takes this device's tensors: NCCL's CUDA, gloo's CPU
        for names, transfers in zip(self.buckets, self.bucket_transfers):
            tensors = {name: torch.empty(self._shard_shape(self.needs[name]), dtype=self.hf_dtypes[name], device=on)
                       for name in names if name in self.needs}
            works, unpack = [], []
            for t in transfers:  # only the first replica's ranks have transfers
                target = t.in_engine_shard(tensors[t.hf_name], self.needs[t.hf_name])
                landing = target if target.is_contiguous() else torch.empty_like(target)
                if landing is not target:
                    unpack.append((landing, target))
                works.append(self.world.bridge.recv([landing], t.src, 0))
            for work in works:
                work.wait()
            for landing, target in unpack:
                target.copy_(landing)
            if self.position_group is not None:
                for name in sorted(tensors):
                    self.position_group.broadcast(tensors[name], 0).wait()
            bucket_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
            received[0] += bucket_bytes
            peak[0] = max(peak[0], bucket_bytes)
            yield from ((name, self._as_hf_tensor(name, shard)) for name, shard in tensors.items())
            del tensors

    def _as_hf_tensor(self, name: str, shard: torch.Tensor) -> torch.Tensor:
        need = self.needs[name]
        if need.stop - need.start == self.hf_shapes[name][need.dim]:
            return shard
        return TensorShard(shard, self.hf_shapes[name], need.dim, need.start)


def _describe_sources(module: torch.nn.Module, arch: Architecture, layout: ParallelLayout) -> tuple | None:
    """On trainer rank 0: (arch, the dense pieces of its DP replica, the expert pieces of its expert
    replica, HF shapes, HF dtypes); a collective over the trainer ranks (None elsewhere)."""
    own_shards = {name: (tuple(p.shape), p.dtype) for name, p in mapped_tensors(module, arch).items()}
    experts, others = local_sources(module, arch, layout)
    replica = gather_replica((layout.rank, others, own_shards), [layout.tp_group, layout.pp_group])
    expert_replica = gather_replica((layout.rank, experts, own_shards), [layout.etp_group, layout.ep_group,
                                                                         layout.pp_group]) if arch.is_moe else []
    if layout.rank != 0:
        return None
    dense = [piece for _, pieces, _ in replica for piece in pieces]
    expert = [piece for _, pieces, _ in expert_replica for piece in pieces]
    shards = {(rank, name): shard for rank, _, rank_shards in replica + expert_replica
              for name, shard in rank_shards.items()}
    shapes = hf_shapes_from(dense + expert, {key: shape for key, (shape, _) in shards.items()})
    dtypes = {piece.hf_name: shards[(piece.rank, piece.megatron_name)][1] for piece in dense + expert}
    return arch, dense, expert, shapes, dtypes

