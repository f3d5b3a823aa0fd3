"""Memory phases: a model's parameters, gradients and optimizer state leave the device while the
rollout engine runs, and come back before training.

Offload works on storages, not tensors: every device storage behind the model's parameters, its
gradients (megatron DDP's contiguous grad buffers, `main_grad` views, the optimizer's main-param
`.grad`) and its optimizer (main parameters, Adam moments) is copied into a host buffer, then
resized to 0 bytes. Resizing keeps the storage object, so every view of it (DDP's bucket and
`main_grad` views, the distributed optimizer's shards of the parameter buffer) is valid again after
`reload()` resizes it back and copies the bytes in: training continues bitwise as if nothing moved.
Gradients are dead between steps (each mini-batch zeroes them first), so they are freed without a
copy and come back as zeros.

On GPU the host buffers are pinned and kept for the next offload (pinning is slow). On CPU the
device *is* host memory: the same code copies each storage into a second CPU buffer and frees the
original, which saves nothing (the buffer is dropped again at `reload()`) but runs, and so tests,
exactly the GPU path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from megarl import device


# Offload order doubles as precedence: a storage seen as a parameter (the FP32 optimizer steps the
# model's own parameters) is copied as one, never freed as a gradient.
CATEGORIES = ("params", "optimizer", "grads")


@dataclass
class _Offloaded:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None
    """The bytes, or None for a gradient (restored as zeros)."""


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a flat uint8 tensor (a view, no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside megatron's (chained) optimizer; none for None (an inference-only model)."""
    if optimizer is None:
        return []
    return [chained.optimizer for chained in getattr(optimizer, "chained_optimizers", [optimizer])]


class MemoryPhases:
    def __init__(self, model: torch.nn.Module, optimizer=None):
        """`model`: a megatron DDP module or a bare one (inference only); `optimizer`: megatron's."""
        self.model, self.optimizer = model, optimizer
        self._offloaded: dict[int, _Offloaded] = {}
        self._pinned: dict[int, torch.Tensor] = {}

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        params = list(self.model.parameters())
        yield from (("params", p) for p in params)
        for optimizer in torch_optimizers(self.optimizer):
            for group in optimizer.param_groups:
                for main_param in group["params"]:
                    yield "optimizer", main_param
                    yield "grads", main_param.grad
            for state in optimizer.state.values():
                yield from (("optimizer", value) for value in state.values())
        for p in params:
            yield "grads", getattr(p, "main_grad", None)
            yield "grads", p.grad

    def _storages(self, device_type: str) -> dict[str, dict[int, torch.UntypedStorage]]:
        """Distinct storages on `device_type` by category (`_cdata` names a storage across views)."""
        found: dict[str, dict[int, torch.UntypedStorage]] = {category: {} for category in CATEGORIES}
        seen = set()
        tensors = sorted(self._tensors(), key=lambda item: CATEGORIES.index(item[0]))
        for category, tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.device.type == device_type:
                storage = tensor.untyped_storage()
                if storage._cdata not in seen:
                    seen.add(storage._cdata)
                    found[category][storage._cdata] = storage
        return found

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds on the device."""
        found = self._storages(device.compute_device().type)
        return {category: sum(s.nbytes() for s in storages.values()) for category, storages in found.items()}

    @torch.no_grad()
    def offload(self, keep_params: bool = False) -> dict[str, int]:
        """Move everything to host (parameters stay with `keep_params`: a sync still reads them);
        returns the bytes freed on the device per category. Repeating it moves only what is left."""
        device_type = device.compute_device().type
        freed = dict.fromkeys(CATEGORIES, 0)
        found = self._storages(device_type)
        for category in CATEGORIES[1 if keep_params else 0 :]:
            for key, storage in found[category].items():
                nbytes = storage.nbytes()
                if nbytes == 0:
                    continue
                host = None if category == "grads" else self._host_copy(key, storage)
                self._offloaded[key] = _Offloaded(storage, nbytes, host)
                storage.resize_(0)
                freed[category] += nbytes
        live = {key for storages in found.values() for key in storages} | set(self._offloaded)
        self._pinned = {key: buffer for key, buffer in self._pinned.items() if key in live}
        device.release_cached_memory()  # hand the freed blocks back so that vLLM can map them
        return freed

    def _host_copy(self, key: int, storage: torch.UntypedStorage) -> torch.Tensor:
        pinned = storage.device.type == "cuda"
        host = self._pinned.get(key)
        if host is None or host.numel() != storage.nbytes():
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned)
            if pinned:
                self._pinned[key] = host
        host.copy_(_bytes_of(storage))
        return host

    @torch.no_grad()
    def reload(self) -> int:
        """Bring everything back before training; returns the bytes restored on the device."""
        restored = 0
        for entry in self._offloaded.values():
            entry.storage.resize_(entry.nbytes)
            if entry.host is None:
                _bytes_of(entry.storage).zero_()
            else:
                _bytes_of(entry.storage).copy_(entry.host)
            restored += entry.nbytes
        self._offloaded.clear()
        return restored

