"""Load a HF directory into the vLLM engine and `transformers`; greedy tokens and log-probs must agree."""

import sys

from megarl.distributed import finish_process, init_layout
from megarl.rollout.base import Sampling
from megarl.rollout.hf_backend import HFRollout
from megarl.rollout.vllm_backend import VLLMRollout
from reporting import print_report

init_layout()
model_dir = sys.argv[1]
prompts = [[10, 11, 12, 13], [40, 41, 42], [70, 71, 72, 73, 74]]
greedy = Sampling(temperature=0.0, max_tokens=8)
vllm = VLLMRollout(model_dir, "float32", 1, max_model_len=64, kv_cache_bytes=16 << 20, gpu_memory_utilization=0.3,
                   seed=0)
ours, reference = vllm.generate(prompts, greedy), HFRollout(model_dir, "float32").generate(prompts, greedy)
difference = max(abs(a - b) for x, y in zip(ours.logprobs, reference.logprobs) for a, b in zip(x, y))
print_report({"tokens_equal": ours.response_ids == reference.response_ids, "logprob_diff": difference})
vllm.shutdown()
finish_process()
