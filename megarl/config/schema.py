"""Typed schema of a megarl run: one dataclass per section, a docstring under every field.

YAML files and dotted CLI overrides are merged onto these dataclasses by `megarl.config.loader`;
everything below the loader receives instances of these classes, never raw dictionaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

# The builder's choices, validated here: the loader checks model.layer_spec against them and the reference
# (megarl.config.reference) spells out the tuples a docstring names.
from megarl.models.layer_specs import LAYER_SPECS  # noqa: F401

DTYPES = ("float32", "bfloat16", "float16")
OPTIMIZERS = ("adam", "sgd")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
KL_CONTROLLERS = ("fixed", "adaptive")
RESUME_MODES = ("auto", "disable", "path")
PLACEMENTS = ("colocated", "split")
LOGGERS = ("console", "mlflow")
PRIME_UPDATES = ("before", "after")
MULTI_TURN_REWARDS = ("environment", "function", "sum")


@dataclass
class MoEConfig:
    """How a mixture-of-experts model routes and balances its experts while training (ignored by
    dense models); becomes `megarl.models.builder.MoESettings`."""

    aux_loss_coeff: float = 0.0
    """Weight of the load-balancing auxiliary loss; 0 disables (1e-2 is a common start)."""

    z_loss_coeff: float = 0.0
    """Weight of the router z-loss (squared log-sum-exp of the router logits); 0 disables."""

    expert_bias: bool = False
    """Aux-loss-free load balancing: a per-expert routing bias nudged towards equal load after every
    step. DeepSeek-V3 and GLM-4.5 checkpoints carry theirs (fixed unless this is on); for the other
    families megatron-core supports it only with sigmoid routing scores, which then replace the
    checkpoint's softmax scores: SFT only, as an RL run's rollout engine routes by the softmax."""

    bias_update_rate: float = 1e-3
    """How far one step moves each expert's bias (with expert_bias)."""


@dataclass
class ModelConfig:
    path: str = MISSING
    """HuggingFace model directory holding config.json and the *.safetensors weights."""

    dtype: str = "float32"
    """Parameter and compute dtype; one of DTYPES."""

    make_vocab_size_divisible_by: int = 128
    """The embedding is padded to a multiple of this value times TP, as in Megatron."""

    layer_spec: str = "auto"
    """Transformer layer implementation, one of LAYER_SPECS; "auto" picks Transformer Engine
    when it is importable and CUDA is present, the local (pure PyTorch) layers otherwise."""

    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-experts training settings."""


@dataclass
class ParallelConfig:
    """Model-parallel sizes; DP is derived as world_size // (tp * pp * cp)."""

    tp: int = 1
    """Tensor-parallel size."""

    pp: int = 1
    """Pipeline-parallel size."""

    cp: int = 1
    """Context-parallel size; only 1 is supported (nothing splits the sequence yet)."""

    ep: int = 1
    """Expert-parallel size: each MoE layer's experts are spread over this many ranks of the DP
    ranks (mixture-of-experts models only)."""

    etp: int = 0
    """Expert tensor-parallel size: each expert's weights are split over this many ranks; 0: same as tp."""


@dataclass
class OptimizerConfig:
    """megatron-core optimizer and learning-rate schedule (warmup, then constant/linear/cosine)."""

    optimizer: str = "adam"
    """One of OPTIMIZERS; "adam" is AdamW (decoupled weight decay)."""

    lr: float = 1e-6
    """Peak learning rate, reached after the warmup."""

    min_lr: float = 0.0
    """Learning rate at the end of a linear or cosine decay."""

    lr_warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to `lr`."""

    lr_decay_style: str = "constant"
    """One of LR_DECAY_STYLES; the decay spans the run's optimizer steps after warmup."""

    weight_decay: float = 0.0
    """Decoupled weight decay."""

    adam_beta1: float = 0.9
    """Adam's first-moment decay."""

    adam_beta2: float = 0.999
    """Adam's second-moment decay."""

    adam_eps: float = 1e-8
    """Adam's denominator epsilon."""

    clip_grad: float = 1.0
    """Clip the global gradient norm (over all TP/PP/DP ranks) to this value; 0 disables."""


@dataclass
class LoRAConfig:
    """LoRA adapters (Hu et al. 2021) on the model's linear layers: the base weights stay frozen, the optimizer
    holds the adapters alone, and the actor's reference model is its own base (the adapters off)."""

    rank: int = 0
    """Adapter rank r; 0: no adapters, every weight trains."""

    alpha: float = 16.0
    """Scale: an adapter adds (alpha / rank) B A x."""

    dropout: float = 0.0
    """Dropout on the adapters' input (PEFT's lora_dropout)."""

    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj"])
    """The HF projections that get adapters: q_proj, k_proj, v_proj, o_proj (multi-latent attention: q_a_proj,
    q_b_proj or q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj), gate_proj, up_proj, down_proj (a mixture of
    experts: every routed expert's, gate and up as one adapter of twice the rank, as PEFT's target_parameters)."""

    adapter_path: str = ""
    """A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) to start from, of this rank,
    alpha and targets; empty: new adapters (B = 0: training starts at the base model)."""


@dataclass
class EngineConfig:
    """A Megatron model that is scored and trained (actor, critic); all models share the actor's
    parallel layout (megatron-core keeps one layout per process)."""

    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and learning-rate schedule."""

    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Train LoRA adapters instead of the whole model (`lora.rank` > 0)."""

    ppo_mini_batch_size: int = 8
    """Prompts per optimizer step; each contributes its n sampled responses."""

    ppo_epochs: int = 1
    """Passes over each RL batch; every sample is used exactly once per pass."""

    micro_batch_size_per_rank: int = 0
    """Sequences per forward/backward on one DP rank: with `use_dynamic_batch_size`, the token budget's measure
    (this many of the share's longest sequences); without, the fixed size. Larger is faster (fewer, fuller
    forwards) until activations outgrow memory. 0: chosen from the model: under the token budget, 4 of the
    share's longest sequences or as many tokens as 1 GiB of activations holds, whichever is more (estimated
    from the model's shape and the share's widest row, `megarl.engine.batching.activation_bytes_per_token`: a
    small model with short sequences, such as the CPU quick starts', runs a rank's whole share in one forward;
    1 GiB holds ~340 tokens of a 0.5B model); fixed, 4."""

    use_dynamic_batch_size: bool = True
    """Form micro-batches under a token budget (`max_token_len_per_rank`): balanced by tokens where sequences
    are packed (Transformer Engine); where rows are padded to the widest (megatron's local layers, as on CPU;
    rows of a prompt and its responses where prompts are shared) narrow rows go together, so that a long tail
    of response lengths does not pad every short sequence to its length (`megarl.engine.batching`: the
    colocated update 4.9x faster on a long-tailed bench task, bench/README.md), and a GRPO group's prompt and
    responses stay in one row while they fit. false: micro-batches of `micro_batch_size_per_rank` sequences in
    the share's order. A mixture-of-experts model's router losses are taken per micro-batch, so which
    sequences share one changes them (as any micro-batch size does)."""

    max_token_len_per_rank: int = 0
    """Token budget of one micro-batch on one rank when `use_dynamic_batch_size` is set: its real tokens where
    sequences are packed (Transformer Engine), its padded tokens (rows x the widest) where rows are right-padded
    to the widest; a longer sequence stops the step. 0: `micro_batch_size_per_rank` times the longest sequence
    of the rank's share (no more tokens than a fixed-size micro-batch of it holds; shorter sequences share
    them), or the model's default where that is 0 too."""

    use_distributed_optimizer: bool = True
    """megatron's distributed optimizer: optimizer state sharded over DP ranks (at DP1 it shards nothing
    but keeps the one checkpoint format that reshards over TP, PP and DP)."""

    recompute_activations: bool = False
    """Recompute each layer's activations in backward instead of storing them."""

    overlap_grad_reduce: bool = True
    """Reduce each bucket of gradients over DP as soon as backward has filled it, while backward goes
    on (megatron DDP's overlap_grad_reduce); false: one reduction after the last micro-batch. The same
    sums either way."""

    grad_bucket_size: int = 0
    """Gradient elements per overlapped DP reduction; 0: sized from the model, about one layer's trainable
    parameters per rank, at least 1M and at most 40M (megatron's own default, which leaves a model under 40M
    parameters in one bucket, reduced after backward)."""

    offload: bool = False
    """Free this model's device memory while the rollout engine generates: parameters and optimizer
    state are copied to pinned host memory and their device storage freed, gradients are freed (each
    mini-batch zeroes them anyway); all return before the model is used again, and training is
    bitwise the same as without offload. The reference model follows actor.offload. On CPU the same
    code runs, but there the host copy takes the memory the freed storage gave back: nothing is saved."""

    logprob_chunk_size: int = 256
    """Rows per chunk of the vocab-parallel log-prob/entropy kernel (peak memory vs. speed)."""

    share_prompt_forward: bool = True
    """Run a prompt once for all sequences of a micro-batch that share it (a GRPO group's samples): a
    row holds the prompt, then each response, attending to the prompt and to itself. Same outputs and
    gradients up to float rounding, with (n-1)/n of the prompt tokens not recomputed. Decided when the
    model is built (`megarl.engine.prompt_sharing`): on for an RL run's models wherever it pays, off,
    with a one-line notice saying why, for rollout.n = 1, mixture-of-experts models and where attention
    over a group's whole row, (P + nR)^2 scores for n responses of length R to a prompt of length P
    instead of n(P + R)^2, costs more than the prompt copies it saves (long responses). A model that
    shares prompts runs RoPE unfused and, with Transformer Engine's layers, TE's unfused attention under
    the rows' masks (instead of packed sequences), which keeps a row's W^2 probabilities per head for
    backward: there sharing is also off for rows wider than 17 x hidden / heads tokens (2,176 at head
    dim 128), whose probabilities would outweigh the rest of a layer's activations. SFT's examples share
    nothing. false: never."""


@dataclass
class ActorConfig(EngineConfig, ParallelConfig):
    """The policy being trained; its parallel sizes sit directly on it (`actor.tp=2`)."""

    policy_loss: str = "vanilla"
    """Registered policy loss (megarl.algorithms.POLICY_LOSSES, docs/algorithms.md): vanilla (PPO clip),
    gspo, cispo, sapo, gmpo, dppo_tv, dppo_kl, clip_cov, kl_cov, gpg, dro. cispo clips its stop-gradient
    weight with clip_ratio_low/high (the paper: clip_ratio_low >= 1, no lower bound); gmpo reads them as
    bounds of the log ratio (the paper: 0.4); dppo_tv/dppo_kl as divergence thresholds (0.15 / 0.05) and
    clip_ratio_c as the cap of the importance weight (0: none)."""

    clip_ratio_low: float = 0.2
    """Lower clip range of the importance ratio: 1 - clip_ratio_low."""

    clip_ratio_high: float = 0.2
    """Upper clip range: 1 + clip_ratio_high (DAPO's clip-higher raises it, e.g. 0.28)."""

    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (0 disables dual clip)."""

    tau_pos: float = 1.0
    """sapo: temperature of the soft gate for positive advantages (the paper: 1.0)."""

    tau_neg: float = 1.05
    """sapo: temperature of the soft gate for other advantages; larger decays faster (the paper: 1.05)."""

    clip_cov_ratio: float = 2e-4
    """clip_cov: share of a micro-batch's valid tokens whose loss is dropped (at least one)."""

    clip_cov_lb: float = 1.0
    """clip_cov: only tokens whose log-prob/advantage covariance exceeds this are dropped."""

    clip_cov_ub: float = 5.0
    """clip_cov: only tokens whose log-prob/advantage covariance is below this are dropped."""

    kl_cov_ratio: float = 2e-4
    """kl_cov: share of a micro-batch's valid tokens, those of largest covariance, that pay the KL
    penalty (at least one)."""

    ppo_kl_coef: float = 1.0
    """kl_cov: weight of the |logp - old_logp| penalty on those tokens."""

    dro_beta: float = 0.05
    """dro: weight beta of the quadratic log-ratio penalty (beta / 2) (logp - old_logp)^2; > 0."""

    loss_agg_mode: str = "token-mean"
    """token-mean, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm (Dr. GRPO)."""

    entropy_coeff: float = 0.0
    """Weight of the entropy bonus subtracted from the policy loss."""

    use_kl_loss: bool = False
    """Add KL(actor || reference) to the loss (GRPO style) instead of, or as well as, in the reward."""

    kl_loss_coef: float = 0.001
    """Weight of the KL loss term."""

    kl_loss_type: str = "k3"
    """Registered KL estimator for the loss term: k1, k2, k3 (low variance)."""

    router_replay: bool = False
    """Mixture-of-experts models: route every token, in scoring and updates, to the experts the rollout
    engine routed it to (R3), instead of the router's own top-k; the router still weighs them. Without
    it, `actor/moe/routing_agreement` shows how often the two routings agree. The reference model
    routes on its own. Dense models: an error."""

    recompute_old_logprobs: bool = True
    """The PPO ratio's old log-probs: the trainer's, from a forward pass over the batch before the update
    (none when the update is one optimizer step: its own forward gives them); false: the rollout engine's,
    the log-probs of the policy that sampled each token (every token its own version under split placement),
    and no such pass, as verl's fully asynchronous trainer does. The ratio then carries the engine's numeric
    difference from the trainer too, so no rollout correction applies (algorithm.rollout_correction.preset
    must be none) and no mismatch/* nor rollout/entropy is logged."""


@dataclass
class CriticConfig(EngineConfig):
    """The value model for PPO with GAE."""

    enable: bool = False
    """Train a critic (needed by the gae estimator)."""

    path: str = ""
    """HF directory of the critic (sharing model.path's tokenizer); empty: start from model.path with a new value
    head."""

    cliprange_value: float = 0.5
    """Clip range of the value update around the old values."""


@dataclass
class TeacherConfig:
    """The frozen model that on-policy distillation (`algorithm.adv_estimator=opd`) learns from: it scores
    the student's rollouts, forward only, on the actor's parallel layout and following actor.offload."""

    path: str = ""
    """HF directory of the teacher (any size, the student's tokenizer); empty: no teacher."""

    micro_batch_size_per_rank: int = 0
    """Sequences per teacher forward on one DP rank; 0: the actor's (a larger teacher may need fewer)."""

    task_reward_weight: float = 0.0
    """opd: weight of the task reward's advantage (score minus its group mean) added to the per-token
    distillation advantage; 0: pure distillation."""


@dataclass
class PrimeConfig(EngineConfig):
    """PRIME's implicit process reward model (`algorithm.adv_estimator=prime`, `megarl.algorithms.prime`):
    a causal LM trained online on the outcome labels, with a frozen reference."""

    path: str = ""
    """HF directory the PRM starts from, which is also its frozen reference; empty: model.path (the SFT
    model), whose reference is then the run's reference model when it has one."""

    beta: float = 0.05
    """Scale of the implicit reward beta * log(pi_prm / pi_ref), token and sequence alike."""

    correct_threshold: float = 0.5
    """A response is labelled correct when the reward function's score exceeds this value."""

    update: str = "before"
    """One of PRIME_UPDATES: before (the paper's order: train the PRM on the step's responses, then score
    them with it) or after (score them first, then train: one PRM forward when the update is one step)."""

    outcome_weight: float = 1.0
    """Weight of the outcome reward's leave-one-out advantage."""

    process_weight: float = 1.0
    """Weight of the implicit process rewards' leave-one-out returns."""


@dataclass
class DataConfig:
    """Prompts in the common RL parquet layout (prompt, data_source, reward_model, extra_info)."""

    train_files: list[str] = field(default_factory=list)
    """Training parquet files."""

    val_files: list[str] = field(default_factory=list)
    """Held-out parquet files for validation (mean score and pass@k)."""

    max_prompt_length: int = 128
    """Prompts longer than this many tokens are filtered out (the count is logged)."""

    max_response_length: int = 64
    """Tokens generated per response at most."""

    train_batch_size: int = 8
    """Prompts per RL step (each sampled rollout.n times)."""

    max_val_samples: int = 0
    """Validate on at most this many prompts (0: all)."""

    apply_chat_template: bool = True
    """Render chat messages with the tokenizer's chat template (its special tokens are the template's);
    false: use the raw text, which gets the tokenizer's own leading special tokens (e.g. BOS)."""

    shuffle: bool = True
    """Shuffle the training prompts every epoch (seeded by trainer.seed)."""


@dataclass
class SandboxConfig:
    """Limits of the child process that runs the model's Python code (docs/running.md, "Sandbox")."""

    cpu_seconds: int = 5
    """CPU time per call (RLIMIT_CPU); the child is killed past it."""

    memory_mib: int = 1024
    """Address space per call (RLIMIT_AS); allocations past it raise MemoryError in the code."""

    max_processes: int = 16
    """Processes and threads the call may add (RLIMIT_NPROC, which the kernel ignores for root)."""

    max_file_mib: int = 16
    """Largest file the code may write, its stdout and stderr included (RLIMIT_FSIZE)."""

    namespaces: bool = True
    """Also isolate with Linux user, network and mount namespaces where the kernel allows them (no
    network, everything but the scratch directory read-only); false: resource limits and audit hook only."""


@dataclass
class MultiTurnConfig:
    """Agentic rollouts: the tools the model may call and the environment that answers its turns."""

    enable: bool = False
    """Generate trajectories turn by turn with an environment instead of one response per sample. Chat
    prompts then open with the chat template's preamble of `tools`, in RL, its validation and SFT alike
    (an SFT warm start for a multi-turn run sets it too)."""

    max_turns: int = 4
    """Model turns per trajectory at most; every response token, the model's and the environment's,
    also counts against data.max_response_length."""

    max_tokens_per_turn: int = 0
    """Tokens of one model turn at most (a longer turn is cut and answered as it is); 0: what is left of
    data.max_response_length."""

    tools: list[str] = field(default_factory=lambda: ["python", "calculator"])
    """Tools offered to the model: built-in names (python, calculator) and user functions
    `path/to/file.py:function` (schema from type hints and the docstring's Args section)."""

    reward: str = "environment"
    """Where a trajectory's reward comes from: `environment` (the reward its environment gives when it
    ends it; 0 for one cut by max_turns or the token budget), `function` (the reward function's score of
    the last assistant turn; for ToolEnvironment, which gives none) or `sum` (both added)."""

    environment: str = ""
    """`path/to/file.py:Class` answering every trajectory (constructed with the run's Toolbox); empty: the
    environment registered for the sample's data_source, else ToolEnvironment (runs the tool calls)."""

    tool_timeout_seconds: float = 5.0
    """Wall-clock limit of one tool call; the calls of a turn run concurrently."""

    max_tool_output_chars: int = 2000
    """A tool's answer is cut to this many characters (the python tool reads no more of its output)."""

    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Limits of the python tool's sandbox."""


@dataclass
class RolloutConfig:
    """The colocated generation engine and its sampling."""

    backend: str = "vllm"
    """Registered rollout backend: vllm, hf (plain transformers, slow; the parity reference)."""

    tp: int = 1
    """Tensor-parallel size of each engine (TP_r); engines are formed from consecutive ranks."""

    n: int = 8
    """Responses sampled per prompt."""

    temperature: float = 1.0
    """Sampling temperature; the trainer scores log-probs at the same temperature."""

    top_p: float = 1.0
    """Nucleus sampling threshold. Below 1 (or with top_k) the engine's log-probs are those of the truncated
    distribution that drew the tokens, the trainer's those of the whole one: the mismatch metrics show the gap,
    rollout corrections weight by it, and with actor.recompute_old_logprobs=false it enters the PPO ratio."""

    top_k: int = -1
    """Top-k sampling (-1 disables); truncates as top_p does."""

    val_temperature: float = 0.0
    """Validation temperature; 0 is greedy."""

    val_n: int = 1
    """Responses per validation prompt; pass@k is reported for k = val_n when above 1."""

    kv_cache_mib: int = 64
    """KV cache of each engine on CPU."""

    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory the engine may take (GPU)."""

    bucket_mib: int = 64
    """Resharding bucket: bytes in flight per rank beyond its own shards."""

    num_ranks: int = 0
    """With trainer.placement=split: the last this many ranks of the world host the rollout engines
    (replicas of `tp` ranks) and nothing else; the others train."""

    partial: bool = False
    """With trainer.placement=split: partial rollouts. The rollout ranks generate continuously while the
    trainer trains: a step's batch is the first groups to finish, a finished group's place in the engine goes
    to the next prompt at once, and a response unfinished when new weights arrive leaves the engine for the
    sync and continues on them, so the slowest response no longer sets the step. Every token keeps the policy
    version that sampled it and its log-prob under that version; a group admitted on version v is trained by
    step v + 1 + trainer.max_staleness (no prompt is admitted that could not be, and a step waits for a group
    due at it), so none is thrown away (`megarl.generation.partial`). With rollout.multi_turn: the environment
    answers each turn as it ends (`megarl.generation.partial_turns`). false: every batch is generated whole,
    at once."""

    partial_groups: int = 0
    """Partial rollouts: prompt groups (a prompt's `n` responses) in flight at once; more keeps the engine's
    batch full through the long tail, at the price of older tokens. 0: data.train_batch_size."""

    keep_kv: bool = False
    """Partial rollouts: a weight sync leaves the requests in the engines with their KV cache, and they go on
    sampling with the new weights over the cache the old ones computed (in-flight weight updates, as AReaL and
    PipelineRL make them); false: each request leaves the engine before the sync and continues as a new one
    whose prompt and tokens so far are prefilled again. Tokens keep the version that sampled them and the
    engine's log-probs either way, so the rollout correction and the staleness bound hold alike. The sync after
    a checkpoint and the one before a validation still take the requests out (a resumed run then continues as
    the uninterrupted one did). vLLM engines run without prefix caching (a cached prefix would outlive the
    weights that computed it)."""

    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn (agentic) rollouts: tools, environments, sandbox."""


@dataclass
class KLControlConfig:
    type: str = "fixed"
    """One of KL_CONTROLLERS: fixed or adaptive (Ziegler et al.)."""

    coef: float = 0.001
    """(Initial) KL coefficient."""

    target_kl: float = 0.1
    """Adaptive controller target."""

    horizon: int = 10000
    """Adaptive controller horizon."""


@dataclass
class RolloutCorrectionConfig:
    """Corrections for tokens whose log-probs under the rollout engine differ from the trainer's (other
    kernels and precision when colocated, an older policy under split placement): importance weights on
    the policy loss and rejection of tokens or sequences, which then leave the whole loss. Applied in the
    actor's loss from the trainer's old log-probs and the engine's; the math, presets and sources are in
    `megarl.algorithms.rollout_correction` and docs/algorithms.md. Logged as actor/rollout_correction/*."""

    preset: str = "auto"
    """auto: token_tis where the engine samples with older weights than the trainer's (trainer.placement=split
    at trainer.max_staleness >= 1) and the trainer computes the old log-probs (actor.recompute_old_logprobs),
    none elsewhere (resolved when the config is loaded; the run's config.yaml shows the outcome). Or one of:
    none, token_tis (token weights truncated at cap), seq_tis (sequence weight truncated), token_mis /
    seq_mis (token / sequence weights; tokens / sequences with the ratio outside [lower, upper] rejected),
    icepop (token_mis with the band [0.5, 5]), geo_rs (sequences with the geometric mean ratio outside
    [lower, upper] rejected, no weights), geo_rs_token_tis (geo_rs with token_tis weights)."""

    cap: float | None = None
    """Truncate the importance weights at this (>= 1); null: the preset's (2 for token_tis, seq_tis and
    geo_rs_token_tis; none for the masked ones). Only for presets with weights."""

    lower: float | None = None
    """Reject ratios below this (in [0, 1)); null: the preset's (0.5 for token_mis, seq_mis, icepop; 0.999
    for geo_rs, geo_rs_token_tis). Only for presets that reject."""

    upper: float | None = None
    """Reject ratios above this (> 1); null: the preset's (2 for token_mis and seq_mis, 5 for icepop, 1.001
    for geo_rs and geo_rs_token_tis). Only for presets that reject."""

    opsm_delta: float = 0.0
    """Off-policy sequence masking (DeepSeek-V3.2), with any preset: drop the negative-advantage tokens of
    a sequence whose mean log-prob under the engine exceeds the current policy's by more than this; 0: off."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Registered advantage estimator: gae, grpo, drgrpo, rloo, reinforce_plus_plus, remax, opd (needs teacher),
    prime, grpo_passk, opo, reinforce_plus_plus_baseline, gdpo (needs reward_components)."""

    gamma: float = 1.0
    """Discount factor."""

    lam: float = 1.0
    """GAE lambda."""

    norm_adv_by_std: bool = True
    """GRPO (and grpo_passk, gdpo): divide by the group std (false gives Dr. GRPO's normalisation)."""

    reward_components: list[str] = field(default_factory=list)
    """gdpo: numeric keys of the reward function's dict, beside 'score', that are the reward's components;
    each is normalised within its group separately before they are summed (logged as reward/<key>)."""

    use_kl_in_reward: bool = False
    """Subtract kl_ctrl.coef * KL(actor || reference) from the token rewards."""

    kl_penalty: str = "k1"
    """Registered KL estimator for the reward penalty."""

    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Controller of the reward KL coefficient."""

    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Importance weights and rejection for the rollout engine's log-probs differing from the trainer's."""

    filter_groups: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal and sample more prompts."""

    max_filter_rounds: int = 4
    """Extra generation rounds at most when filtering groups."""

    overlong_buffer_length: int = 0
    """DAPO overlong shaping: penalise responses in the last this-many tokens (0 disables)."""

    overlong_penalty_factor: float = 1.0
    """Penalty at max_response_length for overlong shaping."""


@dataclass
class JudgeConfig:
    """A generative reward model (`megarl.rewards.judge`): an HF causal LM prompted with a rubric, its verdict
    parsed into each training response's reward, served by a rollout engine of `rollout.backend` in
    `model.dtype` on every rank beside the policy's, with a memory share of its own. Validation keeps
    scoring with `reward.function`: held-out accuracy is measured against the ground truth, not the judge."""

    path: str = ""
    """HF directory of the judge (config, weights, tokenizer); empty: no judge."""

    template: str = ""
    """The judge's prompt, in str.format syntax with the placeholders {prompt}, {response} and
    {ground_truth} (literal braces doubled); the rubric is its text."""

    apply_chat_template: bool = False
    """Render the prompt as a user message with the judge tokenizer's chat template (instruction-tuned
    judges); false: the text as it is."""

    choices: dict[str, float] = field(default_factory=dict)
    """The verdict words and each one's score, e.g. {correct: 1.0, wrong: 0.0}; the first found in the
    verdict as a whole word counts. Empty: the verdict is the first number in it, in [0, max_score]."""

    max_score: float = 10.0
    """Number verdicts: the top of the scale; a verdict scores its number / max_score."""

    max_tokens: int = 16
    """The judge's token budget per verdict (greedy). A verdict that hits it without a parse counts as a
    timeout (reward/judge_timeouts), one that stops without a parse as unparsable (reward/judge_unparsable);
    both score 0 and neither stops the run."""

    max_prompt_length: int = 1024
    """The judge's longest prompt in its tokens; a longer one is not judged (a reward error, scored 0)."""

    rule_weight: float = 0.0
    """The reward function's share: score = (1 - rule_weight) * verdict + rule_weight * function's score;
    0: the judge alone (the function is not called on training responses)."""

    kv_cache_mib: int = 64
    """The judge engine's KV cache on CPU, beside the policy engine's rollout.kv_cache_mib."""

    gpu_memory_utilization: float = 0.1
    """The fraction of GPU memory the judge engine takes for the whole run (GPU), beside the policy
    engine's rollout.gpu_memory_utilization."""


@dataclass
class RewardConfig:
    function: str = ""
    """The scoring function, `path/to/file.py:function` or `pkg.module:function`, with the signature
    compute_score(data_source, solution_str, ground_truth, extra_info=None); empty: the rule scorers
    by data_source."""

    timeout_seconds: float = 10.0
    """A scorer slower than this gives reward 0 (counted and logged)."""

    reward_model_path: str = ""
    """HF value model (*ForTokenClassification) scoring responses: its output at each sequence's last token adds to
    the rule score. It reads the policy's token ids, so it must share model.path's tokenizer."""

    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """A generative reward model (LLM judge) scoring the training responses instead of, or mixed with, the
    reward function."""


@dataclass
class TrainerConfig:
    experiment_name: str = "megarl"
    """Name of the run; outputs go to <output_dir>/<experiment_name>."""

    output_dir: str = "outputs"
    """Root directory of run directories."""

    seed: int = 1
    """Seed for every random number generator of the run."""

    total_steps: int = 1
    """Number of RL steps (rollout plus update) to run."""

    test_freq: int = 0
    """Validate every this many steps (0: only before training and at the end)."""

    val_before_train: bool = True
    """Validate once before the first step."""

    loggers: list[str] = field(default_factory=lambda: ["console", "mlflow"])
    """Metric sinks, from LOGGERS."""

    log_freq: int = 10
    """Print a console metrics line every this many steps (and at validations and the last step);
    mlflow receives every step."""

    mlflow_tracking_uri: str = ""
    """mlflow store; empty: a local SQLite file in the run directory."""

    save_freq: int = 0
    """Save a checkpoint every this many steps and at the last step (0: never)."""

    async_save: bool = False
    """Write checkpoint shards in background processes while training continues; the checkpoint
    is published (and becomes resumable) once they finish."""

    checkpoint_dir: str = "checkpoints"
    """Checkpoints go to <checkpoint_dir>/<experiment_name>/global_step_N."""

    resume_mode: str = "auto"
    """One of RESUME_MODES: auto (the newest complete checkpoint, if any), disable, path."""

    resume_path: str = ""
    """The global_step_N directory to resume from when resume_mode is path."""

    max_ckpt_to_keep: int = 0
    """Keep only this many newest complete checkpoints (0: keep all)."""

    placement: str = "colocated"
    """One of PLACEMENTS: colocated (every rank trains and generates, in turn) or split (rollout.num_ranks
    ranks generate while the others train)."""

    max_staleness: int = 0
    """Split placement: how many policy versions a trained-on sample may lag the trainer (0: synchronous,
    1: one-step off-policy; k: the rollout ranks run up to k batches ahead)."""


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to start from."""

    actor: ActorConfig = field(default_factory=ActorConfig)
    """The policy being trained and its parallel layout."""

    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (PPO with GAE)."""

    prime: PrimeConfig = field(default_factory=PrimeConfig)
    """PRIME's implicit process reward model (used when algorithm.adv_estimator=prime)."""

    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """The teacher of on-policy distillation."""

    data: DataConfig = field(default_factory=DataConfig)
    """Training and validation prompts."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""

    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages and KL."""

    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring of responses."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The training loop: length, seed, where outputs go."""
