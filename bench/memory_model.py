"""Per-GPU memory of Llama-2 70B PPO (actor, reference, critic, vLLM at TP_r=8) at TP8xPP4, on paper.

    python bench/memory_model.py

Bytes per parameter are those of megarl's GPU recipe: bf16 weights, fp32 gradient buffers
(`grad_reduce_in_fp32`, set for bf16), megatron's distributed optimizer (fp32 main parameters and
Adam's two moments, sharded over DP). `bench/memory_scaling.py` measures the same categories on a
104M model in fp32 and prints this table after its own, with the bytes per parameter it measured.

Assumptions, each one line of the table: a micro-batch of 4,096 tokens, full recomputation of each
layer (megarl's `recompute_activations`: every layer's input is kept, one layer's activations are
rebuilt in backward), no sequence parallelism (megarl does not enable it), flash attention (no s^2
scores), 1F1B (the first stage holds PP micro-batches in flight), vLLM asleep at level 2 during
training, and 3 GB for the CUDA context, NCCL buffers and allocator slack.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int

    @property
    def layer_params(self) -> int:
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        return attention + 3 * self.hidden * self.ffn + 2 * self.hidden  # q, o, k, v; gate, up, down; 2 norms

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + 2 * self.vocab * self.hidden + self.hidden  # untied

    def first_stage_params(self, tp: int, pp: int) -> float:
        """Parameters on one GPU of the first pipeline stage (the largest: layers plus the embedding)."""
        return (self.layers // pp * self.layer_params + self.vocab * self.hidden) / tp


LLAMA2_70B = Model("Llama-2-70B", hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=32000)

WEIGHT_BYTES, GRAD_BYTES, MAIN_PARAM_BYTES, ADAM_BYTES = 2, 4, 4, 8
"""bf16 weights, fp32 gradient buffer, fp32 main parameters and Adam moments (the last two / DP)."""
TP, PP, TP_R, MICRO_BATCH_TOKENS, RESERVED_GB, GPU_GB = 8, 4, 8, 4096, 3.0, 80.0


def trained_bytes_per_param(dp: int) -> dict[str, float]:
    return {"weights": WEIGHT_BYTES, "grads": GRAD_BYTES, "optimizer": (MAIN_PARAM_BYTES + ADAM_BYTES) / dp}


def activations_gb(model: Model) -> float:
    """First stage, full recompute: PP micro-batches' layer inputs (bf16, replicated over TP without
    sequence parallelism) + one layer's activations rebuilt in backward (Korthikanti et al. 2022,
    s*b*h*(10 + 24/t) bytes with flash attention)."""
    stored = PP * (model.layers // PP) * MICRO_BATCH_TOKENS * model.hidden * 2
    rebuilt = MICRO_BATCH_TOKENS * model.hidden * (10 + 24 / TP)
    return (stored + rebuilt) / GB


def kv_bytes_per_token(model: Model) -> float:
    """One GPU's KV cache per token at TP_r: K and V of every layer, its share of the KV heads, bf16."""
    return 2 * model.layers * (model.kv_heads / TP_R) * (model.hidden // model.heads) * 2


def table(model: Model, dp: int) -> list[str]:
    """The per-GPU memory of one first-stage GPU in each phase, offload off and on."""
    shard = model.first_stage_params(TP, PP)
    per_param = trained_bytes_per_param(dp)
    trained = sum(per_param.values()) * shard / GB
    reference = WEIGHT_BYTES * shard / GB
    engine = WEIGHT_BYTES * model.params / TP_R / GB
    activations = activations_gb(model)
    megatron = 2 * trained + reference  # actor, critic, reference
    lines = [
        f"{model.name} ({model.params / 1e9:.2f}B parameters) PPO at TP{TP}xPP{PP}xDP{dp} "
        f"({TP * PP * dp} GPUs of {GPU_GB:.0f} GB), vLLM at TP_r={TP_R}; per GPU of the first stage, "
        f"{shard / 1e9:.3f}B parameters",
        "| part | bytes per parameter | GB per GPU |",
        "|---|---|---|",
        *(f"| actor {name} | {value:g} | {value * shard / GB:.2f} |" for name, value in per_param.items()),
        f"| critic (as the actor) | {sum(per_param.values()):g} | {trained:.2f} |",
        f"| reference (bf16 weights) | {WEIGHT_BYTES} | {reference:.2f} |",
        f"| activations, micro-batch of {MICRO_BATCH_TOKENS} tokens, full recompute | - | {activations:.2f} |",
        f"| vLLM weights (bf16 / TP_r) | {WEIGHT_BYTES}/{TP_R} of all {model.params / 1e9:.1f}B | {engine:.2f} |",
        f"| CUDA context, NCCL, allocator slack | - | {RESERVED_GB:.2f} |",
    ]
    training = megatron + activations + RESERVED_GB
    lines.append(f"| training phase, offload off or on (vLLM asleep) | - | {training:.2f} "
                 f"({'fits' if training <= GPU_GB else 'does NOT fit'}) |")
    # With offload the actor's weights stay until the sync has read them; then only the engine is left.
    for offload, resident in (("off: Megatron state resident", megatron), ("on: Megatron state offloaded", 0.0)):
        kv_gb = GPU_GB - resident - engine - RESERVED_GB
        tokens = kv_gb * GB / kv_bytes_per_token(model)
        verdict = f"KV cache {kv_gb:.1f} GB = {tokens / 1e3:,.0f}K tokens" if kv_gb > 0 else "does NOT fit"
        peak = resident + engine + RESERVED_GB
        lines.append(f"| rollout phase, offload {offload} | - | {peak:.2f} + KV: {verdict} |")
    return lines


def main() -> None:
    for dp in (4, 1):
        print("\n".join(table(LLAMA2_70B, dp)))
        print()


if __name__ == "__main__":
    main()
