"""megarl's actor update against a plain megatron-core training loop: same model, layout and batch.

    python bench/train_overhead.py [--tp 2]

Both run in the same torchrun processes (one per TP rank) on the same ~30M-parameter Qwen2 (bench/common.py),
loaded twice: megarl's `MegatronEngine.update` with the PPO-clip actor loss (ratio, clipping,
entropy through the chunked vocab-parallel kernel, global token normalisation, metrics), and a
loop written directly against megatron-core (DDP, `get_megatron_optimizer`, the pipeline
schedule, a policy-gradient loss from `vocab_parallel_cross_entropy`). Each step is one optimizer
step on the same 32 sequences in the same micro-batches of 8; the two alternate, step by step,
after warm-up. Prints tokens/s of each and the ratio (target >= 0.95).
"""

from __future__ import annotations

import argparse
import json
import time

SEQUENCES, MICRO_BATCH, PROMPT_LENGTH, MAX_RESPONSE, STEPS, WARMUP = 32, 8, 32, 96, 6, 1


def make_batch(vocab_size: int):
    """32 random prompt + response sequences (responses 32..96 tokens), advantages ~ N(0, 1)."""
    import torch

    from megarl.engine.batch import SequenceBatch

    generator = torch.Generator().manual_seed(0)
    response_lengths = torch.randint(MAX_RESPONSE // 3, MAX_RESPONSE + 1, (SEQUENCES,), generator=generator)
    tokens = torch.zeros(SEQUENCES, PROMPT_LENGTH + MAX_RESPONSE, dtype=torch.long)
    for i, length in enumerate(response_lengths.tolist()):
        tokens[i, : PROMPT_LENGTH + length] = torch.randint(5, vocab_size, (PROMPT_LENGTH + length,),
                                                            generator=generator)
    batch = SequenceBatch(tokens, torch.full((SEQUENCES,), PROMPT_LENGTH), response_lengths)
    batch.response_tensors.advantages_BR = torch.randn(SEQUENCES, MAX_RESPONSE, generator=generator) * \
        batch.response_mask_BR
    return batch


class PlainMegatronLoop:
    """A policy-gradient step the way a megatron-core user would write it, with nothing of megarl's
    engine: padded micro-batches, token log-probs from `vocab_parallel_cross_entropy`."""

    def __init__(self, module, lr: float):
        import torch
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        module.config.variable_seq_lengths = True
        self.model = DistributedDataParallel(module.config, DistributedDataParallelConfig(), module)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=lr, clip_grad=1.0, params_dtype=torch.float32), [self.model])

    def step(self, batch) -> None:
        import torch
        from megatron.core import tensor_parallel
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megarl import device

        num_tokens = int(batch.response_lengths_B.sum())
        micro_batches = [batch.select(list(range(i, min(i + MICRO_BATCH, len(batch)))))
                         for i in range(0, len(batch), MICRO_BATCH)]

        def forward_step(data_iterator, model):
            micro_batch = next(data_iterator)
            width = int(micro_batch.sequence_lengths_B.max())
            tokens = micro_batch.tokens_BT[:, :width].to(device.compute_device())
            positions = torch.arange(width, device=tokens.device).expand_as(tokens)
            labels = torch.roll(tokens, -1, dims=1)
            logits = model(tokens, positions, None)
            mask = torch.zeros_like(tokens, dtype=torch.float32)
            advantages = torch.zeros_like(mask)
            for i, (prompt, response) in enumerate(zip(micro_batch.prompt_lengths_B.tolist(),
                                                       micro_batch.response_lengths_B.tolist())):
                mask[i, prompt - 1: prompt - 1 + response] = 1.0
                advantages[i, prompt - 1: prompt - 1 + response] = (
                    micro_batch.response_tensors.advantages_BR[i, :response])

            def loss_func(output):
                logprobs = -tensor_parallel.vocab_parallel_cross_entropy(output.float(), labels)  # (b, s)
                loss = -(advantages * logprobs * mask).sum() / num_tokens
                return loss, {"loss": loss.detach()}

            return logits, loss_func

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micro_batches),
                                    model=[self.model], num_microbatches=len(micro_batches),
                                    seq_length=batch.tokens_BT.shape[1], micro_batch_size=MICRO_BATCH,
                                    forward_only=False)
        self.optimizer.step()


def worker(model_dir: str, tp: int) -> None:
    import torch
    import torch.distributed as dist

    from megarl.config.schema import ActorConfig, ModelConfig, OptimizerConfig, RolloutCorrectionConfig
    from megarl.distributed import finish_process, init_layout
    from megarl.engine.megatron_engine import MegatronEngine
    from megarl.models.hf_interop import load_hf_model
    from megarl.trainer.losses import actor_loss

    torch.set_num_threads(1)
    layout = init_layout(tp=tp)
    config = ActorConfig(optim=OptimizerConfig(lr=1e-6), ppo_mini_batch_size=SEQUENCES,
                         micro_batch_size_per_rank=MICRO_BATCH, use_dynamic_batch_size=False)
    engine = MegatronEngine(layout, ModelConfig(path=model_dir), config, total_optimizer_steps=STEPS + WARMUP)
    plain = PlainMegatronLoop(load_hf_model(model_dir, layout)[0], lr=1e-6)
    batch = make_batch(engine.arch.vocab_size)
    batch.response_tensors.old_logprobs_BR = engine.score(batch)["logprobs"]
    loss = actor_loss(config, RolloutCorrectionConfig(preset="none"), MAX_RESPONSE)
    seconds = {"megarl": [], "plain": []}
    groups = torch.arange(len(batch))  # one sample per prompt: each sequence its own group
    for step in range(WARMUP + STEPS):
        for name, run in (("megarl", lambda: engine.update(batch, groups, len(batch), loss, seed=0, step=step)),
                          ("plain", lambda: plain.step(batch))):
            dist.barrier()
            start = time.perf_counter()
            run()
            dist.barrier()
            if step >= WARMUP:
                seconds[name].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        print("OVERHEAD " + json.dumps({"seconds": seconds, "tokens": int(batch.sequence_lengths_B.sum()),
                                        "layout": str(layout)}), flush=True)
    finish_process()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size = number of processes")
    parser.add_argument("--worker", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.tp)

    from common import ensure_bench_model, launch, torchrun

    model = ensure_bench_model()
    result = launch(torchrun(args.tp) + [__file__, "--worker", str(model), "--tp", str(args.tp)], "OVERHEAD")
    median = {name: sorted(values)[len(values) // 2] for name, values in result["seconds"].items()}
    rate = {name: result["tokens"] / seconds for name, seconds in median.items()}
    ratio = rate["megarl"] / rate["plain"]
    print(f"model {model.name}, {result['layout']}, {SEQUENCES} sequences ({result['tokens']} tokens) per optimizer "
          f"step in micro-batches of {MICRO_BATCH}, median of {STEPS} steps after {WARMUP} warm-up")
    for name in ("megarl", "plain"):
        print(f"{name:>7}: {median[name]:.3f} s/step, {rate[name]:,.0f} tokens/s "
              f"(steps: {', '.join(f'{s:.3f}' for s in result['seconds'][name])})")
    print(f"megarl / plain megatron-core tokens/s: {ratio:.3f} "
          f"(target >= 0.95: {'met' if ratio >= 0.95 else 'MISSED'})")


if __name__ == "__main__":
    main()
