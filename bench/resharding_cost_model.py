"""Resharding at scale, on paper: Megatron training layouts synced into colocated vLLM engines.

    python bench/resharding_cost_model.py

Dense: Llama-2 7B and 70B trained at TP8xPP4 (32 GPUs, 4 nodes of 8) into engines at TP_r=8, next
to HybridFlow's published transition numbers. Mixture of experts: Qwen3-30B-A3B and
Qwen3-235B-A22B at the layouts NeMo-RL publishes refit times for, next to those times.

Bytes are not estimated: megarl's own planner (`megarl.resharding.plan.plan_for_rank`) plans the
sync, from the slices every training rank holds (megatron-core's split of each HF tensor, read from
the state-dict adapter's rules: TP for dense weights, expert TP x EP for experts, the layers of the
pipeline stage) to the slices every engine rank needs (vLLM's TP split, `engine_needs`). Only the
shard shapes are computed here, since these models cannot be built on this machine;
tests/distributed/scripts/hf_roundtrip.py checks them against built models. Each rank plans what it
receives from the ranks that together hold one copy of the model: its dense DP replica (TP x PP
ranks) for dense weights, its expert-DP replica (expert TP x EP x PP ranks) for experts.

Time = efficiency x link time of the busiest link, where the link time puts each transfer on
NVLink (same node) or the node's network (across nodes, shared by the node's 8 GPUs; the two
overlap), and the efficiency is calibrated on CPU: megarl's transfer time over one all-gather of
the same bytes on the same ranks, measured by bench/resharding.py (run first when its results are
missing). vLLM's weight processing is not modelled: on CPU it is oneDNN repacking, which GPUs do
not do. The same link model prices the all-gather designs HybridFlow compares with (its Table 2:
DeepSpeed-Chat gathers the whole model on every GPU; at DP=1 HybridFlow-V gathers the same).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from megarl.models.architecture import Architecture, architecture_from_hf, padded_vocab_size  # noqa: E402
from megarl.models.state_dict_adapter import param_mapping, shard_pieces, tp_split  # noqa: E402
from megarl.resharding.engine_layout import engine_needs  # noqa: E402
from megarl.resharding.executor import hf_shapes_from  # noqa: E402
from megarl.resharding.plan import SourcePiece, plan_for_rank  # noqa: E402

CPU_RESULTS = ROOT / "outputs/bench/resharding.json"
GPUS_PER_NODE, BF16 = 8, 2
HF_CONFIGS = {  # the HF configs' fields that matter here (huggingface.co/<name>/config.json)
    "Llama-2-7B": dict(architectures=["LlamaForCausalLM"], hidden_size=4096, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008, vocab_size=32000,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0),
    "Llama-2-70B": dict(architectures=["LlamaForCausalLM"], hidden_size=8192, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672, vocab_size=32000,
                        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0),
    "Qwen3-30B-A3B": dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
                          max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0),
    "Qwen3-235B-A22B": dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=4096, num_hidden_layers=94,
                            num_attention_heads=64, num_key_value_heads=4, head_dim=128, intermediate_size=12288,
                            moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                            decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
                            max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0),
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


A100_HYBRIDFLOW = Cluster("HybridFlow's testbed: A100, NVLink 300 GB/s per direction, 200 Gb/s per node",
                          300e9, 200e9 / 8)
H100 = Cluster("H100, NVLink 450 GB/s per direction, 8 x 400 Gb/s per node", 450e9, 8 * 400e9 / 8)


@dataclass(frozen=True)
class RankCoordinates:
    """Where one rank of a `TrainingLayout` sits (named as `ParallelLayout` names them)."""

    tp: int
    tp_rank: int
    etp: int
    etp_rank: int
    ep_rank: int
    pp_rank: int


@dataclass(frozen=True)
class TrainingLayout:
    """Megatron-core's rank order (tp-cp-ep-dp-pp): pipeline stages outermost; within a stage, dense
    weights are split over TP (fastest) and replicated over DP (context parallelism replicates them
    too: count its ranks in DP), experts split over expert TP (fastest) and EP and replicated over
    expert DP."""

    world: int
    tp: int
    pp: int
    ep: int = 1
    etp: int = 1

    def __post_init__(self):
        for name, size in (("tp x pp", self.tp * self.pp), ("etp x ep x pp", self.etp * self.ep * self.pp)):
            if self.world % size:
                raise ValueError(f"{name} = {size} must divide the world of {self.world} GPUs")

    @property
    def stage_size(self) -> int:
        return self.world // self.pp

    def coordinates(self, rank: int) -> RankCoordinates:
        within_stage = rank % self.stage_size
        return RankCoordinates(self.tp, rank % self.tp, self.etp, rank % self.etp,
                               within_stage // self.etp % self.ep, rank // self.stage_size)

    @property
    def dp(self) -> int:
        return self.stage_size // self.tp

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers per pipeline stage. Where PP does not divide them, the first and last stages (which
        also hold the embedding and the LM head) take one layer fewer each, then the second and the
        second-to-last, ... (megatron's uneven split, set by its num_layers_in_first/last_pipeline_stage)."""
        per_stage = -(-num_layers // self.pp)
        layers = [per_stage] * self.pp
        for i in range(per_stage * self.pp - num_layers):
            layers[i // 2 if i % 2 == 0 else self.pp - 1 - i // 2] -= 1
        return layers

    def dense_replica(self, rank: int) -> list[int]:
        """The TP x PP ranks holding one copy of the dense weights with `rank`."""
        dp_rank = rank % self.stage_size // self.tp
        return [stage * self.stage_size + dp_rank * self.tp + t for stage in range(self.pp) for t in range(self.tp)]

    def expert_replica(self, rank: int) -> list[int]:
        """The expert TP x EP x PP ranks holding one copy of the experts with `rank`."""
        group = self.etp * self.ep
        first = rank % self.stage_size // group * group
        return [stage * self.stage_size + first + i for stage in range(self.pp) for i in range(group)]

    def __str__(self) -> str:
        experts = f"xEP{self.ep} (expert TP {self.etp})" if self.ep > 1 else ""
        return f"TP{self.tp}xPP{self.pp}{experts}, DP{self.dp}, {self.world} GPUs"


@dataclass(frozen=True)
class Published:
    who: str
    layouts: str
    seconds: str
    source: str


@dataclass(frozen=True)
class Scenario:
    model: str
    layout: TrainingLayout
    engine_tp: int
    published: tuple[Published, ...] = ()


# NeMo-RL's published refit times (colocated Megatron -> vLLM, bf16, on DGX-H100, per step), in PR 2808
# "NCCL-Xfer refit" (github.com/NVIDIA-NeMo/RL/pull/2808, the same table in PR 2413) and in PR 2971
# "NCCL-Reshard refit" (its Python fallback path), layouts written as they write them.
NEMO_RL_2808 = "github.com/NVIDIA-NeMo/RL/pull/2808, NCCL-Xfer refit, DGX-H100"
NEMO_RL_2971 = "github.com/NVIDIA-NeMo/RL/pull/2971, NCCL-Reshard refit, Python fallback path, DGX-H100"
# Expert TP is 1 throughout (at TP4xPP8xEP16 on 128 GPUs nothing else fits); context parallelism
# replicates weights like DP, so TP2xCP2xEP8 on 16 GPUs is TP2xEP8 here.
SCENARIOS = [
    Scenario("Llama-2-7B", TrainingLayout(32, tp=8, pp=4), engine_tp=8),
    Scenario("Llama-2-70B", TrainingLayout(32, tp=8, pp=4), engine_tp=8),
    # NeMo-RL's GRPO recipe for 4 nodes of 8 H100 (docs/about/performance-summary.md, v0.4): training
    # [TP2, CP1, EP8, PP1], generation TP4. It publishes step times, not refit times.
    Scenario("Qwen3-30B-A3B", TrainingLayout(32, tp=2, pp=1, ep=8), engine_tp=4),
    Scenario("Qwen3-30B-A3B", TrainingLayout(16, tp=2, pp=1, ep=8), engine_tp=4, published=(
        Published("NeMo-RL PR 2971", "TP2xCP2xEP8 -> TP4xDP4", "1.02-1.45 s", NEMO_RL_2971),)),
    Scenario("Qwen3-30B-A3B", TrainingLayout(16, tp=1, pp=2, ep=8), engine_tp=8, published=(
        Published("NeMo-RL PR 2808", "EP8xPP2 -> TP8xDP2", "0.50-0.51 s", NEMO_RL_2808),
        Published("NeMo-RL PR 2971", "EP8xPP2 -> TP8xDP2", "0.74-1.00 s", NEMO_RL_2971))),
    Scenario("Qwen3-235B-A22B", TrainingLayout(128, tp=4, pp=8, ep=16), engine_tp=8, published=(
        Published("NeMo-RL PR 2808", "TP4xPP8xEP16 -> TP8xDP16", "4.56-4.85 s", NEMO_RL_2808),)),
]
# Published sync times of models megarl cannot plan (DeepSeek-V3's MLA, GLM-4.5's dense first layers
# and shared expert are not megarl architectures): context only, nothing here is computed for them.
UNPLANNED = [
    Published("NeMo-RL PR 2808", "DeepSeek-V3, PP16xEP16 -> TP32xDP8", "7.65-9.94 s", NEMO_RL_2808),
    Published("NeMo-RL v0.3", "DeepSeek-V3, EP64xPP8 -> TP64", "47.2 s",
              "nvidia-nemo.github.io/blog/2025/08/12/nemo-rl-refit-performance, Table 1"),
    Published("slime", "Qwen3-30B-A3B, colocated Megatron -> SGLang, layout not stated", "7 s (from 60 s)",
              "hebiao064.github.io/rl-weight-sync, 'Optimizing Weight Sync in slime'"),
]


def architecture(model: str) -> Architecture:
    return architecture_from_hf({"tie_word_embeddings": False, **HF_CONFIGS[model]}, source=model)


def stage_shard_shapes(arch: Architecture, layout: TrainingLayout, stage: int) -> dict[str, tuple[int, ...]]:
    """Megatron parameter name -> shard shape on one rank of pipeline `stage` (local layer spec:
    SequentialMLP experts, `layout.ep` groups of experts, each expert split over `layout.etp` ranks)."""
    h, d, tp = arch.hidden_size, arch.head_dim, layout.tp
    per_layer = {
        "input_layernorm.weight": (h,),
        "self_attention.linear_qkv.weight": ((arch.num_attention_heads + 2 * arch.num_kv_heads) * d // tp, h),
        "self_attention.linear_proj.weight": (h, arch.num_attention_heads * d // tp),
        "pre_mlp_layernorm.weight": (h,),
    }
    if arch.qk_norm:
        per_layer |= {"self_attention.q_layernorm.weight": (d,), "self_attention.k_layernorm.weight": (d,)}
    if arch.is_moe:
        f = arch.moe_ffn_hidden_size
        per_layer["mlp.router.weight"] = (arch.num_experts, h)
        for j in range(arch.num_experts // layout.ep):
            per_layer[f"mlp.experts.local_experts.{j}.linear_fc1.weight"] = (2 * f // layout.etp, h)
            per_layer[f"mlp.experts.local_experts.{j}.linear_fc2.weight"] = (h, f // layout.etp)
    else:
        f = arch.ffn_hidden_size
        per_layer |= {"mlp.linear_fc1.weight": (2 * f // tp, h), "mlp.linear_fc2.weight": (h, f // tp)}
    shapes = {f"decoder.layers.{i}.{suffix}": shape for i in range(layout.stage_layers(arch.num_layers)[stage])
              for suffix, shape in per_layer.items()}
    vocab_rows = padded_vocab_size(arch.vocab_size, 128, tp) // tp
    if stage == 0:
        shapes["embedding.word_embeddings.weight"] = (vocab_rows, h)
    if stage == layout.pp - 1:
        shapes["decoder.final_layernorm.weight"] = (h,)
        shapes["output_layer.weight"] = (vocab_rows, h)
    return shapes


def rank_sources(arch: Architecture, layout: TrainingLayout, rank: int
                 ) -> tuple[list[SourcePiece], list[SourcePiece], dict]:
    """The HF slices `rank` holds, dense and expert apart, and its shard shapes."""
    at = layout.coordinates(rank)
    stage_layers = layout.stage_layers(arch.num_layers)
    first_layer = sum(stage_layers[:at.pp_rank])
    layer_numbers = {i: first_layer + i for i in range(stage_layers[at.pp_rank])}
    expert_offset = at.ep_rank * (arch.num_experts // layout.ep)
    dense, experts, shard_shapes = [], [], {}
    for name, shape in stage_shard_shapes(arch, layout, at.pp_rank).items():
        shard_shapes[(rank, name)] = shape
        mapping = param_mapping(name, arch, layer_numbers, expert_offset)
        offset = 0
        for piece in shard_pieces(mapping, arch, shape, *tp_split(mapping, at)):
            if piece.hf_name is not None:
                source = SourcePiece(rank, piece.hf_name, piece.dim, piece.start, piece.stop, name, offset)
                (experts if mapping.expert else dense).append(source)
            offset += piece.size
    return dense, experts, shard_shapes


@dataclass
class SyncTraffic:
    """What every rank receives in one sync, as megarl's planner plans it."""

    model_bytes: int
    received: list[int]
    lower_bound: list[int]
    inter_node: list[int]
    intra_node: list[int]
    num_slices: int


def plan_sync(arch: Architecture, layout: TrainingLayout, engine_tp: int) -> SyncTraffic:
    """Each rank plans what it receives (the planner's receiving side: what it sends is the same
    transfers seen from the other end), over its DP replica and, for routed experts, its expert replica."""
    dense, experts, shard_shapes = {}, {}, {}
    for rank in range(layout.world):
        dense[rank], experts[rank], shapes = rank_sources(arch, layout, rank)
        shard_shapes |= shapes
    hf_shapes = hf_shapes_from([p for pieces in (*dense.values(), *experts.values()) for p in pieces], shard_shapes)
    traffic = SyncTraffic(0, [], [], [0] * layout.world, [0] * layout.world, 0)
    for rank in range(layout.world):
        needs = engine_needs(rank, rank % engine_tp, engine_tp, hf_shapes, arch)
        plan = plan_for_rank(rank, [p for r in layout.dense_replica(rank) for p in dense[r]],
                             lambda r, rank=rank: needs if r == rank else [], hf_shapes, BF16,
                             expert_replica=[p for r in layout.expert_replica(rank) for p in experts[r]])
        traffic.received.append(plan.bytes_received(rank))
        traffic.lower_bound.append(plan.lower_bound(rank))
        traffic.num_slices += len(plan.transfers)
        for t in plan.transfers:
            if t.src != rank:
                same_node = t.src // GPUS_PER_NODE == rank // GPUS_PER_NODE
                (traffic.intra_node if same_node else traffic.inter_node)[rank] += plan.slice_bytes(
                    t.hf_name, t.dim, t.start, t.stop)
    traffic.model_bytes = sum(plan.slice_bytes(name, 0, 0, shape[0]) for name, shape in hf_shapes.items())
    return traffic


def node_ingress(inter_node_per_gpu: list[float]) -> list[float]:
    return [sum(inter_node_per_gpu[n:n + GPUS_PER_NODE]) for n in range(0, len(inter_node_per_gpu), GPUS_PER_NODE)]


def link_seconds(inter_node_per_gpu: list[float], intra_node_per_gpu: list[float], cluster: Cluster) -> float:
    """Busiest link: a node's network carries its GPUs' inter-node bytes; NVLink each GPU's own."""
    return max(max(node_ingress(inter_node_per_gpu)) / cluster.node_network_bytes_per_s,
               max(intra_node_per_gpu) / cluster.nvlink_bytes_per_s)


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


def describe(scenario: Scenario, traffic: SyncTraffic) -> str:
    layout = scenario.layout
    return (f"{scenario.model}: {traffic.model_bytes / 1e9:.1f} GB of weights; training {layout} -> "
            f"{layout.world // scenario.engine_tp} vLLM engines at TP_r={scenario.engine_tp}; "
            f"{traffic.num_slices:,} slices")


def report_dense(scenario: Scenario, traffic: SyncTraffic, efficiency: float) -> None:
    layout = scenario.layout
    model_parallel = layout.tp * layout.pp
    formula = (model_parallel - scenario.engine_tp) / (scenario.engine_tp * model_parallel) * traffic.model_bytes
    print(f"\n{describe(scenario, traffic)}\n  per GPU megarl's plan receives {max(traffic.received) / 1e9:.3f} GB "
          f"(lower bound {max(traffic.lower_bound) / 1e9:.3f} GB; HybridFlow Table 2 (tp - t_g p_g) / (t_g p_g t p) M "
          f"= {formula / 1e9:.3f} GB)")
    for cluster in (A100_HYBRIDFLOW, H100):
        ours = efficiency * link_seconds(traffic.inter_node, traffic.intra_node, cluster)
        gathered = link_seconds(*all_gather_traffic(traffic.model_bytes, layout.world), cluster)
        print(f"  {cluster.name}:\n    predicted megarl sync {ours:.2f} s; all-gather of the whole model "
              f"(DeepSpeed-Chat, HybridFlow-V) {gathered:.2f} s; reduction {1 - ours / gathered:.1%} "
              f"(HybridFlow reports {HYBRIDFLOW_REDUCTION['average']:.1%} on average, "
              f"{HYBRIDFLOW_REDUCTION['70B, best']:.1%} at best for 70B)")


def report_moe(scenario: Scenario, traffic: SyncTraffic, efficiency: float) -> list[str]:
    """Prints the details; returns the row of the summary table."""
    link = link_seconds(traffic.inter_node, traffic.intra_node, H100)
    busiest_node = max(node_ingress(traffic.inter_node))
    print(f"\n{describe(scenario, traffic)}\n  per GPU megarl's plan receives {max(traffic.received) / 1e9:.3f} GB "
          f"(busiest; lower bound {max(traffic.lower_bound) / 1e9:.3f} GB; mean "
          f"{sum(traffic.received) / len(traffic.received) / 1e9:.3f} GB), of which at most "
          f"{max(traffic.inter_node) / 1e9:.3f} GB across nodes; into the busiest node {busiest_node / 1e9:.1f} GB, "
          f"busiest NVLink {max(traffic.intra_node) / 1e9:.2f} GB\n  {H100.name}: predicted megarl sync "
          f"{efficiency * link:.2f} s ({link:.3f} s of link time x {efficiency:.2f})")
    for published in scenario.published:
        print(f"  published: {published.who}, {published.layouts}: {published.seconds} ({published.source})")
    published = "; ".join(f"{p.seconds} ({p.who})" for p in scenario.published)
    return [scenario.model, f"{scenario.layout} -> TP_r={scenario.engine_tp}",
            f"{max(traffic.received) / 1e9:.2f} ({max(traffic.lower_bound) / 1e9:.2f})",
            f"{busiest_node / 1e9:.0f}", f"{efficiency * link:.2f}", published or "-"]


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def main() -> None:
    efficiency = cpu_efficiency()
    print(f"bf16 weights, colocated vLLM engines, {GPUS_PER_NODE} GPUs per node; calibration from CPU "
          f"(bench/resharding.py): megarl transfer / all-gather of the same bytes = {efficiency:.2f}")
    rows = []
    for scenario in SCENARIOS:
        arch = architecture(scenario.model)
        traffic = plan_sync(arch, scenario.layout, scenario.engine_tp)
        if arch.is_moe:
            rows.append(report_moe(scenario, traffic, efficiency))
        else:
            report_dense(scenario, traffic, efficiency)
    print("\nMixture of experts on H100, one sync:")
    print_table(["model", "training layout -> colocated engines", "GB/GPU received (lower bound)",
                 "GB into busiest node", "predicted s", "published s"], rows)
    print("\nPublished sync times of models megarl cannot plan (context, not compared):")
    for published in UNPLANNED:
        print(f"  {published.who}, {published.layouts}: {published.seconds} ({published.source})")


if __name__ == "__main__":
    main()
