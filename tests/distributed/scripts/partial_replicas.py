"""Partial rollouts over engine replicas in lockstep (checked by tests/distributed/test_partial_replicas.py).

Every process is a rollout rank holding an `hf` engine replica (rollout.tp=1) of the same model; they make
three batches, the weights updated between them as a sync would. Each rank writes the batches as it holds
them and how many requests its own engine was given.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.config.loader import load_config
from megarl.generation.inputs import RunInputs
from megarl.generation.partial import PartialRollouts
from megarl.rollout.hf_backend import HFRollout

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--train", required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()
dist.init_process_group("gloo")


class CountingEngine(HFRollout):
    """The `hf` engine, counting the requests submitted to it."""

    submits = 0

    def submit(self, key, prompt, sampling):
        self.submits += 1
        super().submit(key, prompt, sampling)


config = load_config(str(Path(__file__).resolve().parents[3] / "configs/quickstart.yaml"), [
    f"model.path={args.model}", f"data.train_files=[{args.train}]", f"data.val_files=[{args.train}]",
    "trainer.placement=split", f"rollout.num_ranks={dist.get_world_size()}", "trainer.max_staleness=2",
    "rollout.backend=hf", "rollout.partial=true", "data.max_response_length=12", "data.train_batch_size=3",
    "rollout.n=2", "rollout.partial_groups=4"])
inputs = RunInputs.open(config)
engine = CountingEngine(config.model.path, "float32")
partial = PartialRollouts(config, inputs.tokenizer, inputs.rewards, inputs.train_data, inputs.sampler, engine)
batches = []
for step in (1, 2, 3):
    rollouts, indices, metrics = partial.take(step, version=step - 1)
    batches.append({"indices": indices, "response_ids": rollouts.response_ids, "logprobs": rollouts.rollout_logprobs,
                    "versions": rollouts.token_versions, "scores": rollouts.scores, "metrics": metrics})
    partial.fill(step + 1, version=step - 1)
    partial.pause(keep=False)
    generator = torch.Generator().manual_seed(step)  # the same new weights on every replica, as a sync brings
    engine.begin_weight_update(step)
    engine.load_weights([(name, p.detach() + 0.1 * torch.randn(p.shape, generator=generator))
                         for name, p in engine.model.named_parameters()])
    engine.end_weight_update()
with open(f"{args.out}/rank{dist.get_rank()}.json", "w") as file:
    json.dump({"batches": batches, "submits": engine.submits}, file)
dist.destroy_process_group()
