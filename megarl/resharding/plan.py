"""The resharding plan: which training rank sends which slice of which HF tensor to which engine rank.

Everything here is pure: from the slices every training rank holds (`SourcePiece`, derived from the
state-dict adapter's pieces) and the slices every engine rank needs (`Need`, from the engine's own
TP sharding), `make_plan` lists the transfers. Every HF tensor is split along one dim on both
sides, so slices are intervals [start, stop) along that dim and planning is interval covering:

- a rank never receives bytes it already holds: where it holds part of a need, that part is a local
  copy, so bytes received per rank equal the lower bound (bytes needed - bytes held);
- among several holders of a slice (DP replicas, replicated norms on every TP rank, a tied
  embedding's two copies) the one that has sent the fewest bytes so far is chosen.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SourcePiece:
    """HF tensor `hf_name`[start:stop along dim] sits in `rank`'s megatron shard `megatron_name`
    from `shard_offset` along the same dim."""

    rank: int
    hf_name: str
    dim: int
    start: int
    stop: int
    megatron_name: str
    shard_offset: int


@dataclass(frozen=True)
class Need:
    """Engine rank `rank` needs HF tensor `hf_name`[start:stop along dim]."""

    rank: int
    hf_name: str
    dim: int
    start: int
    stop: int


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    hf_name: str
    dim: int
    start: int
    stop: int
    megatron_name: str
    shard_offset: int


@dataclass
class Plan:
    transfers: list[Transfer]
    hf_shapes: dict[str, tuple[int, ...]]
    itemsize: int
    needs: list[Need] = field(default_factory=list)

    def slice_bytes(self, hf_name: str, dim: int, start: int, stop: int) -> int:
        shape = self.hf_shapes[hf_name]
        return (stop - start) * math.prod(s for d, s in enumerate(shape) if d != dim) * self.itemsize

    def bytes_received(self, rank: int) -> int:
        return sum(self.slice_bytes(t.hf_name, t.dim, t.start, t.stop) for t in self.transfers
                   if t.dst == rank and t.src != rank)

    def bytes_sent(self, rank: int) -> int:
        return sum(self.slice_bytes(t.hf_name, t.dim, t.start, t.stop) for t in self.transfers
                   if t.src == rank and t.dst != rank)

    def bytes_needed(self, rank: int) -> int:
        return sum(self.slice_bytes(n.hf_name, n.dim, n.start, n.stop) for n in self.needs if n.rank == rank)

    def bytes_held(self, rank: int) -> int:
        """Bytes of `rank`'s needs that it already holds (local copies)."""
        return sum(self.slice_bytes(t.hf_name, t.dim, t.start, t.stop) for t in self.transfers
                   if t.dst == rank and t.src == rank)

    def lower_bound(self, rank: int) -> int:
        return self.bytes_needed(rank) - self.bytes_held(rank)


def make_plan(sources: list[SourcePiece], needs: list[Need], hf_shapes: dict[str, tuple[int, ...]],
              itemsize: int) -> Plan:
    by_name: dict[str, list[SourcePiece]] = defaultdict(list)
    for piece in sources:
        by_name[piece.hf_name].append(piece)
    plan = Plan([], hf_shapes, itemsize, needs)
    sent: dict[int, int] = defaultdict(int)
    for need in needs:
        pieces = by_name.get(need.hf_name)
        if not pieces:
            raise ValueError(f"no training rank holds {need.hf_name!r}, needed by engine rank {need.rank}")
        position = need.start
        while position < need.stop:
            covering = [p for p in pieces if p.start <= position < p.stop]
            if not covering:
                raise ValueError(f"{need.hf_name!r}[{position}] along dim {need.dim} is held by no training rank")
            local = [p for p in covering if p.rank == need.rank]
            if local:
                piece = max(local, key=lambda p: p.stop)
                end = min(piece.stop, need.stop)
            else:
                piece = min(covering, key=lambda p: (sent[p.rank], p.rank))
                # Stop where a local piece begins: those bytes must not travel.
                local_starts = [p.start for p in pieces if p.rank == need.rank and position < p.start]
                end = min([piece.stop, need.stop, *local_starts])
            plan.transfers.append(Transfer(piece.rank, need.rank, need.hf_name, need.dim, position, end,
                                           piece.megatron_name, piece.shard_offset + position - piece.start))
            if piece.rank != need.rank:
                sent[piece.rank] += plan.slice_bytes(need.hf_name, need.dim, position, end)
            position = end
    return plan
