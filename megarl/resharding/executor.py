"""Running the resharding plan every RL step: training shards -> colocated rollout engine.

Set-up (once): every rank describes the HF slices its shards hold, the descriptions are
all-gathered, and every rank computes the same plan. Each sync is one load into the engine, fed by
a generator that walks the model in buckets of whole layers (the engine processes a layer once all
its tensors arrived, so a layer never spans two buckets). Per bucket, the bucket's transfers run as
one `batch_isend_irecv`; slices a rank holds itself are copied locally; the bucket's HF tensors go
to the engine and are freed before the next bucket, so no rank holds more than one bucket (plus
column-slice staging) beyond its own shards.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from megarl.distributed.layout import ParallelLayout
from megarl.models.architecture import Architecture
from megarl.models.state_dict_adapter import param_mappings, shard_pieces
from megarl.resharding.engine_layout import engine_needs
from megarl.resharding.plan import Plan, SourcePiece, Transfer, make_plan
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
    """Largest bucket this rank held beyond its own shards: received tensors plus send buffers."""


@dataclass
class _SyncProgress:
    """What one sync's generator has done so far (read by `sync` for stats and error messages)."""

    bucket: list[str] | None = None
    transfer_seconds: float = 0.0
    received: int = 0
    sent: int = 0
    peak: int = 0


def local_sources(module: torch.nn.Module, arch: Architecture, layout: ParallelLayout) -> list[SourcePiece]:
    """The HF slices this rank's shards hold, with where each sits in its shard."""
    params = dict(module.named_parameters())
    sources = []
    for mapping in param_mappings(module, arch):
        shape = params[mapping.megatron_name].shape
        offset = 0
        for piece in shard_pieces(mapping, arch, shape, layout.tp_rank, layout.tp):
            if piece.hf_name is not None:
                sources.append(SourcePiece(layout.rank, piece.hf_name, piece.dim, piece.start, piece.stop,
                                           mapping.megatron_name, offset))
            offset += piece.size
    return sources


def hf_shapes_from(sources: list[SourcePiece], shard_shapes: dict[tuple[int, str], tuple[int, ...]]) -> dict:
    """Full HF shapes: the split dim spans the furthest slice, the other dims are the shard's."""
    shapes: dict[str, list[int]] = {}
    for piece in sources:
        shape = list(shard_shapes[(piece.rank, piece.megatron_name)])
        shape[piece.dim] = piece.stop
        known = shapes.setdefault(piece.hf_name, shape)
        known[piece.dim] = max(known[piece.dim], piece.stop)
    return {name: tuple(shape) for name, shape in shapes.items()}


def layer_buckets(hf_shapes: dict[str, tuple[int, ...]], itemsize: int, bucket_bytes: int) -> list[list[str]]:
    """HF names in buckets of whole units (a decoder layer, or one global tensor), in model order."""
    def unit(name: str) -> tuple[int, str]:
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            return (1 + layer, f"layer {layer}")
        order = {"model.embed_tokens.weight": 0, "model.norm.weight": 10**9, "lm_head.weight": 10**9 + 1}
        return (order[name], name)

    units: dict[tuple[int, str], list[str]] = defaultdict(list)
    for name in sorted(hf_shapes):
        units[unit(name)].append(name)
    buckets, current, size = [], [], 0
    for key in sorted(units):
        unit_bytes = sum(torch.Size(hf_shapes[n]).numel() * itemsize for n in units[key])
        if current and size + unit_bytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current += units[key]
        size += unit_bytes
    return buckets + ([current] if current else [])


class WeightSync:
    def __init__(self, module: torch.nn.Module, arch: Architecture, layout: ParallelLayout,
                 engine: RolloutEngine, engine_tp: int, bucket_bytes: int):
        self.module, self.engine = module, engine
        self.rank = dist.get_rank()
        itemsize = next(module.parameters()).element_size()
        described = [None] * dist.get_world_size()
        shards = {(self.rank, name): (tuple(p.shape), p.dtype) for name, p in module.named_parameters()}
        dist.all_gather_object(described, (local_sources(module, arch, layout), shards))
        sources = [piece for pieces, _ in described for piece in pieces]
        all_shards = {key: shard for _, shards in described for key, shard in shards.items()}
        self.hf_shapes = hf_shapes_from(sources, {key: shape for key, (shape, _) in all_shards.items()})
        # Each HF tensor travels in its shard's dtype: a bf16 model keeps some parameters (layer norms of
        # megatron's local spec) in fp32, so the first parameter's dtype is not every tensor's.
        self.hf_dtypes = {piece.hf_name: all_shards[(piece.rank, piece.megatron_name)][1] for piece in sources}
        # vLLM forms its TP groups from consecutive ranks of the world.
        needs = [need for rank in range(dist.get_world_size())
                 for need in engine_needs(rank, rank % engine_tp, engine_tp, self.hf_shapes, arch)]
        self.plan: Plan = make_plan(sources, needs, self.hf_shapes, itemsize)
        self.buckets = layer_buckets(self.hf_shapes, itemsize, bucket_bytes)

    def _shard_slice(self, params: dict, transfer: Transfer) -> torch.Tensor:
        shard = params[transfer.megatron_name].detach()
        return shard.narrow(transfer.dim, transfer.shard_offset, transfer.stop - transfer.start)

    def _slice_shape(self, transfer: Transfer) -> list[int]:
        shape = list(self.hf_shapes[transfer.hf_name])
        shape[transfer.dim] = transfer.stop - transfer.start
        return shape

    @torch.no_grad()
    def sync(self, step: int) -> SyncStats:
        """Load the current training weights into the engine; all ranks call this together.

        The engine gets one load per sync, fed by a generator that moves one bucket at a time: a
        bucket's transfers run when the engine asks for its first tensor, so the engine processes
        each layer once, as soon as its tensors arrived. The generator's collectives are entered by
        every rank in bucket order because every engine consumes the whole iterator in order."""
        start_time = time.perf_counter()
        progress = _SyncProgress()
        self.engine.begin_weight_update(step)
        try:
            self.engine.load_weights(self._buckets_in(progress))
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
        return SyncStats(time.perf_counter() - start_time, load_seconds, progress.received, progress.sent,
                         self.plan.lower_bound(self.rank), progress.peak)

    def _buckets_in(self, progress: _SyncProgress) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's HF tensors, bucket by bucket; a bucket is freed before the next one arrives."""
        params = dict(self.module.named_parameters())
        for names in self.buckets:
            transfer_start = time.perf_counter()
            progress.bucket = names
            tensors = self._receive_bucket(params, set(names), progress)
            progress.transfer_seconds += time.perf_counter() - transfer_start
            yield from tensors.items()
            del tensors  # before the next bucket arrives, not after

    def _receive_bucket(self, params: dict, in_bucket: set[str], progress: _SyncProgress) -> dict[str, torch.Tensor]:
        transfers = [t for t in self.plan.transfers if t.hf_name in in_bucket and self.rank in (t.src, t.dst)]
        device = next(iter(params.values())).device
        tensors = {t.hf_name: torch.empty(self.hf_shapes[t.hf_name], dtype=self.hf_dtypes[t.hf_name], device=device)
                   for t in transfers if t.dst == self.rank}
        # One message per transfer, in plan order on both sides (p2p messages between a pair of
        # ranks arrive in order). Contiguous slices (splits along dim 0) are sent from the shard
        # and received into the destination tensor directly; only column slices need a buffer.
        ops, unpack, buffer_bytes = [], [], 0
        for t in transfers:
            if t.src == t.dst:
                tensors[t.hf_name].narrow(t.dim, t.start, t.stop - t.start).copy_(self._shard_slice(params, t))
            elif t.src == self.rank:
                piece = self._shard_slice(params, t)
                if not piece.is_contiguous():
                    piece = piece.contiguous()
                    buffer_bytes += piece.numel() * piece.element_size()
                ops.append(dist.P2POp(dist.isend, piece, t.dst))
                progress.sent += piece.numel() * piece.element_size()
            else:
                target = tensors[t.hf_name].narrow(t.dim, t.start, t.stop - t.start)
                landing = target if target.is_contiguous() else torch.empty_like(target)
                if landing is not target:
                    unpack.append((landing, target))
                    buffer_bytes += landing.numel() * landing.element_size()
                ops.append(dist.P2POp(dist.irecv, landing, t.src))
                progress.received += landing.numel() * landing.element_size()
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        for landing, target in unpack:
            target.copy_(landing)
        needed_here = sum(self.plan.slice_bytes(t.hf_name, t.dim, t.start, t.stop) for t in transfers
                          if t.dst == self.rank)
        progress.peak = max(progress.peak, needed_here + buffer_bytes)
        return tensors
