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


def _hf_outputs(hf_dir: str, value_model: bool, tokens_BT: torch.Tensor, dtype: torch.dtype,
                on: torch.device) -> torch.Tensor:
    """`transformers`' logits (values for value models) of `tokens_BT` in `dtype` on `on`, as fp32 on the CPU."""
    hf_class = AutoModelForTokenClassification if value_model else AutoModelForCausalLM
    model = hf_class.from_pretrained(hf_dir, dtype=dtype).to(on).eval()
    with torch.no_grad():
        return model(tokens_BT.to(on)).logits.float().cpu()


def transformers_error(hf_dir: str, value_model: bool, dtype: torch.dtype) -> float:
    """Largest |transformers in `dtype` on this rank's device - transformers in fp32 on the CPU|: the error
    a framework's own kernels make in `dtype`, measured where the comparison runs, which a tolerance for
    megatron in that dtype is a multiple of (kernels and rounding differ between devices and CPU makes)."""
    tokens_BT, mask_BT = tokenize(hf_dir)
    low = _hf_outputs(hf_dir, value_model, tokens_BT, dtype, device.compute_device())
    reference = _hf_outputs(hf_dir, value_model, tokens_BT, torch.float32, torch.device("cpu"))
    return (low - reference)[mask_BT].abs().max().item()


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
            expected = _hf_outputs(hf_dir, arch.value_model, tokens_BT, torch.float32, torch.device("cpu"))
            difference[0] = (outputs.float().cpu() - expected)[mask_BT].abs().max()
    collectives.all_reduce(difference, op=dist.ReduceOp.MAX)
    return difference.item()
