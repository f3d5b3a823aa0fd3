"""The actor the rollout checks train and sync from (tests/distributed/scripts/rollout_checks.py and
tests/gpu/scripts/cuda_checks.py): a MegatronEngine on a tiny HF model, four fixed prompts, a
negative-log-likelihood step on given responses, and the safetensors an export writes."""

import os

import torch
from safetensors.torch import load_file

from megarl.config.schema import EngineConfig, ModelConfig, OptimizerConfig
from megarl.distributed.layout import ParallelLayout
from megarl.engine.batch import SequenceBatch
from megarl.engine.megatron_engine import MegatronEngine

generator = torch.Generator().manual_seed(1)
"""The stream PROMPTS were drawn from; a script draws what else it needs from its continuation."""
PROMPTS = [torch.randint(5, 100, (n,), generator=generator).tolist() for n in (5, 9, 3, 7)]


def make_actor(layout: ParallelLayout, hf_dir: str, dtype: str = "float32") -> MegatronEngine:
    return MegatronEngine(layout, ModelConfig(path=hf_dir, dtype=dtype), EngineConfig(micro_batch_size_per_rank=4,
                          optim=OptimizerConfig(lr=3e-3)), total_optimizer_steps=4)


def nll(outputs, micro_batch, normalizer):
    mask = micro_batch.response_mask_BR.to(outputs["logprobs"].device)
    return -(outputs["logprobs"] * mask).sum() / normalizer.num_tokens, {}


def make_batch(responses: list[list[int]]) -> SequenceBatch:
    """PROMPTS followed by `responses`, right-padded."""
    tokens = [p + r for p, r in zip(PROMPTS, responses)]
    width = max(map(len, tokens))
    return SequenceBatch(torch.tensor([t + [0] * (width - len(t)) for t in tokens]),
                         torch.tensor([len(p) for p in PROMPTS]), torch.tensor([len(r) for r in responses]))


def train_step(actor: MegatronEngine, responses: list[list[int]]):
    return actor.train_mini_batch(make_batch(responses), nll)


def read_safetensors(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in `directory` (an HF checkpoint or export)."""
    tensors = {}
    for file in sorted(os.listdir(directory)):
        if file.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(directory, file)))
    return tensors
