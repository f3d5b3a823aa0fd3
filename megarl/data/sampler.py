"""A seeded, resumable batch sampler over dataset indices.

Epoch e visits the indices in `torch.randperm(num_items)` drawn from a generator seeded with
`derive_seed(seed, "prompt_order", draw=e)` (or in order without shuffling), `batch_size` at a
time. The whole state is (epoch, position in that epoch's order), so a restored sampler yields
exactly the batches the saved one would have: the permutation is recomputed from the seed, never
stored.
"""

from __future__ import annotations

import torch

from megarl.seeding import derive_seed


class ResumableSampler:
    def __init__(self, num_items: int, batch_size: int, seed: int, shuffle: bool = True, drop_last: bool = True):
        if num_items < 1 or batch_size < 1:
            raise ValueError(f"sampler needs num_items >= 1 and batch_size >= 1, got {num_items} and {batch_size}")
        if drop_last and batch_size > num_items:
            raise ValueError(f"batch_size {batch_size} exceeds the {num_items} items and drop_last is set: "
                             "no batch could ever be formed")
        self.num_items = num_items
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0
        # The current epoch's order, computed lazily; a tensor (8 bytes an item), not a list of
        # Python ints (36): with a million prompts the order is the largest thing a rank holds per row.
        self._order: torch.Tensor | None = None

    def _epoch_order(self) -> torch.Tensor:
        if self._order is None:
            if self.shuffle:
                generator = torch.Generator().manual_seed(derive_seed(self.seed, "prompt_order", draw=self.epoch))
                self._order = torch.randperm(self.num_items, generator=generator)
            else:
                self._order = torch.arange(self.num_items)
        return self._order

    def _epoch_exhausted(self) -> bool:
        remaining = self.num_items - self.position
        return remaining == 0 or (self.drop_last and remaining < self.batch_size)

    def next_batch(self) -> list[int]:
        """The next `batch_size` indices (fewer only at an epoch's end without drop_last)."""
        if self._epoch_exhausted():
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        batch = self._epoch_order()[self.position:self.position + self.batch_size].tolist()
        self.position += len(batch)
        return batch

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.num_items, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "num_items": self.num_items, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        for key in ("num_items", "seed"):  # a different dataset or seed would silently change the batches
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]}, this sampler has {getattr(self, key)}")
        if not 0 <= state["position"] <= self.num_items:
            raise ValueError(f"sampler state position {state['position']} is outside 0..{self.num_items}")
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None
