"""Resharding at scale, on paper: Megatron training layouts synced into colocated vLLM engines.

    python bench/resharding_cost_model.py

Dense: Llama-2 7B and 70B trained at TP8xPP4 (32 GPUs, 4 nodes of 8) into engines at TP_r=8, next
to HybridFlow's published transition numbers. Mixture of experts: Qwen3-30B-A3B and
Qwen3-235B-A22B at the layouts NeMo-RL publishes refit times for, next to those times; and the
frontier models at the layouts their RL frameworks publish, in bf16 on H100 (see `SCENARIOS`):
DeepSeek-V3 671B at NeMo-RL's TP1xPP16xEP16 on 256 GPUs (3 layers on the first stage, 2 on the
last) into engines at TP_r=32, as NeMo-RL runs it (at TP_r=16 its weights alone would be 84 GB a
GPU); Kimi-K2 1T at the same layout and TP_r=32; GLM-4.5 355B at slime's TP8xPP4xCP2xEP16 on 64
GPUs into engines of 32 GPUs. Their published times are measured otherwise (FP8 weights from host
memory for checkpoint-engine, SGLang for slime): context, as the table says.

Bytes are not estimated: megarl's own planner (`megarl.resharding.plan.plan_for_rank`) plans the
sync, from the slices every training rank holds (megatron-core's split of each HF tensor, read from
the state-dict adapter's rules: TP for dense weights, shared experts and multi-latent attention
(megatron's local layer spec splits its down projections too, Transformer Engine's keeps them whole:
the same at TP1), expert TP x EP for routed experts, the layers of the pipeline stage, dense or MoE)
to the slices every engine rank needs (vLLM's TP split, `engine_needs`). Only the shard shapes are
computed here, since these models cannot be built on this machine;
tests/distributed/scripts/hf_roundtrip.py checks them against built models of every family. Each
rank plans what it receives from the ranks that together hold one copy of the model: its dense DP
replica (TP x PP ranks) for dense weights, its expert-DP replica (expert TP x EP x PP ranks) for experts.

Time = efficiency x link time of the busiest link, where the link time puts each transfer on
NVLink (same node) or the node's network (across nodes, shared by the node's 8 GPUs; the two
overlap), and the efficiency is calibrated on CPU: megarl's transfer time over one all-gather of
the same bytes on the same ranks, measured by bench/resharding.py (run first when its results are
missing). vLLM's weight processing is not modelled: on CPU it is oneDNN repacking, which GPUs do
not do. The same link model prices the all-gather designs HybridFlow compares with (its Table 2:
DeepSpeed-Chat gathers the whole model on every GPU; at DP=1 HybridFlow-V gathers the same).
The three frontier models take about eight CPU minutes to plan (Kimi-K2: 256 ranks, each needing a
slice of 70,000 HF tensors).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
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
DEEPSEEK_V3 = dict(  # huggingface.co/deepseek-ai/DeepSeek-V3/config.json, the fields that matter here
    architectures=["DeepseekV3ForCausalLM"], hidden_size=7168, num_hidden_layers=61, first_k_dense_replace=3,
    num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
    n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, topk_method="noaux_tc", scoring_func="sigmoid",
    norm_topk_prob=True, routed_scaling_factor=2.5, vocab_size=129280, max_position_embeddings=163840,
    rms_norm_eps=1e-6, rope_theta=10000.0, num_nextn_predict_layers=1,
    rope_scaling=dict(type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                      mscale=1.0, mscale_all_dim=1.0))
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
    # Kimi-K2 (moonshotai/Kimi-K2-Instruct) is DeepSeek-V3's architecture (its config names
    # DeepseekV3ForCausalLM) with these fields; GLM-4.5 is zai-org/GLM-4.5.
    "DeepSeek-V3": DEEPSEEK_V3,
    "Kimi-K2": DEEPSEEK_V3 | dict(first_k_dense_replace=1, num_attention_heads=64, num_key_value_heads=64,
                                 n_routed_experts=384, n_group=1, topk_group=1, vocab_size=163840,
                                 routed_scaling_factor=2.827, max_position_embeddings=131072, rope_theta=50000.0,
                                 num_nextn_predict_layers=0,
                                 rope_scaling=dict(type="yarn", factor=32.0, original_max_position_embeddings=4096,
                                                   beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
    "GLM-4.5": dict(architectures=["Glm4MoeForCausalLM"], hidden_size=5120, num_hidden_layers=92,
                    first_k_dense_replace=3, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                    partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True, intermediate_size=12288,
                    moe_intermediate_size=1536, n_routed_experts=160, n_shared_experts=1, num_experts_per_tok=8,
                    n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, vocab_size=151552,
                    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1000000.0,
                    num_nextn_predict_layers=1),
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
    first_stage_layers: int = 0
    """Layers of the first and of the last pipeline stage (megatron's num_layers_in_first/last_pipeline_stage,
    the middle stages splitting the rest evenly); 0: `stage_layers`' own uneven split."""
    last_stage_layers: int = 0

    def __post_init__(self):
        for name, size in (("tp x pp", self.tp * self.pp), ("etp x ep x pp", self.etp * self.ep * self.pp)):
            if self.world % size:
                raise ValueError(f"{name} = {size} must divide the world of {self.world} GPUs")
        if bool(self.first_stage_layers) != bool(self.last_stage_layers) or (self.first_stage_layers and self.pp < 3):
            raise ValueError("first_stage_layers and last_stage_layers go together, with pp >= 3")

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
        """Layers per pipeline stage: as set by `first_stage_layers` and `last_stage_layers`, else, where
        PP does not divide them, the first and last stages (which also hold the embedding and the LM
        head) take one layer fewer each, then the second and the second-to-last, ..."""
        if self.first_stage_layers:
            middle, middle_stages = num_layers - self.first_stage_layers - self.last_stage_layers, self.pp - 2
            if middle % middle_stages:
                raise ValueError(f"{middle} middle layers do not split evenly over {middle_stages} stages")
            return [self.first_stage_layers, *[middle // middle_stages] * middle_stages, self.last_stage_layers]
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
        stages = (f" ({self.first_stage_layers}/../{self.last_stage_layers} layers)"
                  if self.first_stage_layers else "")
        return f"TP{self.tp}xPP{self.pp}{experts}{stages}, DP{self.dp}, {self.world} GPUs"


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
    # NeMo-RL's DeepSeek-V3 GRPO recipe for 32 nodes of 8 H100 (examples/configs/recipes/llm/performance/
    # grpo-deepseek-v3-32n8g.yaml, docs/about/performance-summary.md v0.4): training [TP1, CP1, EP16, PP16],
    # 3 layers on the first stage and 2 on the last, generation TP32, PR 2808's "PP16xEP16 -> TP32xDP8".
    # Engines of 8 or 16 GPUs cannot hold it: 1.34 TB of bf16 weights are 84 GB a GPU at TP16.
    Scenario("DeepSeek-V3", TrainingLayout(256, tp=1, pp=16, ep=16, first_stage_layers=3, last_stage_layers=2),
             engine_tp=32, published=(
        Published("NeMo-RL PR 2808", "PP16xEP16 -> TP32xDP8", "7.65-9.94 s", NEMO_RL_2808),
        Published("NeMo-RL", "layout not given", "2.39-2.83 s", "DGX-H100, as megarl issue 43 cites it"))),
    # Kimi-K2 on the same 256 GPUs: Megatron-Bridge's Kimi-K2 layout for 256 GPUs (PP16 EP16, its B200
    # recipe in scripts/performance/configs/kimi); its H100 recipe (TP8 PP16 EP64 on 1024 GPUs, pipeline
    # layout "Et|(tt|)*30L": 3 layers on the first stage, 2 on the last) takes half an hour to plan here.
    # 1.03 T parameters on 256 H100 need the optimizer offloaded to the CPU, as slime's examples do.
    # Engines at TP32, the fewest GPUs that hold 2.05 TB of bf16 weights (64 GB a GPU, as many as
    # checkpoint-engine's FP8 weights at TP16).
    Scenario("Kimi-K2", TrainingLayout(256, tp=1, pp=16, ep=16, first_stage_layers=3, last_stage_layers=2),
             engine_tp=32, published=(
        Published("checkpoint-engine", "Kimi-K2-Instruct in FP8 from host memory -> 16 vLLM engines at TP16, "
                  "256 H20", "16.04 s (broadcast), 16.75 s (P2P)",
                  "github.com/MoonshotAI/checkpoint-engine, README, Benchmark"),)),
    # slime's colocated GLM-4.5 example on 8 nodes of 8 H100 (scripts/run-glm4.5-355B-A32B.sh): training
    # TP8 (sequence parallel) PP4 CP2 EP16, expert TP 1; SGLang engines of 32 GPUs (DP attention 4), here
    # vLLM at TP_r=32 (8 KV heads: each on 4 ranks).
    Scenario("GLM-4.5", TrainingLayout(64, tp=8, pp=4, ep=16), engine_tp=32, published=(
        Published("slime", "colocated Megatron -> SGLang, layout not given", "48 s", "as megarl issue 43 cites it"),)),
]
# Published sync times at layouts not planned here: context only, nothing here is computed for them.
UNPLANNED = [
    Published("NeMo-RL v0.3", "DeepSeek-V3, EP64xPP8 -> TP64", "47.2 s",
              "nvidia-nemo.github.io/blog/2025/08/12/nemo-rl-refit-performance, Table 1"),
    Published("slime", "Qwen3-30B-A3B, colocated Megatron -> SGLang, layout not stated", "7 s (from 60 s)",
              "hebiao064.github.io/rl-weight-sync, 'Optimizing Weight Sync in slime'"),
]


def architecture(model: str) -> Architecture:
    return architecture_from_hf({"tie_word_embeddings": False, **HF_CONFIGS[model]}, source=model)


def attention_shard_shapes(arch: Architecture, tp: int) -> dict[str, tuple[int, ...]]:
    """Megatron attention parameter name (within a layer) -> shard shape on one TP rank."""
    h = arch.hidden_size
    if arch.mla:  # megatron's local MLA spec: every projection column-parallel, the latents' norms whole
        mla, heads = arch.mla, arch.num_attention_heads
        q_head_dim = mla.nope_head_dim + mla.rope_head_dim
        shapes = {
            "self_attention.linear_kv_down_proj.weight": ((mla.kv_lora_rank + mla.rope_head_dim) // tp, h),
            "self_attention.kv_layernorm.weight": (mla.kv_lora_rank,),
            "self_attention.linear_kv_up_proj.weight": (heads * (mla.nope_head_dim + mla.v_head_dim) // tp,
                                                        mla.kv_lora_rank),
            "self_attention.linear_proj.weight": (h, heads * mla.v_head_dim // tp),
        }
        if mla.q_lora_rank is None:
            return shapes | {"self_attention.linear_q_proj.weight": (heads * q_head_dim // tp, h)}
        return shapes | {
            "self_attention.linear_q_down_proj.weight": (mla.q_lora_rank // tp, h),
            "self_attention.q_layernorm.weight": (mla.q_lora_rank,),
            "self_attention.linear_q_up_proj.weight": (heads * q_head_dim // tp, mla.q_lora_rank),
        }
    d, qkv_rows = arch.head_dim, (arch.num_attention_heads + 2 * arch.num_kv_heads) * arch.head_dim // tp
    shapes = {
        "self_attention.linear_qkv.weight": (qkv_rows, h),
        "self_attention.linear_proj.weight": (h, arch.num_attention_heads * d // tp),
    }
    if arch.qkv_bias:
        shapes["self_attention.linear_qkv.bias"] = (qkv_rows,)
    if arch.qk_norm:
        shapes |= {"self_attention.q_layernorm.weight": (d,), "self_attention.k_layernorm.weight": (d,)}
    return shapes


def mlp_shard_shapes(arch: Architecture, layout: TrainingLayout, layer: int) -> dict[str, tuple[int, ...]]:
    """Megatron MLP parameter name (within global layer `layer`) -> shard shape: a dense MLP split over
    TP, or a mixture of experts (the router and its correction bias whole; shared experts split over
    TP; `layout.ep` groups of routed experts, each split over `layout.etp` ranks, SequentialMLP names)."""
    h, tp = arch.hidden_size, layout.tp
    if not arch.is_moe_layer(layer):
        f = arch.ffn_hidden_size
        return {"mlp.linear_fc1.weight": (2 * f // tp, h), "mlp.linear_fc2.weight": (h, f // tp)}
    shapes = {"mlp.router.weight": (arch.num_experts, h)}
    if arch.router_bias:
        shapes["mlp.router.expert_bias"] = (arch.num_experts,)  # a buffer, not a parameter
    if arch.shared_expert_ffn_hidden_size:
        f = arch.shared_expert_ffn_hidden_size
        shapes |= {"mlp.shared_experts.linear_fc1.weight": (2 * f // tp, h),
                   "mlp.shared_experts.linear_fc2.weight": (h, f // tp)}
    if arch.shared_expert_gate:
        shapes["mlp.shared_experts.gate_weight"] = (1, h)
    f = arch.moe_ffn_hidden_size
    for j in range(arch.num_experts // layout.ep):
        shapes[f"mlp.experts.local_experts.{j}.linear_fc1.weight"] = (2 * f // layout.etp, h)
        shapes[f"mlp.experts.local_experts.{j}.linear_fc2.weight"] = (h, f // layout.etp)
    return shapes


def stage_shard_shapes(arch: Architecture, layout: TrainingLayout, stage: int) -> dict[str, tuple[int, ...]]:
    """Megatron tensor name -> shard shape on one rank of pipeline `stage`, megatron's local layer spec:
    the parameters and the routers' correction biases (`state_dict_adapter.mapped_tensors`)."""
    h, tp = arch.hidden_size, layout.tp
    stage_layers = layout.stage_layers(arch.num_layers)
    first_layer = sum(stage_layers[:stage])
    attention = attention_shard_shapes(arch, tp)
    shapes = {}
    for i in range(stage_layers[stage]):
        per_layer = {"input_layernorm.weight": (h,), **attention, "pre_mlp_layernorm.weight": (h,),
                     **mlp_shard_shapes(arch, layout, first_layer + i)}
        shapes |= {f"decoder.layers.{i}.{suffix}": shape for suffix, shape in per_layer.items()}
    vocab_rows = padded_vocab_size(arch.vocab_size, 128, tp) // tp
    if stage == 0:
        shapes["embedding.word_embeddings.weight"] = (vocab_rows, h)
    if stage == layout.pp - 1:
        shapes["decoder.final_layernorm.weight"] = (h,)
        if arch.value_model:
            shapes |= {"output_layer.score.weight": (1, h), "output_layer.score.bias": (1,)}
        elif not (arch.tie_word_embeddings and stage == 0):
            # A tied output layer shares the embedding on a one-stage model; the last of several keeps a copy.
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
    plan_seconds: float = 0.0
    """Rank 0's set-up plan on this machine, as the executor makes it: every slice it sends and receives."""


def plan_sync(arch: Architecture, layout: TrainingLayout, engine_tp: int) -> SyncTraffic:
    """Each rank plans what it receives (the planner's receiving side: what it sends is the same
    transfers seen from the other end), over its DP replica and, for routed experts, its expert replica."""
    dense, experts, shard_shapes = {}, {}, {}
    for rank in range(layout.world):
        dense[rank], experts[rank], shapes = rank_sources(arch, layout, rank)
        shard_shapes |= shapes
    hf_shapes = hf_shapes_from([p for pieces in (*dense.values(), *experts.values()) for p in pieces], shard_shapes)
    traffic = SyncTraffic(0, [], [], [0] * layout.world, [0] * layout.world, 0)

    def needs_of(r, names):
        return engine_needs(r, r % engine_tp, engine_tp, hf_shapes, arch, names)

    for rank in range(layout.world):
        plan = plan_for_rank(rank, [p for r in layout.dense_replica(rank) for p in dense[r]],
                             lambda r, names, rank=rank: needs_of(r, names) if r == rank else [], hf_shapes, BF16,
                             expert_replica=[p for r in layout.expert_replica(rank) for p in experts[r]])
        traffic.received.append(plan.bytes_received(rank))
        traffic.lower_bound.append(plan.lower_bound(rank))
        traffic.num_slices += len(plan.transfers)
        for t in plan.transfers:
            if t.src != rank:
                same_node = t.src // GPUS_PER_NODE == rank // GPUS_PER_NODE
                (traffic.intra_node if same_node else traffic.inter_node)[rank] += plan.slice_bytes(
                    t.hf_name, t.dim, t.start, t.stop)
    start = time.perf_counter()
    plan_for_rank(0, [p for r in layout.dense_replica(0) for p in dense[r]], needs_of, hf_shapes, BF16,
                  expert_replica=[p for r in layout.expert_replica(0) for p in experts[r]])
    traffic.plan_seconds = time.perf_counter() - start
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
        print(f"{scenario.model}, {scenario.layout.world} GPUs: rank 0 planned its sync (every slice it sends and "
              f"receives, as at set-up) in {traffic.plan_seconds:.2f} s")
        if arch.is_moe:
            rows.append(report_moe(scenario, traffic, efficiency))
        else:
            report_dense(scenario, traffic, efficiency)
    print("\nMixture of experts on H100, one sync:")
    print_table(["model", "training layout -> colocated engines", "GB/GPU received (lower bound)",
                 "GB into busiest node", "predicted s", "published s"], rows)
    print("\nPublished sync times at layouts not planned here (context, not compared):")
    for published in UNPLANNED:
        print(f"  {published.who}, {published.layouts}: {published.seconds} ({published.source})")


if __name__ == "__main__":
    main()
