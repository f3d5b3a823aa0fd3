"""How far vLLM's forward is from transformers' on a checkpoint, with no megarl code in between.

    python tools/vllm_vs_transformers.py MODEL_DIR [--dtype bfloat16] [--prompts 4] [--max-tokens 3]

vLLM (its own loader, eager, no prefix caching) samples a few tokens for random prompts; transformers
scores the same tokens in float32. Prints each sequence's log-probs from both and the largest
difference. A megarl engine that disagrees with its trainer can be told apart from an engine that
disagrees with the model: here megatron-core and transformers agree (checkpoints_tools/compare_logits.py).
"""

from __future__ import annotations

import argparse
import os

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--dtype", default="bfloat16", help="vLLM's dtype")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=9)
    parser.add_argument("--max-tokens", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(args.model_dir, dtype=args.dtype, max_model_len=128, enforce_eager=True, seed=0,
              enable_prefix_caching=False, gpu_memory_utilization=0.2)
    reference = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    vocab = reference.config.vocab_size
    prompts = [torch.randint(5, vocab, (args.prompt_length,), generator=generator).tolist()
               for _ in range(args.prompts)]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                           SamplingParams(temperature=1.0, max_tokens=args.max_tokens, logprobs=0, seed=0))
    worst = 0.0
    for prompt, output in zip(prompts, outputs):
        ids = list(output.outputs[0].token_ids)
        engine = torch.tensor([step[token].logprob for step, token in zip(output.outputs[0].logprobs, ids)])
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
        scored = logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None])[:, 0]
        worst = max(worst, float((engine - scored).abs().max()))
        print(f"vllm {[round(x, 3) for x in engine.tolist()]}  transformers {[round(x, 3) for x in scored.tolist()]}")
    print(f"max |vllm - transformers| = {worst:.3g} nats over {args.prompts} x {args.max_tokens} sampled tokens")


if __name__ == "__main__":
    main()
