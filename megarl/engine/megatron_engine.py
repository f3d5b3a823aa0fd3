"""One Megatron model on this rank (actor, critic, reference or reward): scoring and training.

Each DP rank passes its own share of the step (`megarl.engine.batching`; the TP and PP ranks of a
DP rank pass the same share). The engine cuts it into micro-batches, runs them through
megatron-core's pipeline schedule, and returns the share's results: scores are broadcast from the
last pipeline stage to the other stages, never gathered over DP.

Where the model shares prompts (on by default for an RL run's models wherever it pays,
`megarl.engine.prompt_sharing`), micro-batches are laid out one row per distinct prompt with all its
responses, on either layer spec. Otherwise, on GPU with Transformer Engine, they are packed (THD):
sequences are concatenated without padding and attention restarts at each boundary
(`PackedSeqParams`); elsewhere they are right-padded to the micro-batch's longest sequence (token-budget
micro-batches are then cut from the share sorted by length, so that little is padding: `megarl.engine.batching`).

Losses are normalised by *global* counts (tokens or sequences of the whole mini-batch, summed over
the DP ranks' shares), so gradients are summed, not averaged, over micro-batches and DP ranks
(`calculate_per_token_loss`): the update equals a single big-batch step at any layout.

Mixture-of-experts models (`arch.is_moe`) train at any expert-parallel size: megatron's DDP reduces
expert gradients over the expert-data-parallel group and its optimizer keeps expert parameters in a
second (chained) optimizer over that group; the grad norm is taken over both. Their routers' auxiliary
losses (load balancing, z-loss) join the backward as token-means over the mini-batch but stay out of
the reported losses; `RoutingStats` logs them with each layer's expert load. A trainable MoE engine
also routes batches that carry the rollout's routing as the rollout did (`router_replay`), or only
measures how often its own routing agrees (`megarl.engine.router_replay`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import partial
import logging
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func

from megarl.kernels.vocab_parallel_logprobs import logprobs_and_entropy
from megarl.config.schema import EngineConfig, LoRAConfig, ModelConfig
from megarl import device
from megarl.distributed import collectives
from megarl.distributed.layout import ParallelLayout
from megarl.engine.batch import SequenceBatch
from megarl.engine.batching import (
    DEFAULT_SEQUENCES,
    budgeted_micro_batches,
    default_token_budget,
    fixed_micro_batches,
    mini_batch_groups,
    padded_micro_batches,
    recut_micro_batches,
    shared_row_micro_batches,
    shared_row_width,
    token_imbalance,
)
from megarl.engine.memory import MemoryPhases, torch_optimizers
from megarl.engine.packing import last_token_rows, pack, padding_mask, response_output_rows, router_rows
from megarl.engine.prompt_sharing import PositionedRope, PromptGroups, prompt_rows, share_prompts, sharing_off_reason
from megarl.engine.router_replay import RoutingReplay
from megarl.engine.routing_stats import RoutingStats
from megarl.models.architecture import Architecture
from megarl.models.builder import MoESettings, ScheduleSettings, resolve_layer_spec
from megarl.models.hf_checkpoint import SafetensorsReader
from megarl.models.hf_interop import hf_architecture, load_hf_model
from megarl.models.lora import LoRAAdapter, LoRASettings, adapters_disabled, apply_lora
from megarl.models.peft_adapter import load_peft


@dataclass(frozen=True)
class ModelInput:
    """A micro-batch as the model takes it, and where its outputs for response tokens are."""

    tokens: torch.Tensor
    positions: torch.Tensor
    output_rows: torch.Tensor
    """(b * R,) rows of the flattened model output that predict each response token."""
    last_rows: torch.Tensor
    """(b,) rows of the flattened model output that read each sequence's last token."""
    attention_mask: torch.Tensor | None = None
    packed_seq_params: PackedSeqParams | None = None


@dataclass(frozen=True)
class LossNormalizer:
    """Global counts of the mini-batch that losses divide by (the same on every rank)."""

    num_tokens: int
    num_sequences: int


# loss_fn(outputs, micro_batch, normalizer) -> (loss, metrics); outputs are (b, R) tensors named
# "logprobs" and "entropy" (language models) or "values" (value models).
LossFn = Callable[[dict, SequenceBatch, LossNormalizer], tuple[torch.Tensor, dict]]


class LossScaling:
    """What the schedule multiplies a loss by before backward (`grad_scale_func`; for MoE models also
    the routers' losses): the optimizer's loss scale (fp16; 1 otherwise) times `factor`
    (`MegatronEngine.train_mini_batch`). megatron's SequentialMLP deep-copies the model config that
    holds it; the copies share this one."""

    def __init__(self):
        self.optimizer = None
        self.factor = 1.0

    def __call__(self, loss: torch.Tensor) -> torch.Tensor:
        return self.optimizer.scale_loss(loss) * self.factor

    def __deepcopy__(self, memo: dict) -> LossScaling:
        return self


class MegatronEngine:
    def __init__(
        self,
        layout: ParallelLayout,
        model_config: ModelConfig,
        config: EngineConfig,
        model_path: str | None = None,
        total_optimizer_steps: int | None = None,
        value_head: bool = False,
        router_replay: bool = False,
        groups: PromptGroups | None = None,
    ):
        """Load `model_path` (default `model_config.path`); trainable when `total_optimizer_steps` is set;
        `value_head` turns a causal LM checkpoint into a value model (a critic's usual start);
        `router_replay` (MoE only) routes each token to the experts the rollout engine chose for it;
        `groups`: the RL run's prompt groups, whose prompts the model shares where that pays (None: batches
        of distinct prompts, as SFT's)."""
        self.layout, self.config = layout, config
        self.model_path = model_path or model_config.path
        trainable = total_optimizer_steps is not None
        self.loss_scaling = LossScaling()
        schedule = ScheduleSettings(
            variable_seq_lengths=True,  # micro-batches are padded to their own length
            calculate_per_token_loss=True,  # losses arrive globally normalised
            finalize_model_grads_func=_finalize_without_token_scaling,
            grad_scale_func=self.loss_scaling if trainable else None,
        )
        layer_spec = resolve_layer_spec(model_config.layer_spec)
        shares_prompts = self._shares_prompts(groups, hf_architecture(self.model_path, value_head), layer_spec)
        self.module, self.arch = load_hf_model(
            self.model_path, layout, model_config.dtype, layer_spec,
            model_config.make_vocab_size_divisible_by, recompute_activations=config.recompute_activations,
            value_head=value_head, schedule=schedule, moe=MoESettings(**asdict(model_config.moe)),
            shared_prompts=shares_prompts,
        )
        self.positioned_rope = PositionedRope(self.module) if shares_prompts else None
        self.model = self.module
        self.adapters: list[LoRAAdapter] = []
        self.base_fingerprint = None
        """With LoRA adapters: the fingerprint of the base weights they adapt (its checkpoints record it)."""
        if trainable and config.lora.rank:
            self.adapters = self._adapt(config.lora)
            self.base_fingerprint = SafetensorsReader(self.model_path).fingerprint()
        self.packed = layer_spec == "transformer_engine"
        # Sequence parallelism splits each micro-batch's tokens over the TP ranks.
        self.sequence_multiple = layout.tp if self.module.config.sequence_parallel else 1
        # TE's fused masked softmax takes rows of a multiple of 8 tokens (else its unfused one: the same values in
        # about three times the memory).
        self.shared_row_multiple = math.lcm(self.sequence_multiple, 8) if self.packed else self.sequence_multiple
        if router_replay and not self.arch.is_moe:
            raise ValueError(f"actor.router_replay=true needs a mixture-of-experts model; "
                             f"{self.model_path} is dense")
        self.optimizer = self.scheduler = self.routing = self.rollout_routing = None
        if trainable:
            self._make_trainable(model_config, total_optimizer_steps)
            if self.arch.is_moe:
                self.routing = RoutingStats(self.module, self.arch)
                self.rollout_routing = RoutingReplay(
                    self.routing.routers, router_replay, recomputes=config.recompute_activations,
                    sequence_parallel_rank=layout.tp_rank, sequence_parallel_size=self.sequence_multiple)
        self.memory = MemoryPhases(self.model, self.optimizer)

    def _adapt(self, lora: LoRAConfig) -> list[LoRAAdapter]:
        """LoRA adapters on the targeted linears (from `lora.adapter_path` when set), everything else frozen:
        only the adapters get gradient buffers and optimizer state (`_make_trainable` comes after)."""
        settings = LoRASettings(lora.rank, lora.alpha, lora.dropout, tuple(lora.target_modules))
        adapters = apply_lora(self.module, self.arch, settings)
        if lora.adapter_path:
            load_peft(adapters, settings, lora.adapter_path)
        return adapters

    def _shares_prompts(self, groups: PromptGroups | None, arch: Architecture, layer_spec: str) -> bool:
        """Whether this model takes the shared-prompt layout (rank 0 logs why not when `share_prompt_forward`
        asked for it); it is then built for it: a mask of its own for every row, RoPE angles per row."""
        if not self.config.share_prompt_forward or groups is None:
            return False
        off = sharing_off_reason(arch, layer_spec, groups)
        if off is not None and self.layout.rank == 0:
            logging.getLogger("megarl").warning(f"prompt sharing off for {self.model_path}: {off}")
        return off is None

    def _make_trainable(self, model_config: ModelConfig, total_optimizer_steps: int) -> None:
        optim = self.config.optim
        # Also at DP1, where it shards nothing: one optimizer class at every layout means one checkpoint
        # format, so a run saved at DP2 resumes at TP2 or PP2 (`megarl.checkpoint.optimizer_state`).
        distributed = self.config.use_distributed_optimizer
        # bf16/fp16 gradients are accumulated over micro-batches and reduced over DP in fp32 buffers
        # (megatron's own training does the same): summing in bf16 loses the small contributions.
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=distributed, grad_reduce_in_fp32=model_config.dtype != "float32",
            overlap_grad_reduce=self.config.overlap_grad_reduce,
            bucket_size=self.config.grad_bucket_size or self._layer_sized_bucket(),
        )
        self.model = DistributedDataParallel(self.module.config, ddp_config, self.module)
        if ddp_config.overlap_grad_reduce:
            # As megatron's own training does: every micro-batch but the last runs under no_sync. Without it
            # the schedule counts each gradient as ready in every micro-batch, and megatron issues a bucket's
            # reduction once the count matches the first step's: a step with another number of micro-batches
            # (dynamic batching) never issued it ("Communication call has not been issued for this bucket").
            self.module.config.no_sync_func = self.model.no_sync
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer=optim.optimizer, lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
                adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
                clip_grad=optim.clip_grad, bf16=model_config.dtype == "bfloat16",
                fp16=model_config.dtype == "float16", params_dtype=self.module.config.params_dtype,
                use_distributed_optimizer=distributed,
            ),
            [self.model],
        )
        self.loss_scaling.optimizer = self.optimizer
        _fused_adam_on_cpu(self.optimizer)
        if optim.lr_warmup_steps >= max(total_optimizer_steps, 1) and optim.lr_decay_style != "constant":
            raise ValueError(
                f"actor.optim.lr_warmup_steps={optim.lr_warmup_steps} must be below the run's "
                f"{total_optimizer_steps} optimizer steps for a {optim.lr_decay_style} decay"
            )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if optim.lr_warmup_steps else optim.lr, max_lr=optim.lr,
            min_lr=optim.min_lr, lr_warmup_steps=optim.lr_warmup_steps,
            lr_decay_steps=max(total_optimizer_steps, optim.lr_warmup_steps + 1),
            lr_decay_style=optim.lr_decay_style, start_wd=optim.weight_decay, end_wd=optim.weight_decay,
            wd_incr_steps=max(total_optimizer_steps, 1), wd_incr_style="constant",
        )

    def _layer_sized_bucket(self) -> int:
        """Gradient elements per overlapped DP reduction: about one layer's trainable parameters on this
        rank, so that a layer's gradients are reduced while backward computes the layers before it (megatron's
        default, 40M, leaves a model under 40M parameters in one bucket, reduced after backward); at least
        1M, the bucket measured on the quick start's configs before it was the default (commit 02c9fb9), as
        each reduction has a fixed cost; at most megatron's 40M."""
        trainable = sum(p.numel() for p in self.module.parameters() if p.requires_grad)
        layers = max(self.arch.num_layers // self.layout.pp, 1)
        return min(max(trainable // layers, 1_000_000), 40_000_000)

    # ---- planning -------------------------------------------------------------------------------

    def _micro_batches(self, batch: SequenceBatch, idle: bool = False) -> list[list[int]]:
        """This rank's share cut into micro-batches (index lists into `batch`); `idle`: a stand-in."""
        batch.validate(self.arch.max_position_embeddings)
        if self.config.use_dynamic_batch_size:
            micro = self._budgeted_micro_batches(batch)
        else:
            size = self.config.micro_batch_size_per_rank or DEFAULT_SEQUENCES
            micro = fixed_micro_batches(list(range(len(batch))), size)
        if self.layout.ep > 1:
            micro = self._same_count_on_every_rank(micro, batch, idle)
        return micro

    def _budgeted_micro_batches(self, batch: SequenceBatch) -> list[list[int]]:
        """Under the token budget: packed sequences balanced by their tokens; rows padded to the micro-batch's
        widest (a sequence each, or a prompt with its responses where the model shares prompts) by their
        padded tokens, narrowest rows together (`megarl.engine.batching`). The budget: `max_token_len_per_rank`,
        else `micro_batch_size_per_rank` times the share's longest sequence, else `default_token_budget`."""
        rows = prompt_rows(batch) if self.positioned_rope is not None else None
        longest = int(batch.sequence_lengths_B.max())
        budget = self.config.max_token_len_per_rank or self.config.micro_batch_size_per_rank * longest
        if not budget:
            widest = longest if rows is None else max(
                shared_row_width(row, batch.prompt_lengths_B, batch.response_lengths_B) for row in rows)
            budget = default_token_budget(self.arch, self.module.config.params_dtype.itemsize, longest, widest)
        if rows is None:
            cut = budgeted_micro_batches if self.packed else padded_micro_batches
            return cut(list(range(len(batch))), batch.sequence_lengths_B, budget)
        return shared_row_micro_batches(rows, batch.prompt_lengths_B, batch.response_lengths_B, budget)

    def _same_count_on_every_rank(self, micro: list[list[int]], batch: SequenceBatch, idle: bool) -> list[list[int]]:
        """Expert parallelism exchanges tokens between DP ranks in every MoE layer, so all DP ranks run
        the same number of micro-batches: the most any rank has, unless a rank's share has fewer
        sequences, then that many (ranks merge micro-batches beyond their size then). An idle rank
        repeats its zero-weight stand-in."""
        wanted = torch.tensor([0 if idle else len(micro), -len(batch) if not idle else -(1 << 30)])
        collectives.all_reduce(wanted, op=dist.ReduceOp.MAX, group=self.layout.dp_group)
        count = min(int(wanted[0]), -int(wanted[1]))
        if idle:
            return [micro[0]] * count
        return recut_micro_batches(micro, count, batch.sequence_lengths_B)

    def _run_schedule(self, batch: SequenceBatch, micro: list[list[int]], loss_func, forward_only: bool) -> list:
        """Runs `micro` through the schedule; `loss_func(micro_batch, model_input, output)` finds the
        micro-batch's response tokens in the flattened output through its `ModelInput`'s rows."""
        micro_batches = [batch.select(indices) for indices in micro]
        if not self.packed and self.positioned_rope is None:
            micro_batches = [mb.widened_to_multiple(self.sequence_multiple) for mb in micro_batches]
        inputs = [self._model_input(mb) for mb in micro_batches]
        data = iter(zip(micro_batches, inputs))
        replaying = self.rollout_routing is not None and batch.routed_experts_BTLK is not None

        def forward_step(data_iterator, model):
            micro_batch, model_input = next(data_iterator)
            tokens = model_input.tokens
            # Routers leave padding out of their losses and of the expert load (dense models take no mask).
            moe_inputs = {"padding_mask": padding_mask(micro_batch, tokens.shape[1], self.packed).to(tokens.device)
                          } if self.arch.is_moe else {}
            if replaying:
                self.rollout_routing.set_micro_batch(*router_rows(micro_batch, tokens.shape[1], self.packed))
            if self.positioned_rope is not None:
                self.positioned_rope.positions_gW = model_input.positions
            output = model(tokens, model_input.positions, attention_mask=model_input.attention_mask,
                           packed_seq_params=model_input.packed_seq_params, **moe_inputs)
            return output, partial(loss_func, micro_batch, model_input)

        if self.rollout_routing is not None:
            self.rollout_routing.begin(has_routing=replaying)
        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=data, model=[self.model],
                num_microbatches=len(micro_batches), seq_length=max(i.tokens.shape[1] for i in inputs),
                micro_batch_size=max(i.tokens.shape[0] for i in inputs), forward_only=forward_only,
            )
        finally:
            if self.rollout_routing is not None:
                self.rollout_routing.end()

    def _model_input(self, micro_batch: SequenceBatch) -> ModelInput:
        """Right-padded (b, T) rows; one packed (1, sum of lengths) row whose positions restart at every
        sequence; or one row per distinct prompt with its responses (`share_prompt_forward`)."""
        compute = device.compute_device()
        if self.positioned_rope is not None:
            shared = share_prompts(micro_batch, self.shared_row_multiple)
            return ModelInput(shared.tokens_gW.to(compute), shared.positions_gW.to(compute), shared.output_rows,
                              shared.last_rows, attention_mask=shared.blocked_g1WW.to(compute))
        if not self.packed:
            tokens_bT = micro_batch.tokens_BT.to(compute)
            positions_bT = torch.arange(tokens_bT.shape[1], device=compute).expand_as(tokens_bT)
            return ModelInput(tokens_bT, positions_bT, response_output_rows(micro_batch, packed=False),
                              last_token_rows(micro_batch, packed=False))
        tokens_1N, positions_1N, cu_seqlens = pack(micro_batch, self.sequence_multiple)
        longest = int(cu_seqlens.diff().max())
        cu_seqlens = cu_seqlens.to(compute)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                 max_seqlen_q=longest, max_seqlen_kv=longest)
        return ModelInput(tokens_1N.to(compute), positions_1N.to(compute),
                          response_output_rows(micro_batch, packed=True), last_token_rows(micro_batch, packed=True),
                          packed_seq_params=params)

    # ---- outputs of the model for response tokens -------------------------------------------------

    def _response_outputs(self, micro_batch: SequenceBatch, model_input: ModelInput, output_bTV: torch.Tensor,
                          temperature: float) -> dict:
        """(b, R) log-probs and entropy of the response tokens from the model output; of a value model,
        (b, R) values of the positions predicting them and (b,) values of each sequence's last token."""
        b = len(micro_batch)
        mask_bR = micro_batch.response_mask_BR.to(output_bTV.device)
        rows = model_input.output_rows.to(output_bTV.device)
        if self.arch.value_model:
            values_N = output_bTV.reshape(-1)
            return {"values": values_N[rows].view(b, -1).float() * mask_bR,
                    "last_values": values_N[model_input.last_rows.to(values_N.device)].float()}
        local_vocab = output_bTV.shape[-1]
        logprobs, entropy = logprobs_and_entropy(
            output_bTV.reshape(-1, local_vocab)[rows],
            micro_batch.response_tokens_BR().flatten().to(output_bTV.device),
            group=self.layout.tp_group,
            vocab_start=self.layout.tp_rank * local_vocab,
            vocab_size=self.arch.vocab_size,
            temperature=temperature,
            chunk_size=self.config.logprob_chunk_size,
            inplace_backward=True,  # the gathered response rows belong to the kernel alone
            use_triton=device.triton(),
        )
        return {"logprobs": logprobs.view(b, -1) * mask_bR, "entropy": entropy.view(b, -1) * mask_bR}

    # ---- scoring ----------------------------------------------------------------------------------

    @torch.no_grad()
    def score(self, batch: SequenceBatch, temperature: float = 1.0) -> dict[str, torch.Tensor]:
        """Per-token (B, R) log-probs and entropy of the responses of this DP rank's share; of a value
        model, (B, R) `values` of the positions predicting each response token (a critic's V(s_t)) and (B,)
        `last_values`, each sequence's value once it has read its last token (a reward model's score)."""
        self.model.eval()
        micro = self._micro_batches(batch)

        def collect(micro_batch, model_input, output):
            return torch.zeros((), device=output.device), torch.tensor(0), self._response_outputs(
                micro_batch, model_input, output, temperature
            )

        collected = self._run_schedule(batch, micro, collect, forward_only=True)
        return self._assemble_outputs(batch, micro, collected)

    def _assemble_outputs(self, batch: SequenceBatch, micro: list[list[int]],
                          per_micro_batch: list[dict]) -> dict[str, torch.Tensor]:
        """Per-micro-batch (b, R) and (b,) outputs of the last stage -> (B, R) and (B,) tensors of the
        share, on every stage (broadcast over PP), on the CPU."""
        B, R = len(batch), batch.max_response_length
        shapes = {"values": (B, R), "last_values": (B,)} if self.arch.value_model else {"logprobs": (B, R),
                                                                                          "entropy": (B, R)}
        assembled = {name: torch.zeros(shape, device=device.compute_device()) for name, shape in shapes.items()}
        if self.layout.is_last_stage:
            for indices, outputs in zip(micro, per_micro_batch):
                for name, output in outputs.items():
                    # A micro-batch's responses may be narrower than the share's: (indices, :r) of (B, R).
                    assembled[name][(indices, *(slice(size) for size in output.shape[1:]))] = output
        if self.layout.pp > 1:
            last_stage = dist.get_process_group_ranks(self.layout.pp_group)[-1]
            for tensor in assembled.values():
                dist.broadcast(tensor, src=last_stage, group=self.layout.pp_group)
        return {name: value.cpu() for name, value in assembled.items()}

    # ---- training ---------------------------------------------------------------------------------

    def train_mini_batch(self, batch: SequenceBatch, loss_fn: LossFn, temperature: float = 1.0,
                         keep_outputs: bool = False, idle: bool = False
                         ) -> tuple[dict[str, float], dict[str, torch.Tensor] | None]:
        """One optimizer step on a mini-batch, of which `batch` is this DP rank's share. Returns its
        metrics (the loss terms summed over micro-batches and DP ranks, grad norm, learning rate, DP
        imbalance) and, with `keep_outputs`, the forward's per-token outputs of the share as `score()`
        gives them: the model's before this step, at no extra cost.

        `idle`: this DP rank holds none of the mini-batch; `batch` is a stand-in run with zero weight,
        so that the rank still takes part in the gradient reduction and the optimizer's collectives."""
        assert self.optimizer is not None, "engine was built without an optimizer (inference only)"
        self.model.train()
        micro = self._micro_batches(batch, idle)
        weight = 0.0 if idle else 1.0
        # (model's response tokens, sequences, all tokens) of each DP rank's share: the loss normalizer and the balance.
        counts = weight * torch.tensor([batch.num_loss_tokens, len(batch), int(batch.sequence_lengths_B.sum())])
        counts_per_rank = collectives.all_gather(counts.double(), group=self.layout.dp_group)
        num_tokens, num_sequences, num_all_tokens = map(int, sum(counts_per_rank))
        normalizer = LossNormalizer(num_tokens, num_sequences)
        # megatron's routers hand their losses to the backward as sums over their micro-batch's tokens
        # (its per-token-loss convention), scaled by `loss_scaling` like the main loss. Dividing both by the
        # mini-batch's token count makes the router losses token-means over the mini-batch; the main loss,
        # normalised already, is handed over multiplied by that count.
        token_sum = float(num_all_tokens) if self.arch.is_moe else 1.0
        self.loss_scaling.factor = weight / token_sum
        if self.routing is not None:
            self.routing.begin(weight)
        kept = []

        def loss_func(micro_batch, model_input, output):
            outputs = self._response_outputs(micro_batch, model_input, output, temperature)
            if keep_outputs:
                kept.append({name: value.detach() for name, value in outputs.items()})
            loss, metrics = loss_fn(outputs, micro_batch, normalizer)
            reported = {"loss": loss.detach() * weight, **{k: v.detach() * weight for k, v in metrics.items()}}
            return loss * token_sum, torch.tensor(int(micro_batch.num_loss_tokens * weight)), reported

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        collected = self._run_schedule(batch, micro, loss_func, forward_only=False)
        self.loss_scaling.factor = 1.0
        outputs = self._assemble_outputs(batch, micro, kept) if keep_outputs else None
        update_successful, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        metrics = self._reduce_metrics(collected)
        metrics.update(
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=self.optimizer.param_groups[0]["lr"],
            update_skipped=float(not update_successful),
            dp_token_imbalance=token_imbalance([float(c[2]) for c in counts_per_rank]),
        )
        if self.routing is not None:
            metrics.update(self.routing.metrics(len(micro), self.layout))
        if self.rollout_routing is not None and batch.routed_experts_BTLK is not None:
            metrics.update(self.rollout_routing.metrics(weight, self.layout))
        return metrics, outputs

    def _reduce_metrics(self, collected: list[dict]) -> dict[str, float]:
        """Sum metric contributions over micro-batches and DP on the last stage, share over PP."""
        metrics = None
        if self.layout.is_last_stage:
            names = sorted(collected[0])
            sums = torch.stack([sum(c[name].float() for c in collected) for name in names])
            collectives.all_reduce(sums, group=self.layout.dp_group)
            metrics = dict(zip(names, sums.tolist()))
        if self.layout.pp > 1:
            box = [metrics]
            dist.broadcast_object_list(box, src=dist.get_process_group_ranks(self.layout.pp_group)[-1],
                                       group=self.layout.pp_group)
            metrics = box[0]
        return metrics

    @property
    def weights_version(self) -> int:
        """Changes whenever the weights may have: the optimizer steps taken (a checkpoint load restores
        the count along with the weights)."""
        return self.scheduler.num_steps if self.scheduler is not None else 0

    def is_single_step(self, num_groups: int) -> bool:
        """Whether `update` on a step of `num_groups` groups is one optimizer step on all of it."""
        return self.config.ppo_epochs == 1 and self.config.ppo_mini_batch_size >= num_groups

    def update(self, batch: SequenceBatch, group_ids_B: torch.Tensor, num_groups: int, loss_fn: LossFn, seed: int,
               step: int, temperature: float = 1.0, keep_outputs: bool = False
               ) -> tuple[list[dict[str, float]], dict[str, torch.Tensor] | None]:
        """`ppo_epochs` passes over the step's `num_groups` groups in shuffled mini-batches of
        `ppo_mini_batch_size` groups (`mini_batch_groups`: the same at any layout); `batch` is this DP
        rank's share, whole groups whose global ids are `group_ids_B`. Each mini-batch is one optimizer
        step, every DP rank training on its part of it. Returns the metrics of every step and, with
        `keep_outputs` (single-step updates only), the per-token outputs of the model before the
        step, in batch order (what `score()` would give)."""
        if keep_outputs and not self.is_single_step(num_groups):
            raise ValueError("keep_outputs needs an update of one optimizer step on the whole batch")
        history, outputs = [], None
        for epoch in range(self.config.ppo_epochs):
            for groups in mini_batch_groups(num_groups, self.config.ppo_mini_batch_size, seed, step, epoch):
                indices = torch.isin(group_ids_B, torch.tensor(groups)).nonzero().flatten()
                idle = len(indices) == 0
                share = batch.select(indices if not idle else [0])
                metrics, kept = self.train_mini_batch(share, loss_fn, temperature, keep_outputs, idle=idle)
                history.append(metrics)
                if kept is not None:
                    outputs = kept  # the one mini-batch holds the whole share, in batch order
        return history, outputs


class BaseModel:
    """A LoRA engine's frozen base model, its adapters off: the reference model, at no memory of its own."""

    def __init__(self, engine: MegatronEngine):
        self.engine, self.config, self.memory = engine, engine.config, engine.memory

    def score(self, batch: SequenceBatch, temperature: float = 1.0) -> dict[str, torch.Tensor]:
        with adapters_disabled(self.engine.module):
            return self.engine.score(batch, temperature)


def _fused_adam_on_cpu(optimizer) -> None:
    """torch's Adam(W), which megatron builds where neither Transformer Engine nor Apex gives it a fused Adam, takes
    torch's fused multi-tensor kernel for CPU parameters: one call a step instead of about ten operators per
    parameter (the quick start's 0.8M parameters in 30 tensors: 0.36 against 1.23 ms a step, one thread)."""
    for inner in torch_optimizers(optimizer):
        if isinstance(inner, torch.optim.Adam) and all(
                param.device.type == "cpu" for group in inner.param_groups for param in group["params"]):
            for group in inner.param_groups:
                group.update(fused=True, foreach=False)


def _finalize_without_token_scaling(model, num_tokens=None, pg_collection=None, **kwargs):
    # Gradients are already normalised by global counts; only synchronise them (DP all-reduce,
    # tied-embedding and layer-norm reductions), never divide again by token counts.
    finalize_model_grads(model, None, pg_collection=pg_collection, **kwargs)
