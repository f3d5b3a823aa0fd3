"""Make a tiny random HuggingFace model and a character-level tokenizer, entirely offline.

    python checkpoints_tools/make_tiny_model.py --family qwen2 --out outputs/tiny_qwen2
    python checkpoints_tools/make_tiny_model.py --family qwen3_moe --out outputs/tiny_qwen3_moe

The tokenizer (built with `tokenizers`) has one token per printable ASCII character plus chat
special tokens and a chat template; its 101 tokens are deliberately not a multiple of any TP size,
so vocabulary padding is always exercised. It is byte-level, as GPT-2's and Qwen2's are (a space is
the token `Ġ`, a newline `Ċ`), with no merges: transformers loads a Qwen model's tokenizer as its own
Qwen2Tokenizer, which rebuilds Qwen2's byte-level pipeline around the saved vocabulary, and that
pipeline must find every character, whitespace included. With --bos it also has a BOS token (102
tokens) that its post-processor prepends to every encoded text, as Llama's and Mistral's tokenizers
do, and that its chat template renders (tokenizing the rendered template must then add no special
tokens). Every weight, including norms and biases, is random (HF initialises norms to one and biases
to zero, which would hide mapping mistakes).

The mixture-of-experts families (qwen3_moe, qwen2_moe, mixtral, deepseek_v3, glm4_moe) have
--num-experts experts of intermediate size --moe-ffn-hidden-size per layer, --top-k routed per token;
Qwen2-MoE adds a gated shared expert of --ffn-hidden-size. Qwen3-MoE renormalises its top-k routing
weights (norm_topk_prob, as Qwen3-30B-A3B does), Qwen2-MoE does not (as Qwen1.5-MoE), Mixtral always does.
DeepSeek-V3 and GLM-4.5 route by sigmoid scores with a correction bias (random and non-zero here, as in
real checkpoints: a zero bias would hide a wrong sign or a missing term) within --n-group groups, have
one shared expert and --dense-layers dense first layers. DeepSeek-V3 has multi-latent attention
(--q-lora-rank 0: no query latent, as Moonlight; --rope-type yarn for YaRN); GLM-4.5 has q/k/v biases,
qk-norm and RoPE on half of each head. DeepSeek-V2 is DeepSeek-V3 with softmax routing (greedy, no bias).

    python checkpoints_tools/make_tiny_model.py --family deepseek_v3 --out outputs/tiny_deepseek_v3
"""

from __future__ import annotations

import argparse
import string

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    GenerationConfig,
    PreTrainedTokenizerFast,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from megarl.models.architecture import HF_CLASS_PREFIX

SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"]
BOS_TOKEN = "<|bos|>"
# Qwen2.5's conventions, compacted for a character-level tokenizer (every character is a token): with
# `tools`, a system turn names them (Qwen lists their whole JSON schemas) after the system message's own
# content; consecutive `tool` messages become one user turn of <tool_response> blocks. Without tools,
# every message is `<|im_start|>role\ncontent<|im_end|>\n`.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{{ '\\n' }}{% endif %}Tools: {% for tool in tools %}{{ (tool.function or tool).name }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' }}{{ message['content'] }}{{ '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
               "qwen2_moe": "qwen2_moe", "mixtral": "mixtral", "deepseek_v3": "deepseek_v3", "glm4_moe": "glm4_moe",
               "deepseek_v2": "deepseek_v2"}


def make_tokenizer(bos: bool = False) -> PreTrainedTokenizerFast:
    """The character-level tokenizer; `bos`: one that prepends BOS to every text it encodes."""
    characters = sorted(set(string.printable) - set("\t\r\x0b\x0c"))
    special_tokens = SPECIAL_TOKENS + ([BOS_TOKEN] if bos else [])
    vocab = {token: i for i, token in enumerate(special_tokens + [character_token(c) for c in characters])}
    tokenizer = Tokenizer(models.BPE(vocab, merges=[], unk_token="<|unk|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(special_tokens)
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B:1", special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<|pad|>",
        eos_token="<|endoftext|>",
        unk_token="<|unk|>",
        bos_token=BOS_TOKEN if bos else None,
        chat_template=("{{ bos_token }}" if bos else "") + CHAT_TEMPLATE,
    )


def character_token(character: str) -> str:
    """The vocabulary's token for one character: byte-level BPE's printable stand-in for its byte
    (GPT-2's table, as transformers converts tokenizers with it: " " is "Ġ", a newline "Ċ")."""
    return bytes_to_unicode()[ord(character)]


def make_config(args, tokenizer: PreTrainedTokenizerFast):
    suffix = "ForTokenClassification" if args.value_model else "ForCausalLM"
    fields = dict(
        architectures=[HF_CLASS_PREFIX[args.family] + suffix],
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        # Mixtral's experts have the model's intermediate size
        intermediate_size=args.moe_ffn_hidden_size if args.family == "mixtral" else args.ffn_hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=args.hidden_size // args.num_heads,
        max_position_embeddings=args.max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_parameters=rope_parameters(args),
        tie_word_embeddings=args.tied and not args.value_model,
        initializer_range=args.init_std,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    return AutoConfig.for_model(MODEL_TYPES[args.family], **{**fields, **moe_fields(args)})


def moe_fields(args) -> dict:
    if args.family == "mixtral":
        return dict(num_local_experts=args.num_experts, num_experts_per_tok=args.top_k)
    if args.family in ("qwen3_moe", "qwen2_moe"):
        shared = {"shared_expert_intermediate_size": args.ffn_hidden_size} if args.family == "qwen2_moe" else {}
        return dict(num_experts=args.num_experts, num_experts_per_tok=args.top_k,
                    moe_intermediate_size=args.moe_ffn_hidden_size, norm_topk_prob=args.family == "qwen3_moe",
                    decoder_sparse_step=1, mlp_only_layers=[], **shared)
    if args.family in ("deepseek_v3", "glm4_moe", "deepseek_v2"):
        fields = dict(n_routed_experts=args.num_experts, num_experts_per_tok=args.top_k,
                      moe_intermediate_size=args.moe_ffn_hidden_size, n_shared_experts=1,
                      norm_topk_prob=args.family != "deepseek_v2",
                      n_group=args.n_group, topk_group=max(1, args.top_k // 2) if args.n_group > 1 else 1,
                      routed_scaling_factor=args.routed_scaling_factor, first_k_dense_replace=args.dense_layers,
                      topk_method="greedy" if args.family == "deepseek_v2" else "noaux_tc", num_nextn_predict_layers=0)
        if args.family == "glm4_moe":
            return dict(fields, attention_bias=True, use_qk_norm=True, num_mtp_layers=0)
        head_dim = args.hidden_size // args.num_heads
        return dict(fields, q_lora_rank=args.q_lora_rank or None, kv_lora_rank=args.kv_lora_rank,
                    qk_rope_head_dim=args.qk_rope_head_dim, qk_nope_head_dim=head_dim, v_head_dim=head_dim,
                    num_key_value_heads=args.num_heads, head_dim=args.qk_rope_head_dim)
    return {}


def rope_parameters(args) -> dict:
    parameters = {"rope_type": args.rope_type, "rope_theta": args.rope_theta}
    if args.family == "glm4_moe":
        parameters["partial_rotary_factor"] = 0.5
    if args.rope_type == "yarn":  # DeepSeek-V3's settings; the context before scaling is the context / factor, as there
        original = round(args.max_position_embeddings / args.rope_factor)
        parameters.update(factor=args.rope_factor, original_max_position_embeddings=original,
                          beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
    if args.rope_type == "linear":
        parameters["factor"] = args.rope_factor
    if args.rope_type == "llama3":  # the constants megatron-core implements
        parameters.update(factor=args.rope_factor, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)
    return parameters


@torch.no_grad()
def randomize(model: torch.nn.Module, std: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.1 * noise)
        else:
            param.copy_(std * noise)
    for name, bias in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # of the order of the sigmoid scores' spread
            bias.copy_(0.05 * torch.randn(bias.shape, generator=generator))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(MODEL_TYPES), default="qwen2")
    parser.add_argument("--out", required=True, help="output directory (HF layout)")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--ffn-hidden-size", type=int, default=384)
    parser.add_argument("--num-experts", type=int, default=8, help="MoE families: routed experts per layer")
    parser.add_argument("--top-k", type=int, default=2, help="MoE families: experts per token")
    parser.add_argument("--moe-ffn-hidden-size", type=int, default=64, help="MoE families: one expert's size")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=4, help="head dim = hidden / heads; vLLM needs >= 32")
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--max-position-embeddings", type=int, default=512)
    parser.add_argument("--rope-theta", type=float, default=10000.0)
    parser.add_argument("--rope-type", choices=["default", "linear", "llama3", "yarn"], default="default",
                        help="yarn: deepseek_v3 only")
    parser.add_argument("--rope-factor", type=float, default=8.0, help="scaling factor of linear/llama3/yarn RoPE")
    parser.add_argument("--dense-layers", type=int, default=1, help="deepseek_v3, glm4_moe: dense first layers")
    parser.add_argument("--n-group", type=int, default=1,
                        help="deepseek_v3, glm4_moe: expert groups (tokens pick from the best top-k/2)")
    parser.add_argument("--routed-scaling-factor", type=float, default=2.5, help="deepseek_v3, glm4_moe")
    parser.add_argument("--q-lora-rank", type=int, default=48, help="deepseek_v3: query latent; 0: none")
    parser.add_argument("--kv-lora-rank", type=int, default=32, help="deepseek_v3: key/value latent")
    parser.add_argument("--qk-rope-head-dim", type=int, default=16, help="deepseek_v3: RoPE part of each head")
    parser.add_argument("--tied", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--value-model", action="store_true", help="a *ForTokenClassification value model")
    parser.add_argument("--init-std", type=float, default=0.05)
    parser.add_argument("--eos-scale", type=float, default=1.0,
                        help="scale EOS's output row (tied: its embedding): 16 ends random responses at varied lengths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-size", default="50MB", help="shard the safetensors above this size")
    parser.add_argument("--bos", action="store_true", help="a tokenizer whose post-processor prepends a BOS token")
    args = parser.parse_args(argv)

    tokenizer = make_tokenizer(args.bos)
    config = make_config(args, tokenizer)
    model_class = AutoModelForTokenClassification if args.value_model else AutoModelForCausalLM
    model = model_class.from_config(config, dtype=torch.float32)
    randomize(model, args.init_std, args.seed)
    if not args.value_model:
        with torch.no_grad():
            model.get_output_embeddings().weight[tokenizer.eos_token_id] *= args.eos_scale
    model.save_pretrained(args.out, max_shard_size=args.max_shard_size)
    tokenizer.save_pretrained(args.out)
    if not args.value_model:
        generation = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        generation.save_pretrained(args.out)
    print(f"wrote {config.architectures[0]} ({sum(p.numel() for p in model.parameters()):,} params) to {args.out}")


if __name__ == "__main__":
    main()
