"""Memory phases: parameters, gradients and optimizer state leave the GPU while the rollout runs.

On GPU, `offload()` moves megatron's DDP parameter and gradient buffers and the optimizer state to
host memory (megatron-core's own RL hooks), and `reload()` brings them back before training. On
CPU there is nowhere else to put them: both are no-ops that report the bytes they would move, so
the trainer's phase logic runs unchanged and the numbers still show up in the metrics.
"""

from __future__ import annotations

import torch

from megarl import device


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class MemoryPhases:
    def __init__(self, model: torch.nn.Module, optimizer=None):
        self.model, self.optimizer = model, optimizer
        self.offloaded = False

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds."""
        params = list(self.model.parameters())
        grads = [getattr(p, "main_grad", None) for p in params]
        state = []
        if self.optimizer is not None:
            for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                for param_state in optimizer.optimizer.state.values():
                    state.extend(param_state.values())
        return {"params": _nbytes(params), "grads": _nbytes(grads), "optimizer": _nbytes(state)}

    def offload(self) -> dict[str, int]:
        """Move to host (GPU); returns the bytes moved (or that would move, on CPU)."""
        moved = self.resident_bytes()
        if device.offload() and not self.offloaded:
            for buffer in getattr(self.model, "buffers", []) + getattr(self.model, "expert_parallel_buffers", []):
                buffer.offload_to_cpu(move_params=True, move_grads=True)
            if self.optimizer is not None:
                self.optimizer.offload_to_cpu()
            torch.cuda.empty_cache()
            self.offloaded = True
        return moved

    def reload(self) -> dict[str, int]:
        """Bring everything back to the device before training; returns the bytes moved."""
        if device.offload() and self.offloaded:
            for buffer in getattr(self.model, "buffers", []) + getattr(self.model, "expert_parallel_buffers", []):
                buffer.reload_from_cpu(move_params=True, move_grads=True)
            if self.optimizer is not None:
                self.optimizer.restore_from_cpu()
            self.offloaded = False
        return self.resident_bytes()
