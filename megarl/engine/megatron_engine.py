"""One Megatron model on this rank (actor, critic, reference or reward): scoring and training.

Every rank holds the whole batch. The engine deals sequences to DP ranks (balancing tokens), cuts
each rank's share into micro-batches, runs them through megatron-core's pipeline schedule, and
hands the results back to every rank: scores are broadcast from the last pipeline stage and
all-gathered over DP, so `score()` returns the full (B, R) tensors everywhere.

On GPU with Transformer Engine, micro-batches are packed (THD): sequences are concatenated
without padding and attention restarts at each boundary (`PackedSeqParams`). Elsewhere they are
right-padded to the micro-batch's longest sequence.

Losses are normalised by *global* counts (tokens or sequences of the whole mini-batch, known to
every rank), so gradients are summed, not averaged, over micro-batches and DP ranks
(`calculate_per_token_loss`): the update equals a single big-batch step at any layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func

from kernels.vocab_parallel_logprobs import logprobs_and_entropy
from megarl.config.schema import EngineConfig, ModelConfig
from megarl import device
from megarl.distributed.layout import ParallelLayout
from megarl.engine.batch import SequenceBatch
from megarl.engine.batching import budgeted_micro_batches, fixed_micro_batches, split_over_data_parallel, token_imbalance
from megarl.engine.memory import MemoryPhases
from megarl.engine.packing import pack, response_output_rows
from megarl.models.builder import ScheduleSettings, resolve_layer_spec
from megarl.models.hf_interop import load_hf_model
from megarl.seeding import derive_seed


@dataclass(frozen=True)
class LossNormalizer:
    """Global counts of the mini-batch that losses divide by (the same on every rank)."""

    num_tokens: int
    num_sequences: int


# loss_fn(outputs, micro_batch, normalizer) -> (loss, metrics); outputs are (b, R) tensors named
# "logprobs" and "entropy" (language models) or "values" (value models).
LossFn = Callable[[dict, SequenceBatch, LossNormalizer], tuple[torch.Tensor, dict]]


class MegatronEngine:
    def __init__(
        self,
        layout: ParallelLayout,
        model_config: ModelConfig,
        config: EngineConfig,
        model_path: str | None = None,
        total_optimizer_steps: int | None = None,
        value_head: bool = False,
    ):
        """Load `model_path` (default `model_config.path`); trainable when `total_optimizer_steps` is set;
        `value_head` turns a causal LM checkpoint into a value model (a critic's usual start)."""
        self.layout, self.config = layout, config
        trainable = total_optimizer_steps is not None
        schedule = ScheduleSettings(
            variable_seq_lengths=True,  # micro-batches are padded to their own length
            calculate_per_token_loss=True,  # losses arrive globally normalised
            finalize_model_grads_func=_finalize_without_token_scaling,
            grad_scale_func=self._scale_loss if trainable else None,
        )
        self.module, self.arch = load_hf_model(
            model_path or model_config.path, layout, model_config.dtype, model_config.layer_spec,
            model_config.make_vocab_size_divisible_by, recompute_activations=config.recompute_activations,
            value_head=value_head, schedule=schedule,
        )
        self.model = self.module
        self.packed = resolve_layer_spec(model_config.layer_spec) == "transformer_engine"
        self.optimizer = self.scheduler = None
        if trainable:
            self._make_trainable(model_config, total_optimizer_steps)
        self.memory = MemoryPhases(self.model, self.optimizer)

    def _make_trainable(self, model_config: ModelConfig, total_optimizer_steps: int) -> None:
        optim = self.config.optim
        # Also at DP1, where it shards nothing: one optimizer class at every layout means one checkpoint
        # format, so a run saved at DP2 resumes at TP2 or PP2 (`megarl.checkpoint.optimizer_state`).
        distributed = self.config.use_distributed_optimizer
        # bf16/fp16 gradients are accumulated over micro-batches and reduced over DP in fp32 buffers
        # (megatron's own training does the same): summing in bf16 loses the small contributions.
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=distributed, grad_reduce_in_fp32=model_config.dtype != "float32"
        )
        self.model = DistributedDataParallel(self.module.config, ddp_config, self.module)
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

    def _scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The optimizer's loss scaling (fp16; identity otherwise), called by the schedule before backward."""
        return self.optimizer.scale_loss(loss)

    # ---- planning -------------------------------------------------------------------------------

    def _plan(self, batch: SequenceBatch) -> tuple[list[list[int]], list[list[int]]]:
        """(indices of every DP rank, this rank's micro-batches as index lists)."""
        batch.validate(self.arch.max_position_embeddings)
        lengths = batch.sequence_lengths_B
        dynamic = self.config.use_dynamic_batch_size
        ranks = split_over_data_parallel(lengths, self.layout.dp, equal_counts=not dynamic)
        mine = ranks[self.layout.dp_rank]
        if dynamic:
            micro = budgeted_micro_batches(mine, lengths, self.config.max_token_len_per_rank)
        else:
            micro = fixed_micro_batches(mine, self.config.micro_batch_size_per_rank)
        return ranks, micro

    def _run_schedule(self, batch: SequenceBatch, micro: list[list[int]], loss_func, forward_only: bool) -> list:
        micro_batches = [batch.select(indices) for indices in micro]
        data = iter(micro_batches)

        def forward_step(data_iterator, model):
            micro_batch = next(data_iterator)
            tokens, positions, packed_seq_params = self._model_inputs(micro_batch)
            output = model(tokens, positions, attention_mask=None, packed_seq_params=packed_seq_params)
            return output, partial(loss_func, micro_batch)

        longest = max(mb.tokens_BT.shape[1] for mb in micro_batches)
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=[self.model],
            num_microbatches=len(micro_batches), seq_length=longest,
            micro_batch_size=max(len(mb) for mb in micro_batches), forward_only=forward_only,
        )

    def _model_inputs(self, micro_batch: SequenceBatch):
        """(tokens, positions, packed_seq_params): right-padded (b, T), or one packed (1, sum of lengths)
        row whose positions restart at every sequence."""
        if not self.packed:
            tokens_bT = micro_batch.tokens_BT.to(device.compute_device())
            positions_bT = torch.arange(tokens_bT.shape[1], device=tokens_bT.device).expand_as(tokens_bT)
            return tokens_bT, positions_bT, None
        tokens_1N, positions_1N, cu_seqlens = pack(micro_batch)
        cu_seqlens = cu_seqlens.to(device.compute_device())
        longest = int(micro_batch.sequence_lengths_B.max())
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                 max_seqlen_q=longest, max_seqlen_kv=longest)
        return tokens_1N.to(device.compute_device()), positions_1N.to(device.compute_device()), params

    # ---- outputs of the model for response tokens -------------------------------------------------

    def _response_outputs(self, micro_batch: SequenceBatch, output_bTV: torch.Tensor, temperature: float) -> dict:
        """(b, R) log-probs and entropy (or values) of the response tokens from the model output."""
        b = len(micro_batch)
        mask_bR = micro_batch.response_mask_BR.to(output_bTV.device)
        rows = response_output_rows(micro_batch, self.packed).to(output_bTV.device)
        if self.arch.value_model:
            values = output_bTV.reshape(-1)[rows].view(b, -1).float()
            return {"values": values * mask_bR}
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
        """Per-token (B, R) log-probs and entropy of the responses (or values), on every rank."""
        self.model.eval()
        ranks, micro = self._plan(batch)

        def collect(micro_batch, output):
            return torch.zeros((), device=output.device), torch.tensor(0), self._response_outputs(
                micro_batch, output, temperature
            )

        collected = self._run_schedule(batch, micro, collect, forward_only=True)
        return self._gather_outputs(batch, ranks, micro, collected)

    def _gather_outputs(self, batch: SequenceBatch, ranks: list[list[int]], micro: list[list[int]],
                        per_micro_batch: list[dict]) -> dict[str, torch.Tensor]:
        """This rank's per-micro-batch (b, R) outputs (on the last stage) -> full (B, R) tensors on every rank."""
        names = ("values",) if self.arch.value_model else ("logprobs", "entropy")
        width = batch.max_response_length
        mine = ranks[self.layout.dp_rank]
        local = {name: torch.zeros(len(mine), width, device=device.compute_device()) for name in names}
        if self.layout.is_last_stage:
            row_of = {index: row for row, index in enumerate(mine)}
            for indices, outputs in zip(micro, per_micro_batch):
                rows = [row_of[index] for index in indices]
                for name in names:
                    local[name][rows, : outputs[name].shape[1]] = outputs[name]
        return {name: self._share(local[name], ranks, len(batch)) for name in names}

    def _share(self, local_bR: torch.Tensor, ranks: list[list[int]], batch_size: int) -> torch.Tensor:
        """Last stage -> all stages (broadcast over PP), then all DP ranks (gather), in batch order."""
        layout = self.layout
        if layout.pp > 1:
            last_stage = dist.get_process_group_ranks(layout.pp_group)[-1]
            dist.broadcast(local_bR, src=last_stage, group=layout.pp_group)
        # Row k of local_bR is sequence ranks[dp_rank][k].
        padded = max(len(indices) for indices in ranks)
        send = torch.zeros(padded, local_bR.shape[1], device=local_bR.device)
        send[: local_bR.shape[0]] = local_bR
        gathered = [torch.empty_like(send) for _ in range(layout.dp)]
        dist.all_gather(gathered, send, group=layout.dp_group)
        result = torch.zeros(batch_size, local_bR.shape[1], device=local_bR.device)
        for rank_rows, indices in zip(gathered, ranks):
            result[indices] = rank_rows[: len(indices)]
        return result.cpu()

    # ---- training ---------------------------------------------------------------------------------

    def train_mini_batch(self, batch: SequenceBatch, loss_fn: LossFn, temperature: float = 1.0,
                         keep_outputs: bool = False) -> tuple[dict[str, float], dict[str, torch.Tensor] | None]:
        """One optimizer step on `batch` (the whole mini-batch, on every rank). Returns its metrics (the
        loss terms summed over micro-batches and DP ranks, grad norm, learning rate, DP imbalance) and,
        with `keep_outputs`, the forward's per-token outputs as `score()` gives them: the model's
        before this step, at no extra cost."""
        assert self.optimizer is not None, "engine was built without an optimizer (inference only)"
        self.model.train()
        ranks, micro = self._plan(batch)
        normalizer = LossNormalizer(int(batch.response_lengths_B.sum()), len(batch))
        kept = []

        def loss_func(micro_batch, output):
            outputs = self._response_outputs(micro_batch, output, temperature)
            if keep_outputs:
                kept.append({name: value.detach() for name, value in outputs.items()})
            loss, metrics = loss_fn(outputs, micro_batch, normalizer)
            reported = {"loss": loss.detach(), **{k: v.detach() for k, v in metrics.items()}}
            return loss, torch.tensor(int(micro_batch.response_lengths_B.sum())), reported

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        collected = self._run_schedule(batch, micro, loss_func, forward_only=False)
        outputs = self._gather_outputs(batch, ranks, micro, kept) if keep_outputs else None
        update_successful, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        metrics = self._reduce_metrics(collected)
        metrics.update(
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=self.optimizer.param_groups[0]["lr"],
            update_skipped=float(not update_successful),
            dp_token_imbalance=token_imbalance(batch.sequence_lengths_B, ranks),
        )
        return metrics, outputs

    def _reduce_metrics(self, collected: list[dict]) -> dict[str, float]:
        """Sum metric contributions over micro-batches and DP on the last stage, share over PP."""
        metrics = None
        if self.layout.is_last_stage:
            names = sorted(collected[0])
            sums = torch.stack([sum(c[name].float() for c in collected) for name in names])
            dist.all_reduce(sums, group=self.layout.dp_group)
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

    def is_single_step(self, batch_size: int, samples_per_prompt: int) -> bool:
        """Whether `update` on a batch of `batch_size` sequences is one optimizer step on all of it."""
        return self.config.ppo_epochs == 1 and self.config.ppo_mini_batch_size * samples_per_prompt >= batch_size

    def update(self, batch: SequenceBatch, loss_fn: LossFn, samples_per_prompt: int, seed: int, step: int,
               temperature: float = 1.0, keep_outputs: bool = False
               ) -> tuple[list[dict[str, float]], dict[str, torch.Tensor] | None]:
        """`ppo_epochs` passes over `batch` in shuffled mini-batches of `ppo_mini_batch_size` prompts
        (times `samples_per_prompt` sequences): every sequence is used exactly once per epoch, in an
        order drawn from the run's `seed` for this `step` and epoch (`megarl.seeding`).
        Returns the metrics of every step and, with `keep_outputs` (single-step updates only), the
        per-token outputs of the model before the step, in batch order (what `score()` would give)."""
        if keep_outputs and not self.is_single_step(len(batch), samples_per_prompt):
            raise ValueError("keep_outputs needs an update of one optimizer step on the whole batch")
        mini_batch = self.config.ppo_mini_batch_size * samples_per_prompt
        history, outputs = [], None
        for epoch in range(self.config.ppo_epochs):
            generator = torch.Generator().manual_seed(derive_seed(seed, "mini_batch_order", step=step, draw=epoch))
            order = torch.randperm(len(batch), generator=generator)
            for start in range(0, len(batch), mini_batch):
                indices = order[start : start + mini_batch]
                metrics, kept = self.train_mini_batch(batch.select(indices), loss_fn, temperature, keep_outputs)
                history.append(metrics)
                if kept is not None:
                    outputs = {name: torch.empty_like(value).index_copy_(0, indices, value)
                               for name, value in kept.items()}
        return history, outputs


def _finalize_without_token_scaling(model, num_tokens=None, pg_collection=None, **kwargs):
    # Gradients are already normalised by global counts; only synchronise them (DP all-reduce,
    # tied-embedding and layer-norm reductions), never divide again by token counts.
    finalize_model_grads(model, None, pg_collection=pg_collection, **kwargs)
