"""What the routers of an MoE model did in one optimizer step: per-layer expert load and router losses.

Expert load: a forward hook on every router counts, per layer, the tokens routed to each expert (a
token counts once for each of its top-k experts; padding is left out), in training forwards only.
With activation recomputation megatron runs the first forward without grad and the recomputation
with it, so each token is still counted once. Summed over the micro-batches and DP ranks of the
mini-batch (and over TP, whose sequence-parallel routers each see part of the tokens), a layer's
load is its busiest expert's tokens (`tokens_per_expert_max`) against the mean over experts
(`tokens_per_expert_mean` = tokens x top-k / experts); `load_max_over_mean` is the worst layer's
ratio (1 when every layer is perfectly balanced). The same counts drive aux-loss-free balancing
(`model.moe.expert_bias`): megatron moves each expert's bias after the step from them;
`expert_bias_abs_mean` is the biases' mean magnitude after the step. Dense layers (DeepSeek-V3's and
GLM-4.5's first ones) are left out of every metric.

Router losses: megatron's routers record each layer's load-balancing loss and z-loss of every
training micro-batch, without their coefficients, in megatron-core's layer-wise tracker
(`moe_utils.get_moe_layer_wise_logging_tracker`). Reported: their mean over the mini-batch's
micro-batches on all DP ranks, per layer and averaged over the layers. Under sequence parallelism
each TP rank's z-loss is its own tokens' mean: reported is their mean over TP. The engine puts them
in the backward (`MegatronEngine.train_mini_batch`), never in the reported losses.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker
from megatron.core.transformer.moe.router import TopKRouter

from megarl import device
from megarl.distributed import collectives
from megarl.distributed.layout import ParallelLayout
from megarl.models.architecture import Architecture


def _counted_by_the_hook(routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None) -> None:
    """Stands in for `TopKRouter._apply_expert_bias`: `RoutingStats._count` counts the tokens."""


class RoutingStats:
    def __init__(self, module: torch.nn.Module, arch: Architecture):
        """Hook the routers of `module` (this rank's pipeline stage of a model of `arch`)."""
        num_layers, num_experts = arch.num_layers, arch.num_experts
        self.num_layers = num_layers
        self.moe_layers = [layer for layer in range(num_layers) if arch.is_moe_layer(layer)]
        self.expert_bias = module.config.moe_router_enable_expert_bias
        self.sequence_parallel = module.config.sequence_parallel  # each TP rank routes its part of the tokens
        self.tokens_LE = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device.compute_device())
        self.weight = 1.0
        self.routers = [router for router in module.modules() if isinstance(router, TopKRouter)]
        for router in self.routers:
            router.register_forward_hook(self._count, with_kwargs=True)
            if router.enable_expert_bias:
                # megatron-core 0.16.1 masks padding out of the aux-loss-free balancing's counts with a
                # mask of the wrong shape ((tokens,) against (tokens, experts)): the hook counts for it.
                router._apply_expert_bias = _counted_by_the_hook

    def begin(self, weight: float) -> None:
        """Start an optimizer step whose micro-batches count with `weight` (0: a DP rank's stand-in)."""
        self.tokens_LE.zero_()
        clear_aux_losses_tracker()
        self.weight = weight

    def _count(self, router: TopKRouter, args: tuple, kwargs: dict, output: tuple) -> None:
        if not torch.is_grad_enabled():  # scoring, or the first pass of a recomputed layer
            return
        _, routing_map_NE = output  # (tokens, experts), tokens in the (T, b) order of the router's input
        padding = args[1] if len(args) > 1 else kwargs.get("padding_mask")
        if padding is not None:
            routing_map_NE = routing_map_NE & ~padding.reshape(-1, 1)
        tokens_E = routing_map_NE.sum(0) * self.weight
        self.tokens_LE[router.layer_number - 1] += tokens_E
        if router.enable_expert_bias:  # read and reset by megatron's finalize_model_grads
            router.local_tokens_per_expert += tokens_E

    def metrics(self, num_micro_batches: int, layout: ParallelLayout) -> dict[str, float]:
        """The step's `moe/*` metrics, the same on every rank (collective over PP and DP)."""
        tracker = get_moe_layer_wise_logging_tracker()
        names = sorted(tracker)
        losses_KL = torch.zeros(len(names), self.num_layers, dtype=torch.float64, device=self.tokens_LE.device)
        for k, name in enumerate(names):
            values_L = tracker[name]["values"].detach().double() * self.weight  # sums over micro-batches
            if tracker[name]["reduce_group"] is not None:  # parts of one loss on the TP (sequence-parallel) ranks
                collectives.all_reduce(values_L, group=tracker[name]["reduce_group"])
            elif self.sequence_parallel:  # the z-loss: each TP rank's mean over its own part of the tokens
                collectives.all_reduce(values_L, group=layout.tp_group)
                values_L /= layout.tp
            losses_KL[k] = values_L.to(losses_KL.device)
        clear_aux_losses_tracker()
        # Each pipeline stage holds its own layers (zeros elsewhere); the first stage counts the micro-batches.
        count = torch.tensor([num_micro_batches * self.weight if layout.is_first_stage else 0.0],
                             dtype=torch.float64, device=losses_KL.device)
        if self.sequence_parallel:
            collectives.all_reduce(self.tokens_LE, group=layout.tp_group)
        totals = torch.cat([self.tokens_LE.flatten(), losses_KL.flatten(), count])
        for group in (layout.pp_group, layout.dp_group):
            collectives.all_reduce(totals, group=group)
        tokens_LE = totals[: self.tokens_LE.numel()].view_as(self.tokens_LE).cpu()
        losses_KL = totals[self.tokens_LE.numel() : -1].view_as(losses_KL).cpu() / totals[-1].item()
        tokens_LE, losses_KL = tokens_LE[self.moe_layers], losses_KL[:, self.moe_layers]
        metrics = {}
        for layer, tokens_E in zip(self.moe_layers, tokens_LE):
            metrics[f"moe/layer{layer}/tokens_per_expert_max"] = float(tokens_E.max())
            metrics[f"moe/layer{layer}/tokens_per_expert_mean"] = float(tokens_E.mean())
        metrics["moe/load_max_over_mean"] = float((tokens_LE.max(1).values / tokens_LE.mean(1).clamp(min=1e-9)).max())
        for name, losses_L in zip(names, losses_KL):
            metrics[f"moe/{name}"] = float(losses_L.mean())
            metrics.update({f"moe/layer{layer}/{name}": float(loss) for layer, loss in zip(self.moe_layers, losses_L)})
        if self.expert_bias:  # a stage of dense layers alone holds none, but joins the sum
            bias_sum = torch.zeros(1, dtype=torch.float64, device=self.tokens_LE.device)
            for router in self.routers:
                bias_sum += router.expert_bias.abs().sum().double()
            collectives.all_reduce(bias_sum, group=layout.pp_group)  # each stage holds its layers' biases
            metrics["moe/expert_bias_abs_mean"] = float(bias_sum) / (len(self.moe_layers) * tokens_LE.shape[1])
        return metrics
