"""Running the resharding plan every RL step: training shards -> colocated rollout engine.

Set-up (once): every rank describes the HF slices its shards hold; the descriptions are gathered
within its DP replica only (over its TP group, then its PP group: what it can send to or receive
from), and every rank plans its own transfers (`plan_for_rank`). A mixture-of-experts model's
routed experts are spread over the EP ranks, which megatron carves out of the DP ranks: one copy of
them lies on an *expert replica* (the ETP x EP x PP ranks of one expert-data-parallel rank), so
expert tensors are planned over that replica, everything else over the DP replica. Each sync is one load into the
engine, fed by a generator that walks the model in buckets of whole layers (the engine processes a
layer once all its tensors arrived, so a layer never spans two buckets). Per bucket, this rank's
transfers of the bucket run as one `batch_isend_irecv` into tensors of exactly its engine shard
(`TensorShard` where the shard is part of an HF tensor); slices it holds itself are copied locally;
a tensor whose whole engine shard it holds in one piece goes to the engine as a view of its training
shard (lent: the engine copies what it loads); the bucket goes to the engine and is freed before the
next one. Buckets are sized by the most any rank allocates for their tensors (its engine shards, but
the lent ones, plus staging copies of column slices), so what
a rank allocates per bucket stays within the bucket size at any engine TP size, unless one layer
alone is larger; the reported peak counts those allocations. A rank that holds every slice it needs,
with an engine whose last load was only a copy (`RolloutEngine.weight_places`: vLLM's direct load of
layers it leaves plain, the `hf` engine), skips all of that: its slices are copied into the
engine's tensors in one call (the quick start's 3.1 MiB in 0.16 ms, against 1.4 ms through the
buckets and the direct load, and a memcpy's 0.10 ms).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Collection, Iterator, NamedTuple

import torch
import torch.distributed as dist

from megarl.distributed import collectives
from megarl.distributed.layout import ParallelLayout
from megarl.models.architecture import Architecture
from megarl.models.lora import adapters_of
from megarl.models.state_dict_adapter import mapped_tensors, param_mappings, served_tensors, shard_pieces, tp_split
from megarl.resharding.engine_layout import engine_needs
from megarl.resharding.plan import Need, Plan, SourcePiece, Transfer, plan_for_rank
from megarl.resharding.tensor_shard import TensorShard
from megarl.rollout.base import RolloutEngine


@dataclass
class SyncStats:
    seconds: float
    load_seconds: float
    """Part of `seconds` spent inside the engine's weight loader (vLLM's own processing)."""
    bytes_received: int
    bytes_sent: int
    lower_bound: int
    peak_extra_bytes: int
    """Most bytes this rank allocated for one bucket: its engine shards plus staging copies."""


@dataclass
class _SyncProgress:
    """What one sync's generator has done so far (read by `sync` for stats and error messages)."""

    bucket: list[str] | None = None
    transfer_seconds: float = 0.0
    received: int = 0
    sent: int = 0
    peak: int = 0


class _Copies(NamedTuple):
    """A sync into the engine's places, as pairs of views: valid for these places and shard addresses."""

    places: dict[str, torch.Tensor | None]
    addresses: list[int]
    targets: list[torch.Tensor]
    slices: list[torch.Tensor]


def local_sources(module: torch.nn.Module, arch: Architecture, layout: ParallelLayout
                  ) -> tuple[list[SourcePiece], list[SourcePiece]]:
    """The HF slices this rank's shards hold, with where each sits in its shard: (those of routed
    experts, split over ETP and EP; all others)."""
    params = mapped_tensors(module, arch)
    experts, others = [], []
    for mapping in param_mappings(module, arch):
        shape = params[mapping.megatron_name].shape
        offset = 0
        for piece in shard_pieces(mapping, arch, shape, *tp_split(mapping, layout)):
            if piece.hf_name is not None:
                (experts if mapping.expert else others).append(SourcePiece(
                    layout.rank, piece.hf_name, piece.dim, piece.start, piece.stop, mapping.megatron_name, offset))
            offset += piece.size
    return experts, others


def hf_shapes_from(sources: list[SourcePiece], shard_shapes: dict[tuple[int, str], tuple[int, ...]]) -> dict:
    """Full HF shapes: the split dim spans the furthest slice, the other dims are the shard's."""
    shapes: dict[str, list[int]] = {}
    for piece in sources:
        shape = list(shard_shapes[(piece.rank, piece.megatron_name)])
        shape[piece.dim] = piece.stop
        known = shapes.setdefault(piece.hf_name, shape)
        known[piece.dim] = max(known[piece.dim], piece.stop)
    return {name: tuple(shape) for name, shape in shapes.items()}


def layer_buckets(tensor_bytes: dict[str, int], bucket_bytes: int) -> list[list[str]]:
    """HF names in buckets of whole units (a decoder layer, or one global tensor), in model order,
    each bucket at most `bucket_bytes` of `tensor_bytes` (unless one unit alone is larger)."""
    def unit(name: str) -> tuple[int, str]:
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            return (1 + layer, f"layer {layer}")
        order = {"model.embed_tokens.weight": 0, "model.norm.weight": 10**9, "lm_head.weight": 10**9 + 1}
        return (order[name], name)

    units: dict[tuple[int, str], list[str]] = defaultdict(list)
    for name in sorted(tensor_bytes):
        units[unit(name)].append(name)
    buckets, current, size = [], [], 0
    for key in sorted(units):
        unit_bytes = sum(tensor_bytes[n] for n in units[key])
        if current and size + unit_bytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current += units[key]
        size += unit_bytes
    return buckets + ([current] if current else [])


def allocated_bytes(plan: Plan, rank: int, shard_shapes: dict[str, tuple[int, ...]],
                    dtypes: dict[str, torch.dtype]) -> dict[str, int]:
    """Bytes `rank` allocates per HF tensor in a sync: its engine shard (unless lent), and a staging
    copy of each slice it sends or receives that is not contiguous where it sits (a column slice)."""
    def narrow_is_contiguous(shape, dim: int, length: int) -> bool:
        return math.prod(shape[:dim]) == 1 or length == shape[dim]

    def elements(shape, dim: int, length: int) -> int:
        return math.prod(shape) // shape[dim] * length

    allocated = defaultdict(int)
    shapes = {}
    lent = plan.lent(rank)
    for need in plan.needs:
        shapes[need.hf_name] = list(plan.hf_shapes[need.hf_name])
        shapes[need.hf_name][need.dim] = need.stop - need.start
        if need.hf_name not in lent:
            allocated[need.hf_name] += math.prod(shapes[need.hf_name]) * dtypes[need.hf_name].itemsize
    for t in plan.transfers:
        if t.src == t.dst:
            continue
        shape = shard_shapes[t.megatron_name] if t.src == rank else shapes[t.hf_name]
        if not narrow_is_contiguous(shape, t.dim, t.stop - t.start):
            allocated[t.hf_name] += elements(shape, t.dim, t.stop - t.start) * dtypes[t.hf_name].itemsize
    return allocated


def gather_replica(described, groups: list[dist.ProcessGroup]) -> list:
    """`described` of every rank of the replica spanned by `groups`, innermost first: a DP replica is
    (TP group, PP group), an expert replica (ETP group, EP group, PP group)."""
    gathered = [described]
    for group in groups:
        gathered = [rank_described for part in collectives.all_gather_object(gathered, group)
                    for rank_described in part]
    return gathered


class WeightSync:
    def __init__(self, module: torch.nn.Module, arch: Architecture, layout: ParallelLayout,
                 engine: RolloutEngine, engine_tp: int, bucket_bytes: int):
        self.engine, self.module, self.arch = engine, module, arch
        self.rank = layout.rank
        itemsize = next(module.parameters()).element_size()
        self.params = mapped_tensors(module, arch)
        own_shards = {name: (tuple(p.shape), p.dtype) for name, p in self.params.items()}
        experts, others = local_sources(module, arch, layout)
        replica = gather_replica((self.rank, others, own_shards), [layout.tp_group, layout.pp_group])
        expert_replica = gather_replica((self.rank, experts, own_shards), [layout.etp_group, layout.ep_group,
                                                                           layout.pp_group]) if arch.is_moe else []
        dense_sources = [piece for _, pieces, _ in replica for piece in pieces]
        expert_sources = [piece for _, pieces, _ in expert_replica for piece in pieces]
        sources = dense_sources + expert_sources
        shards = {(rank, name): shard for rank, _, rank_shards in replica + expert_replica
                  for name, shard in rank_shards.items()}
        self.hf_shapes = hf_shapes_from(sources, {key: shape for key, (shape, _) in shards.items()})
        # Each HF tensor travels in its shard's dtype: a bf16 model keeps some parameters (layer norms of
        # megatron's local spec) in fp32, so the first parameter's dtype is not every tensor's.
        self.hf_dtypes = {piece.hf_name: shards[(piece.rank, piece.megatron_name)][1] for piece in sources}

        # vLLM forms its TP groups from consecutive ranks of the world: what a rank needs depends on
        # its engine TP rank only.
        def needs_of(rank: int, names: Collection[str] | None) -> list[Need]:
            return engine_needs(rank, rank % engine_tp, engine_tp, self.hf_shapes, arch, names)

        self.plan: Plan = plan_for_rank(self.rank, dense_sources, needs_of, self.hf_shapes, itemsize, expert_sources)
        self.needs = {need.hf_name: need for need in self.plan.needs}
        self.lent = self.plan.lent(self.rank)
        self.lower_bound = self.plan.lower_bound(self.rank)
        self.local = all(t.src == t.dst == self.rank for t in self.plan.transfers)
        """Whether this rank holds every slice its engine needs: a sync may then copy them into the
        engine's own tensors, where the engine says a load is that copy (`RolloutEngine.weight_places`)."""
        self._copies: _Copies | None = None
        # Buckets by the most any rank allocates for each tensor, so that they are the same on every
        # rank and none allocates more than one bucket.
        hf_names = sorted(self.hf_shapes)
        mine = allocated_bytes(self.plan, self.rank, {name: shape for name, (shape, _) in own_shards.items()},
                               self.hf_dtypes)
        most = torch.tensor([mine[name] for name in hf_names], dtype=torch.int64,
                            device=next(module.parameters()).device)
        collectives.all_reduce(most, op=dist.ReduceOp.MAX)
        bucket_sizes = dict(zip(hf_names, most.tolist()))
        self.buckets = layer_buckets(bucket_sizes, bucket_bytes)
        self.largest_bucket_bytes = max((sum(bucket_sizes[name] for name in names) for names in self.buckets),
                                        default=0)
        """The most any rank allocates for one bucket by the plan: `bucket_bytes` or less, unless a single
        unit (a decoder layer, a global tensor) is larger."""
        # This rank's transfers per bucket, in one order on every rank: p2p messages between a pair
        # of ranks arrive in the order they were posted.
        bucket_of = {name: index for index, names in enumerate(self.buckets) for name in names}
        self.bucket_transfers: list[list[Transfer]] = [[] for _ in self.buckets]
        for t in sorted(self.plan.transfers, key=lambda t: (t.hf_name, t.src, t.dst, t.start)):
            self.bucket_transfers[bucket_of[t.hf_name]].append(t)
        trained = {f"{name}.weight" for name in adapters_of(module)}
        if trained:  # besides the adapted linears, aux-loss-free balancing moves the routers' correction biases
            trained |= {name for name in mapped_tensors(module, arch) if name.endswith(".router.expert_bias")}
        changing = {hf_name for mapping in param_mappings(module, arch) if mapping.megatron_name in trained
                    for hf_name in mapping.hf_names}
        changing = set().union(*collectives.all_gather_object(changing))
        self.changing: frozenset[str] | None = frozenset(changing) if changing else None
        """LoRA: the HF tensors whose weights training changes (the adapted linears', merged, and any router
        correction biases), on any rank; an engine that kept the others needs only these (`sync(names=...)`).
        None: every tensor changes."""

    def _shard_slice(self, transfer: Transfer) -> torch.Tensor:
        return transfer.of_shard(self.params[transfer.megatron_name].detach())

    @torch.no_grad()
    def sync(self, step: int, names: Collection[str] | None = None) -> SyncStats:
        """Load the current training weights into the engine, of the HF tensors `names` (every one when None:
        the engine holds none yet, or dropped them, or can take no update of some tensors alone: see
        `RolloutEngine.takes_partial_loads`); all ranks call this together with the same `names`.

        Where this rank holds every slice its engine needs and the engine's last load was a copy into
        places it names, the slices are copied into those places: no buckets, no loader. Otherwise
        the engine gets one load per sync, fed by a generator that moves one bucket at a time: a
        bucket's transfers run when the engine asks for its first tensor, so the engine processes
        each layer once, as soon as its tensors arrived. The generator's collectives are entered by
        every rank in bucket order because every engine consumes the whole iterator in order."""
        start_time = time.perf_counter()
        progress = _SyncProgress()
        self.params = served_tensors(self.module, self.arch)  # LoRA: the adapters merged as they are now
        places = self.engine.weight_places() if self.local else None
        if places is None and not self.engine.takes_partial_loads:
            names = None
        self.engine.begin_weight_update(step, partial=names is not None)
        try:
            if places is None:
                self.engine.load_weights(self._buckets_in(progress, names))
            else:
                self._copy_into(places, progress, names)
        except Exception as error:
            names = progress.bucket or ["(before the first bucket)"]
            raise RuntimeError(
                f"weight sync of step {step} failed loading {names[0]} .. {names[-1]} into the rollout "
                f"engine; it refuses to generate until a sync succeeds: {error}"
            ) from error
        load_start = time.perf_counter()
        self.engine.end_weight_update()
        end_seconds = time.perf_counter() - load_start
        load_seconds = load_start - start_time - progress.transfer_seconds + end_seconds
        lower_bound = self.lower_bound if names is None else self.plan.lower_bound(self.rank, names)
        return SyncStats(time.perf_counter() - start_time, load_seconds, progress.received, progress.sent,
                         lower_bound, progress.peak)

    def _copy_into(self, places: dict[str, torch.Tensor | None], progress: _SyncProgress,
                   names: Collection[str] | None) -> None:
        """Every slice this rank holds for itself (of `names`), copied straight into its place in the engine, in
        one call. The pairs of views are made once: for the same places, and training shards at the same
        addresses (an offload frees and restores their storages in place), they are the same views."""
        progress.bucket = ["(every tensor, into the engine's places)"]
        start = time.perf_counter()
        if names is not None:  # LoRA's merged weights: made anew every sync, copied into their places
            pairs = [(t.in_engine_shard(places[t.hf_name], self.needs[t.hf_name]), self._shard_slice(t))
                     for t in self.plan.transfers if t.hf_name in names and places[t.hf_name] is not None]
            torch._foreach_copy_([target for target, _ in pairs], [piece for _, piece in pairs])
            progress.transfer_seconds = time.perf_counter() - start
            return
        addresses = [p.data_ptr() for p in self.params.values()]
        if self._copies is None or self._copies.places is not places or self._copies.addresses != addresses:
            targets, slices = [], []
            for t in self.plan.transfers:
                place = places[t.hf_name]
                if place is not None:
                    targets.append(t.in_engine_shard(place, self.needs[t.hf_name]))
                    slices.append(self._shard_slice(t))
            self._copies = _Copies(places, addresses, targets, slices)
        torch._foreach_copy_(self._copies.targets, self._copies.slices)
        progress.transfer_seconds = time.perf_counter() - start

    def _buckets_in(self, progress: _SyncProgress, only: Collection[str] | None) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's engine shards (of the HF tensors `only`), bucket by bucket; a bucket is freed before the next
        one arrives."""
        for names, transfers in zip(self.buckets, self.bucket_transfers):
            if only is not None:
                names, transfers = [n for n in names if n in only], [t for t in transfers if t.hf_name in only]
                if not names:
                    continue
            transfer_start = time.perf_counter()
            progress.bucket = names
            tensors = self._receive_bucket(transfers, progress)
            progress.transfer_seconds += time.perf_counter() - transfer_start
            yield from ((name, self._as_hf_tensor(name, shard)) for name, shard in tensors.items())
            del tensors  # before the next bucket arrives, not after

    def _as_hf_tensor(self, name: str, shard: torch.Tensor) -> torch.Tensor:
        """The engine shard as the HF tensor it is part of (itself when the engine needs it whole)."""
        need = self.needs[name]
        if need.stop - need.start == self.hf_shapes[name][need.dim]:
            return shard
        return TensorShard(shard, self.hf_shapes[name], need.dim, need.start)

    def _receive_bucket(self, transfers: list[Transfer], progress: _SyncProgress) -> dict[str, torch.Tensor]:
        """This rank's engine shards of one bucket, filled by its transfers; counts what it allocates."""
        device = next(iter(self.params.values())).device
        allocated = 0

        def allocate(shape, dtype) -> torch.Tensor:
            nonlocal allocated
            allocated += math.prod(shape) * dtype.itemsize
            return torch.empty(shape, dtype=dtype, device=device)

        tensors = {}
        for t in transfers:
            if t.hf_name in self.lent and t.dst == self.rank:
                tensors[t.hf_name] = self._shard_slice(t)
            elif t.dst == self.rank and t.hf_name not in tensors:
                need = self.needs[t.hf_name]
                shape = list(self.hf_shapes[t.hf_name])
                shape[need.dim] = need.stop - need.start
                tensors[t.hf_name] = allocate(shape, self.hf_dtypes[t.hf_name])
        # One message per transfer, in the same order on both sides. Contiguous slices (splits along
        # dim 0) are sent from the shard and received into the engine shard directly; only column
        # slices need a staging copy.
        ops, unpack = [], []
        for t in transfers:
            if t.hf_name in self.lent and t.dst == self.rank:
                continue
            if t.dst == self.rank:
                target = t.in_engine_shard(tensors[t.hf_name], self.needs[t.hf_name])
            if t.src == t.dst:
                target.copy_(self._shard_slice(t))
            elif t.src == self.rank:
                piece = self._shard_slice(t)
                if not piece.is_contiguous():
                    piece = allocate(piece.shape, piece.dtype).copy_(piece)
                ops.append(dist.P2POp(dist.isend, piece, t.dst))
                progress.sent += piece.numel() * piece.element_size()
            else:
                landing = target if target.is_contiguous() else allocate(target.shape, target.dtype)
                if landing is not target:
                    unpack.append((landing, target))
                ops.append(dist.P2POp(dist.irecv, landing, t.src))
                progress.received += landing.numel() * landing.element_size()
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        for landing, target in unpack:
            target.copy_(landing)
        progress.peak = max(progress.peak, allocated)
        return tensors
