"""A policy served by its colocated rollout engine: built and synced one way, for the trainer and
for `launchers/generate.py`.

    policy = RolloutPolicy(actor.module, actor.arch, layout, settings, offload=[...])
    sync = policy.enter_rollout(step, timer)   # models out, engine weights in, synced, KV cache in
    ... policy.engine.generate(...) ...
    policy.leave_rollout(timer)                # engine asleep, models back

The engine starts with dummy weights: every generation follows a sync from the policy, so reading
the checkpoint's weights a second time (minutes for a large model) would be wasted. Memory is
shared in time: the engine is created while the models that offload are off the device (vLLM sizes
its KV cache from the free memory it sees then), and each rollout wakes the engine's weights
before the sync and its KV cache after it, once the policy's own parameters have left too. Each
wake-up first has PyTorch's allocator hand back the blocks it caches (`_wake`).

A sync is skipped when the engine still holds the weights of the current `weights_version` (the
training weights change only by an optimizer step or a checkpoint load): a validation's sync serves
the next step's rollout too, if the validation left the engine asleep with its weights kept. With LoRA
the engine keeps its weights asleep, and a sync after the first sends only the adapted linears' weights,
merged (`WeightSync.changing`): the base weights never change.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from megarl import device
from megarl.distributed.layout import ParallelLayout
from megarl.engine.memory import MemoryPhases
from megarl.generation.engine import EngineSettings, start_rollout_engine
from megarl.models.architecture import Architecture
from megarl.resharding.executor import SyncStats, WeightSync
from megarl.rollout import RolloutEngine
from megarl.tracking.timing import PhaseTimer


class RolloutPolicy:
    def __init__(self, module: torch.nn.Module, arch: Architecture, layout: ParallelLayout, settings: EngineSettings,
                 offload: Sequence[MemoryPhases] = (), policy_memory: MemoryPhases | None = None,
                 weights_version: Callable[[], int] = lambda: 0):
        """`offload`: memory phases of the models that leave the device during rollouts; the policy's
        own (`policy_memory`, if among them) keeps its parameters until the sync has read them.
        `weights_version`: changes whenever `module`'s weights may have (constant: they never do)."""
        self.offload, self.policy_memory = list(offload), policy_memory
        self.weights_version = weights_version
        self.engine_version: int | None = None
        """The weights version the engine holds; None when it holds none we know of."""
        for memory in self.offload:
            memory.offload()
        self.engine: RolloutEngine = start_rollout_engine(settings, dummy_weights=True)
        self.engine.sleep(keep_weights=False)
        for memory in self.offload:
            memory.reload()
        self.sync = WeightSync(module, arch, layout, self.engine, settings.tp, settings.bucket_bytes)

    def enter_rollout(self, step: int, timer: PhaseTimer) -> SyncStats | None:
        """Models out, engine in, each part into the memory the previous one freed. Returns the
        sync's statistics, None when the engine already held the current weights."""
        with timer("offload"):
            for memory in self.offload:
                memory.offload(keep_params=memory is self.policy_memory)  # the sync reads them
        with timer("reshard"):
            self._wake(("weights",))
            version, sync = self.weights_version(), None
            if version != self.engine_version:
                # LoRA: an engine that holds some version gets only the adapted linears (merged) again, where it
                # can take them alone (`WeightSync.sync`).
                names = self.sync.changing if self.engine_version is not None else None
                self.engine_version = None  # until the sync succeeds
                sync = self.sync.sync(step, names)
                self.engine_version = version
        with timer("offload"):
            if self.policy_memory in self.offload:
                self.policy_memory.offload()
            self._wake(("kv_cache",))
        return sync

    def _wake(self, tags: tuple[str, ...]) -> None:
        """Wake part of the engine into memory PyTorch no longer holds: vLLM sized its KV cache before
        the first training step, whose freed activations stay in PyTorch's allocator cache until
        released (with offload off, nothing else releases them)."""
        device.release_cached_memory()
        self.engine.wake_up(tags)

    def leave_rollout(self, timer: PhaseTimer, keep_weights: bool = False) -> None:
        """`keep_weights`: the engine keeps its weights while asleep (on GPU in host memory), so that
        the next rollout reuses them if no optimizer step came in between. A LoRA policy's engine always keeps
        them: the next sync sends the adapted linears alone."""
        keep_weights = keep_weights or self.sync.changing is not None
        with timer("reload"):
            self.engine.sleep(keep_weights)
            if not keep_weights:
                self.engine_version = None
            for memory in self.offload:
                memory.reload()
