"""Check that megatron-core at a TP x PP layout computes the same logits as `transformers`.

    torchrun --nproc_per_node=4 checkpoints_tools/compare_logits.py --hf DIR [DIR ...] --tp 2 --pp 2

Each HF checkpoint is loaded into megatron at the layout (each rank reading only its slices), a
batch of prompts runs through the pipeline, and one last-stage rank compares the real-vocabulary
logits of real tokens (value models: the values) with a `transformers` forward on the same
weights. Prints one line per model; exits 1 when any difference exceeds --tolerance.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from megarl.config.schema import LAYER_SPECS
from megarl.distributed import init_layout
from megarl.distributed.launch import device
from megarl.engine.forward import forward_outputs, gather_vocab
from megarl.models.hf_interop import load_hf_model

PROMPTS = (
    "What is 17 + 25? Think step by step.",
    "The quick brown fox jumps over the lazy dog.",
    "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "Megatron meets vLLM.",
)


def tokenize(model_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids (B, T) and the mask of real tokens."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    length = max(map(len, ids))
    tokens_BT = torch.full((len(ids), length), tokenizer.pad_token_id or 0)
    mask_BT = torch.zeros(len(ids), length, dtype=torch.bool)
    for i, row in enumerate(ids):
        tokens_BT[i, : len(row)] = torch.tensor(row)
        mask_BT[i, : len(row)] = True
    return tokens_BT, mask_BT


def max_difference(model_dir: str, layout, tokens_BT, mask_BT, layer_spec: str) -> float:
    model, arch = load_hf_model(model_dir, layout, layer_spec=layer_spec)
    model.eval()
    outputs = forward_outputs(model, layout, tokens_BT, micro_batch_size=2)
    difference = torch.zeros(1, device=device())
    if layout.is_last_stage:
        if not arch.value_model:
            outputs = gather_vocab(outputs, layout)[..., : arch.vocab_size]
        if layout.holds_unique_stage_copy:
            hf_class = AutoModelForTokenClassification if arch.value_model else AutoModelForCausalLM
            reference = hf_class.from_pretrained(model_dir, dtype=torch.float32).eval()
            with torch.no_grad():
                expected = reference(tokens_BT).logits
            difference[0] = (outputs.float().cpu() - expected)[mask_BT].abs().max()
    dist.all_reduce(difference, op=dist.ReduceOp.MAX)
    return difference.item()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", nargs="+", required=True, help="HuggingFace model directories")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--layer-spec", choices=LAYER_SPECS, default="auto")
    args = parser.parse_args(argv)

    layout = init_layout(tp=args.tp, pp=args.pp)
    failed = False
    for model_dir in args.hf:
        tokens_BT, mask_BT = tokenize(model_dir)
        difference = max_difference(model_dir, layout, tokens_BT, mask_BT, args.layer_spec)
        ok = difference <= args.tolerance
        failed |= not ok
        if dist.get_rank() == 0:
            verdict = "OK" if ok else "FAIL"
            print(f"{verdict} {model_dir} {layout}: max |megatron - transformers| = {difference:.3e} "
                  f"(tolerance {args.tolerance:g})", flush=True)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
