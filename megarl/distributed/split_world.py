"""Split placement's processes: one torchrun world divided into trainer ranks and rollout ranks.

    world = join_split_world(num_rollout_ranks)   # instead of init_process_group
    world.is_trainer                              # ranks 0 .. T-1 train, T .. W-1 generate

Each side gets a default process group of its own: the trainer ranks' world is the T trainer
ranks, the rollout ranks' world the K = W - T rollout ranks. Everything written for one world
runs unchanged on its side: megatron-core's groups and checkpoints over the trainer ranks, vLLM's
external launcher (which builds its groups over the default world) over the rollout ranks. The
two sides meet only through the *bridge*, a process group over all W ranks built directly from
the rendezvous store (a backend object, not registered with torch's default world, so its
collectives are the backend's own methods), and its subgroups (`bridge_group`).

A trainer rank's rank in its own world equals its global rank (trainers come first); a rollout
rank's equals its global rank minus T, and RANK/WORLD_SIZE in its environment are rewritten to
its side's (vLLM's external launcher reads them).
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megarl import device
from megarl.distributed.process import configure_process
from megarl.distributed.timeouts import collective_timeout


@dataclass
class SplitWorld:
    rank: int
    """Global rank, 0 .. W-1."""
    num_trainer_ranks: int
    num_rollout_ranks: int
    store: dist.Store
    bridge: dist.ProcessGroup
    """Every rank of both sides; ranks are global ranks."""
    _groups: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)

    @property
    def is_trainer(self) -> bool:
        return self.rank < self.num_trainer_ranks

    @property
    def first_rollout_rank(self) -> int:
        return self.num_trainer_ranks

    def bridge_group(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        """A process group over `ranks` (global ranks, in this order); only its members call this.
        Its ranks are positions in `ranks`."""
        if ranks not in self._groups:
            prefix = dist.PrefixStore("bridge/" + ",".join(map(str, ranks)) + "/", self.store)
            self._groups[ranks] = _backend(prefix, ranks.index(self.rank), len(ranks))
        return self._groups[ranks]

    def broadcast_object(self, value, root: int, ranks: tuple[int, ...] | None = None):
        """`value` of global rank `root` on every rank of the world, or of `ranks` alone (global ranks, `root`
        among them; only they call). Pickled: for small state only."""
        on = device.compute_device()
        group, group_root = (self.bridge, root) if ranks is None else (self.bridge_group(ranks), ranks.index(root))
        data = _pickled(value, on) if self.rank == root else None
        size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64, device=on)
        group.broadcast(size, group_root).wait()
        if data is None:
            data = torch.empty(int(size), dtype=torch.uint8, device=on)
        group.broadcast(data, group_root).wait()
        return value if self.rank == root else _unpickled(data)

    @property
    def rank_0_and_rollout_ranks(self) -> tuple[int, ...]:
        """Trainer rank 0 and every rollout rank: what the trainer tells the rollout ranks alone goes over these."""
        return (0, *range(self.first_rollout_rank, self.num_trainer_ranks + self.num_rollout_ranks))

    def send_object(self, value, dst: int) -> None:
        """`value` to global rank `dst` alone (pickled), which takes it with `recv_object`."""
        data = _pickled(value, device.compute_device())
        self.bridge.send([torch.tensor([data.numel()], dtype=torch.int64, device=data.device)], dst, 0).wait()
        self.bridge.send([data], dst, 0).wait()

    def recv_object(self, src: int):
        """What global rank `src` sends with `send_object`."""
        on = device.compute_device()
        size = torch.empty(1, dtype=torch.int64, device=on)
        self.bridge.recv([size], src, 0).wait()
        data = torch.empty(int(size), dtype=torch.uint8, device=on)
        self.bridge.recv([data], src, 0).wait()
        return _unpickled(data)


def _pickled(value, on: torch.device) -> torch.Tensor:
    """`value` pickled into a uint8 tensor on `on` (the bridge's backend takes that device's tensors)."""
    return torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).to(on)


def _unpickled(data: torch.Tensor):
    return pickle.loads(data.cpu().numpy().tobytes())


def join_split_world(num_rollout_ranks: int) -> SplitWorld:
    """Join torchrun's world as a trainer or a rollout rank (the last `num_rollout_ranks`)."""
    configure_process()
    device.select_local_device()
    store, rank, world_size = next(dist.rendezvous("env://"))
    num_trainers = world_size - num_rollout_ranks
    is_trainer = rank < num_trainers
    side_rank, side_size = (rank, num_trainers) if is_trainer else (rank - num_trainers, num_rollout_ranks)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(side_rank), str(side_size)
    side_store = dist.PrefixStore("trainer/" if is_trainer else "rollout/", store)
    dist.init_process_group(backend=device.backend(), timeout=collective_timeout(), rank=side_rank,
                            world_size=side_size, store=side_store)
    bridge = _backend(dist.PrefixStore("bridge/", store), rank, world_size)
    return SplitWorld(rank, num_trainers, num_rollout_ranks, store, bridge)


def _backend(store: dist.Store, rank: int, size: int) -> dist.ProcessGroup:
    if device.cuda():
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = collective_timeout()  # as torch's own groups are given theirs; NCCL's default is 10 min
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, collective_timeout())
