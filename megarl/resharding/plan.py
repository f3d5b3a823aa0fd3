"""The resharding plan: which training rank sends which slice of which HF tensor to which engine rank.

Everything here is pure: from the slices the training ranks of one DP replica hold (`SourcePiece`,
derived from the state-dict adapter's pieces) and the slices engine ranks need (`Need`, from the
engine's own TP sharding), `plan_for_rank` lists the transfers one rank takes part in. Every HF
tensor is split along one dim on both sides, so slices are intervals [start, stop) along that dim
and planning is interval covering:

- a rank never receives bytes it already holds: where it holds part of a need, that part is a local
  copy, so bytes received per rank equal the lower bound (bytes needed - bytes held);
- a rank receives only from its own DP replica (the TP x PP ranks that together hold one copy of the
  model), so each replica is planned alone and a rank plans over its replica, whatever the world size
  (routed experts: over its expert replica, the TP x EP x PP ranks that hold one copy of them);
- among several holders of a slice in the replica (replicated norms on every TP rank, a tied
  embedding's two copies) the receiver picks one by its own rank, so that receivers spread over the
  holders and sender and receiver make the same choice without talking.

Each rank computes only its own transfers: those it receives (its needs, covered) and those it
sends (the needs of the other ranks of its replica, covered the same way, kept where it is chosen).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence


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

    def of_shard(self, shard):
        """The slice this transfer moves, in the training shard of `megatron_name` (a tensor)."""
        return shard.narrow(self.dim, self.shard_offset, self.stop - self.start)

    def in_engine_shard(self, engine_shard, need: Need):
        """Where this transfer lands in the engine shard (a tensor) that fills `need`."""
        return engine_shard.narrow(self.dim, self.start - need.start, self.stop - self.start)


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

    def bytes_needed(self, rank: int, names: Collection[str] | None = None) -> int:
        """Bytes of `rank`'s needs (of the HF tensors `names`; every one when None)."""
        return sum(self.slice_bytes(n.hf_name, n.dim, n.start, n.stop) for n in self.needs
                   if n.rank == rank and (names is None or n.hf_name in names))

    def bytes_held(self, rank: int, names: Collection[str] | None = None) -> int:
        """Bytes of `rank`'s needs that it already holds (local copies)."""
        return sum(self.slice_bytes(t.hf_name, t.dim, t.start, t.stop) for t in self.transfers
                   if t.dst == rank and t.src == rank and (names is None or t.hf_name in names))

    def lower_bound(self, rank: int, names: Collection[str] | None = None) -> int:
        """The bytes `rank` must receive for its needs of `names` (every HF tensor when None)."""
        return self.bytes_needed(rank, names) - self.bytes_held(rank, names)

    def lent(self, rank: int) -> set[str]:
        """The HF tensors of which `rank` holds its whole need in one piece of one shard: handed to the
        engine as a view of that shard, neither allocated nor copied (the engine copies what it loads)."""
        into = defaultdict(list)
        for t in self.transfers:
            if t.dst == rank:
                into[t.hf_name].append(t)
        return {need.hf_name for need in self.needs
                if need.rank == rank and len(into[need.hf_name]) == 1 and into[need.hf_name][0].src == rank}


NeedsOf = Callable[[int, Collection[str] | None], list[Need]]
"""`needs_of(r, names)`: what engine rank r needs of the HF tensors `names` (of every tensor when None);
a pure function of r's engine TP rank."""


def plan_for_rank(rank: int, replica: list[SourcePiece], needs_of: NeedsOf, hf_shapes: dict[str, tuple[int, ...]],
                  itemsize: int, expert_replica: list[SourcePiece] = (),
                  receivers: Sequence[int] | None = None) -> Plan:
    """The transfers `rank` sends or receives. `replica`: the pieces every rank of `rank`'s DP replica
    holds; `expert_replica`: the routed experts' pieces every rank of `rank`'s expert replica holds, over
    which the experts are planned (the ranks of one expert-data-parallel rank: their EP ranks span
    several DP replicas). `receivers`: the engine ranks this rank may send to; by default the
    replica's own ranks (colocated engines), under split placement the rollout ranks."""
    experts = {piece.hf_name for piece in expert_replica}
    dense = set(hf_shapes) - experts if experts else None  # None: every tensor
    plan = _plan_over(rank, replica, lambda r, names: needs_of(r, dense if names is None else names), hf_shapes,
                      itemsize, receivers)
    if not experts:
        return plan
    return merge_plans([plan, _plan_over(rank, list(expert_replica),
                                         lambda r, names: needs_of(r, experts if names is None else names),
                                         hf_shapes, itemsize, receivers)])


def _plan_over(rank: int, replica: list[SourcePiece], needs_of: NeedsOf,
               hf_shapes: dict[str, tuple[int, ...]], itemsize: int, receivers: Sequence[int] | None) -> Plan:
    """`plan_for_rank` for the tensors of one replica: `rank` receives from its ranks and sends to
    `receivers` (the replica's ranks by default)."""
    by_name: dict[str, list[SourcePiece]] = defaultdict(list)
    for piece in replica:
        by_name[piece.hf_name].append(piece)
    mine = {piece.hf_name for piece in replica if piece.rank == rank}
    plan = Plan([], hf_shapes, itemsize, needs_of(rank, None))
    for need in plan.needs:
        plan.transfers += _cover(need, by_name)
    receivers = {piece.rank for piece in replica} if receivers is None else set(receivers)
    for receiver in sorted(receivers - {rank}):
        for need in needs_of(receiver, mine):
            plan.transfers += [t for t in _cover(need, by_name) if t.src == rank]
    return plan


def merge_plans(plans: list[Plan]) -> Plan:
    """Several plans as one, each transfer once: a rank's dense and expert plans, or several ranks'
    plans (for analysis and tests)."""
    transfers = {t for plan in plans for t in plan.transfers}
    return Plan(sorted(transfers, key=lambda t: (t.dst, t.hf_name, t.start, t.src)), plans[0].hf_shapes,
                plans[0].itemsize, [need for plan in plans for need in plan.needs])


def _cover(need: Need, by_name: dict[str, list[SourcePiece]]) -> list[Transfer]:
    """The transfers that fill `need` from the replica's pieces: local pieces first, every other
    interval from one of its holders, chosen by the receiver's rank."""
    pieces = by_name.get(need.hf_name)
    if not pieces:
        raise ValueError(f"no training rank holds {need.hf_name!r}, needed by engine rank {need.rank}")
    local_starts = sorted(p.start for p in pieces if p.rank == need.rank)
    transfers, position = [], need.start
    while position < need.stop:
        covering = [p for p in pieces if p.start <= position < p.stop]
        if not covering:
            raise ValueError(f"{need.hf_name!r}[{position}] along dim {need.dim} is held by no training rank")
        local = [p for p in covering if p.rank == need.rank]
        if local:
            piece = max(local, key=lambda p: p.stop)
            end = min(piece.stop, need.stop)
        else:
            covering.sort(key=lambda p: p.rank)
            piece = covering[need.rank % len(covering)]
            # Stop where a local piece begins: those bytes must not travel.
            end = min([piece.stop, need.stop, *(s for s in local_starts if s > position)])
        transfers.append(Transfer(piece.rank, need.rank, need.hf_name, need.dim, position, end,
                                  piece.megatron_name, piece.shard_offset + position - piece.start))
        position = end
    return transfers
