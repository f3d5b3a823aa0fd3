"""Building megatron-core GPT models (actor, reference, critic, reward) for an `Architecture`.

The layer spec decides *which* modules implement the layer: megatron-core's local modules on CPU,
Transformer Engine's fused ones where `megarl.device` says TE is usable (`layer_spec="auto"`,
`resolve_layer_spec`). Fused kernels and sequence parallelism follow the device and the layer spec
(`fused_kernels`).

Mixture-of-experts architectures get megatron-core's own MoE layer in every decoder layer past
their dense first ones: a router, the experts (one MLP per local expert with the local spec; grouped
GEMMs over the local experts with Transformer Engine) and the shared experts (Qwen2-MoE's gated).
How they train (token dispatcher, balancing losses, expert bias) is `MoESettings`. Multi-latent
attention (DeepSeek-V3) is megatron-core's MLA, configured by `MLATransformerConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megarl import device
from megarl.distributed.layout import ParallelLayout
from megarl.models.architecture import Architecture, check_layout_fits, padded_vocab_size
from megarl.models.layer_specs import LAYER_SPECS
from megarl.models.local_mla import local_mla_spec
from megarl.models.value_head import GPTValueModel, ValueHead

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ScheduleSettings:
    """How megatron-core's pipeline schedule drives the model: fields of the model's TransformerConfig
    that only the schedule reads, given at build time. The defaults are megatron-core's."""

    variable_seq_lengths: bool = False
    """Each micro-batch has its own length: pipeline stages exchange tensor shapes before tensors."""
    calculate_per_token_loss: bool = False
    """Losses arrive already normalised: the schedule does not divide them by the micro-batch count."""
    finalize_model_grads_func: Callable | None = None
    """Called after the last backward of a step (gradient all-reduces)."""
    grad_scale_func: Callable | None = None
    """Scales the loss before backward (the optimizer's loss scale for fp16)."""


@dataclass(frozen=True)
class MoESettings:
    """How a mixture-of-experts model routes and balances while training (from config `model.moe`);
    ignored by dense models."""

    token_dispatcher: str = "alltoall"
    """How tokens reach the EP ranks holding their experts: "alltoall" sends each token only where it
    is routed; "allgather" gathers every token on every EP rank. The engine trains with "alltoall":
    megatron-core takes "allgather" only with micro-batches of one fixed length."""
    aux_loss_coeff: float = 0.0
    """Weight of the load-balancing auxiliary loss (Switch-Transformer style); 0 disables."""
    z_loss_coeff: float = 0.0
    """Weight of the router z-loss (mean squared log-sum-exp of the router logits); 0 disables."""
    expert_bias: bool = False
    """Aux-loss-free load balancing: a per-expert bias, nudged after every step towards equal load,
    is added to the routing scores for choosing experts (not for weighting them). An architecture
    with a correction bias (DeepSeek-V3, GLM-4.5) starts from its checkpoint's, which stays fixed
    without this; for the others megatron-core supports it with sigmoid scores only, so the router
    then scores experts with a sigmoid (weights renormalised over the chosen experts) instead of the
    checkpoint's softmax."""

    bias_update_rate: float = 1e-3
    """How far one step moves each expert's bias (megatron-core's default)."""


def moe_transformer_fields(arch: Architecture, layout: ParallelLayout, moe: MoESettings,
                           layer_spec: str) -> dict:
    """The TransformerConfig fields of the MoE layers; none for a dense model."""
    if not arch.is_moe:
        # megatron-core rejects variable_seq_lengths with its default MoE token dispatcher
        # ("allgather") even in a dense model, which builds no dispatcher at all.
        return {"moe_token_dispatcher_type": "alltoall"}
    sigmoid = arch.router_score == "sigmoid" or moe.expert_bias
    return dict(
        num_moe_experts=arch.num_experts,
        moe_layer_freq=[0] * arch.dense_layers + [1] * (arch.num_layers - arch.dense_layers),
        moe_router_topk=arch.moe_topk,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=arch.shared_expert_ffn_hidden_size or None,
        moe_shared_expert_gate=arch.shared_expert_gate,
        # Softmax after top-k equals the top-k entries of the full softmax renormalised to sum to one.
        moe_router_pre_softmax=not sigmoid and not arch.moe_norm_topk_prob,
        moe_router_score_function="sigmoid" if sigmoid else "softmax",
        moe_router_enable_expert_bias=arch.router_bias or moe.expert_bias,
        moe_router_bias_update_rate=moe.bias_update_rate if moe.expert_bias else 0.0,
        moe_router_num_groups=arch.router_groups if arch.router_groups > 1 else None,
        moe_router_group_topk=arch.router_group_topk if arch.router_groups > 1 else None,
        moe_router_topk_scaling_factor=arch.routed_scaling_factor if arch.routed_scaling_factor != 1.0 else None,
        # As HF's DeepSeek-V3 and GLM-4.5 routers: scores in float32 whatever the model's dtype.
        moe_router_dtype="fp32" if arch.router_score == "sigmoid" else None,
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        # megatron divides the z-loss weight by TP, but under sequence parallelism (MoE training at TP > 1)
        # each TP rank's router sees only its part of the tokens: the division would shrink the loss TP-fold.
        moe_z_loss_coeff=moe.z_loss_coeff * layout.tp or None,
        moe_token_dispatcher_type=moe.token_dispatcher,
        moe_grouped_gemm=layer_spec == "transformer_engine",
        expert_tensor_parallel_size=layout.etp,
    )


def resolve_layer_spec(layer_spec: str) -> str:
    """"auto" -> Transformer Engine where `megarl.device` says it is usable, megatron's local layers
    elsewhere."""
    if layer_spec not in LAYER_SPECS:
        raise ValueError(f"model.layer_spec={layer_spec!r}; allowed: {', '.join(LAYER_SPECS)}")
    if layer_spec == "auto":
        return "transformer_engine" if device.transformer_engine() else "local"
    if layer_spec == "transformer_engine" and not device.transformer_engine():
        raise ValueError("model.layer_spec='transformer_engine' needs CUDA and `pip install megarl[gpu]`")
    return layer_spec


def fused_kernels(layer_spec: str, tp: int, is_moe: bool = False, rope_fusable: bool = True) -> dict[str, bool]:
    """megatron-core's speed features, on where they run (`layer_spec` resolved):

    - SwiGLU and bias-dropout-add fusions: megatron's own jit-fused functions, on CUDA;
    - RoPE fusion: Transformer Engine's kernels (BSHD and THD), with TE's layers; unfused RoPE on
      packed THD micro-batches syncs with the host in every layer. The local layers keep megatron's
      unfused RoPE on every device. Not `rope_fusable`: multi-latent attention without YaRN, whose
      RoPE megatron-core does not fuse, and a model that shares prompts, whose RoPE takes per-row
      positions (`share_prompt_forward`), which TE's fused kernels do not;
    - gradient-accumulation fusion: TE's layers accumulate weight gradients straight into the
      fp32 `main_grad` buffers; megatron's own output layer then needs Apex's extension for it
      (`device.gradient_accumulation_fusion`), without which megatron refuses to build the model;
    - sequence parallelism at TP > 1: activations outside attention and MLP are split over the
      sequence. With TE's layers; with the local layers for mixture-of-experts models only, which
      megatron-core trains at TP > 1 with it alone (the torch-norm bridge of `cpu_compat`, applied
      on every device, marks their norms' weights). Dense local models keep the path their parity is
      measured on, on CPU and GPU alike (megatron's torch norm asserts sequence parallelism away).
    Masked-softmax and persistent layer-norm fusions stay off: TE's attention and RMSNorm replace
    them, and megatron's local versions need Megatron-LM's own CUDA extensions."""
    cuda, te_layers = device.cuda(), layer_spec == "transformer_engine"
    return {
        "bias_activation_fusion": cuda,
        "bias_dropout_fusion": cuda,
        "apply_rope_fusion": te_layers and rope_fusable,
        "gradient_accumulation_fusion": te_layers and device.gradient_accumulation_fusion(),
        "sequence_parallel": tp > 1 and (te_layers or is_moe),
    }


def attend_under_given_masks(spec: TransformerBlockSubmodules) -> None:
    """Every layer's self-attention applies the mask each forward is given ("arbitrary") instead of its own
    causal one. megatron's local attention already applies a given mask; Transformer Engine's attention
    needs to be told, and then takes a (b, 1, s, s) boolean mask, True where a query may not look."""
    for layer in spec.layer_specs:
        layer.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.arbitrary


def latent_attention_fields(arch: Architecture) -> dict:
    """The MLATransformerConfig fields of multi-latent attention (YaRN's too: MLA applies its RoPE)."""
    mla, yarn = arch.mla, arch.yarn
    fields = dict(
        q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank, qk_head_dim=mla.nope_head_dim,
        qk_pos_emb_head_dim=mla.rope_head_dim, v_head_dim=mla.v_head_dim, rotary_base=arch.rope_theta,
        rope_type="yarn" if yarn else "rope", rotary_scaling_factor=yarn.factor if yarn else 1.0,
    )
    if yarn:
        fields.update(original_max_position_embeddings=yarn.original_max_position_embeddings,
                      beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow, mscale=yarn.mscale,
                      mscale_all_dim=yarn.mscale_all_dim)
    return fields


def transformer_config(
    arch: Architecture, layout: ParallelLayout, dtype: str, recompute_activations: bool = False,
    schedule: ScheduleSettings = ScheduleSettings(), layer_spec: str = "local", moe: MoESettings = MoESettings(),
    shared_prompts: bool = False,
) -> TransformerConfig:
    params_dtype = TORCH_DTYPES[dtype]
    config_class, attention_fields = TransformerConfig, {}
    if arch.mla:
        config_class, attention_fields = MLATransformerConfig, latent_attention_fields(arch)
    return config_class(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads,
        # MLA reads its own head dims; its local core attention takes this as its output's.
        kv_channels=arch.mla.v_head_dim if arch.mla else arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        # MLA's q_layernorm and kv_layernorm normalise its latents.
        qk_layernorm=arch.qk_norm or arch.mla is not None,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.initializer_range,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        # Full recomputation of every layer: activations of one layer input per layer are kept.
        recompute_granularity="full" if recompute_activations else None,
        recompute_method="uniform" if recompute_activations else None,
        recompute_num_layers=1 if recompute_activations else None,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=not device.cuda(),
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        **fused_kernels(layer_spec, layout.tp, arch.is_moe,
                        rope_fusable=(arch.mla is None or arch.yarn is not None) and not shared_prompts),
        **vars(schedule),
        **moe_transformer_fields(arch, layout, moe, layer_spec),
        **attention_fields,
    )


def build_model(
    arch: Architecture,
    layout: ParallelLayout,
    dtype: str = "float32",
    layer_spec: str = "auto",
    make_vocab_size_divisible_by: int = 128,
    recompute_activations: bool = False,
    schedule: ScheduleSettings = ScheduleSettings(),
    moe: MoESettings = MoESettings(),
    shared_prompts: bool = False,
) -> GPTModel:
    """The stage of `arch` that this rank holds: its layers, embedding on the first stage, and the
    output layer (or value head for value models) on the last stage. `shared_prompts`: the model takes
    the shared-prompt layout (`megarl.engine.prompt_sharing`): an attention mask of its own for every row,
    RoPE unfused (positions per row), on either layer spec."""
    check_layout_fits(arch, layout.tp, layout.pp, layout.ep)
    layer_spec = resolve_layer_spec(layer_spec)
    config = transformer_config(arch, layout, dtype, recompute_activations, schedule, layer_spec, moe, shared_prompts)
    # Each layer's spec from the config: MLA or not, dense or MoE (`moe_layer_freq`), this stage's layers.
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=layer_spec == "transformer_engine",
                                      normalization="RMSNorm", pp_rank=layout.pp_rank)
    if arch.mla and layer_spec == "local":
        local_mla_spec(spec)
    if shared_prompts:
        attend_under_given_masks(spec)
    model_class = GPTValueModel if arch.value_model else GPTModel
    model = model_class(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(arch.vocab_size, make_vocab_size_divisible_by, layout.tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=layout.is_first_stage,
        post_process=layout.is_last_stage,
        share_embeddings_and_output_weights=arch.tie_word_embeddings and not arch.value_model,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        rotary_percent=arch.rotary_percent,
        rope_scaling=arch.rope_type == "llama3",
        rope_scaling_factor=arch.rope_factor,
        seq_len_interpolation_factor=arch.rope_factor if arch.rope_type == "linear" else None,
    )
    if arch.value_model and layout.is_last_stage:
        model.output_layer = ValueHead(arch.hidden_size, config.params_dtype, device.compute_device(),
                                       config.sequence_parallel)
    # megatron's torch-norm fallback (the local spec without Apex) makes its weights on the CPU whatever the
    # config says; like Megatron-LM, move the whole model to the rank's device once built.
    return model.to(device.compute_device())
