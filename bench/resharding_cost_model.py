"""Resharding at scale, on paper: Llama-2 7B and 70B trained at TP8xPP4 (32 GPUs, 4 nodes of 8)
synced into vLLM engines at TP_r=8 (one per node), next to HybridFlow's published transition numbers.

    python bench/resharding_cost_model.py

Bytes are not estimated: megarl's own planner (`megarl.resharding.plan.plan_for_rank`) plans the sync,
from the slices every training rank holds (megatron-core's TP split of each HF tensor, read from
the state-dict adapter's rules, and the layers of its pipeline stage) to the slices every engine
rank needs (vLLM's TP split). Only the shard shapes are computed here, since a 70B model cannot be
built on this machine; tests/distributed/scripts/hf_roundtrip.py checks them against built models.

Time = efficiency x link time of the busiest link, where the link time puts each transfer on
NVLink (same node) or the node's network (across nodes, shared by the node's 8 GPUs; the two
overlap), and the efficiency is calibrated on CPU: megarl's transfer time over one all-gather of
the same bytes on the same ranks, measured by bench/resharding.py (run first when its results are
missing). vLLM's weight processing is not modelled: on CPU it is oneDNN repacking, which GPUs do
not do. The same link model prices the all-gather designs HybridFlow compares with (its Table 2:
DeepSpeed-Chat gathers the whole model on every GPU; at DP=1 HybridFlow-V gathers the same).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from megarl.models.architecture import Architecture, architecture_from_hf, padded_vocab_size  # noqa: E402
from megarl.models.state_dict_adapter import param_mapping, shard_pieces  # noqa: E402
from megarl.resharding.engine_layout import engine_needs  # noqa: E402
from megarl.resharding.executor import hf_shapes_from  # noqa: E402
from megarl.resharding.plan import Plan, SourcePiece, merge_plans, plan_for_rank  # noqa: E402

CPU_RESULTS = ROOT / "outputs/bench/resharding.json"
GPUS_PER_NODE, TRAIN_TP, TRAIN_PP, ENGINE_TP, BF16 = 8, 8, 4, 8, 2
LLAMA2 = {  # the HF configs' fields that matter here
    "Llama-2-7B": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       intermediate_size=11008),
    "Llama-2-70B": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                        intermediate_size=28672),
}
# HybridFlow (Sheng et al., EuroSys 2025, arXiv 2409.19256), section 8.4: the 3D-HybridEngine cuts
# the actor's training -> generation transition time by 55.2% on average and by up to 89.1% (70B)
# against DeepSpeed-Chat, OpenRLHF and NeMo-Aligner, on 16 nodes of 8 A100-80GB (600 GB/s NVLink,
# 200 Gb/s between nodes). The absolute seconds are only in its Figure 13.
HYBRIDFLOW_REDUCTION = {"average": 0.552, "70B, best": 0.891}


@dataclass(frozen=True)
class Cluster:
    name: str
    nvlink_bytes_per_s: float
    """Per GPU, one direction."""
    node_network_bytes_per_s: float
    """Per node, into the node."""


CLUSTERS = [
    Cluster("HybridFlow's testbed: A100, NVLink 300 GB/s per direction, 200 Gb/s per node", 300e9, 200e9 / 8),
    Cluster("H100, NVLink 450 GB/s per direction, 8 x 400 Gb/s per node", 450e9, 8 * 400e9 / 8),
]


def llama2(name: str) -> Architecture:
    return architecture_from_hf({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000,
                                 "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                                 "tie_word_embeddings": False, **LLAMA2[name]}, source=name)


def stage_shard_shapes(arch: Architecture, tp: int, pp: int, stage: int) -> dict[str, tuple[int, ...]]:
    """Megatron parameter name -> shard shape on one TP rank of pipeline `stage` (local layer spec)."""
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    per_layer = {
        "input_layernorm.weight": (h,),
        "self_attention.linear_qkv.weight": ((arch.num_attention_heads + 2 * arch.num_kv_heads) * d // tp, h),
        "self_attention.linear_proj.weight": (h, arch.num_attention_heads * d // tp),
        "pre_mlp_layernorm.weight": (h,),
        "mlp.linear_fc1.weight": (2 * f // tp, h),
        "mlp.linear_fc2.weight": (h, f // tp),
    }
    shapes = {f"decoder.layers.{i}.{suffix}": shape for i in range(arch.num_layers // pp)
              for suffix, shape in per_layer.items()}
    vocab_rows = padded_vocab_size(arch.vocab_size, 128, tp) // tp
    if stage == 0:
        shapes["embedding.word_embeddings.weight"] = (vocab_rows, h)
    if stage == pp - 1:
        shapes["decoder.final_layernorm.weight"] = (h,)
        shapes["output_layer.weight"] = (vocab_rows, h)
    return shapes


def training_sources(arch: Architecture, tp: int, pp: int, dp: int = 1, dp_rank: int = 0
                     ) -> tuple[list[SourcePiece], dict]:
    """The HF slices and shard shapes of every training rank of DP replica `dp_rank` (global ranks in
    megatron's order, TP fastest, then DP, then PP)."""
    sources, shard_shapes = [], {}
    layers_per_stage = arch.num_layers // pp
    for stage, tp_rank in itertools.product(range(pp), range(tp)):
        rank = tp_rank + tp * (dp_rank + dp * stage)
        layer_numbers = {i: stage * layers_per_stage + i for i in range(layers_per_stage)}
        for name, shape in stage_shard_shapes(arch, tp, pp, stage).items():
            shard_shapes[(rank, name)] = shape
            offset = 0
            for piece in shard_pieces(param_mapping(name, arch, layer_numbers), arch, shape, tp_rank, tp):
                if piece.hf_name is not None:
                    sources.append(SourcePiece(rank, piece.hf_name, piece.dim, piece.start, piece.stop, name, offset))
                offset += piece.size
    return sources, shard_shapes


def plan_sync(arch: Architecture) -> Plan:
    sources, shard_shapes = training_sources(arch, TRAIN_TP, TRAIN_PP)
    hf_shapes = hf_shapes_from(sources, shard_shapes)

    def needs_of(rank: int):
        return engine_needs(rank, rank % ENGINE_TP, ENGINE_TP, hf_shapes, arch)

    return merge_plans([plan_for_rank(rank, sources, needs_of, hf_shapes, BF16) for rank in range(TRAIN_TP * TRAIN_PP)])


def link_seconds(inter_node_per_gpu: list[float], intra_node_per_gpu: list[float], cluster: Cluster) -> float:
    """Busiest link: a node's network carries its GPUs' inter-node bytes; NVLink each GPU's own."""
    nodes = len(inter_node_per_gpu) // GPUS_PER_NODE
    node_ingress = [sum(inter_node_per_gpu[n * GPUS_PER_NODE:(n + 1) * GPUS_PER_NODE]) for n in range(nodes)]
    return max(max(node_ingress) / cluster.node_network_bytes_per_s,
               max(intra_node_per_gpu) / cluster.nvlink_bytes_per_s)


def plan_traffic(plan: Plan, world: int) -> tuple[list[float], list[float]]:
    """Bytes each rank receives across nodes and within its node."""
    inter, intra = [0.0] * world, [0.0] * world
    for t in plan.transfers:
        if t.src != t.dst:
            size = plan.slice_bytes(t.hf_name, t.dim, t.start, t.stop)
            same_node = t.src // GPUS_PER_NODE == t.dst // GPUS_PER_NODE
            (intra if same_node else inter)[t.dst] += size
    return inter, intra


def all_gather_traffic(model_bytes: float, world: int) -> tuple[list[float], list[float]]:
    """Every GPU gathers the whole model from `world` equal shards (DeepSpeed-Chat; HybridFlow-V at DP=1)."""
    shard = model_bytes / world
    return ([shard * (world - GPUS_PER_NODE)] * world, [shard * (GPUS_PER_NODE - 1)] * world)


def cpu_efficiency() -> float:
    if not CPU_RESULTS.is_file():
        print(f"{CPU_RESULTS} is missing: running bench/resharding.py first ...", flush=True)
        subprocess.run([sys.executable, str(ROOT / "bench/resharding.py")], cwd=ROOT, check=True)
    measured = json.loads(CPU_RESULTS.read_text())
    return measured["transfer_seconds"] / measured["all_gather_seconds"]


def main() -> None:
    efficiency = cpu_efficiency()
    world = TRAIN_TP * TRAIN_PP
    print(f"training TP{TRAIN_TP}xPP{TRAIN_PP} on {world} GPUs ({world // GPUS_PER_NODE} nodes of {GPUS_PER_NODE}) -> "
          f"{world // ENGINE_TP} vLLM engines at TP_r={ENGINE_TP}, bf16; calibration from CPU "
          f"(bench/resharding.py): megarl transfer / all-gather of the same bytes = {efficiency:.2f}")
    for name in LLAMA2:
        arch = llama2(name)
        plan = plan_sync(arch)
        model_bytes = sum(plan.slice_bytes(n, 0, 0, shape[0]) for n, shape in plan.hf_shapes.items())
        received = max(plan.bytes_received(r) for r in range(world))
        lower = max(plan.lower_bound(r) for r in range(world))
        formula = (TRAIN_TP * TRAIN_PP - ENGINE_TP) / (ENGINE_TP * TRAIN_TP * TRAIN_PP) * model_bytes
        print(f"\n{name}: {model_bytes / 1e9:.1f} GB of weights; per GPU megarl's plan receives {received / 1e9:.3f} GB "
              f"(lower bound {lower / 1e9:.3f} GB; HybridFlow Table 2 (tp - t_g p_g) / (t_g p_g t p) M = "
              f"{formula / 1e9:.3f} GB), {len(plan.transfers):,} slices")
        for cluster in CLUSTERS:
            ours = efficiency * link_seconds(*plan_traffic(plan, world), cluster)
            gathered = link_seconds(*all_gather_traffic(model_bytes, world), cluster)
            print(f"  {cluster.name}:\n    predicted megarl sync {ours:.2f} s; all-gather of the whole model "
                  f"(DeepSpeed-Chat, HybridFlow-V) {gathered:.2f} s; reduction {1 - ours / gathered:.1%} "
                  f"(HybridFlow reports {HYBRIDFLOW_REDUCTION['average']:.1%} on average, "
                  f"{HYBRIDFLOW_REDUCTION['70B, best']:.1%} at best for 70B)")


if __name__ == "__main__":
    main()
