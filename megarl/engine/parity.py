"""Megatron outputs against `transformers` on the same weights: the check behind compare_logits
and the conversion tools' --verify.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from megarl import device
from megarl.data.tokenization import prompt_ids
from megarl.distributed import collectives
from megarl.distributed.layout import ParallelLayout
from megarl.engine.batch import right_pad
from megarl.engine.forward import forward_outputs, gather_vocab
from megarl.models.architecture import Architecture

PROMPTS = (
    "What is 17 + 25? Think step by step.",
    "The quick brown fox jumps over the lazy dog.",
    "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "Megatron meets vLLM.",
)


def tokenize(model_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids (B, T) of the check prompts and the mask of real tokens."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = prompt_ids(list(PROMPTS), tokenizer, apply_chat_template=False)
    return right_pad(ids, tokenizer.pad_token_id or 0), right_pad([[True] * len(row) for row in ids], False, torch.bool)


def max_difference(model: torch.nn.Module, arch: Architecture, layout: ParallelLayout, hf_dir: str) -> float:
    """Largest |megatron - transformers(hf_dir)| over real tokens and the real vocabulary (values for
    value models); the same number on every rank."""
    tokens_BT, mask_BT = tokenize(hf_dir)
    if model.config.sequence_parallel:  # the TP ranks split the sequence: right-pad it to a multiple of TP
        padding = -tokens_BT.shape[1] % layout.tp
        tokens_BT, mask_BT = F.pad(tokens_BT, (0, padding)), F.pad(mask_BT, (0, padding), value=False)
    model.eval()
    outputs = forward_outputs(model, layout, tokens_BT, micro_batch_size=2)
    difference = torch.zeros(1, device=device.compute_device())
    if layout.is_last_stage:
        if not arch.value_model:
            outputs = gather_vocab(outputs, layout)[..., : arch.vocab_size]
        if layout.holds_unique_stage_copy:
            hf_class = AutoModelForTokenClassification if arch.value_model else AutoModelForCausalLM
            reference = hf_class.from_pretrained(hf_dir, dtype=torch.float32).eval()
            with torch.no_grad():
                expected = reference(tokens_BT).logits
            difference[0] = (outputs.float().cpu() - expected)[mask_BT].abs().max()
    collectives.all_reduce(difference, op=dist.ReduceOp.MAX)
    return difference.item()
