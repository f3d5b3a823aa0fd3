"""Engine checks at one layout: scoring vs `transformers`, then one optimizer step (whose kept
forward outputs must equal the scores), exported to HF. Each DP rank passes its token-balanced
share of the batch, as the trainers do.

Prints one JSON line (rank 0) with the max differences over all ranks and the step's metrics; the
test compares the exported weights across layouts.
"""

import argparse

import torch
import torch.distributed as dist
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.transformer.attention import SelfAttention
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from megarl.config.schema import EngineConfig, ModelConfig, OptimizerConfig
from megarl.distributed import finish_process, init_layout
from megarl.engine.batch import SequenceBatch
from megarl.engine.batching import balance_over_data_parallel, padded_micro_batches
from megarl.engine.megatron_engine import MegatronEngine
from megarl.engine.prompt_sharing import PromptGroups
from megarl.models.hf_interop import export_hf
from reporting import print_report

parser = argparse.ArgumentParser()
parser.add_argument("--policy", required=True)
parser.add_argument("--value", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--pp", type=int, default=1)
parser.add_argument("--dynamic", action="store_true", help="token-budget micro-batches")
parser.add_argument("--recompute", action="store_true", help="recompute activations in backward")
parser.add_argument("--share-prompts", action="store_true",
                    help="build the engines for prompt groups (n = 2), which they share: one row per distinct prompt")
parser.add_argument("--grad-bucket-size", type=int, default=0, help="gradient elements per overlapped DP reduction")
parser.add_argument("--dtype", default="float32", help="the policy's and critic's model.dtype")
parser.add_argument("--bf16-steps", type=int, default=0,
                    help="then train the fp32 policy and a bf16 copy this many steps each, reporting both losses")
args = parser.parse_args()

TEMPERATURE = 0.7
layout = init_layout(tp=args.tp, pp=args.pp)
generator = torch.Generator().manual_seed(0)
prompt_lengths = torch.tensor([5, 5, 8, 8, 6, 2, 7, 3])
response_lengths = torch.tensor([10, 12, 6, 15, 1, 9, 4, 13])
tokens = torch.randint(5, 100, (8, 24), generator=generator)
tokens[1, :5], tokens[3, :8] = tokens[0, :5], tokens[2, :8]  # two prompts sampled twice, as in a GRPO group
share = balance_over_data_parallel((prompt_lengths + response_lengths).tolist(), layout.dp)[layout.dp_rank]
batch = SequenceBatch(tokens, prompt_lengths, response_lengths).select(share)
engine_config = EngineConfig(
    micro_batch_size_per_rank=2, use_dynamic_batch_size=args.dynamic, max_token_len_per_rank=40,
    recompute_activations=args.recompute, grad_bucket_size=args.grad_bucket_size,
    optim=OptimizerConfig(lr=1e-3, adam_eps=1e-6, clip_grad=1.0, weight_decay=0.01),
)
groups = PromptGroups(2, int(prompt_lengths.max()), int(response_lengths.max())) if args.share_prompts else None


def hf_response_outputs(model_dir, value_model):
    """Reference per-response-token outputs from a `transformers` forward on each sequence; of a value
    model also its output at each sequence's last token (a reward model's score)."""
    hf_class = AutoModelForTokenClassification if value_model else AutoModelForCausalLM
    model = hf_class.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = int(response_lengths.max())
    results = {name: torch.zeros(8, width) for name in (("values",) if value_model else ("logprobs", "entropy"))}
    if value_model:
        results["last_values"] = torch.zeros(8)
    with torch.no_grad():
        for i in range(8):
            length = int(prompt_lengths[i] + response_lengths[i])
            out = model(tokens[i : i + 1, :length]).logits[0]
            rows = out[int(prompt_lengths[i]) - 1 : length - 1]
            if value_model:
                results["values"][i, : len(rows)] = rows[:, 0]
                results["last_values"][i] = out[length - 1, 0]
                continue
            log_p = torch.log_softmax(rows / TEMPERATURE, dim=-1)
            targets = tokens[i, int(prompt_lengths[i]) : length]
            results["logprobs"][i, : len(rows)] = log_p.gather(1, targets[:, None]).squeeze(1)
            results["entropy"][i, : len(rows)] = -(log_p.exp() * log_p).sum(-1)
    return results


def max_diff(scores, reference):
    """The largest difference on any rank; `reference` holds the whole batch, `scores` this rank's share."""
    assert scores.keys() == reference.keys(), (sorted(scores), sorted(reference))
    local = max(float((scores[name] - reference[name][share][..., : scores[name].shape[-1]]).abs().max())
                for name in scores)
    worst = torch.tensor(local)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


report = {}
policy = MegatronEngine(layout, ModelConfig(path=args.policy, dtype=args.dtype), engine_config,
                        total_optimizer_steps=10, groups=groups)
rows_embedded = []  # rows of each micro-batch the first stage embeds: a sequence each, or a shared prompt's
for module in policy.module.modules():
    if isinstance(module, LanguageModelEmbedding):
        module.register_forward_pre_hook(lambda _, args, kwargs: rows_embedded.append(len(kwargs["input_ids"])),
                                         with_kwargs=True)
scores = policy.score(batch, temperature=TEMPERATURE)
report["rows_scored"], report["sequences"] = sum(rows_embedded), len(batch)
critic = MegatronEngine(layout, ModelConfig(path=args.value, dtype=args.dtype), engine_config, groups=groups)
report["shares_prompts"] = [engine.positioned_rope is not None for engine in (policy, critic)]
# causal: the self-attention layers mask on their own; arbitrary: they apply the mask each forward gives them.
report["attention_masks"] = [sorted({module.attn_mask_type.name for module in engine.module.modules()
                                     if isinstance(module, SelfAttention)}) for engine in (policy, critic)]
report["rope_fusion"] = [engine.module.config.apply_rope_fusion for engine in (policy, critic)]
values = critic.score(batch)
report["logprob_entropy_diff"] = max_diff(scores, hf_response_outputs(args.policy, False))
try:  # router replay needs a mixture-of-experts model
    MegatronEngine(layout, ModelConfig(path=args.policy), engine_config, total_optimizer_steps=10, router_replay=True)
    report["dense_router_replay_error"] = None
except ValueError as error:
    report["dense_router_replay_error"] = str(error)
report["value_diff"] = max_diff(values, hf_response_outputs(args.value, True))


def nll_with_entropy_bonus(outputs, micro_batch, normalizer):
    mask = micro_batch.response_mask_BR.to(outputs["logprobs"].device)
    entropy = (outputs["entropy"] * mask).sum() / normalizer.num_tokens
    nll = -(outputs["logprobs"] * mask).sum() / normalizer.num_tokens
    return nll - 0.01 * entropy, {"entropy": entropy}


metrics, before_step = policy.train_mini_batch(batch, nll_with_entropy_bonus, temperature=TEMPERATURE,
                                               keep_outputs=True)
whole_batch_scores = {name: value.new_zeros(8, value.shape[1]).index_copy(0, torch.tensor(share), value)
                      for name, value in scores.items()}
report["kept_outputs_vs_score"] = max_diff(before_step, whole_batch_scores)  # the trainer's old log-probs, for free
export_hf(policy.module, policy.arch, layout, args.out, args.policy)
report.update(metrics)
if args.bf16_steps:
    # bf16 from the same checkpoint: its gradients must accumulate and reduce over DP in fp32 buffers.
    bf16 = MegatronEngine(layout, ModelConfig(path=args.policy, dtype="bfloat16"), engine_config,
                          total_optimizer_steps=10)
    report["bf16_param_dtypes"] = sorted({str(p.dtype) for p in bf16.module.parameters()})
    report["bf16_grad_buffer_dtypes"] = sorted({str(p.main_grad.dtype) for p in bf16.module.parameters()})
    report["fp32_losses"] = [metrics["loss"]] + [
        policy.train_mini_batch(batch, nll_with_entropy_bonus, temperature=TEMPERATURE)[0]["loss"]
        for _ in range(args.bf16_steps - 1)
    ]
    report["bf16_losses"] = [bf16.train_mini_batch(batch, nll_with_entropy_bonus, temperature=TEMPERATURE)[0]["loss"]
                             for _ in range(args.bf16_steps)]
    # Token-budget micro-batches: a step of fewer tokens runs fewer micro-batches than the steps before it, with
    # gradients reduced in overlapped buckets (megatron issues each bucket's reduction in the last micro-batch).
    fewer = batch.select(list(range(len(batch) // 2)))
    budget = engine_config.max_token_len_per_rank
    report["micro_batches"] = [len(padded_micro_batches(list(range(len(b))), b.sequence_lengths_B, budget))
                               for b in (batch, fewer)]
    report["fewer_micro_batches_loss"] = policy.train_mini_batch(fewer, nll_with_entropy_bonus,
                                                                 temperature=TEMPERATURE)[0]["loss"]
report["offload_bytes"] = policy.memory.offload()  # device bytes freed, per category
report["param_count"] = sum(p.numel() for p in policy.module.parameters())
report["grad_buckets"] = sum(len(buffer.buckets) for buffer in policy.model.buffers)
if dist.get_rank() == 0:
    print_report(report)
finish_process()
