"""Recording which experts vLLM routed each token to, for router replay (R3) and routing agreement.

vLLM 0.32's own `enable_return_routed_experts` needs its model runner V2, which needs Triton: not on
CPU. It is built on a hook that exists on every platform, though: each MoE layer's router calls
`capture_fn(topk_ids)` with the (tokens, k) expert ids of the batch it routes, before any expert
load-balancing remapping (the logical ids, as the HF checkpoint numbers its experts). We bind that
hook and place each row by the model runner's own bookkeeping of the step: row i is token position
`positions[i]` of request `req_ids[req_indices[i]]`. A request's routing is then every position the
engine ran: its prompt and its response but the last token (never fed back). A recomputed position
(a preempted request) overwrites its earlier row. Prefix caching must be off: a cached prefix is not
recomputed, so its routing would never be seen.

Functions named `_on_worker` run on the worker through `collective_rpc`.
"""

from __future__ import annotations

import numpy as np
import torch

_STEPS = "_megarl_routing_steps"


def bind_on_worker(worker) -> None:
    """Hook every MoE router of the worker's model."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    runner = worker.model_runner
    steps: list[tuple[int, list[str], np.ndarray, np.ndarray, np.ndarray]] = []
    setattr(runner, _STEPS, steps)
    layers = [module for module in runner.model.modules() if isinstance(module, MoERunner)]
    for module in layers:
        def capture(topk_ids: torch.Tensor, layer: int = module.layer_id) -> None:
            rows = topk_ids.shape[0]
            steps.append((layer, list(runner.input_batch.req_ids), runner.req_indices.np[:rows].copy(),
                          runner.positions[:rows].numpy(force=True).copy(),  # on CPU, .cpu() would alias the buffer
                          topk_ids.numpy(force=True).astype(np.int16)))

        module.router.set_capture_fn(capture)


def take_on_worker(worker, num_layers: int, topk: int) -> dict[str, np.ndarray]:
    """Each request's (positions, layers, k) int16 expert ids recorded since the last call, by
    vLLM's internal request id; forgets them."""
    steps = getattr(worker.model_runner, _STEPS)
    lengths: dict[str, int] = {}
    for _, req_ids, req_indices, positions, _ in steps:
        for index in np.unique(req_indices):
            request = req_ids[index]
            lengths[request] = max(lengths.get(request, 0), int(positions[req_indices == index].max()) + 1)
    routing = {request: np.zeros((length, num_layers, topk), dtype=np.int16) for request, length in lengths.items()}
    for layer, req_ids, req_indices, positions, ids in steps:
        for index in np.unique(req_indices):
            rows = req_indices == index
            routing[req_ids[index]][positions[rows], layer] = ids[rows]
    steps.clear()
    return routing


def forget_on_worker(worker) -> None:
    """Drop what was recorded since the last call (requests advanced a step at a time, whose routing nothing reads)."""
    getattr(worker.model_runner, _STEPS).clear()


def request_key(internal_id: str) -> tuple[str, int]:
    """(external request id, sample index) of vLLM's internal id: `<external>-<8 random chars>` for a
    request of one sample, `<index>_<external>-<8 random chars>` for sample `index` of several."""
    request = internal_id.rsplit("-", 1)[0]
    index, separator, external = request.partition("_")
    return (external, int(index)) if separator else (request, 0)
