"""MemoryPhases on a bare module (how the reference model is held: no DDP wrapper, no optimizer).

Offloading frees every parameter storage on the device and keeps views valid: after `reload()`
the parameters and a view taken before the offload hold their old bytes again. (The megatron DDP
and optimizer cases run in tests/distributed/test_offload.py.)
"""

from __future__ import annotations

import torch

from megarl.engine.memory import MemoryPhases


def test_bare_module_parameters_leave_and_return_bitwise():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3, bias=False))
    before = [p.detach().clone() for p in module.parameters()]
    view = module[0].weight.view(-1)[5:20]  # like DDP's main_grad and bucket views
    view_before = view.detach().clone()
    expected_bytes = 4 * (8 * 16 + 16 + 16 * 3)  # fp32 parameters, counted by hand

    memory = MemoryPhases(module)
    assert memory.resident_bytes() == {"params": expected_bytes, "optimizer": 0, "grads": 0}
    assert memory.offload() == {"params": expected_bytes, "optimizer": 0, "grads": 0}
    assert sum(p.untyped_storage().nbytes() for p in module.parameters()) == 0
    assert memory.resident_bytes()["params"] == 0
    assert memory.offload()["params"] == 0  # nothing left to move

    assert memory.reload() == expected_bytes
    assert all(torch.equal(p, b) for p, b in zip(module.parameters(), before))
    assert torch.equal(view, view_before)
    assert module(torch.ones(2, 8)).shape == (2, 3)
