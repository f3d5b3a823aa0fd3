"""Per-rank memory and weight-sync bytes of full fine-tuning against LoRA (rank 8 and 64), measured on the ~30M
Qwen2 of bench/common.py and, with the same formula, on paper for Llama-3-70B and Qwen3-235B-A22B.

    python bench/lora_memory.py

Per training rank: trainable parameters, gradient bytes (megatron's DDP keeps a gradient buffer, fp32 at bf16
training, for every trainable parameter of the rank, at any DP), optimizer bytes (megatron's distributed
optimizer: fp32 main parameters and Adam's two moments, 12 bytes a trainable parameter, sharded over DP; expert
parameters over expert DP). Per engine rank at TP_r, the bytes one weight sync moves: full fine-tuning, every
weight; LoRA served merged (W + (alpha / r) B A, megarl's sync), the adapted linears' weights alone, the only
tensors that change between steps; LoRA served as adapters (vLLM's LoRA path: every worker loads the whole
adapter and slices it itself), the adapter's A and B. Weights bf16.

Measured: one torchrun launch per layout (TP1 on 1 process, TP2 and DP2 on 2) builds a `MegatronEngine` in
bf16 without and with LoRA on all seven targets, takes one optimizer step, and counts from the real objects:
parameters with requires_grad, the gradient buffers' `numel_unpadded` times their element size, the optimizer's
main parameters and state tensors (Adam's per-tensor step counters, one scalar each, left out), the HF tensors
`gather_hf_state_dict` serves that changed in the step (an engine at TP_r=1 needs them all), and the tensors of
the PEFT adapter `export_peft` writes. Each is printed beside `footprint`'s number, with their ratio.

On paper (`footprint`, a pure function): the rank of the pipeline stage holding the most parameters; untied
embeddings padded as megatron pads them (to 128 x TP), SwiGLU MLPs; vLLM replicates KV heads when TP_r exceeds
their number. Layouts: Llama-3-70B at TP8xPP2xDP4 on 64 GPUs (a full node per TP group, PP2 to fit the
optimizer), engines at TP_r=8; Qwen3-235B-A22B at TP4xPP8xEP16 (expert TP 1), DP4 on 128 GPUs, engines at
TP_r=8: NeMo-RL's layout, as bench/resharding_cost_model.py takes it. LoRA on MoE models covers the attention
(q, k, v, o) alone, as megarl supports today.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""megarl.models.lora.TARGETS (not imported: the formula stays free of megatron)."""
ROW_TARGETS = ("o_proj", "down_proj")
"""Row-parallel in megatron (input split over TP: A is split, B whole); the others are column-parallel (B split)."""
WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2, 4, 12
"""bf16 weights; fp32 gradient buffers (`grad_reduce_in_fp32`); fp32 main parameters + Adam's two moments."""


# ---- the formula ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Model:
    """A decoder with untied embeddings, RMSNorm and SwiGLU MLPs (every layer dense, or every layer MoE)."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    """Dense MLPs' (unused by MoE models)."""
    vocab_size: int
    num_experts: int = 0
    """Routed experts per layer; 0: a dense model."""
    expert_ffn_hidden_size: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def target_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each LoRA target's HF weight."""
        h, q, kv, f = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.ffn_hidden_size
        shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        if not self.is_moe:
            shapes |= {"gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}
        return shapes


@dataclass(frozen=True)
class Layout:
    """Training TP x PP x DP (MoE: experts over EP x expert TP, replicated over expert DP); engines at TP_r."""

    tp: int
    pp: int
    dp: int
    engine_tp: int
    ep: int = 1
    etp: int = 1
    vocab_multiple: int = 128
    """megarl's `model.make_vocab_size_divisible_by`: the embedding is padded to this times TP."""

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def expert_dp(self) -> int:
        return self.world // (self.pp * self.ep * self.etp)

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers per stage; where PP does not divide them, the end stages (which also hold the embedding and the
        LM head) take one fewer each, then the next ones in (as bench/resharding_cost_model.py splits them)."""
        per_stage = -(-num_layers // self.pp)
        layers = [per_stage] * self.pp
        for i in range(per_stage * self.pp - num_layers):
            layers[i // 2 if i % 2 == 0 else self.pp - 1 - i // 2] -= 1
        return layers

    def __str__(self) -> str:
        experts = f"xEP{self.ep} (expert TP {self.etp})" if self.ep > 1 else ""
        return f"TP{self.tp}xPP{self.pp}{experts}, DP{self.dp}, {self.world} GPUs, engines at TP_r={self.engine_tp}"


@dataclass(frozen=True)
class LoRA:
    rank: int
    targets: tuple[str, ...] = TARGETS


@dataclass(frozen=True)
class Footprint:
    trainable_params: int
    """On one training rank."""
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: float
    sync_bytes: int
    """Per engine rank per step: full, every weight; LoRA, the merged weights of the adapted linears."""
    adapter_sync_bytes: int
    """LoRA served as adapters: the whole adapter, per engine rank per step (0 for full fine-tuning)."""

    @property
    def model_state_bytes(self) -> float:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes


def stage_params(model: Model, layout: Layout, stage: int) -> tuple[int, int]:
    """(dense, expert) parameters one rank of pipeline stage `stage` holds."""
    h, d, t = model.hidden_size, model.head_dim, layout.tp
    qkv_rows = (model.num_heads + 2 * model.num_kv_heads) * d
    split = qkv_rows * h + model.num_heads * d * h + (qkv_rows if model.qkv_bias else 0)  # qkv, o, qkv bias
    replicated = 2 * h + (2 * d if model.qk_norm else 0)  # the layer's two norms (and q_norm, k_norm)
    if model.is_moe:
        replicated += model.num_experts * h  # the router
        experts = model.num_experts // layout.ep * 3 * h * model.expert_ffn_hidden_size // layout.etp
    else:
        split += 3 * h * model.ffn_hidden_size
        experts = 0
    layers = layout.stage_layers(model.num_layers)[stage]
    dense = layers * (split // t + replicated)
    embedding = -(-model.vocab_size // (layout.vocab_multiple * t)) * layout.vocab_multiple * h  # a rank's rows
    dense += embedding * (stage == 0) + (embedding + h) * (stage == layout.pp - 1)  # LM head and final norm
    return dense, layers * experts


def adapter_params(model: Model, layout: Layout, lora: LoRA, stage: int) -> int:
    """LoRA parameters one rank of `stage` holds: the split half of each pair (B of a column-parallel target,
    A of a row-parallel one) is 1/TP of it, the other half whole."""
    unknown = set(lora.targets) - set(model.target_shapes())
    if unknown:
        raise ValueError(f"LoRA targets {sorted(unknown)} are not in {model.name}'s adaptable "
                         f"{sorted(model.target_shapes())}")
    t = layout.tp
    per_layer = sum(lora.rank * (fan_in // t + fan_out if target in ROW_TARGETS else fan_in + fan_out // t)
                    for target, (fan_in, fan_out) in model.target_shapes().items() if target in lora.targets)
    return layout.stage_layers(model.num_layers)[stage] * per_layer


def engine_rank_weights(model: Model, layout: Layout, targets: tuple[str, ...] | None = None) -> int:
    """HF weight elements one engine rank at TP_r holds: every tensor, or only the weights of `targets`."""
    h, d, e = model.hidden_size, model.head_dim, layout.engine_tp
    q_rows, kv_rows = model.num_heads * d // e, max(model.num_kv_heads // e, 1) * d
    f, fe = model.ffn_hidden_size, model.expert_ffn_hidden_size
    weights = {"q_proj": q_rows * h, "k_proj": kv_rows * h, "v_proj": kv_rows * h, "o_proj": q_rows * h}
    if not model.is_moe:
        weights |= {"gate_proj": f // e * h, "up_proj": f // e * h, "down_proj": f // e * h}
    if targets is not None:
        return model.num_layers * sum(weights[target] for target in targets)
    layer = sum(weights.values()) + 2 * h + (q_rows + 2 * kv_rows if model.qkv_bias else 0) \
        + (2 * d if model.qk_norm else 0)
    if model.is_moe:  # the router, replicated; every expert, split over TP_r (no EP in the engine)
        layer += model.num_experts * h + model.num_experts * 3 * h * fe // e
    return model.num_layers * layer + 2 * -(-model.vocab_size // e) * h + h  # embedding, LM head, final norm


def footprint(model: Model, layout: Layout, lora: LoRA | None = None) -> Footprint:
    """The memory of the training rank with the most parameters and the bytes of one weight sync per engine rank,
    for full fine-tuning (`lora` None) or LoRA."""
    stage = max(range(layout.pp), key=lambda s: sum(stage_params(model, layout, s)))
    dense, expert = stage_params(model, layout, stage)
    if lora is None:
        return Footprint(dense + expert, WEIGHT_BYTES * (dense + expert), GRAD_BYTES * (dense + expert),
                         OPTIMIZER_BYTES * (dense / layout.dp + expert / layout.expert_dp),
                         WEIGHT_BYTES * engine_rank_weights(model, layout), 0)
    adapters = adapter_params(model, layout, lora, stage)
    whole_adapter = model.num_layers * sum(lora.rank * (fan_in + fan_out) for target, (fan_in, fan_out)
                                           in model.target_shapes().items() if target in lora.targets)
    return Footprint(adapters, WEIGHT_BYTES * (dense + expert + adapters), GRAD_BYTES * adapters,
                     OPTIMIZER_BYTES * adapters / layout.dp,
                     WEIGHT_BYTES * engine_rank_weights(model, layout, lora.targets), WEIGHT_BYTES * whole_adapter)


LLAMA3_70B = Model("Llama-3-70B", hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                   ffn_hidden_size=28672, vocab_size=128256)
QWEN3_235B = Model("Qwen3-235B-A22B", hidden_size=4096, num_layers=94, num_heads=64, num_kv_heads=4, head_dim=128,
                   ffn_hidden_size=12288, vocab_size=151936, num_experts=128, expert_ffn_hidden_size=1536,
                   qk_norm=True)
PAPER = [(LLAMA3_70B, Layout(tp=8, pp=2, dp=4, engine_tp=8), TARGETS),
         (QWEN3_235B, Layout(tp=4, pp=8, dp=4, engine_tp=8, ep=16), TARGETS[:4])]
RANKS = (8, 64)


# ---- measured: a worker per rank, inside torchrun ----------------------------------------------------

MEASURED_LAYOUTS = {"TP1": (1, 1), "TP2": (2, 2), "DP2": (1, 2)}
"""name: (TP, processes); DP = processes / TP."""


def measure(engine, layout, model_path: str, out: Path) -> dict:
    """One optimizer step on 4 short sequences, and this rank's counts from the engine's objects."""
    import torch

    from megarl.engine.batch import SequenceBatch
    from megarl.models.hf_interop import gather_hf_state_dict
    from megarl.models.peft_adapter import WEIGHTS_FILE, export_peft

    def negative_log_likelihood(outputs, micro_batch, normalizer):
        mask = micro_batch.response_mask_BR.to(outputs["logprobs"].device)
        return -(outputs["logprobs"] * mask).sum() / normalizer.num_tokens, {}

    generator = torch.Generator().manual_seed(0)
    batch = SequenceBatch(torch.randint(5, 100, (4, 20), generator=generator), torch.tensor([4, 6, 3, 5]),
                          torch.tensor([9, 12, 5, 14]))
    before = {name: t.clone() for name, t in gather_hf_state_dict(engine.module, engine.arch, layout).items()}
    engine.train_mini_batch(batch, negative_log_likelihood)
    after = gather_hf_state_dict(engine.module, engine.arch, layout)
    buffers = engine.model.buffers + engine.model.expert_parallel_buffers
    optimizer_bytes, seen = 0, set()
    for optimizer in engine.memory._optimizers():
        tensors = [p for group in optimizer.param_groups for p in group["params"]]
        tensors += [value for state in optimizer.state.values() for key, value in state.items() if key != "step"]
        for tensor in tensors:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                optimizer_bytes += tensor.nbytes
    report = {"trainable": sum(p.numel() for p in engine.module.parameters() if p.requires_grad),
              "grads": sum(b.numel_unpadded * b.grad_data.element_size() for b in buffers),
              "optimizer": optimizer_bytes,
              "sync": sum(t.nbytes for name, t in after.items() if not torch.equal(t, before[name])),
              "served": sum(t.nbytes for t in after.values()), "adapter": 0}
    if engine.adapters:
        export_peft(engine.adapters, engine.adapters[0].settings, layout, out, model_path)
        if layout.rank == 0:
            from safetensors.torch import load_file

            report["adapter"] = sum(t.nbytes for t in load_file(out / WEIGHTS_FILE).values())
    return report


def worker(model_path: str, tp: int, out: Path) -> None:
    from megarl.tracking.console import quiet_third_party_logs

    quiet_third_party_logs()
    import gc

    import torch

    from megarl.config.schema import EngineConfig, LoRAConfig, ModelConfig, OptimizerConfig
    from megarl.distributed import collectives, finish_process, init_layout
    from megarl.engine.megatron_engine import MegatronEngine

    torch.set_num_threads(1)
    layout = init_layout(tp=tp)
    reports = {}
    for rank in (0, *RANKS):
        # lr 1e-3: the default 1e-6 moves few bf16 weights at all (a step below half their last bit is lost).
        config = EngineConfig(micro_batch_size_per_rank=2, optim=OptimizerConfig(lr=1e-3),
                              lora=LoRAConfig(rank=rank, alpha=2.0 * max(rank, 1)))
        engine = MegatronEngine(layout, ModelConfig(path=model_path, dtype="bfloat16", layer_spec="local"), config,
                                total_optimizer_steps=10)
        reports[rank] = measure(engine, layout, model_path, out / f"r{rank}")
        del engine
        gc.collect()
    every_rank = collectives.all_gather_object(reports)
    if layout.rank == 0:
        print("LORA_MEMORY " + json.dumps(every_rank), flush=True)
    finish_process()


# ---- driver -----------------------------------------------------------------------------------------

def bench_model(config: dict) -> Model:
    """The ~30M Qwen2's shapes, read from its HF config (Qwen2: biases on q, k and v)."""
    return Model(config["model_type"], config["hidden_size"], config["num_hidden_layers"],
                 config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
                 config["intermediate_size"], config["vocab_size"], qkv_bias=config["model_type"] == "qwen2")


def config_name(rank: int) -> str:
    return f"LoRA r{rank}" if rank else "full"


def print_measured(results: dict, model: Model) -> None:
    print(f"measured: {model.name} h{model.hidden_size} x {model.num_layers} layers (bf16), one optimizer step; "
          "LoRA on all seven targets; sync = HF tensors that changed (an engine at TP_r=1 needs each whole); "
          "measured (x formula)")
    print(f"{'layout':>6} {'rank':>4} {'config':>9} {'trainable params':>22} {'grads MiB':>16} "
          f"{'optimizer MiB':>16} {'sync MiB':>16} {'adapter-only MiB':>16}")
    worst = 1.0
    for name, ranks in results.items():
        tp, nproc = MEASURED_LAYOUTS[name]
        layout = Layout(tp=tp, pp=1, dp=nproc // tp, engine_tp=1)
        for index, reports in enumerate(ranks):
            for rank_key, report in reports.items():
                rank = int(rank_key)
                paper = footprint(model, layout, LoRA(rank) if rank else None)
                pairs = [(report["trainable"], paper.trainable_params), (report["grads"], paper.grad_bytes),
                         (report["optimizer"], paper.optimizer_bytes), (report["sync"], paper.sync_bytes)]
                if rank and index == 0:
                    pairs.append((report["adapter"], paper.adapter_sync_bytes))
                worst = max([worst] + [abs(m / p - 1) + 1 for m, p in pairs])
                cells = [f"{pairs[0][0]:>13,} ({pairs[0][0] / pairs[0][1]:5.3f})"]
                cells += [f"{m / 2**20:8.2f} ({m / p:5.3f})" for m, p in pairs[1:]]
                print(f"{name:>6} {index:>4} {config_name(rank):>9} " + " ".join(f"{c:>16}" for c in cells))
    print(f"largest |measured / formula - 1|: {worst - 1:.4f}")


def print_paper() -> None:
    for model, layout, targets in PAPER:
        kind = ("all seven targets" if len(targets) == len(TARGETS)
                else "attention only (q, k, v, o): megarl has no LoRA on experts")
        print(f"\non paper: {model.name} at {layout}; bf16; LoRA on {kind}; per GPU of the largest stage")
        print(f"{'config':>9} {'trainable/GPU':>14} {'weights GB':>11} {'grads GB':>9} {'optim GB':>9} "
              f"{'state GB':>9} {'sync GB/engine GPU':>19} {'adapter-only MB':>16}")
        full = footprint(model, layout)
        for rank in (0, *RANKS):
            row = footprint(model, layout, LoRA(rank, targets)) if rank else full
            adapter = f"{row.adapter_sync_bytes / 1e6:16.1f}" if rank else f"{'-':>16}"
            print(f"{config_name(rank):>9} {row.trainable_params:>14,} {row.weight_bytes / 1e9:11.2f} "
                  f"{row.grad_bytes / 1e9:9.3f} {row.optimizer_bytes / 1e9:9.3f} {row.model_state_bytes / 1e9:9.2f} "
                  f"{row.sync_bytes / 1e9:19.2f} {adapter}")
            if rank:
                print(f"{'':>9} x full: state {row.model_state_bytes / full.model_state_bytes:.3f}, "
                      f"merged sync {row.sync_bytes / full.sync_bytes:.3f}, "
                      f"adapter sync {row.adapter_sync_bytes / full.sync_bytes:.5f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paper-only", action="store_true", help="skip the measured launches")
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "TP", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker[0], int(args.worker[1]), Path(args.worker[2]))
    if not args.paper_only:
        from common import ROOT, ensure_bench_model, launch, torchrun

        model_path = ensure_bench_model()
        results = {name: launch(torchrun(nproc) + [__file__, "--worker", str(model_path), str(tp),
                                                   str(ROOT / "outputs/bench/lora_memory" / name)], "LORA_MEMORY")
                   for name, (tp, nproc) in MEASURED_LAYOUTS.items()}
        print_measured(results, bench_model(json.loads((model_path / "config.json").read_text())))
    print_paper()


if __name__ == "__main__":
    main()
