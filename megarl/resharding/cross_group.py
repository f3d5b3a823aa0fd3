"""Split placement's weight sync: training shards on the trainer ranks -> the engines on the rollout ranks.

Every trainer replica (the ranks of one TP x PP model copy: a DP, or context-parallel, rank) feeds an
engine replica of its own: engine replica j < F = min(trainer replicas, engine replicas) takes its weights
from trainer replica j, and for mixture-of-experts models its routed experts from expert replica j mod E
(the ranks of one ETP x EP x PP copy of the experts, E of them), in the same plan as a colocated sync
(`plan_for_rank`, with the rollout ranks as receivers), so each rank of a fed replica receives exactly the
bytes its engine shard holds, in messages over the bridge (`megarl.distributed.split_world`), and the
trainer replicas send at once: a sync takes as long with F engine replicas as with one. Engine replicas
j >= F need the same slices as replica j mod F: the ranks at one engine TP position of replicas j, j + F,
j + 2F ... form a group, and the fed replica's rank broadcasts each received tensor over it, a broadcast
tree (the backend's) rather than more sends from the trainers.

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
from megarl.distributed import collectives
from megarl.distributed.layout import ParallelLayout
from megarl.distributed.split_world import SplitWorld
from megarl.models.architecture import Architecture
from megarl.models.state_dict_adapter import mapped_tensors, served_tensors
from megarl.resharding.engine_layout import engine_needs
from megarl.resharding.executor import SyncStats, gather_replica, hf_shapes_from, layer_buckets, local_sources
from megarl.resharding.plan import Need, Transfer, merge_plans, plan_for_rank
from megarl.resharding.tensor_shard import TensorShard
from megarl.rollout.base import RolloutEngine


class CrossGroupSync:
    def __init__(self, world: SplitWorld, engine_tp: int, bucket_bytes: int,
                 trainer: tuple[torch.nn.Module, Architecture, ParallelLayout] | None = None,
                 engine: RolloutEngine | None = None):
        """Collective over the whole world: trainer ranks pass `trainer`, rollout ranks `engine`."""
        self.world, self.engine, self.rank = world, engine, world.rank
        self.trainer = trainer
        self.trainer_tensors: dict[str, torch.Tensor] = {}
        """What this trainer rank sends in the current sync (`served_tensors`: LoRA adapters merged as they are)."""
        described = _describe_sources(*trainer) if trainer is not None else None
        arch, replicas, expert_replicas, shapes, dtypes = world.broadcast_object(described, root=0)
        self.hf_shapes, self.hf_dtypes = shapes, dtypes
        first = world.first_rollout_rank
        self.fed = min(len(replicas), world.num_rollout_ranks // engine_tp)
        """Engine replicas 0 .. fed-1 take their weights from the trainer replica of their number."""
        itemsize = max(dtype.itemsize for dtype in dtypes.values())
        plans = []
        for j in range(self.fed):
            engine_ranks = range(first + j * engine_tp, first + (j + 1) * engine_tp)

            def needs_of(rank: int, names: Collection[str] | None, engine_ranks=engine_ranks) -> list[Need]:
                if rank not in engine_ranks:
                    return []
                return engine_needs(rank, rank - engine_ranks[0], engine_tp, shapes, arch, names)

            experts = expert_replicas[j % len(expert_replicas)] if expert_replicas else []
            plans.append(plan_for_rank(self.rank, replicas[j], needs_of, shapes, itemsize, experts, engine_ranks))
        self.plan = merge_plans(plans)
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
        """The rollout ranks at this rank's engine TP position in the replicas fed alike, the fed one first (over
        which it broadcasts)."""
        if not world.is_trainer:
            alike = ((self.rank - first) // engine_tp) % self.fed
            ranks = tuple(range(first + alike * engine_tp + position, first + world.num_rollout_ranks,
                                self.fed * engine_tp))
            if len(ranks) > 1:
                self.position_group = world.bridge_group(ranks)

    @torch.no_grad()
    def sync(self, step: int) -> SyncStats:
        """Trainer ranks send, rollout ranks receive and load; every rank of the world calls this."""
        start = time.perf_counter()
        if self.world.is_trainer:
            self.trainer_tensors = served_tensors(*self.trainer[:2])
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
        """This rank's engine shards, bucket by bucket: received from the trainers (a fed replica) or
        broadcast from the rank at the same engine TP position of the fed replica alike (the others)."""
        on = device.compute_device()  # the bridge's backend takes this device's tensors: NCCL's CUDA, gloo's CPU
        for names, transfers in zip(self.buckets, self.bucket_transfers):
            tensors = {name: torch.empty(self._shard_shape(self.needs[name]), dtype=self.hf_dtypes[name], device=on)
                       for name in names if name in self.needs}
            works, unpack = [], []
            for t in transfers:  # only the fed replicas' ranks have transfers
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
    """On trainer rank 0: (arch, the dense pieces of each trainer replica (the ranks of one TP x PP copy), the
    expert pieces of each expert replica (of one ETP x EP x PP copy; none for dense models), HF shapes, HF
    dtypes); a collective over the trainer ranks (None elsewhere). Replicas are in the order of their first
    ranks, trainer rank 0's first."""
    own_shards = {name: (tuple(p.shape), p.dtype) for name, p in mapped_tensors(module, arch).items()}
    experts, others = local_sources(module, arch, layout)
    replica = gather_replica((layout.rank, others, own_shards), [layout.tp_group, layout.pp_group])
    expert_replica = gather_replica((layout.rank, experts, own_shards), [layout.etp_group, layout.ep_group,
                                                                         layout.pp_group]) if arch.is_moe else []
    replicas = _every_replica(replica, layout.rank)
    expert_replicas = _every_replica(expert_replica, layout.rank) if arch.is_moe else []
    if layout.rank != 0:
        return None
    shards = {(rank, name): shard for rank, _, rank_shards in replica + expert_replica
              for name, shard in rank_shards.items()}
    pieces = replicas[0] + (expert_replicas[0] if expert_replicas else [])
    shapes = hf_shapes_from(pieces, {key: shape for key, (shape, _) in shards.items()})
    dtypes = {piece.hf_name: shards[(piece.rank, piece.megatron_name)][1] for piece in pieces}
    return arch, replicas, expert_replicas, shapes, dtypes


def _every_replica(replica: list, rank: int) -> list[list]:
    """The pieces of every replica, given this rank's (`gather_replica`), in the order of their first ranks;
    a collective over the trainer ranks."""
    leads = rank == min(member for member, _, _ in replica)
    gathered = collectives.all_gather_object([piece for _, pieces, _ in replica for piece in pieces] if leads else None)
    return [pieces for pieces in gathered if pieces is not None]

